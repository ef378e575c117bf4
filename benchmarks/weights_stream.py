"""Publishing weights from a bucket stream: the publisher's peak RSS against two buckets, and its throughput
against publishing the same bytes as one whole mapping.

    python -m benchmarks.weights_stream [--params-b 1.0] [--bucket-mb 256] [--only object_store checkpoint]
        [--repeat 2] [--json PATH]

The model is a Qwen2 configuration scaled to about `--params-b` billion parameters (hidden 2048, 151936
tokens, tied embeddings, as many decoder layers as fit), its names and shapes taken from transformers on
the meta device, in bf16. Each publisher is a fresh process (so its RSS is its own); it connects, warms up
with one small publish, then, per round:

- ``stream``: `transport.publish(version, stream)` where `stream` makes each bucket of about
  `--bucket-mb` when asked, every tensor a fresh copy out of a 64 MiB random pool (what a gather from
  shards hands out), and drops it once it has been sent;
- ``whole``: the same tensors made first into one `{name: tensor}` mapping, then published
  (``whole_publish_s``: the publish alone; ``whole_total_s``: making the mapping as well).

Per transport it prints the peak RSS growth of the publisher during the publish (VmHWM reset through
/proc/self/clear_refs after a malloc_trim) against ``bound_mib`` = 2 x the largest bucket (`--bucket-mb`,
or a tensor larger than that, which is a bucket alone: here the 151936 x 2048 embedding, 594 MiB), and
throughput as GB/s =
1e9 bytes per second. ``ratio_to_whole`` compares the stream (which makes its tensors as it goes) with
the whole mapping's publish alone, the stricter figure; ``ratio_to_whole_total`` with making and
publishing the mapping, the same work. Best of `--repeat` rounds. The object store runs on an embedded
nats-server with memory storage; the checkpoint writes to a temporary directory without fsync (the
page cache: what is measured is the transport, not the disk).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MB = 1 << 20
_POOL = 64 * MB
_ROOT = Path(__file__).resolve().parents[1]


def model_shapes(params_b: float) -> tuple[list[tuple[str, list[int]]], dict[str, Any]]:
    """(name, shape) of a Qwen2-like model of about `params_b` billion parameters, and its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
            "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}

    def shapes(layers: int) -> list[tuple[str, list[int]]]:
        config = AutoConfig.for_model("qwen2", num_hidden_layers=layers, **base)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return [(name, list(p.shape)) for name, p in model.named_parameters()]

    def count(s: list[tuple[str, list[int]]]) -> int:
        return sum(_numel(shape) for _, shape in s)

    one, two = count(shapes(1)), count(shapes(2))
    layers = max(1, round(1 + (params_b * 1e9 - one) / (two - one)))
    out = shapes(layers)
    return out, {"model_type": "qwen2", **base, "num_hidden_layers": layers, "parameters": count(out),
                 "dtype": "bfloat16"}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# the publisher process ---------------------------------------------------------------------------------


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rolectl.bus.weights.checkpoint import CheckpointTransport
    from rolectl.bus.weights.object_store import ObjectStoreTransport

    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    shapes: list[tuple[str, list[int]]] = spec["shapes"]
    bucket_bytes = spec["bucket_mb"] * MB
    pool = torch.empty(_POOL // 2, dtype=torch.bfloat16).uniform_(-1, 1, generator=torch.Generator().manual_seed(0))

    def make(name: str, shape: list[int], k: int) -> torch.Tensor:
        n = _numel(shape)
        out = torch.empty(n, dtype=torch.bfloat16)
        done = 0
        while done < n:  # a fresh tensor, as a gather makes it; copies are cheap next to the transfer
            start = (k * 7919 + done) % pool.numel()
            take = min(n - done, pool.numel() - start)
            out[done : done + take].copy_(pool[start : start + take])
            done += take
        return out.view(shape)

    def stream() -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        filled = 0
        for k, (name, shape) in enumerate(shapes):
            size = _numel(shape) * 2
            if bucket and filled + size > bucket_bytes:
                yield bucket
                bucket, filled = [], 0
            bucket.append((name, make(name, shape, k)))
            filled += size
        if bucket:
            yield bucket

    async def run() -> dict[str, Any]:
        nc = None
        if spec["transport"] == "object_store":
            import nats

            nc = await nats.connect(spec["url"])
            transport: Any = ObjectStoreTransport(nc, spec["job"], storage="memory", timeout=120.0)
        else:
            transport = CheckpointTransport(spec["root"], fsync=False)
        small = {"warm": torch.zeros(1024)}
        await transport.publish(0, small)  # connections, stream, threads
        await transport.publish(0, iter([list(small.items())]))
        rounds = []
        version = 1
        for r in range(spec["repeat"]):
            # alternate the order, so a burst of background load does not always hit the same mode
            for mode in (spec["modes"] if r % 2 == 0 else spec["modes"][::-1]):
                gc.collect()
                libc.malloc_trim(0)
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
                base = _kib("VmRSS")
                started = time.perf_counter()
                if mode == "stream":
                    ref = await transport.publish(version, stream())
                    made = published = time.perf_counter()
                else:
                    whole = {name: t for bucket in stream() for name, t in bucket}
                    made = time.perf_counter()
                    ref = await transport.publish(version, whole)
                    published = time.perf_counter()
                    del whole
                peak = _kib("VmHWM")
                rounds.append({"mode": mode, "nbytes": ref.nbytes, "baseline_mib": base / 1024,
                               "peak_mib": peak / 1024, "growth_mib": (peak - base) / 1024,
                               "make_s": made - started, "publish_s": published - made,
                               "total_s": published - started})
                await transport.prune(0)  # keep memory (server) and disk bounded
                version += 1
        await transport.aclose()
        if nc is not None:
            await nc.close()
        return {"rounds": rounds}

    return asyncio.run(run())


# the run ----------------------------------------------------------------------------------------------


def _publisher(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.weights_stream", "--worker", json.dumps(spec)],
                          capture_output=True, text=True, cwd=_ROOT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"publisher for {spec['transport']} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def largest_bucket_mib(shapes: list[tuple[str, list[int]]], bucket_mb: int) -> float:
    """The largest bucket the stream makes: `bucket_mb`, or a larger tensor that is a bucket alone."""
    return max(bucket_mb, max(_numel(shape) * 2 for _, shape in shapes) / MB)


def summarize(rounds: list[dict[str, Any]], bucket_mb: int, largest_mib: float) -> dict[str, Any]:
    stream = [r for r in rounds if r["mode"] == "stream"]
    whole = [r for r in rounds if r["mode"] == "whole"]
    nbytes = stream[0]["nbytes"]
    best_stream = min(r["total_s"] for r in stream)
    out: dict[str, Any] = {
        "nbytes": nbytes,
        "bucket_mib": bucket_mb,
        "largest_bucket_mib": largest_mib,
        "bound_mib": 2 * largest_mib,
        "stream_growth_mib": max(r["growth_mib"] for r in stream),
        "stream_peak_mib": max(r["peak_mib"] for r in stream),
        "baseline_mib": min(r["baseline_mib"] for r in stream),
        "stream_s": best_stream,
        "stream_gbps": nbytes / best_stream / 1e9,
    }
    out["within_bound"] = out["stream_growth_mib"] <= out["bound_mib"]
    if whole:
        best_publish = min(r["publish_s"] for r in whole)
        best_total = min(r["total_s"] for r in whole)
        out.update(whole_growth_mib=max(r["growth_mib"] for r in whole), whole_publish_s=best_publish,
                   whole_total_s=best_total, whole_gbps=nbytes / best_publish / 1e9,
                   ratio_to_whole=best_publish / best_stream, ratio_to_whole_total=best_total / best_stream)
    return out


def run(params_b: float, bucket_mb: int, repeat: int, only: list[str] | None, whole: bool,
        progress: Any = print) -> dict[str, Any]:
    shapes, config = model_shapes(params_b)
    modes = ["stream", "whole"] if whole else ["stream"]
    transports: dict[str, Any] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rolectl-bench-stream-") as workdir:
        from rolectl.bus.server import NatsServer

        async def with_server() -> None:
            async with NatsServer(store_dir=str(Path(workdir) / "nats")) as server:
                for name in ("object_store", "checkpoint"):
                    if only and name not in only:
                        continue
                    progress(f"{name}: {config['parameters'] / 1e9:.2f}B parameters, {bucket_mb} MiB buckets...")
                    spec = {"transport": name, "url": server.url, "job": "bench-stream",
                            "root": str(Path(workdir) / "ckpt"), "shapes": shapes, "bucket_mb": bucket_mb,
                            "repeat": repeat, "modes": modes}
                    result = await asyncio.to_thread(_publisher, spec)
                    largest = largest_bucket_mib(shapes, bucket_mb)
                    transports[name] = {**summarize(result["rounds"], bucket_mb, largest), "rounds": result["rounds"]}

        asyncio.run(with_server())
    return {"model": config, "tensors": len(shapes), "bucket_mb": bucket_mb, "repeat": repeat,
            "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
            "transports": transports}


def render(result: dict[str, Any]) -> None:
    model = result["model"]
    print(f"{model['parameters'] / 1e9:.2f}B parameters ({model['num_hidden_layers']} layers, bf16), "
          f"{result['bucket_mb']} MiB buckets; GB/s = 1e9 B/s")
    for name, t in result["transports"].items():
        line = (f"{name:13s} stream {t['stream_gbps']:.2f} GB/s, peak growth {t['stream_growth_mib']:.0f} MiB "
                f"(bound 2 x largest bucket = {t['bound_mib']:.0f} MiB: {'within' if t['within_bound'] else 'OVER'}), "
                f"peak RSS {t['stream_peak_mib']:.0f} MiB on a baseline of {t['baseline_mib']:.0f}")
        if "whole_gbps" in t:
            line += (f"; whole {t['whole_gbps']:.2f} GB/s, growth {t['whole_growth_mib']:.0f} MiB; stream/whole "
                     f"{t['ratio_to_whole']:.0%} (publish alone), {t['ratio_to_whole_total']:.0%} (make + publish)")
        print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weights_stream",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--params-b", type=float, default=1.0, help="billions of parameters (bf16)")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--only", nargs="*", choices=["object_store", "checkpoint"])
    parser.add_argument("--no-whole", action="store_true", help="skip the whole-mapping publish")
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    if args.params_b <= 0 or args.bucket_mb <= 0 or args.repeat <= 0:
        parser.error("--params-b, --bucket-mb and --repeat must be positive")
    result = run(args.params_b, args.bucket_mb, args.repeat, args.only, not args.no_whole,
                 progress=lambda m: print(m, file=sys.stderr, flush=True))
    render(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
