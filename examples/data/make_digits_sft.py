"""Writes examples/data/digits_sft.jsonl: demonstrations of a skill related to the LLM quickstart's task, for
the SFT stage that makes the LoRA quickstart's base (examples/sft_base.yaml), and digits_sft_eval.jsonl, a
held-out set of the same (drawn with another seed).

The RL task (examples/data/reverse_digits.jsonl) reverses strings of 3 digits. These rows never do: they
copy strings of 1 to 4 digits (`{"prompt": "copy 3 1 4 =", "response": "3 1 4"}`) and reverse strings of 1,
2 or 4 digits (`{"prompt": "reverse 3 1 =", "response": "1 3"}`), never 3. A model trained on them knows
the format, the words and what "reverse" asks for, not the answers of the RL task: on 3 digits it
mostly copies (positional_match about 0.3), so RL (full or a LoRA adapter) has something to learn and
something to build on. (With reversals of 1 and 2 digits only, the base answers 3 digits with one:
too far from the task for an adapter's RL to find it.)

Run `python examples/data/make_digits_sft.py` to regenerate both; the output is a function of the seeds
alone (a test checks the shipped files are exactly what this writes).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "digits_sft.jsonl"
EVAL_OUT = OUT.with_name("digits_sft_eval.jsonl")
SEED, ROWS = 0, 4000
EVAL_SEED, EVAL_ROWS = 1, 128
COPY_LENGTHS = (1, 2, 3, 4)
REVERSE_LENGTHS = (1, 2, 4)


def rows(seed: int = SEED, count: int = ROWS) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        verb = "copy" if i % 2 == 0 else "reverse"
        length = rng.choice(COPY_LENGTHS if verb == "copy" else REVERSE_LENGTHS)
        digits = [str(rng.randrange(10)) for _ in range(length)]
        answer = digits if verb == "copy" else digits[::-1]
        out.append({"prompt": f"{verb} {' '.join(digits)} =", "response": " ".join(answer)})
    return out


def render(seed: int = SEED, count: int = ROWS) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows(seed, count))


def render_eval() -> str:
    return render(EVAL_SEED, EVAL_ROWS)


if __name__ == "__main__":
    OUT.write_text(render())
    EVAL_OUT.write_text(render_eval())
    print(f"wrote {ROWS} rows to {OUT} and {EVAL_ROWS} to {EVAL_OUT}")
