"""Delta weight sync on real training: bytes changed and moved per sync, publish and fetch-and-apply time.

    python -m benchmarks.delta [--json F] [--steps 8] [--large-steps 6] [--large-lr 1e-6] [--keyframe-interval 8]
        [--scenarios tiny example large]

Starts its own nats-server (file storage, as a job's default). Per scenario an engine trains for
`--steps` steps on its own rollouts: the explorer side (a rollout engine holding the wire dtype,
bf16) generates, the trainer trains (float32 master weights) and publishes the version cast to
bf16, twice, to two object-store streams: one with delta sync (`keyframe_interval`), one where
every version is full. An explorer holding the previous version fetches each (the delta one
applies the delta onto what it holds) and loads the result into its engine; it rolls out the next
step with the delta-synced weights. The two results are checked bit-identical (so the learning is
the same as with a full bf16 sync, by construction).

Scenarios:
- ``tiny``: the tiny engine (reverse digits; its own learning rate);
- ``example``: the `hf` engine with the LLM quickstart's model and learning rate (examples/llm_quickstart.yaml);
- ``large``: the `hf` engine with a model built from a transformers (Qwen2) config whose bf16
  weights are at least 256 MiB, at a fine-tuning learning rate (`--large-lr`).

Per sync it prints the fraction of bytes changed, bytes moved by delta and full sync, publish time
and fetch-and-apply time (fetch, verify, load into the rollout engine) of each. With ``--json F``
it writes a JSON object: per scenario the per-sync rows and medians, and at the top
``delta_bytes_ratio``: bytes moved by delta sync over full bytes, median over every sync of
every scenario (keyframe syncs included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
import torch

from rolectl.bus.server import NatsServer
from rolectl.bus.weights.delta import cast_source
from rolectl.bus.weights.object_store import ObjectStoreTransport
from rolectl.roles.config import load_config
from rolectl.roles.engines import make_rollout_engine, make_taskset, make_train_engine

__all__ = ["main", "run"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llm_quickstart.yaml"
# A Qwen2-shaped model whose bf16 weights are about 280 MiB (the tokenizer's vocabulary is small).
LARGE_BUILD = {"family": "qwen2", "hidden_size": 1024, "num_layers": 11, "num_heads": 16, "head_dim": 64,
               "intermediate_size": 2816, "seed": 0}


def _config(scenario: str, workdir: Path, args: argparse.Namespace) -> Any:
    cfg = load_config(str(EXAMPLE))
    transport = cfg.transport.replace(wire_dtype="bfloat16", keyframe_interval=args.keyframe_interval)
    if scenario == "tiny":
        return cfg.with_overrides(model={"engine": "tiny", "group_size": 8, "seed": 0}, data=None,
                                  algorithm=None, transport=transport)
    model = {**cfg.model.model_dump(), "rollout_engine": "hf", "path": str(ROOT / cfg.model.path)}
    data = cfg.data.replace(path=str(ROOT / cfg.data.path))
    if scenario == "large":
        model.update(path=str(workdir / "large-model"), build=LARGE_BUILD, lr=args.large_lr,
                     micro_batch_size=32, minibatches=1)
    return cfg.with_overrides(model=model, data=data, transport=transport)


async def _timed(coro: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = await coro
    return out, time.perf_counter() - started


async def run_scenario(scenario: str, url: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    cfg = _config(scenario, workdir, args)
    trainer = make_train_engine(cfg)
    explorer = make_rollout_engine(cfg, "explorer-0")  # loads the wire dtype (bf16)
    tasks = make_taskset(cfg, seed=0, batch_size=args.large_tasks if scenario == "large" else args.tasks)
    interval = cfg.transport.keyframe_interval
    nc = await nats.connect(url)
    job = f"bench-delta-{scenario}"
    try:
        pub_delta = ObjectStoreTransport(nc, job, storage="file", keyframe_interval=interval)
        pub_full = ObjectStoreTransport(nc, job + "-full", storage="file")
        sub_delta = ObjectStoreTransport(nc, job, storage="file", keyframe_interval=interval)
        sub_full = ObjectStoreTransport(nc, job + "-full", storage="file")
        # version 0: what every explorer starts from (the trainer's initial weights)
        first = cast_source(trainer.weights(), torch.bfloat16)
        ref = await pub_delta.publish(0, first)
        explorer.load_weights(await sub_delta.fetch(ref), 0)
        rows = []
        for step in range(1, (args.large_steps if scenario == "large" else args.steps) + 1):
            started = time.perf_counter()
            experiences = explorer.rollout(tasks.next_batch(), explore_step=step)
            rollout_s = time.perf_counter() - started
            started = time.perf_counter()
            metrics = trainer.train_step(experiences, current_version=step - 1)
            train_s = time.perf_counter() - started
            weights = cast_source(trainer.weights(), torch.bfloat16)  # the trainer's cast, as in a job
            ref_d, publish_d = await _timed(pub_delta.publish(step, weights))
            ref_f, publish_f = await _timed(pub_full.publish(step, weights))
            assert ref_d.digest == ref_f.digest, "a delta must publish the very version a full sync does"
            full_tensors, fetch_f = await _timed(sub_full.fetch(ref_f))
            started = time.perf_counter()
            explorer.load_weights(full_tensors, step)
            load_f = time.perf_counter() - started
            del full_tensors
            delta_tensors, fetch_d = await _timed(sub_delta.fetch(ref_d))
            started = time.perf_counter()
            explorer.load_weights(delta_tensors, step)  # the explorer goes on with the delta-synced weights
            load_d = time.perf_counter() - started
            del delta_tensors
            await pub_delta.prune(2, announced=range(step + 1))
            await pub_full.prune(2, announced=range(step + 1))
            published, fetched = pub_delta.last_publish, sub_delta.last_fetch
            rows.append({
                "step": step, "kind": published["kind"], "route": fetched["route"], "nbytes": ref_d.nbytes,
                "changed_fraction": published["changed_bytes"] / ref_d.nbytes,
                "bytes_moved_delta": fetched["bytes_moved"], "bytes_moved_full": ref_f.nbytes,
                "bytes_ratio": fetched["bytes_moved"] / ref_f.nbytes,
                "publish_s_delta": publish_d, "publish_s_full": publish_f,
                "fetch_apply_s_delta": fetch_d + load_d, "fetch_apply_s_full": fetch_f + load_f,
                "rollout_s": rollout_s, "train_s": train_s,
                "reward_mean": float(sum(e.reward for e in experiences) / max(len(experiences), 1)),
                "loss": float(metrics.get("loss", metrics.get("pg_loss", float("nan")))),
            })
            r = rows[-1]
            print(f"[{scenario}] sync {step}: {r['kind']:8} changed {r['changed_fraction']:.3f}  moved "
                  f"{r['bytes_moved_delta'] / 2**20:8.2f} / {r['bytes_moved_full'] / 2**20:8.2f} MiB "
                  f"(ratio {r['bytes_ratio']:.3f})  publish {publish_d:.3f} s vs {publish_f:.3f} s  "
                  f"fetch+apply {r['fetch_apply_s_delta']:.3f} s vs {r['fetch_apply_s_full']:.3f} s  "
                  f"reward {r['reward_mean']:.3f}", flush=True)
    finally:
        await nc.close()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    deltas = [r for r in rows if r["kind"] == "delta"]
    return {
        "scenario": scenario,
        "model_bytes_wire": rows[0]["nbytes"],
        "lr": getattr(getattr(trainer, "config", None), "lr", None),
        "keyframe_interval": interval,
        "steps": len(rows),
        "median_changed_fraction": median("changed_fraction"),
        "median_bytes_ratio": median("bytes_ratio"),
        "mean_bytes_ratio": statistics.fmean(r["bytes_ratio"] for r in rows),
        "median_publish_s_delta": median("publish_s_delta"),
        "median_publish_s_full": median("publish_s_full"),
        "median_fetch_apply_s_delta": median("fetch_apply_s_delta"),
        "median_fetch_apply_s_full": median("fetch_apply_s_full"),
        "median_fetch_apply_s_delta_syncs_only": (statistics.median(r["fetch_apply_s_delta"] for r in deltas)
                                                  if deltas else None),
        "rows": rows,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rolectl-delta-") as tmp:
        workdir = Path(tmp)
        async with NatsServer(store_dir=str(workdir / "nats")) as server:
            results = [await run_scenario(s, server.url, workdir, args) for s in args.scenarios]
    ratios = [r["bytes_ratio"] for res in results for r in res["rows"]]
    return {
        "delta_bytes_ratio": statistics.median(ratios),
        "delta_bytes_ratio_mean": statistics.fmean(ratios),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "scenarios": results,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--steps", type=int, default=8, help="train steps (syncs) per scenario")
    parser.add_argument("--tasks", type=int, default=8, help="tasks per step")
    parser.add_argument("--keyframe-interval", type=int, default=8)
    parser.add_argument("--large-steps", type=int, default=6, help="train steps of the large model")
    parser.add_argument("--large-tasks", type=int, default=2, help="tasks per step of the large model")
    parser.add_argument("--large-lr", type=float, default=1e-6,
                        help="learning rate of the large model (verl's default for RL fine-tuning)")
    parser.add_argument("--scenarios", nargs="+", default=["tiny", "example", "large"],
                        choices=["tiny", "example", "large"])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    figures = asyncio.run(run(args))
    summary = {k: v for k, v in figures.items() if k != "scenarios"}
    summary["scenarios"] = [{k: v for k, v in s.items() if k != "rows"} for s in figures["scenarios"]]
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
