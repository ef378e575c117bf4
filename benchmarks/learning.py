"""Does the reference pair learn fast enough for the quickstart? A one-process simulation on one core.

One trainer and two explorers that take turns, like `rolectl up`: before each trainer step one explorer
samples a batch with weights one version behind the trainer (the async pipeline's usual staleness),
the trainer steps on it and "publishes" the new weights. Prints per-step reward; the last line is JSON
{steps, seconds, reward_first, reward_last, gain,
rollout_seconds, train_seconds} (rewards averaged over the first / last 5 steps).

    .venv/bin/python benchmarks/learning.py --seed 0 --steps 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolectl.roles.engines.tiny import TinyConfig, TinyRolloutEngine, TinyTrainEngine, build_task_set  # noqa: E402

__all__ = ["simulate", "main"]

_WINDOW = 5


def simulate(config: TinyConfig, *, steps: int, staleness: int = 1, verbose: bool = True) -> dict:
    trainer = TinyTrainEngine(config)
    explorers = [
        TinyRolloutEngine(config, member=f"explorer-{i}", sampling_seed=config.seed * 100 + i + 1)
        for i in range(2)
    ]
    task_sets = [build_task_set(config, seed=config.seed * 100 + i + 1) for i in range(2)]
    explore_steps = [0, 0]
    published = {0: trainer.weights()}
    rewards = []
    rollout_seconds = train_seconds = 0.0
    started = time.perf_counter()
    for step in range(1, steps + 1):
        turn = (step - 1) % 2
        explorer = explorers[turn]
        # Experiences for trainer step `step` were sampled while the trainer was still finishing
        # earlier steps: with weights `staleness` versions behind the trainer's current version.
        wanted = max(0, trainer.step - staleness)
        if explorer.version != wanted:
            explorer.load_weights(published[wanted], wanted)
        explore_steps[turn] += 1
        rollout_started = time.perf_counter()
        experiences = explorer.rollout(task_sets[turn].next_batch(), explore_step=explore_steps[turn])
        train_started = time.perf_counter()
        metrics = trainer.train_step(experiences, current_version=trainer.step)
        rollout_seconds += train_started - rollout_started
        train_seconds += time.perf_counter() - train_started
        published[trainer.step] = trainer.weights()
        published.pop(trainer.step - staleness - 1, None)
        rewards.append(metrics["reward_mean"])
        if verbose:
            print(
                f"step {step:3d}  v{explorer.version:<3d} reward {metrics['reward_mean']:.3f}  "
                f"loss {metrics['loss']:+.3f}  kl {metrics['approx_kl']:.4f}  "
                f"clip {metrics['clip_fraction']:.3f}  t {time.perf_counter() - started:5.1f}s",
                flush=True,
            )
    seconds = time.perf_counter() - started
    reward_first = sum(rewards[:_WINDOW]) / _WINDOW
    reward_last = sum(rewards[-_WINDOW:]) / _WINDOW
    return {
        "steps": steps,
        "seconds": round(seconds, 2),
        "reward_first": round(reward_first, 4),
        "reward_last": round(reward_last, 4),
        "gain": round(reward_last - reward_first, 4),
        "rollout_seconds": round(rollout_seconds, 2),
        "train_seconds": round(train_seconds, 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    # Any TinyConfig field can be overridden, e.g. --lr 0.002 --group_size 16.
    tunable = {name: field.default for name, field in TinyConfig.model_fields.items()
               if isinstance(field.default, (int, float))}
    for name, default in tunable.items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = TinyConfig(**{name: getattr(args, name) for name in tunable})
    print(f"config {config.model_dump()}", flush=True)
    print(json.dumps(simulate(config, steps=args.steps, staleness=args.staleness)))


if __name__ == "__main__":
    main()
