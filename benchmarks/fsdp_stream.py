"""Memory of the `fsdp` engine's weight stream: each rank's peak RSS growth while streaming, against two buckets.

    python -m benchmarks.fsdp_stream [--hidden 1024] [--layers 8] [--bucket-mb 32] [--ranks 2] [--json PATH]

Builds a random-init Qwen2 of the given shape (word-level tokenizer from examples/data) in a temporary
directory, starts `--ranks` CPU ranks (gloo, one process each) of the `fsdp` engine, and on each rank:

- ``stream_growth_mb``: the peak RSS growth (VmHWM reset through /proc/self/clear_refs) while
  `iter_weight_buckets(bucket)` is driven to its end, each bucket dropped when the next arrives
  (what a transport sending from the stream holds), against ``bound_mb`` = 2 x max(bucket, largest
  tensor) + 4 x largest tensor: the bucket being sent, the one being filled, and the transient of
  gathering one tensor (gloo's all-gather buffers and the result) (freed heap is trimmed before each
  measure; ``first_stream_growth_mb`` is the first stream's, which also sets up gloo buffers);
- ``whole_growth_mb``: the same, keeping every bucket (the whole model on rank 0, as a transport
  taking a `{name: tensor}` mapping must);
- ``shard_mb``: the rank's own shard of the parameters; ``stream_gbps``: streamed bytes per second
  on rank 0.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "reverse_digits.jsonl"
MB = 1 << 20


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _section(model_dir: Path, args: argparse.Namespace) -> dict:
    heads = max(1, args.hidden // 64)
    return {"engine": "fsdp", "path": str(model_dir), "group_size": 2,
            "build": {"family": "qwen2", "hidden_size": args.hidden, "num_layers": args.layers, "num_heads": heads,
                      "head_dim": 64, "intermediate_size": args.hidden * 11 // 4, "seed": 0}}


def worker(workdir: Path, args: argparse.Namespace) -> None:
    import torch

    from rolectl.roles.engines.algorithms import AlgorithmConfig
    from rolectl.roles.engines.fsdp import FSDPTrainEngine
    from rolectl.roles.engines.sections import FSDPModelSection

    torch.set_num_threads(1)
    engine = FSDPTrainEngine(FSDPModelSection.model_validate(_section(workdir / "model", args)), AlgorithmConfig(),
                             model_path=workdir / "model")
    bucket_bytes = args.bucket_mb * MB
    shard = sum(p.to_local().numel() * p.to_local().element_size() for p in engine.model.parameters())
    largest = max(engine._streamed_nbytes.values())

    libc = ctypes.CDLL("libc.so.6")

    def measure(keep: bool) -> tuple[float, float, int]:
        gc.collect()
        libc.malloc_trim(0)  # return freed heap to the OS, so the baseline is what is live
        _reset_peak()
        base = _status_kb("VmRSS")
        kept, streamed, start = [], 0, time.perf_counter()
        for bucket in engine.iter_weight_buckets(bucket_bytes):
            streamed += sum(t.numel() * t.element_size() for _, t in bucket)
            if keep:
                kept.append(bucket)
            del bucket
        seconds = time.perf_counter() - start
        growth = (_status_kb("VmHWM") - base) / 1024
        del kept
        gc.collect()
        return growth, seconds, streamed

    first_growth, _, _ = measure(keep=False)  # first use also sets up gloo buffers and state-dict hooks
    stream_growth, seconds, streamed = measure(keep=False)
    whole_growth, _, _ = measure(keep=True)
    report = {"rank": engine.rank, "shard_mb": round(shard / MB, 1), "bucket_mb": args.bucket_mb,
              "largest_tensor_mb": round(largest / MB, 1),
              "bound_mb": round((2 * max(bucket_bytes, largest) + 4 * largest) / MB, 1),
              "first_stream_growth_mb": round(first_growth, 1),
              "stream_growth_mb": round(stream_growth, 1), "whole_growth_mb": round(whole_growth, 1),
              "streamed_mb": round(streamed / MB, 1), "stream_seconds": round(seconds, 3),
              "stream_gbps": round(streamed / seconds / 1e9, 3) if streamed else 0.0,
              "model_mb": round(sum(engine._streamed_nbytes.values()) / MB, 1)}
    (workdir / f"rank-{engine.rank}.json").write_text(json.dumps(report))
    engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fsdp_stream", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker), args)
        return

    from rolectl.bus.server import free_port
    from rolectl.roles.engines.hf_model import HFModelConfig, ensure_model

    with tempfile.TemporaryDirectory(prefix="fsdp-stream-") as tmp:
        workdir = Path(tmp)
        section = {k: v for k, v in _section(workdir / "model", args).items() if k != "engine"}
        ensure_model(HFModelConfig.model_validate(section), data_path=str(DATA))
        port = free_port()
        forwarded = [f"--hidden={args.hidden}", f"--layers={args.layers}", f"--bucket-mb={args.bucket_mb}"]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fsdp_stream", "--worker", str(workdir), *forwarded], cwd=ROOT,
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}) for r in range(args.ranks)]
        deadline = time.monotonic() + args.timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
        ranks = [json.loads((workdir / f"rank-{r}.json").read_text()) for r in range(args.ranks)]
    result = {"hidden": args.hidden, "layers": args.layers, "ranks": ranks,
              "within_bound": all(r["stream_growth_mb"] <= r["bound_mb"] for r in ranks)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
