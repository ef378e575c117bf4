"""Writes examples/data/reverse_digits.jsonl: the LLM quickstart's task set (reverse a digit string), as text,
and examples/data/reverse_digits_eval.jsonl: a held-out eval set of 4-digit strings for the tiny engine's
quickstart (examples/eval_and_tracking.yaml; drawn with another seed).

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
EVAL_OUT = OUT.with_name("reverse_digits_eval.jsonl")
EVAL_SEED, EVAL_ROWS, EVAL_LENGTHS = 1, 64, (4,)


def rows(seed: int = SEED, count: int = ROWS, lengths: tuple[int, ...] = LENGTHS) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        digits = [str(rng.randrange(10)) for _ in range(rng.choice(lengths))]
        out.append({"prompt": "reverse " + " ".join(digits) + " =", "answer": " ".join(reversed(digits))})
    return out


def render(seed: int = SEED, count: int = ROWS, lengths: tuple[int, ...] = LENGTHS) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows(seed, count, lengths))


def render_eval() -> str:
    return render(EVAL_SEED, EVAL_ROWS, EVAL_LENGTHS)


if __name__ == "__main__":
    OUT.write_text(render())
    EVAL_OUT.write_text(render_eval())
    print(f"wrote {ROWS} rows to {OUT} and {EVAL_ROWS} to {EVAL_OUT}")
