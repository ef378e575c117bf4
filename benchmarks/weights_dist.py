"""Benchmark of the rendezvous weight transports (gloo / nccl broadcast, CUDA IPC) against raw physical limits.

`measure(size_mb, explorers)` runs one trainer process and `explorers` receiver processes (this
module run with `--worker`), moves a mixed fp32/bf16/int64 state dict of `size_mb` MiB, and
returns `(limits, transports)`:

- limits: `raw_broadcast_gbps` — a bare `torch.distributed.broadcast` of the same number of bytes
  as one flat tensor over gloo, same processes; with CUDA also `pinned_d2h_gbps`,
  `pinned_h2d_gbps`, `d2d_copy_gbps` (and `raw_nccl_broadcast_gbps` when there are enough GPUs);
- transports: `gloo` (and `nccl`, `cuda_ipc` where the hardware allows), each
  `{"gbps", "seconds", "ratio_to_limit"}`; gloo's ratio is against `raw_broadcast_gbps`, nccl's
  against `raw_nccl_broadcast_gbps`, cuda_ipc's against `d2d_copy_gbps`.

gbps here is GB/s: 1e9 *bytes* per second of payload (one copy of the state dict), best of
`reps` timed rounds after a warm-up. A round is timed on the trainer from "every receiver is
waiting" to "every receiver has its copy" (receivers report through a side TCPStore), and raw and
transport rounds alternate so background load hits both alike.

Run alone: `python -m benchmarks.weights_dist --size-mb 256 --explorers 1` prints a table + JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = ["measure", "bench_state_dict", "main"]

_ROOT = Path(__file__).resolve().parents[1]
_RESULT = "RESULT "


def bench_state_dict(size_mb: int, *, device: str = "cpu", fill: bool = True) -> dict[str, torch.Tensor]:
    """A transformer-shaped state dict of about `size_mb` MiB: bf16 attention, fp32 and bf16 MLP,
    fp32 norms and biases, int64 position buffers (so some tensors are packed, most go direct)."""
    layers = 8
    # per layer ≈ 32·h² bytes (qkv 6h² + o 2h² + up fp32 16h² + down 8h²)
    h = max(64, int(math.sqrt(size_mb * (1 << 20) / (32 * layers))) // 64 * 64)
    spec: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for i in range(layers):
        p = f"layers.{i}"
        spec += [
            (f"{p}.attn.qkv", torch.bfloat16, (3 * h, h)),
            (f"{p}.attn.qkv_bias", torch.float32, (3 * h,)),
            (f"{p}.attn.o", torch.bfloat16, (h, h)),
            (f"{p}.norm1", torch.float32, (h,)),
            (f"{p}.mlp.up", torch.float32, (4 * h, h)),
            (f"{p}.mlp.down", torch.bfloat16, (h, 4 * h)),
            (f"{p}.norm2", torch.float32, (h,)),
            (f"{p}.positions", torch.int64, (h,)),
        ]
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, dtype, shape in spec:
        if not fill:
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
        elif dtype == torch.int64:
            out[name] = torch.randint(0, 1 << 40, shape, generator=gen, dtype=dtype).to(device)
        else:
            out[name] = torch.empty(shape, dtype=torch.float32).uniform_(-1, 1, generator=gen).to(dtype).to(device)
    return out


def _state_dict(spec: dict, *, device: str, fill: bool) -> dict[str, torch.Tensor]:
    """The worker's state dict: `benchmarks.weights.shaped_state_dict` when the spec names a shape."""
    if spec.get("shape"):
        from benchmarks.weights import shaped_state_dict

        return shaped_state_dict(spec["shape"], spec["size_mb"], device=device, fill=fill)
    return bench_state_dict(spec["size_mb"], device=device, fill=fill)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --------------------------------------------------------------------------------------------------
# worker processes: rank 0 = trainer, ranks 1..K = receivers


