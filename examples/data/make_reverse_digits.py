"""Writes examples/data/reverse_digits.jsonl: the LLM quickstart's task set (reverse a digit string), as text.

Run `python examples/data/make_reverse_digits.py` to regenerate it; the output is a function of the
seed alone (a test checks the shipped file is exactly what this writes). Each line is
`{"prompt": "reverse 3 1 4 =", "answer": "4 1 3"}`: digits are separate words so that a word-level
tokenizer built from the file gives one token per digit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "reverse_digits.jsonl"
SEED = 0
ROWS = 2000
LENGTHS = (3,)


def rows(seed: int = SEED, count: int = ROWS) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        digits = [str(rng.randrange(10)) for _ in range(rng.choice(LENGTHS))]
        out.append({"prompt": "reverse " + " ".join(digits) + " =", "answer": " ".join(reversed(digits))})
    return out


def render(seed: int = SEED, count: int = ROWS) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows(seed, count))


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {ROWS} rows to {OUT}")
