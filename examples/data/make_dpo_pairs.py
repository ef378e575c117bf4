"""Writes the DPO quickstart's preference pairs from a base model's own samples, scored by the task's reward.

For each prompt of the RL task (examples/data/reverse_digits.jsonl: "reverse 3 1 4 =" -> "4 1 3"), the
base model (by default the SFT base `runs/bases/digits-sft/`, made by examples/sft_base.yaml) samples
`--samples` responses with the hf rollout engine (seeded: the same base gives the same pairs); each
is scored with the task's reward (`positional_match`, as the RL examples train on), and where the best
and the worst differ, the pair (prompt, best, worst) is written. Prompts are rendered as the RL task
renders them (`data:` defaults). Two files, under `--out` (default runs/data/digits-dpo/):

- `pairs.jsonl`: `{prompt, chosen, rejected, answer, chosen_reward, rejected_reward}` from the first
  `--prompts` rows of the task file;
- `eval.jsonl`: held-out prompts (rows from the file's end whose prompt is not among the training
  ones) with their `answer`, and a pair where their samples differ (else `chosen`/`rejected` null):
  the DPO stage's eval loss on the pairs, and the reward of greedy generations on every row.

It prints how many pairs it wrote and the base's greedy reward on the held-out prompts (what DPO
should raise). Run from the repository root, after the base exists:

    python examples/data/make_dpo_pairs.py                  # or --model DIR --out DIR --prompts N
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TASKS = Path(__file__).resolve().parent / "reverse_digits.jsonl"
REWARD = "positional_match"
MODEL = Path("runs/bases/digits-sft")  # examples/sft_base.yaml's trainer.export_dir
OUT = Path("runs/data/digits-dpo")  # examples/dpo_quickstart.yaml's dpo.path and eval_path are here
MAX_NEW_TOKENS = 5  # as the base's eval and the DPO stage's eval generate (model.max_new_tokens)


def _tasks(rows: list, tokenizer, *, path: Path) -> list:
    """The rows (`TaskRow`s) as the RL task's `Task`s, rendered as its data: section renders them."""
    from rolectl.roles.engines.data import DataConfig, TextTaskSet

    tasks = TextTaskSet(DataConfig(path=str(path)), tokenizer, shard=0, num_shards=1, batch_size=1, rows=rows)
    return [tasks.tasks[i] for i in range(len(rows))]


def _pairs(engine, tasks: list, rows: list) -> list[dict | None]:
    """Per task: its best and worst sample by reward (a dict), or None when all samples tie."""
    out: list[dict | None] = []
    batch = 32
    for start in range(0, len(tasks), batch):
        experiences = engine.rollout(tasks[start:start + batch], explore_step=start // batch)
        by_group: dict[str, list] = {}
        for experience in experiences:
            by_group.setdefault(experience.group, []).append(experience)
        for row, group in zip(rows[start:start + batch], by_group.values()):
            best = max(group, key=lambda e: e.reward)
            worst = min(group, key=lambda e: e.reward)
            if best.reward == worst.reward:
                out.append(None)
                continue
            text = [engine.tokenizer.decode(e.response, skip_special_tokens=True) for e in (best, worst)]
            out.append({"prompt": row.prompt, "chosen": text[0], "rejected": text[1], "answer": row.answer,
                        "chosen_reward": best.reward, "rejected_reward": worst.reward})
    return out


def _greedy_reward(engine, tasks: list) -> float:
    from rolectl.roles.engines.rewards import score_all

    texts = engine.generate(tasks, temperature=0.0, samples=1, seed=0)
    return sum(score_all(engine.rewards, text, task)[0] for (text,), task in zip(texts, tasks)) / len(tasks)


def make_pairs(model: Path, out: Path, *, tasks_file: Path = TASKS, prompts: int = 256, eval_prompts: int = 64,
               samples: int = 8, max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = 1.0, seed: int = 0) -> dict:
    """Write `pairs.jsonl` and `eval.jsonl` under `out`; what it wrote and the base's greedy reward."""
    from rolectl.roles.engines.data import DataConfig, load_rows
    from rolectl.roles.engines.hf import HFRolloutEngine
    from rolectl.roles.engines.hf_model import HFModelConfig
    from rolectl.roles.engines.rewards import parse_reward_specs

    if not (model / "config.json").is_file():
        raise SystemExit(f"{model}: no model there; make the SFT base first: "
                         "rolectl up --config examples/sft_base.yaml (see examples/dpo_quickstart.yaml)")
    rows = load_rows(DataConfig(path=str(tasks_file)))
    train_rows = rows[:prompts]
    seen = {row.prompt for row in train_rows}
    by_prompt = {row.prompt: row for row in reversed(rows[prompts:]) if row.prompt not in seen}  # one per prompt
    held_out = list(by_prompt.values())[:eval_prompts]
    config = HFModelConfig(path=str(model), group_size=samples, max_new_tokens=max_new_tokens,
                           temperature=temperature, seed=seed)
    engine = HFRolloutEngine(config, parse_reward_specs(REWARD), member="dpo-pairs", model_path=model)
    train_tasks, eval_tasks = (_tasks(r, engine.tokenizer, path=tasks_file) for r in (train_rows, held_out))
    pairs = [p for p in _pairs(engine, train_tasks, train_rows) if p is not None]
    eval_rows = []
    for row, pair in zip(held_out, _pairs(engine, eval_tasks, held_out)):
        eval_rows.append({"prompt": row.prompt, "answer": row.answer, "chosen": pair and pair["chosen"],
                          "rejected": pair and pair["rejected"]})
    out.mkdir(parents=True, exist_ok=True)
    (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (out / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in eval_rows))
    return {"pairs": len(pairs), "prompts": len(train_rows), "eval_rows": len(eval_rows),
            "eval_pairs": sum(r["chosen"] is not None for r in eval_rows),
            "base_greedy_reward": _greedy_reward(engine, eval_tasks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL, help="the base model directory")
    parser.add_argument("--out", type=Path, default=OUT, help="where the files go")
    parser.add_argument("--tasks", type=Path, default=TASKS, help="the RL task file (prompt, answer)")
    parser.add_argument("--prompts", type=int, default=256, help="training prompts (the file's first rows)")
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts (from the file's end)")
    parser.add_argument("--samples", type=int, default=8, help="responses sampled per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help="longest response in tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = parser.parse_args()
    written = make_pairs(args.model, args.out, tasks_file=args.tasks, prompts=args.prompts,
                         eval_prompts=args.eval_prompts, samples=args.samples, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, seed=args.seed)
    print(f"wrote {written['pairs']} pairs from {written['prompts']} prompts to {args.out / 'pairs.jsonl'} and "
          f"{written['eval_rows']} held-out rows ({written['eval_pairs']} with a pair) to {args.out / 'eval.jsonl'}; "
          f"the base's greedy {REWARD} on them: {written['base_greedy_reward']:.3f}")


if __name__ == "__main__":
    main()