async def _worker(spec: dict) -> None:
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    from rolectl.bus.logging import setup_logging
    from rolectl.bus.weights.cuda_ipc import CudaIpcTransport, HandleRequest
    from rolectl.bus.weights.torch_dist import TorchDistTransport
    from rolectl.sync_protocol import MemberRef, RankAssignment, RendezvousReady, Role, SyncMethod

    setup_logging("warning", stream=sys.stderr)  # stdout carries the result line
    torch.set_num_threads(1)  # K+1 processes share the cores; oversubscription only adds noise
    if any(m in spec["modes"] for m in ("nccl", "raw_nccl")):
        torch.cuda.set_device(spec["rank"])
    rank, world = spec["rank"], spec["world"]
    timeout = datetime.timedelta(seconds=120)
    ctl = TCPStore("127.0.0.1", spec["ctl_port"], None, False, timeout)
    receivers = range(1, world)
    members = [MemberRef(role=Role.EXPLORER, id=f"bench{r}", incarnation=0) for r in receivers]
    me = members[rank - 1] if rank else None
    modes: list[str] = spec["modes"]

    def ready(method: SyncMethod, round_: int, port: int) -> RendezvousReady:
        return RendezvousReady.for_group(
            round=round_, cause_seq=round_, method=method, version=round_, epoch=1, master_addr="127.0.0.1",
            master_port=port,
            participants=tuple(RankAssignment(member=m, rank_offset=r, ranks=1)
                               for r, m in zip(receivers, members)),
        )

    ops = {}
    device_of = {"raw": "cpu", "gloo": "cpu", "raw_nccl": f"cuda:{rank}", "nccl": f"cuda:{rank}", "cuda_ipc": "cuda:0"}
    dicts = {}
    for mode in modes:
        device = device_of[mode]
        if mode in ("raw", "raw_nccl"):
            size = _nbytes(_state_dict(spec, device="meta", fill=False))
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            if rank == 0:
                flat.random_(0, 256)
            else:
                flat.zero_()
            if mode == "raw":
                dist.init_process_group("gloo", store=PrefixStore("raw", ctl), rank=rank, world_size=world)
                group = None
            else:  # "raw" always comes first, so the default group exists: add an nccl one
                group = dist.new_group(backend="nccl")

            async def op(round_: int, flat=flat, group=group) -> None:
                dist.broadcast(flat, src=0, group=group)
                if flat.is_cuda:
                    torch.cuda.synchronize(flat.device)

            ops[mode] = op
            continue
        tensors = _state_dict(spec, device=device, fill=rank == 0)
        dicts[mode] = tensors
        if mode in ("gloo", "nccl"):
            transport = TorchDistTransport(backend=mode, bucket_bytes=spec["bucket_bytes"], timeout=120,
                                           **({"direct_min_bytes": spec["direct_bytes"]}
                                              if spec.get("direct_bytes") else {}))
            port = spec["ports"][mode]

            async def op(round_: int, transport=transport, tensors=tensors, port=port) -> None:
                r = ready(SyncMethod.NCCL, round_, port)
                if rank == 0:
                    await transport.send(r, tensors)
                else:
                    await transport.receive(r, me, tensors)

            ops[mode] = op
        elif mode == "cuda_ipc":
            # Handles travel through the control store: a tiny request/reply channel of bytes; each
            # pair numbers its exchanges, so request n meets reply n. The trainer asks every receiver
            # at once, each from its own thread: one store client and one count per receiver, since a
            # client's blocking get holds its socket (a shared one deadlocks with two receivers).
            received = itertools.count(1)
            sent = {m.id: itertools.count(1) for m in members}
            clients = {m.id: TCPStore("127.0.0.1", spec["ctl_port"], None, False, timeout)
                       for m in members} if rank == 0 else {}

            async def send_handles(member: MemberRef, payload: bytes, sent=sent, clients=clients) -> bytes:
                key, client = f"ipc/{next(sent[member.id])}/{member.id}", clients[member.id]
                await asyncio.to_thread(client.set, f"{key}/req", payload)
                return await asyncio.to_thread(client.get, f"{key}/rep")

            async def recv_handles(received=received) -> HandleRequest:
                key = f"ipc/{next(received)}/{me.id}"
                payload = await asyncio.to_thread(ctl.get, f"{key}/req")

                async def reply(data: bytes) -> None:
                    await asyncio.to_thread(ctl.set, f"{key}/rep", data)

                return HandleRequest(payload=payload, reply=reply)

            transport = CudaIpcTransport(send_handles=send_handles if rank == 0 else None,
                                         recv_handles=recv_handles if rank else None,
                                         bucket_bytes=spec["bucket_bytes"], timeout=120)

            async def op(round_: int, transport=transport, tensors=tensors) -> None:
                r = ready(SyncMethod.CUDA_IPC, round_, 1)
                if rank == 0:
                    await transport.send(r, tensors)
                else:
                    await transport.receive(r, me, tensors)

            ops[mode] = op

    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for rep in range(spec["reps"] + 1):  # rep 0 warms up: groups form, pages get touched
        for mode in modes:
            key = f"{mode}/{rep}"
            if rank:
                ctl.set(f"ready/{key}/{rank}", b"1")
                await ops[mode](rep + 1)
                ctl.set(f"done/{key}/{rank}", b"1")
                continue
            ctl.wait([f"ready/{key}/{r}" for r in receivers])
            started = time.perf_counter()
            await ops[mode](rep + 1)
            ctl.wait([f"done/{key}/{r}" for r in receivers])
            if rep:
                seconds[mode].append(time.perf_counter() - started)
    if rank == 0:
        nbytes = _nbytes(_state_dict(spec, device="meta", fill=False))
        print(_RESULT + json.dumps({"nbytes": nbytes, "seconds": seconds}), flush=True)
    ctl.set(f"exit/{rank}", b"1")
    if rank == 0:  # keep serving until every receiver is through (rank 0 hosts the gloo groups)
        ctl.wait([f"exit/{r}" for r in receivers])
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# the parent: limits measured in-process, transports through worker processes


