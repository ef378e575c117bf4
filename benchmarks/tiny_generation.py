"""One explorer step's generation on the tiny engine: the old static sampler against the generation pool.

    python -m benchmarks.tiny_generation [--steps 12] [--warmup 3] [--json F]

The shape of `benchmarks.async_speedup`: `--tasks` (16) tasks of `--group-size` (8) rows, `--task-length`
(2) digits, `--long-fraction` (10 %) of them `--long-length` (20), on one torch thread. Three ways:

- `static (old)`: `model.sample_responses` on prompts left-padded to the long tasks' length, the
  whole sequence recomputed every token, every row until the longest is done (the engine before the
  pool);
- `rollout (pool)`: `TinyRolloutEngine.rollout`: unpadded prompts, KV cache, finished rows leave;
- `streaming (pool)`: `admit` a step's tasks, then `collect` as many groups (the rest carry over),
  in steady state after `--warmup` steps. From an empty pool, admit n + collect n waits for all n
  (nothing is carried: it is `rollout`); `--primed` (1) batches are admitted first, so that many
  batches stay in flight and a long generation holds no step (`--primed 0`: none).

Prints the median seconds per step of each (over `--steps` steps, the same task batches) and the
speedups; the last line is JSON (also written to `--json`) with the load average it ran under.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from rolectl.roles.engines.model import sample_responses
from rolectl.roles.engines.task import EOS, make_reverse_task
from rolectl.roles.engines.tiny import TinyConfig, TinyRolloutEngine, build_task_set

__all__ = ["main", "measure"]


def _static_step(engine: TinyRolloutEngine, tasks, step: int, prompt_length: int) -> None:
    prompts = torch.tensor([make_reverse_task(t.id, tuple(reversed(t.target)), prompt_length=prompt_length).prompt
                            for t in tasks]).repeat_interleave(engine.group_size, dim=0)
    sample_responses(engine.policy, prompts, max_new_tokens=engine.config.max_response_length,
                     allowed_tokens=engine.allowed_tokens, eos_token=EOS, temperature=engine.config.temperature,
                     generator=torch.Generator().manual_seed(step))


def _timed(run, batches) -> list[float]:
    seconds = []
    for step, tasks in enumerate(batches):
        start = time.perf_counter()
        run(tasks, step)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    config = TinyConfig(seed=0, group_size=args.group_size, tasks_per_step=args.tasks, task_length=args.task_length,
                        long_task_length=args.long_length, long_task_fraction=args.long_fraction)
    task_set = build_task_set(config, seed=1)
    batches = [task_set.next_batch() for _ in range(args.warmup + args.steps)]
    engine = TinyRolloutEngine(config, member="bench")
    static = _timed(lambda tasks, step: _static_step(engine, tasks, step, config.prompt_length), batches)
    rollout = _timed(lambda tasks, step: engine.rollout(tasks, explore_step=step), batches)
    collected = []
    for prime in range(args.primed):  # what stays in flight: the pipeline's depth
        engine.admit(task_set.next_batch(), explore_step=-1 - prime)

    def stream(tasks, step):
        engine.admit(tasks, explore_step=step)
        collected.append(len(engine.collect(len(tasks))))

    streaming = _timed(stream, batches)
    assert all(n == args.tasks * args.group_size for n in collected)
    medians = {name: statistics.median(seconds[args.warmup:])
               for name, seconds in (("static (old)", static), ("rollout (pool)", rollout),
                                     ("streaming (pool)", streaming))}
    return {"benchmark": "tiny_generation", "tasks": args.tasks, "group_size": args.group_size,
            "task_length": args.task_length, "long_length": args.long_length, "long_fraction": args.long_fraction,
            "steps": args.steps, "primed": args.primed, "torch_threads": 1, "seconds_per_step": medians,
            "speedup_rollout": medians["static (old)"] / medians["rollout (pool)"],
            "speedup_streaming": medians["static (old)"] / medians["streaming (pool)"],
            "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--task-length", type=int, default=2)
    parser.add_argument("--long-length", type=int, default=20)
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=12, help="steps timed (after the warmup)")
    parser.add_argument("--warmup", type=int, default=3, help="steps run first and not timed")
    parser.add_argument("--primed", type=int, default=1, help="batches admitted before streaming starts")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args)
    for name, seconds in result["seconds_per_step"].items():
        print(f"{name:18} {seconds * 1000:8.1f} ms per step")
    print(f"speedup: rollout {result['speedup_rollout']:.1f}x, streaming {result['speedup_streaming']:.1f}x "
          f"(load {result['load_average'][0]:.2f})")
    line = json.dumps(result)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
