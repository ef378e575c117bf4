"""Does a LoRA adapter learn the LLM quickstart's task, and how many bytes does each sync move against
full fine-tuning? A one-process run of the `hf` trainer and an `hf` explorer on the quickstart's model.

Each step the explorer samples a batch with the weights one version behind the trainer (as
`sync_offset: 1` does), the trainer steps on it and the explorer loads what a sync would send
(`weights()`: the adapter alone under `model.lora`). Prints the reward per 10 steps; the last line is
JSON {mode, lr, steps, reward_first, reward_last, gain, bytes_per_sync, seconds} (rewards averaged over
the first / last 5 steps).

    .venv/bin/python -m benchmarks.lora --mode lora --steps 150 --lr 0.03
    .venv/bin/python -m benchmarks.lora --mode full --steps 150 --lr 0.003
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import yaml

from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_rollout_engine, make_taskset, make_train_engine

__all__ = ["run", "main"]

_WINDOW = 5


def job(mode: str, lr: float, rank: int, model_path: str) -> Any:
    """The LoRA quickstart's job (or, with mode `full`, without its `model.lora`), one hf explorer."""
    with open("examples/lora_quickstart.yaml") as fh:
        data = yaml.safe_load(fh)
    model = {**data["model"], "rollout_engine": "hf", "path": model_path, "lr": lr}
    if mode == "full":
        model.pop("lora")
    else:
        model["lora"] = {**model["lora"], "rank": rank, "alpha": 2 * rank, "merge_on_save": False}
    return parse_config({"job": "lora-bench", "model": model, "data": data["data"],
                         "algorithm": data["algorithm"], "explorers": {"count": 1}})


def run(mode: str, *, lr: float, rank: int = 8, steps: int = 150, tasks: int = 32,
        model_path: str = "runs/models/llm-quickstart") -> dict[str, Any]:
    cfg = job(mode, lr, rank, model_path)
    trainer, explorer = make_train_engine(cfg), make_rollout_engine(cfg, "explorer-0")
    taskset = make_taskset(cfg, seed=0, batch_size=tasks)
    published = {0: trainer.weights()}
    rewards, sent = [], []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        wanted = max(0, trainer.step - 1)
        if explorer.version != wanted:
            explorer.load_weights(published[wanted], wanted)
        metrics = trainer.train_step(explorer.rollout(taskset.next_batch(), explore_step=step),
                                     current_version=trainer.step)
        rewards.append(metrics["reward_mean"])
        published[trainer.step] = trainer.weights()
        published.pop(trainer.step - 2, None)
        sent.append(sum(t.numel() * t.element_size() for t in published[trainer.step].values()))
        if step % 10 == 0:
            print(f"step {step}: mean reward of the last 10 {sum(rewards[-10:]) / 10:.3f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    first, last = rewards[:_WINDOW], rewards[-_WINDOW:]
    result = {"mode": mode, "lr": lr, "rank": rank if mode == "lora" else None, "steps": steps, "tasks": tasks,
              "reward_first": round(sum(first) / len(first), 4), "reward_last": round(sum(last) / len(last), 4),
              "bytes_per_sync": sent[-1], "seconds": round(time.perf_counter() - started, 1)}
    result["gain"] = round(result["reward_last"] - result["reward_first"], 4)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("lora", "full"), default="lora")
    parser.add_argument("--lr", type=float, default=None, help="default: the example's (lora) or 0.003 (full)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--tasks", type=int, default=32, help="tasks per step (x group_size responses)")
    parser.add_argument("--model-path", default="runs/models/llm-quickstart")
    args = parser.parse_args(argv)
    with open("examples/lora_quickstart.yaml") as fh:
        example_lr = yaml.safe_load(fh)["model"]["lr"]
    lr = args.lr if args.lr is not None else (example_lr if args.mode == "lora" else 0.003)
    print(json.dumps(run(args.mode, lr=lr, rank=args.rank, steps=args.steps, tasks=args.tasks,
                          model_path=args.model_path)))


if __name__ == "__main__":
    main()