def _gpu_limits(nbytes: int, reps: int) -> dict[str, float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src)

    def best(copy) -> float:
        copy()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return nbytes / min(times) / 1e9

    return {
        "pinned_d2h_gbps": best(lambda: host.copy_(src, non_blocking=True)),
        "pinned_h2d_gbps": best(lambda: src.copy_(host, non_blocking=True)),
        "d2d_copy_gbps": best(lambda: dst.copy_(src)),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(size_mb: int, explorers: int, *, reps: int = 5, bucket_mb: int = 512, direct_kib: int | None = None,
            timeout: float = 600.0, shape: str | None = None) -> tuple[dict, dict]:
    """Measure limits and transports for a `size_mb` MiB state dict sent to `explorers` receivers.

    `bucket_mb` / `direct_kib` override the transports' bucket size and direct-send threshold;
    `shape` names a `benchmarks.weights.SHAPES` model to shape the state dict like."""
    from torch.distributed import TCPStore

    if size_mb <= 0 or explorers <= 0 or reps <= 0:
        raise ValueError("size_mb, explorers and reps must be positive")
    world = explorers + 1
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    modes = ["raw", "gloo"]
    if gpus >= world:  # nccl needs one GPU per rank
        modes += ["raw_nccl", "nccl"]
    if cuda:
        modes.append("cuda_ipc")
    ctl_port = _free_port()
    ctl = TCPStore("127.0.0.1", ctl_port, None, True, datetime.timedelta(seconds=timeout), wait_for_workers=False)
    base = {"world": world, "ctl_port": ctl_port, "size_mb": size_mb, "reps": reps, "modes": modes,
            "bucket_bytes": bucket_mb << 20, "direct_bytes": direct_kib << 10 if direct_kib else None,
            "shape": shape, "ports": {"gloo": _free_port(), "nccl": _free_port()}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-m", "benchmarks.weights_dist", "--worker", json.dumps({**base, "rank": r})],
                         cwd=str(_ROOT), env=env, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                         text=True)
        for r in range(world)
    ]
    try:
        out, _ = procs[0].communicate(timeout=timeout)
        for p in procs[1:]:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        del ctl
    codes = [p.returncode for p in procs]
    lines = [line for line in (out or "").splitlines() if line.startswith(_RESULT)]
    if any(codes) or not lines:
        raise RuntimeError(f"benchmark workers failed (exit codes {codes}); output:\n{out}")
    result = json.loads(lines[-1][len(_RESULT):])
    nbytes = result["nbytes"]

    def rate(mode: str) -> tuple[float, float]:
        best = min(result["seconds"][mode])
        return nbytes / best / 1e9, best

    limits: dict[str, float] = {"raw_broadcast_gbps": rate("raw")[0]}
    if cuda:
        limits.update(_gpu_limits(nbytes, reps))
    if "raw_nccl" in modes:
        limits["raw_nccl_broadcast_gbps"] = rate("raw_nccl")[0]
    against = {"gloo": "raw_broadcast_gbps", "nccl": "raw_nccl_broadcast_gbps", "cuda_ipc": "d2d_copy_gbps"}
    transports: dict[str, dict[str, float]] = {}
    for mode in ("gloo", "nccl", "cuda_ipc"):
        if mode in modes:
            gbps, seconds = rate(mode)
            transports[mode] = {"gbps": gbps, "seconds": seconds, "ratio_to_limit": gbps / limits[against[mode]]}
    return limits, transports


def _table(size_mb: int, explorers: int, limits: dict, transports: dict) -> str:
    rows = [f"weights_dist: {size_mb} MiB to {explorers} explorer(s); GB/s = 1e9 bytes/s of payload",
            f"{'what':<28}{'GB/s':>10}{'seconds':>10}{'of limit':>10}"]
    rows += [f"{'limit ' + k.removesuffix('_gbps'):<28}{v:>10.2f}" for k, v in limits.items()]
    rows += [f"{'transport ' + k:<28}{v['gbps']:>10.2f}{v['seconds']:>10.4f}{v['ratio_to_limit']:>10.1%}"
             for k, v in transports.items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weights_dist", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--explorers", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--direct-kib", type=int, default=None, help="direct-send threshold (default: transport's)")
    parser.add_argument("--shape", default=None,
                        help="a benchmarks.weights.SHAPES model (qwen2-1.5b, qwen2-7b) to shape the state dict like")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        asyncio.run(_worker(json.loads(args.worker)))
        return
    limits, transports = measure(args.size_mb, args.explorers, reps=args.reps, bucket_mb=args.bucket_mb,
                                 direct_kib=args.direct_kib, shape=args.shape)
    print(_table(args.size_mb, args.explorers, limits, transports))
    print(json.dumps({"size_mb": args.size_mb, "explorers": args.explorers, "limits": limits,
                      "transports": transports}, indent=2))


if __name__ == "__main__":
    main()
