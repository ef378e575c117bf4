"""Does the LLM quickstart's model learn its task? The `hf` engines in one process, no bus, on one core.

The quickstart's job without the processes: two `hf` rollout engines sample from
examples/data/reverse_digits.jsonl with weights `--offset` versions behind, the `hf` trainer takes a
step with verl's GRPO advantages and PPO loss, the explorers load the new weights. The model is built
from `--family` (the quickstart's shape otherwise) into a temporary directory. Each step prints the
reward, the share of groups whose responses all scored alike (no signal), the sampled tokens' mean
negative logprob (entropy: near 0 means the policy stopped exploring), verl's clip fraction and KL, and
the accuracy per answer position; the last line is JSON {family, steps, seconds, reward_first,
reward_last, gain, reward_per_10_steps} (rewards averaged over the first / last 5 steps).

    .venv/bin/python benchmarks/hf_learning.py --family gpt2 --steps 80
    .venv/bin/python benchmarks/hf_learning.py --family qwen2 --steps 120
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolectl.roles.engines.algorithms import AlgorithmConfig  # noqa: E402
from rolectl.roles.engines.data import DataConfig, TextTaskSet  # noqa: E402
from rolectl.roles.engines.hf import HFRolloutEngine, HFTrainEngine  # noqa: E402
from rolectl.roles.engines.hf_model import HFModelConfig, ensure_model, load_tokenizer  # noqa: E402
from rolectl.roles.engines.rewards import parse_reward_specs  # noqa: E402

__all__ = ["simulate", "main"]

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "reverse_digits.jsonl"
_WINDOW = 5


def simulate(model: HFModelConfig, algorithm: AlgorithmConfig, *, steps: int, tasks: int, offset: int,
             verbose: bool = True) -> dict:
    data = DataConfig(path=str(DATA))
    path = ensure_model(model, data_path=str(DATA))
    tokenizer = load_tokenizer(path)
    trainer = HFTrainEngine(model, algorithm, model_path=path)
    rewards_spec = parse_reward_specs([{"name": "positional_match", "weight": 1.0}])
    explorers = [HFRolloutEngine(model, rewards_spec, member=f"explorer-{i}", model_path=path) for i in range(2)]
    task_sets = [TextTaskSet(data, tokenizer, shard=i, num_shards=2, batch_size=tasks // 2) for i in range(2)]
    answers = {t.prompt: tokenizer(t.answer)["input_ids"] for ts in task_sets for t in ts.tasks.values()}
    pending, rewards, version = [], [], 0
    started = time.perf_counter()
    for explore_step in range(steps + offset):
        batch = []
        for explorer, task_set in zip(explorers, task_sets):
            batch += explorer.rollout(task_set.next_batch(), explore_step=explore_step)
        pending.append(batch)
        if len(pending) <= offset:
            continue  # the trainer is `offset` steps behind the explorers
        batch = pending.pop(0)
        metrics = trainer.train_step(batch, current_version=version)
        version += 1
        weights = trainer.weights()
        for explorer in explorers:
            explorer.load_weights(weights, version)
        rewards.append(metrics["reward_mean"])
        if verbose:
            groups: dict[str, list[float]] = {}
            for e in batch:
                groups.setdefault(e.group, []).append(e.reward)
            flat = sum(max(g) == min(g) for g in groups.values()) / len(groups)
            entropy = sum(-sum(e.logprobs) / len(e.logprobs) for e in batch) / len(batch)
            positions = [sum(len(e.response) > j and e.response[j] == answers[e.prompt][j] for e in batch)
                         / len(batch) for j in range(3)]
            print(f"step {version:3d}  reward {metrics['reward_mean']:.3f}  flat groups {flat:.2f}  "
                  f"nll {entropy:.3f}  clip {metrics.get('pg_clipfrac', 0.0):.3f}  "
                  f"kl {metrics.get('ppo_kl', 0.0):+.4f}  positions {' '.join(f'{p:.2f}' for p in positions)}  "
                  f"t {time.perf_counter() - started:5.1f}s", flush=True)
    return {
        "family": model.build.family if model.build else None,
        "steps": steps,
        "seconds": round(time.perf_counter() - started, 1),
        "reward_first": round(sum(rewards[:_WINDOW]) / _WINDOW, 4),
        "reward_last": round(sum(rewards[-_WINDOW:]) / _WINDOW, 4),
        "gain": round((sum(rewards[-_WINDOW:]) - sum(rewards[:_WINDOW])) / _WINDOW, 4),
        "reward_per_10_steps": [round(sum(rewards[i:i + 10]) / len(rewards[i:i + 10]), 2)
                                for i in range(0, len(rewards), 10)],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="gpt2", choices=["gpt2", "qwen2", "llama"])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--tasks", type=int, default=32, help="tasks per trainer step (two explorers' batches)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--offset", type=int, default=1, help="versions the explorers' weights lag behind")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    build = {"family": args.family, "hidden_size": 128, "num_layers": 3, "num_heads": 4, "head_dim": 32,
             "intermediate_size": 256, "seed": 0}  # the quickstart's shape
    algorithm = AlgorithmConfig.model_validate({"advantage": "grpo", "policy_loss": "vanilla", "clip_ratio": 0.2,
                                                "loss_agg_mode": "token-mean", "kl_coef": 0.0})
    with tempfile.TemporaryDirectory(prefix="hf-learning-") as tmp:
        model = HFModelConfig.model_validate({
            "path": str(Path(tmp) / "model"), "build": build, "seed": 0, "group_size": args.group_size,
            "max_new_tokens": 4, "temperature": 1.0, "lr": args.lr, "minibatches": args.minibatches,
            "micro_batch_size": 256})
        print(f"model {model.model_dump(exclude={'path'})}", flush=True)
        print(json.dumps(simulate(model, algorithm, steps=args.steps, tasks=args.tasks, offset=args.offset)))


if __name__ == "__main__":
    main()
