"""Writes examples/data/add_numbers.jsonl: the tool example's task set (examples/agent_tools.yaml): add two
numbers, where calling the calculator helps.

Run `python examples/data/make_add_numbers.py` to regenerate it; the output is a function of the seed
alone (a test checks the shipped file is exactly what this writes). Each line is
`{"prompt": "what is 37 + 45 ?", "answer": "82"}`: every number is one word, so a word-level tokenizer
built from the file gives one token per number, and a model that copies the two numbers into a call
(`<tool_call> calculator 37 + 45`) and the calculator's result into its answer solves every row, while
one that answers at once must learn each sum by heart.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "add_numbers.jsonl"
SEED = 0
ROWS = 1000
LOW, HIGH = 10, 49  # operands, inclusive: 1,600 pairs, sums 20-98


def rows(seed: int = SEED, count: int = ROWS) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        out.append({"prompt": f"what is {a} + {b} ?", "answer": str(a + b)})
    return out


def render(seed: int = SEED, count: int = ROWS) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows(seed, count))


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {ROWS} rows to {OUT}")
