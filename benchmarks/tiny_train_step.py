"""The tiny trainer's `train_step` on `benchmarks.async_speedup`'s long-tailed batch, with and without
length buckets (`roles.engines.tiny.length_buckets`).

    python -m benchmarks.tiny_train_step [--repeats 7] [--tasks 32] [--group-size 8]

The batch: `--tasks` tasks x `--group-size` responses; `--long-task-fraction` (10 %) of the tasks,
drawn with a fixed seed, are `--long-task-length` digits (20: a 22-token prompt, 21-token responses),
the rest `--task-length` (2: 4 and 3). Two prompt layouts: `unpadded` (each prompt its own length) and
`padded` (every prompt left-padded to the long tasks', as the task set pads them today). Each layout
is trained `bucketed` (the engine's default) and `one_bucket` (`bucket_growth` inf: each
micro-batch one tensor, padded to its longest row). At a commit before buckets (1af260d's parent)
the engine ignores `bucket_growth`: both are the forward that padded every row to its micro-batch's
longest prompt + the batch's longest response. The default tiny model (d_model
64, 2 layers, 4 minibatches), one torch thread. Prints one JSON line: the median `train_step` wall
and CPU seconds over `--repeats` after one warm-up, the token positions the policy ran over in a
step (forward passes: the proximal pass, if any, and one per minibatch) beside the rows' real
tokens, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rolectl.roles.engines.task import EOS, make_reverse_task  # noqa: E402
from rolectl.roles.engines.tiny import TinyConfig, TinyTrainEngine  # noqa: E402
from rolectl.sync_protocol.experience import Experience  # noqa: E402

__all__ = ["long_tailed_experiences", "main"]


def long_tailed_experiences(*, tasks: int, group_size: int, length: int, long_length: int, long_fraction: float,
                            padded: bool, seed: int = 0) -> list[Experience]:
    """`tasks` x `group_size` experiences, each response its task's target then EOS, random rewards."""
    rng = random.Random(seed)
    long_tasks = set(rng.sample(range(tasks), round(long_fraction * tasks)))
    experiences = []
    for index in range(tasks):
        digits = [rng.randrange(10) for _ in range(long_length if index in long_tasks else length)]
        task = make_reverse_task(f"t{index}", digits, prompt_length=long_length + 2 if padded else None)
        for k in range(group_size):
            response = (*task.target, EOS)
            experiences.append(Experience(id=f"t{index}-{k}", group=f"t{index}", prompt=task.prompt,
                                          response=response, logprobs=(-math.log(11.0),) * len(response),
                                          reward=rng.random(), model_version=0))
    return experiences


def _timed(engine: TinyTrainEngine, experiences: list[Experience], repeats: int) -> dict[str, float]:
    """Median wall and CPU (this process's: less moved by a loaded machine) seconds of a `train_step`
    over `repeats` after one warm-up, and the token positions its policy passes ran over."""
    positions = []
    hook = engine.policy.register_forward_hook(lambda _module, args, _out: positions.append(args[0].numel()))
    engine.train_step(experiences, current_version=0)  # warm-up
    hook.remove()
    wall, cpu = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        engine.train_step(experiences, current_version=0)
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return {"train_step_s": round(statistics.median(wall), 4), "train_step_cpu_s": round(statistics.median(cpu), 4),
            "positions": sum(positions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--task-length", type=int, default=2)
    parser.add_argument("--long-task-length", type=int, default=20)
    parser.add_argument("--long-task-fraction", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = TinyConfig(task_length=args.task_length, long_task_length=args.long_task_length,
                        long_task_fraction=args.long_task_fraction, group_size=args.group_size,
                        tasks_per_step=args.tasks)
    figures: dict[str, object] = {"rows": args.tasks * args.group_size, "load_before": os.getloadavg()[0]}
    for layout in ("unpadded", "padded"):
        experiences = long_tailed_experiences(tasks=args.tasks, group_size=args.group_size, length=args.task_length,
                                              long_length=args.long_task_length,
                                              long_fraction=args.long_task_fraction, padded=layout == "padded")
        figures[f"{layout}_real_tokens"] = sum(len(e.prompt) + len(e.response) for e in experiences)
        for name, growth in (("one_bucket", math.inf), ("bucketed", None)):
            engine = TinyTrainEngine(config)
            if growth is not None:
                engine.bucket_growth = growth
            for key, value in _timed(engine, experiences, args.repeats).items():
                figures[f"{layout}_{name}_{key}"] = value
        figures[f"{layout}_speedup"] = round(figures[f"{layout}_one_bucket_train_step_s"]
                                             / figures[f"{layout}_bucketed_train_step_s"], 2)
    figures["load_after"] = os.getloadavg()[0]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
