"""Weight transfer benchmark: pull transports (object store, checkpoint) against this machine's limits.

    python -m benchmarks.weights [--size-mb 256] [--explorers 4] [--repeat 5] [--json PATH] [--no-dist]
        [--shape qwen2-1.5b|qwen2-7b] [--device cuda] [--fanout 4 8]
        [--sizes 256 1024 4096] [--beside-job] [--storage memory|file] [--file-storage-above MB]
        [--publish-once] [--digest xxh3-128|blake3|sha256] [--fetch-connections N]

Starts its own nats-server. A transformer-shaped state dict of `--size-mb` MiB (bf16 attention and
MLP-down, fp32 MLP-up / norms / biases, int64 buffers) goes from the trainer (this process) to
explorers, which are separate processes (like real explorers: own interpreter, own GIL). One timed
fetch = manifest lookup + every byte received + every chunk digest checked + tensors ready.

Limits, measured in the same run on the same bytes, each the best of two kinds of touched memory:
what receivers fetch into (`host_memory.host_buffer`: huge-page backed at model sizes, where a read from
the page cache runs about twice as fast) and a plain bytearray:
- ``loopback_socket_gbps``: a plain TCP socket over loopback, sender thread ``sendall`` -> receiver
  ``recv_into`` a preallocated, already-touched buffer (no protocol, no digest, no allocation);
- ``host_memcpy_gbps``: one copy between two touched buffers;
- ``fresh_memory_gbps``: one copy into freshly allocated memory (page faults and kernel zeroing on
  first touch: what every receiver of new tensors pays; the other limits write touched memory);
- ``page_cache_read_gbps``: ``readinto`` of a page-cached file into a touched buffer (the limit the
  checkpoint transport is measured against);
- ``stock_nats_object_store_gbps``: nats-py's own ObjectStore ``get`` of the first ``--stock-mb``
  MiB of the same bytes (default 8; its ``put`` is reported too): at full size it alone would take
  minutes, so its rate is what is compared, and ``stock_nats_object_store_mb`` says on how much it
  was measured (figures: docs/benchmarks.md).

Per transport: best single-explorer fetch (``gbps``, ``seconds``; median too), publish time, and with
``--explorers K`` the time for K explorers fetching the same version at once (``fanout_seconds``,
``fanout_ratio`` = fan-out / single, rounds alternate so background load hits both), and the
receiver's peak RSS growth during a fetch (VmHWM reset through /proc/self/clear_refs). gbps is
GB/s = 1e9 bytes of payload per second. ``object_store`` ``ratio_to_limit`` is against the loopback
socket; ``checkpoint`` against the page-cache read.

``--shape`` builds a bf16 state dict from a transformers config (a Qwen2-1.5B- or 7B-like model with
as many layers as fit in ``--size-mb``; `SHAPES`) instead. ``--device cuda`` has explorers fetch into
CUDA tensors: the pinned H2D, D2H and D2D copies join the limits (``ratio_to_h2d`` per transport) and
each fetch reports the receiver's peak GPU memory too (``receiver_peak_gpu_mib``). ``--fanout K ...``
adds, per version, a fetch by K explorers at once for each K (``fanout_by_explorers``).

Every round records the machine's 1-minute load average with its figures (``rounds``), and each
transport reports ``best_over_median`` and ``spread`` (worst / best) and the peak memory of every
process: receiver (``receiver_peak_mib``, growth during a fetch), publisher (``publisher_peak_mib``,
growth during a publish) and nats-server (``server_peak_rss_mib``, its whole RSS: memory storage
holds the kept versions there), and per round the CPU seconds the receiver and the server spent on
the fetch (``receiver_cpu_s``, ``server_cpu_s``; medians per transport) and the receiver's page
faults (``receiver_page_faults``). ``--sizes`` runs the size curve and writes one JSON whose
``curve`` has one point per size; ``--beside-job`` runs the quickstart job (``rolectl up
examples/quickstart.yaml``, its own nats-server, trainer and two explorers) beside the transfers, as
roles share hosts in a real job; ``--file-storage-above MB`` makes the object store use file storage
above that size (memory storage keeps two versions in the server's RAM); ``--publish-once``
publishes one version and fetches it every round, so the server holds one version (memory storage at
a size where two do not fit). ``--digest`` sets the publishers' chunk digest (receivers check with
the manifest's).

``object_store_fresh`` is the object store with every fetch into fresh memory (no buffer given back,
a CUDA fetch's pinned staging buffer dropped; ``--fresh-buffers`` does the same to every transport):
beside ``object_store`` in one run it shows what the spare buffer saves from the second fetch on.

Adding a transport: put an ``async def bench(ctx: BenchContext) -> dict`` into ``TRANSPORT_BENCHES``
(pull transports can reuse ``bench_pull`` with a worker factory in ``WORKER_FACTORIES``). If
``benchmarks.weights_dist`` exists, its ``measure(size_mb, explorers)`` results are merged in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SHAPES",
    "BenchContext",
    "TRANSPORT_BENCHES",
    "WORKER_FACTORIES",
    "build_state_dict",
    "shaped_state_dict",
    "bench_pull",
    "measure_limits",
    "run",
    "main",
]

_ROOT = Path(__file__).resolve().parents[1]


def _now() -> float:
    # CLOCK_MONOTONIC is one clock for every process on the host: worker timestamps compare.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# the state dict ---------------------------------------------------------------------------------------


def build_state_dict(size_mb: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """About `size_mb` MiB shaped like a small transformer, with bf16, fp32 and int64 tensors."""
    layers = 8
    # bytes: per layer 32 h^2 (qkv bf16 6h^2, o bf16 2h^2, up fp32 16h^2, down bf16 8h^2) + embed 16 h^2
    h = max(64, int(math.sqrt(size_mb * (1 << 20) / (32 * layers + 16))) // 64 * 64)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {"embed.weight": _rand((8 * h, h), torch.bfloat16, gen)}
    for i in range(layers):
        p = f"layers.{i}"
        out[f"{p}.attn.qkv.weight"] = _rand((3 * h, h), torch.bfloat16, gen)
        out[f"{p}.attn.qkv.bias"] = _rand((3 * h,), torch.float32, gen)
        out[f"{p}.attn.o.weight"] = _rand((h, h), torch.bfloat16, gen)
        out[f"{p}.norm1.weight"] = _rand((h,), torch.float32, gen)
        out[f"{p}.mlp.up.weight"] = _rand((4 * h, h), torch.float32, gen)
        out[f"{p}.mlp.down.weight"] = _rand((h, 4 * h), torch.bfloat16, gen)
        out[f"{p}.norm2.weight"] = _rand((h,), torch.float32, gen)
        out[f"{p}.rotary.positions"] = torch.randint(0, 1 << 40, (h,), generator=gen, dtype=torch.int64)
    out["step"] = torch.tensor(12345, dtype=torch.int64)
    # top up to the exact size with an int64 buffer, so sizes compare across runs
    missing = size_mb * (1 << 20) - _nbytes(out)
    if missing >= 8:
        out["token_counts"] = torch.randint(0, 1 << 40, (missing // 8,), generator=gen, dtype=torch.int64)
    return out


# transformers configs of real models: `shaped_state_dict` keeps their tensor shapes, not their depth
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                   "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
}


def _meta_params(shape: str, layers: int) -> dict[str, torch.Size]:
    """Parameter names and shapes of `shape`'s model with `layers` layers (on the meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(SHAPES[shape])
    config = AutoConfig.for_model(values.pop("model_type"), num_hidden_layers=layers, **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: p.shape for name, p in model.named_parameters()}  # a tied embedding once


def shape_layers(shape: str, size_mb: int) -> int:
    """How many of `shape`'s layers fit in `size_mb` MiB of bf16 (at least one)."""
    one, two = (sum(s.numel() * 2 for s in _meta_params(shape, n).values()) for n in (1, 2))
    return max(1, 1 + (size_mb * (1 << 20) - one) // (two - one))


def shaped_state_dict(shape: str, size_mb: int, *, seed: int = 0, device: str = "cpu",
                      fill: bool = True) -> dict[str, torch.Tensor]:
    """A bf16 state dict with the names and shapes of `SHAPES[shape]`, as many layers as fit in
    `size_mb` MiB (embeddings whole); uniform in [-1, 1] from `seed`, or zeros without `fill`."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, size in _meta_params(shape, shape_layers(shape, size_mb)).items():
        t = torch.empty(size, dtype=torch.bfloat16)
        if fill:
            t.uniform_(-1, 1, generator=gen)
        else:
            t.zero_()
        out[name] = t.to(device)
    return out


def _rand(shape, dtype, gen) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32).uniform_(-1, 1, generator=gen).to(dtype)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _flat_bytes(tensors: dict[str, torch.Tensor]) -> memoryview:
    """The state dict's bytes as one buffer (for the limit measurements)."""
    from rolectl.bus.weights.format import SourceBytes

    source = SourceBytes(tensors)
    buf = torch.empty(source.nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    source.read_into(0, view)
    return view


# limits -------------------------------------------------------------------------------------------


def _best_median(values: list[float]) -> dict[str, float]:
    return {"best": min(values), "median": statistics.median(values)}


def _touched_buffers(nbytes: int) -> Iterator[memoryview]:
    """Touched destinations for the limits, one at a time: the kind a receiver fetches into
    (`host_buffer`: huge-page backed at model sizes), then a plain bytearray. Each limit keeps the
    best of both, since either can be the faster for a given copy here."""
    from rolectl.bus.weights.host_memory import host_buffer

    yield memoryview(host_buffer(nbytes).fill_(0).numpy())
    yield memoryview(bytearray(nbytes))  # zero-filled, hence touched


def limit_host_memcpy(data: memoryview, dst: memoryview, repeat: int) -> list[float]:
    """One memcpy by one thread into a touched buffer (torch's copy_ would use every core)."""
    times = []
    for _ in range(repeat):
        t0 = _now()
        dst[:] = data
        times.append(_now() - t0)
    return times


def limit_fresh_memory(data: memoryview, repeat: int) -> list[float]:
    """One copy by one thread into freshly allocated memory: every page faulted in and zeroed by the
    kernel on first touch, as a receiver's new tensors are (the other limits write touched memory)."""
    from rolectl.bus.weights.host_memory import host_buffer

    src = torch.frombuffer(data, dtype=torch.uint8)
    times = []
    for _ in range(repeat):
        t0 = _now()
        dst = host_buffer(len(data))
        for a in range(0, len(data), 64 << 20):  # in pieces: torch would copy a whole buffer on every core
            dst[a : a + (64 << 20)].copy_(src[a : a + (64 << 20)])
        times.append(_now() - t0)
        del dst
    return times


def limit_loopback_socket(data: memoryview, view: memoryview, repeat: int) -> list[float]:
    """Seconds to move `data` over one loopback TCP connection into a touched buffer, per round."""
    times = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        for _ in range(repeat):
            sender = threading.Thread(target=_send_all, args=(port, data))
            t0 = _now()
            sender.start()
            conn, _ = listener.accept()
            with conn:
                got = 0
                while got < len(view):
                    n = conn.recv_into(view[got:])
                    if not n:
                        raise RuntimeError(f"loopback sender stopped after {got} bytes")
                    got += n
            times.append(_now() - t0)
            sender.join()
    if bytes(view[-4096:]) != bytes(data[-4096:]):
        raise RuntimeError("loopback copy corrupted the data")
    return times


def _send_all(port: int, data: memoryview) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)


def limit_page_cache_read(data: memoryview, view: memoryview, directory: str, repeat: int) -> list[float]:
    path = Path(directory) / "limit-read.bin"
    with open(path, "wb") as f:
        f.write(data)
    times = []
    try:
        for _ in range(repeat):
            t0 = _now()
            with open(path, "rb", buffering=0) as f:
                pos = 0
                while pos < len(view):
                    n = f.readinto(view[pos:])
                    if not n:
                        break
                    pos += n
            times.append(_now() - t0)
    finally:
        path.unlink()
    return times


async def limit_stock_object_store(url: str, data: memoryview) -> dict[str, float]:
    """nats-py's ObjectStore put and get of the same bytes (once each: the get is slow)."""
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        store = await js.create_object_store("rolectl_bench_stock")
        payload = bytes(data)
        t0 = _now()
        await store.put("weights", payload)
        t1 = _now()
        got = await store.get("weights")
        t2 = _now()
        if got.data != payload:
            raise RuntimeError("stock object store returned different bytes")
        await js.delete_object_store("rolectl_bench_stock")
    finally:
        await nc.close()
    return {"put_seconds": t1 - t0, "get_seconds": t2 - t1}


async def measure_limits(ctx: BenchContext, *, stock: bool = True) -> None:
    """Measure (again) and keep the best figure of every run: called before and after the transports,
    so a burst of background load during one of them does not flatter the transports."""
    data = ctx.flat
    n = len(data)
    measured = [("fresh_memory", limit_fresh_memory(data, ctx.repeat))]
    for dst in _touched_buffers(n):
        measured += [
            ("host_memcpy", limit_host_memcpy(data, dst, ctx.repeat)),
            ("loopback_socket", limit_loopback_socket(data, dst, ctx.repeat)),
            ("page_cache_read", limit_page_cache_read(data, dst, ctx.workdir, ctx.repeat)),
        ]
        del dst  # freed before the next kind is allocated: two model-sized buffers at once may not fit
    for key, times in measured:
        seen = ctx.details.setdefault(f"{key}_seconds", [])
        seen.extend(times)
        ctx.limits[f"{key}_gbps"] = n / min(seen) / 1e9
        ctx.details[f"{key}_median_gbps"] = n / statistics.median(seen) / 1e9
    if ctx.device.startswith("cuda"):
        from benchmarks.weights_dist import _gpu_limits

        for key, gbps in _gpu_limits(n, ctx.repeat).items():
            ctx.limits[key] = max(gbps, ctx.limits.get(key, 0.0))
    if stock:
        # the stock store is orders of magnitude slower: its rate on a slice is the reference
        sample = data[: min(n, ctx.stock_mb << 20)]
        ctx.progress(f"limits: loopback {ctx.limits['loopback_socket_gbps']:.2f} GB/s; "
                     f"stock nats-py object store on {len(sample) >> 20} MiB (slow)...")
        times = await limit_stock_object_store(ctx.url, sample)
        ctx.limits["stock_nats_object_store_gbps"] = len(sample) / times["get_seconds"] / 1e9
        ctx.details["stock_nats_object_store_put_gbps"] = len(sample) / times["put_seconds"] / 1e9
        ctx.details["stock_nats_object_store_seconds"] = times
        ctx.details["stock_nats_object_store_mb"] = len(sample) / (1 << 20)


# explorer worker processes ------------------------------------------------------------------------


async def _object_store_worker(spec: dict) -> tuple[Any, Callable[[], Awaitable[None]]]:
    import nats

    from rolectl.bus.weights.object_store import ObjectStoreTransport

    options = {}
    if spec.get("security"):  # TLS + nkey identity (the secured object store bench)
        from rolectl.bus.security import ClientSecurity

        options = ClientSecurity(**spec["security"]).connect_options(spec["job"])
    nc = await nats.connect(spec["url"], **options)
    transport = ObjectStoreTransport(nc, spec["job"], storage=spec.get("storage", "memory"),
                                     fetch_connections=spec.get("fetch_connections"))

    async def close() -> None:
        await transport.aclose()
        await nc.close()

    return transport, close


async def _checkpoint_worker(spec: dict) -> tuple[Any, Callable[[], Awaitable[None]]]:
    from rolectl.bus.weights.checkpoint import CheckpointTransport

    transport = CheckpointTransport(spec["root"])
    return transport, transport.aclose


# name -> async factory(spec) -> (transport with .fetch, async close)
WORKER_FACTORIES: dict[str, Callable[[dict], Awaitable[tuple[Any, Callable[[], Awaitable[None]]]]]] = {
    "object_store": _object_store_worker,
    "checkpoint": _checkpoint_worker,
}


def _rss_kib(field_name: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _reset_peak(pid: int | str = "self") -> int:
    """Reset `pid`'s VmHWM to its current RSS (Linux >= 4.0; our own children only); its RSS in KiB."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _rss_kib("VmRSS", pid)


async def _worker_main(spec: dict) -> None:
    """An explorer: build the transport, then for each `fetch` line on stdin fetch and report."""
    from rolectl.bus.weights.base import WeightsRef

    transport, close = await WORKER_FACTORIES[spec["factory"]](spec)
    device = spec.get("device", "cpu")
    if device.startswith("cuda"):
        torch.cuda.init()  # the context exists before the first timed fetch
    print(json.dumps({"ready": True}), flush=True)
    base_kib = _rss_kib("VmRSS")  # peaks count from here: a buffer kept for the next fetch is counted
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line or line.strip() == "quit":
                return
            ref = WeightsRef(**json.loads(line))
            with contextlib.suppress(OSError):  # reset VmHWM to the current RSS (Linux >= 4.0)
                Path("/proc/self/clear_refs").write_text("5")
            cuda = device.startswith("cuda")
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                gpu0 = torch.cuda.memory_allocated(device)
            t0, usage0 = _now(), resource.getrusage(resource.RUSAGE_SELF)
            tensors = await transport.fetch(ref, device=device)
            if cuda:
                torch.cuda.synchronize(device)  # the bytes are on the GPU, not queued
            t1, usage1 = _now(), resource.getrusage(resource.RUSAGE_SELF)
            peak = _rss_kib("VmHWM")
            got = sum(t.numel() * t.element_size() for t in tensors.values())
            if spec.get("recycle", True):
                transport.recycle(tensors)  # as an explorer does once its engine copied them
            elif cuda:
                _drop_spare(transport)
            del tensors
            row = {"t0": t0, "t1": t1, "nbytes": got, "peak_kib": peak - base_kib,
                   "cpu_s": usage1.ru_utime + usage1.ru_stime - usage0.ru_utime - usage0.ru_stime,
                   "page_faults": usage1.ru_minflt - usage0.ru_minflt}
            if cuda:
                row["gpu_peak_kib"] = (torch.cuda.max_memory_allocated(device) - gpu0) // 1024
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
    finally:
        await close()


def _drop_spare(transport) -> None:
    """Forget the transport's spare buffer, so its next fetch allocates fresh memory. A CUDA fetch
    keeps its pinned staging buffer as the spare by itself (`recycle` covers CPU fetches only):
    without this, `--fresh-buffers` on CUDA would still land every fetch after the first in it."""
    from rolectl.bus.weights.host_memory import SpareBuffer

    transport._spare = SpareBuffer()


class _Explorers:
    """K worker processes for one transport; `fetch(k, ref)` has the first k fetch at once."""

    def __init__(self, spec: dict, count: int):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])}
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.weights", "--worker", json.dumps(spec)],
                cwd=str(_ROOT), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            for _ in range(count)
        ]

    async def ready(self) -> None:
        for proc in self.procs:
            await self._read(proc)

    async def _read(self, proc) -> dict:
        line = await asyncio.to_thread(proc.stdout.readline)
        if not line:
            raise RuntimeError(f"explorer worker {proc.pid} died (exit {proc.wait()}); see its stderr")
        return json.loads(line)

    async def fetch(self, k: int, ref) -> list[dict]:
        body = json.dumps({"version": ref.version, "location": ref.location, "nbytes": ref.nbytes,
                           "digest": ref.digest}) + "\n"
        for proc in self.procs[:k]:
            proc.stdin.write(body)
            proc.stdin.flush()
        results = [await self._read(proc) for proc in self.procs[:k]]
        for r in results:
            if r["nbytes"] != ref.nbytes:
                raise RuntimeError(f"explorer got {r['nbytes']} bytes, expected {ref.nbytes}")
        return results

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.write("quit\n")
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


# a job beside the transfer ----------------------------------------------------------------------------


class BesideJob:
    """`rolectl up` of examples/quickstart.yaml (its own nats-server, a trainer and two explorers),
    run beside the transfer as trainer and explorers share hosts with it in a real job; long enough
    to outlast the benchmark, stopped (SIGINT, then SIGKILL of its process group) at the end."""

    STEPS = 1_000_000  # never reached: the benchmark stops the job

    def __init__(self, workdir: str, *, ready_timeout: float = 300.0):
        import yaml

        data = yaml.safe_load((_ROOT / "examples" / "quickstart.yaml").read_text())
        data["job"] = "beside"
        data["run_dir"] = str(Path(workdir) / "beside-runs")
        data["trainer"]["total_steps"] = data["explorers"]["total_steps"] = self.STEPS
        self.run_dir = Path(data["run_dir"])
        self.config = Path(workdir) / "beside.yaml"
        self.config.write_text(yaml.safe_dump(data, sort_keys=False))
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.out = Path(workdir) / "beside.out"

    def start(self) -> None:
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rolectl", "up", "--config", str(self.config), "--no-dashboard"],
                cwd=str(_ROOT), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )

    async def ready(self) -> int:
        """Wait (bounded) until the job's trainer has trained a step; the steps so far."""
        deadline = _now() + self.ready_timeout
        while _now() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job beside exited with {self.proc.returncode}: {self.out.read_text()[-2000:]}")
            if steps := self.steps():
                return steps
            await asyncio.sleep(1.0)  # polling a log file: there is no event to wait on across processes
        raise RuntimeError(f"the job beside trained no step in {self.ready_timeout:.0f} s; see {self.out}")

    def steps(self) -> int:
        """Train steps the job's trainer has logged (how much it ran beside the transfer)."""
        return sum(log.read_text(errors="replace").count("train_step")
                   for log in self.run_dir.glob("*/logs/trainer*.log"))

    def stop(self) -> None:
        import signal

        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # `up` stops its roles in order
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
            self.proc.wait()


# transports -----------------------------------------------------------------------------------------


@dataclass
class BenchContext:
    """Everything a transport bench needs; benches add to `limits` / `details` / `transports`."""

    size_mb: int
    explorers: int
    repeat: int
    url: str
    workdir: str
    state: dict[str, torch.Tensor]
    flat: memoryview
    limits: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)
    progress: Callable[[str], None] = print
    stock_mb: int = 8  # MiB the stock nats-py object store reference moves
    device: str = "cpu"  # where explorers fetch into
    fanout: tuple[int, ...] = ()  # extra fan-out sizes measured per version
    server_pid: int | None = None  # the nats-server the transport under test talks to (its peak RSS)
    storage: str = "memory"  # the object store's storage in the plain `object_store` bench
    recycle: bool = True  # receivers give each fetch's buffer back, as an explorer does (PullTransport.recycle)
    fetch_connections: int | None = None  # data connections per object-store fetch (None: the transport's default)
    publish_once: bool = False  # one version, fetched `repeat` times: the server holds one version, not two
    digest: str | None = None  # the publishers' digest algorithm (None: the transports' default)

    @property
    def nbytes(self) -> int:
        return len(self.flat)


async def bench_pull(ctx: BenchContext, transport, worker_spec: dict, limit_key: str) -> dict:
    """Publish `repeat` versions (one with `publish_once`); after each, one explorer fetches, then K
    fetch at once."""
    explorers = _Explorers({"device": ctx.device, "recycle": ctx.recycle, "fetch_connections": ctx.fetch_connections,
                            **worker_spec},
                           max(ctx.explorers, 1, *ctx.fanout))
    by_k: dict[int, list[float]] = {k: [] for k in ctx.fanout}
    gpu_peaks: list[int] = []
    try:
        await explorers.ready()
        publish, single, fanout, peaks = [], [], [], []
        rounds: list[dict[str, Any]] = []
        publisher_peaks, server_peaks = [], []
        ref = None
        for version in range(1, ctx.repeat + 1):
            server_rss0 = _reset_peak(ctx.server_pid) if ctx.server_pid else 0
            if ref is None or not ctx.publish_once:
                rss0 = _reset_peak()
                t0 = _now()
                ref = await transport.publish(version, ctx.state)
                publish.append(_now() - t0)
                publisher_peaks.append(_rss_kib("VmHWM") - rss0)
                await transport.prune(2)  # as the trainer does, untimed
            server_cpu0 = _cpu_seconds(ctx.server_pid) if ctx.server_pid else 0.0
            one = await explorers.fetch(1, ref)
            single.append(one[0]["t1"] - one[0]["t0"])
            peaks.append(one[0]["peak_kib"])
            # CPU seconds each side spent on the fetch: where the time goes on a machine short of cores
            cpu = {"receiver_cpu_s": one[0]["cpu_s"], "receiver_page_faults": one[0]["page_faults"]}
            if ctx.server_pid:
                server_peaks.append((_rss_kib("VmHWM", ctx.server_pid), server_rss0))
                cpu["server_cpu_s"] = _cpu_seconds(ctx.server_pid) - server_cpu0
            rounds.append({"publish_s": publish[-1], "fetch_s": single[-1],
                           "fetch_gbps": ctx.nbytes / single[-1] / 1e9, **cpu, "loadavg_1m": os.getloadavg()[0]})
            gpu_peaks += [r["gpu_peak_kib"] for r in one if "gpu_peak_kib" in r]
            if ctx.explorers > 1:
                many = await explorers.fetch(ctx.explorers, ref)
                fanout.append(max(r["t1"] for r in many) - min(r["t0"] for r in many))
                peaks += [r["peak_kib"] for r in many]
            for k in ctx.fanout:
                many = await explorers.fetch(k, ref)
                by_k[k].append(max(r["t1"] for r in many) - min(r["t0"] for r in many))
                peaks += [r["peak_kib"] for r in many]
                gpu_peaks += [r["gpu_peak_kib"] for r in many if "gpu_peak_kib" in r]
    finally:
        explorers.close()
        await transport.aclose()
    best = min(single)
    out: dict[str, Any] = {
        "gbps": ctx.nbytes / best / 1e9,
        "seconds": best,
        "median_seconds": statistics.median(single),
        "median_gbps": ctx.nbytes / statistics.median(single) / 1e9,
        "ratio_to_limit": ctx.nbytes / best / 1e9 / ctx.limits[limit_key],
        "limit": limit_key,
        "publish_seconds": min(publish),
        "publish_gbps": ctx.nbytes / min(publish) / 1e9,
        "end_to_end_seconds": min(publish) + best,
        "receiver_peak_mib": max(peaks) / 1024,
        "receiver_peak_over_model": max(peaks) * 1024 / ctx.nbytes,
        # the spread a user sees: how far the median and the worst round fall below the best
        "best_over_median": statistics.median(single) / best,
        "spread": max(single) / best,
        "publisher_peak_mib": max(publisher_peaks) / 1024,
        "receiver_cpu_s_median": statistics.median(r["receiver_cpu_s"] for r in rounds),
        "rounds": rounds,
    }
    if ctx.server_pid:
        out["server_cpu_s_median"] = statistics.median(r["server_cpu_s"] for r in rounds)
    if server_peaks:
        # absolute: with memory storage the server holds the kept versions, with file storage the page cache does
        out["server_peak_rss_mib"] = max(peak for peak, _ in server_peaks) / 1024
        out["server_peak_growth_mib"] = max(peak - before for peak, before in server_peaks) / 1024
    if gpu_peaks:
        out.update(device=ctx.device, receiver_peak_gpu_mib=max(gpu_peaks) / 1024,
                   receiver_peak_gpu_over_model=max(gpu_peaks) * 1024 / ctx.nbytes)
    if "pinned_h2d_gbps" in ctx.limits:
        out["ratio_to_h2d"] = out["gbps"] / ctx.limits["pinned_h2d_gbps"]
    if by_k:
        out["fanout_by_explorers"] = {
            str(k): {"seconds": min(times), "ratio": min(times) / best,
                     "median_ratio": statistics.median(times) / statistics.median(single)}
            for k, times in by_k.items()
        }
    if fanout:
        out.update(
            explorers=ctx.explorers,
            fanout_seconds=min(fanout),
            fanout_ratio=min(fanout) / best,
            fanout_median_ratio=statistics.median(fanout) / statistics.median(single),
        )
    return out


async def _bench_object_store(ctx: BenchContext, storage: str, *, recycle: bool | None = None) -> dict:
    import nats

    from rolectl.bus.weights.object_store import ObjectStoreTransport

    job = f"bench-{storage}" if recycle is None else f"bench-{storage}-fresh"
    nc = await nats.connect(ctx.url)
    try:
        transport = ObjectStoreTransport(nc, job, storage=storage, algorithm=ctx.digest)
        spec = {"factory": "object_store", "url": ctx.url, "job": job, "storage": storage,
                **({} if recycle is None else {"recycle": recycle})}
        result = await bench_pull(ctx, transport, spec, "loopback_socket_gbps")
        result.update(storage=storage, chunk_bytes=transport.chunk_size, recycle=spec.get("recycle", ctx.recycle))
        return result
    finally:
        with contextlib.suppress(Exception):
            # Its versions would stay in the server's memory through the next benches (2 x the size).
            await nc.jetstream().delete_stream(transport.stream)
        await nc.close()


async def bench_object_store(ctx: BenchContext) -> dict:
    """The default configuration: memory storage (file with `--storage file`)."""
    return await _bench_object_store(ctx, ctx.storage)


async def bench_object_store_fresh(ctx: BenchContext) -> dict:
    """The default configuration with every fetch into fresh memory: receivers give no buffer back
    and drop a CUDA fetch's pinned staging buffer, against `object_store`'s spare buffer."""
    return await _bench_object_store(ctx, ctx.storage, recycle=False)


async def bench_object_store_file(ctx: BenchContext) -> dict:
    """File storage (survives a server restart)."""
    return await _bench_object_store(ctx, "file")


async def bench_object_store_secure(ctx: BenchContext) -> dict:
    """Memory storage on a server from `rolectl auth init` (TLS, nkeys, least privilege): admin
    makes the stream, the trainer identity publishes, explorer identities fetch (through the
    data connection, over TLS and signed with the identity's nkey like the nats-py client)."""
    import nats

    from rolectl.bus.auth import init_auth_dir
    from rolectl.bus.server import NatsServer, free_port, go_gc_for_weights
    from rolectl.bus.weights.object_store import ObjectStoreTransport

    job = "bench-secure"
    auth = init_auth_dir(Path(ctx.workdir) / "auth", job=job, explorers=1, port=free_port(),
                         http_port=free_port(), store_dir=str(Path(ctx.workdir) / "nats-secure"))
    storage = ctx.storage
    async with NatsServer(config_file=str(auth.server_conf), port=auth.port, http_port=auth.http_port,
                          go_gc=go_gc_for_weights(storage)) as server:
        admin = await nats.connect(auth.url, **auth.security("admin").connect_options(job))
        try:
            await ObjectStoreTransport(admin, job, storage=storage).ensure_stream()
        finally:
            await admin.close()
        nc = await nats.connect(auth.url, **auth.security("trainer").connect_options(job))
        plain_server, ctx.server_pid = ctx.server_pid, server.pid
        try:
            transport = ObjectStoreTransport(nc, job, storage=storage, algorithm=ctx.digest)
            explorer = auth.security("explorer-0")
            result = await bench_pull(
                ctx, transport,
                {"factory": "object_store", "url": auth.url, "job": job, "storage": storage,
                 "security": {"creds": explorer.creds, "tls_ca": explorer.tls_ca}},
                "loopback_socket_gbps",
            )
            result.update(storage=storage, chunk_bytes=transport.chunk_size, tls=True, nkeys=True)
            return result
        finally:
            ctx.server_pid = plain_server
            await nc.close()


async def bench_checkpoint(ctx: BenchContext) -> dict:
    from rolectl.bus.weights.checkpoint import CheckpointTransport

    root = str(Path(ctx.workdir) / "checkpoints")
    result = await bench_pull(
        ctx, CheckpointTransport(root, algorithm=ctx.digest), {"factory": "checkpoint", "root": root},
        "page_cache_read_gbps",
    )
    result["directory"] = root
    return result


TRANSPORT_BENCHES: dict[str, Callable[[BenchContext], Awaitable[dict]]] = {
    "object_store": bench_object_store,
    "object_store_fresh": bench_object_store_fresh,
    "object_store_file": bench_object_store_file,
    "object_store_secure": bench_object_store_secure,
    "checkpoint": bench_checkpoint,
}


# the run --------------------------------------------------------------------------------------------


async def run(size_mb: int, explorers: int, repeat: int, *, dist: bool = True,
              only: list[str] | None = None, progress: Callable[[str], None] = print,
              stock_mb: int = 8, shape: str | None = None, device: str = "cpu",
              fanout: tuple[int, ...] = (), beside_job: bool = False, storage: str = "memory",
              recycle: bool = True, fetch_connections: int | None = None, publish_once: bool = False,
              digest: str | None = None) -> dict:
    from rolectl.bus.server import NatsServer, go_gc_for_weights
    from rolectl.bus.weights.format import DEFAULT_DIGEST_ALGORITHM

    state = shaped_state_dict(shape, size_mb) if shape else build_state_dict(size_mb)
    beside: BesideJob | None = None
    with tempfile.TemporaryDirectory(prefix="rolectl-bench-") as workdir:
        async with NatsServer(store_dir=str(Path(workdir) / "nats"), go_gc=go_gc_for_weights(storage)) as server:
            ctx = BenchContext(size_mb=size_mb, explorers=explorers, repeat=repeat, url=server.url,
                               workdir=workdir, state=state, flat=_flat_bytes(state), progress=progress,
                               stock_mb=stock_mb, device=device, fanout=tuple(fanout),
                               server_pid=server.pid, storage=storage, recycle=recycle,
                               fetch_connections=fetch_connections, publish_once=publish_once,
                               digest=digest)
            if beside_job:
                beside = BesideJob(workdir)
                beside.start()
                progress("waiting for the quickstart job beside to train a step...")
                steps_before = await beside.ready()
            try:
                result = await _measure(ctx, server.monitor_url, only, progress)
            finally:
                if beside is not None:
                    steps_during = beside.steps() - steps_before
                    beside.stop()
    if beside is not None:
        # proof it ran all along: the trainer beside kept training while the transfers were timed
        result["beside_job"] = {"config": "examples/quickstart.yaml (total_steps raised; stopped at the end)",
                                "train_steps_during": steps_during}
    result.update(size_mb=size_mb, explorers=explorers, repeat=repeat, digest=digest or DEFAULT_DIGEST_ALGORITHM,
                  storage=storage, fetch_connections=fetch_connections or "default", publish_once=publish_once)
    if shape:
        result["shape"] = {"name": shape, **SHAPES[shape], "num_hidden_layers": shape_layers(shape, size_mb),
                           "dtype": "bfloat16", "tensors": len(state)}
    if device != "cpu":
        result["device"] = device
    if fanout:
        result["fanout"] = list(fanout)
    if dist:
        try:
            import benchmarks.weights_dist as weights_dist
        except ImportError:
            weights_dist = None
        if weights_dist is not None:
            progress("benchmarks.weights_dist.measure...")
            limits, transports = await asyncio.to_thread(
                weights_dist.measure, size_mb, explorers, **({"shape": shape} if shape else {}))
            result["limits"].update(limits)
            result["transports"].update(transports)
    return result


async def _measure(ctx: BenchContext, monitor_url: str, only: list[str] | None,
                   progress: Callable[[str], None]) -> dict[str, Any]:
    """Limits, every transport asked for, limits again; the machine's load around them."""
    load_before = os.getloadavg()
    await measure_limits(ctx)
    for name, bench in TRANSPORT_BENCHES.items():
        if only and name not in only:
            continue
        progress(f"transport {name}...")
        try:
            ctx.transports[name] = await bench(ctx)
        except Exception:
            progress(f"nats-server's closed connections: {_closed_reasons(monitor_url)}")
            raise
    await measure_limits(ctx, stock=False)
    for t in ctx.transports.values():  # against the best limits of the whole run
        if "limit" in t:
            t["ratio_to_limit"] = t["gbps"] / ctx.limits[t["limit"]]
    return {
        "nbytes": ctx.nbytes,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "limits": ctx.limits,
        "limit_details": ctx.details,
        "transports": ctx.transports,
    }


def _closed_reasons(monitor_url: str) -> dict[str, int]:
    """Why the server closed connections (slow consumers show here, not in its log)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{monitor_url}/connz?state=closed&limit=1024", timeout=5) as resp:
            conns = json.load(resp).get("connections") or []
    except OSError as exc:
        return {f"monitor unreachable: {exc}": 1}
    reasons: dict[str, int] = {}
    for c in conns:
        reasons[c.get("reason", "?")] = reasons.get(c.get("reason", "?"), 0) + 1
    return reasons


def curve_point(result: dict) -> dict[str, Any]:
    """One size of the size curve: per transport best, median, spread and peak memory per process,
    with the machine's load while its rounds ran (this machine is shared: read figures with it)."""
    point: dict[str, Any] = {"size_mb": result["size_mb"], "nbytes": result["nbytes"],
                             "storage": result.get("storage", "memory"),
                             "loadavg_before": result["machine"]["loadavg_before"],
                             "loadavg_after": result["machine"]["loadavg_after"],
                             "limits_gbps": result["limits"], "transports": {}}
    for name, t in result["transports"].items():
        if "rounds" not in t:
            continue
        loads = [r["loadavg_1m"] for r in t["rounds"]]
        point["transports"][name] = {
            "best_gbps": t["gbps"], "median_gbps": t["median_gbps"], "best_over_median": t["best_over_median"],
            "spread": t["spread"], "of_limit": t.get("ratio_to_limit"), "limit": t.get("limit"),
            "rounds": len(t["rounds"]), "loadavg_1m_min": min(loads), "loadavg_1m_max": max(loads),
            "receiver_peak_mib": t["receiver_peak_mib"], "publisher_peak_mib": t["publisher_peak_mib"],
            "server_peak_rss_mib": t.get("server_peak_rss_mib"), "storage": t.get("storage"),
            **({"fanout_ratio": t["fanout_ratio"], "explorers": t["explorers"]} if "fanout_ratio" in t else {}),
        }
    if "beside_job" in result:
        point["beside_job"] = result["beside_job"]
    return point


def render_curve(curve: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="size curve: GB/s = 1e9 B/s; load = 1-minute load average over the rounds")
    for col in ("size MiB", "transport", "best", "median", "median/best s", "spread", "of limit",
                "recv MiB", "pub MiB", "server MiB", "load"):
        table.add_column(col, justify="right")
    for point in curve:
        for name, t in point["transports"].items():
            server = t["server_peak_rss_mib"]
            table.add_row(str(point["size_mb"]), name, f"{t['best_gbps']:.2f}", f"{t['median_gbps']:.2f}",
                          f"{t['best_over_median']:.2f}", f"{t['spread']:.2f}",
                          f"{t['of_limit']:.0%}" if t["of_limit"] else "", f"{t['receiver_peak_mib']:.0f}",
                          f"{t['publisher_peak_mib']:.0f}", f"{server:.0f}" if server else "",
                          f"{t['loadavg_1m_min']:.1f}-{t['loadavg_1m_max']:.1f}")
    Console(width=160).print(table)


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"weights: {result['size_mb']} MiB to {result['explorers']} explorer(s), "
                        f"digest {result['digest']}; GB/s = 1e9 B/s")
    for col in ("what", "GB/s best", "s best", "GB/s median", "of limit", "publish GB/s", "fan-out s",
                "fan-out / one", "recv peak MiB"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for key, value in result["limits"].items():
        table.add_row(f"limit {key.removesuffix('_gbps')}", f"{value:.2f}", *[""] * 7)
    for name, t in result["transports"].items():
        def fmt(key, spec, t=t):
            return format(t[key], spec) if key in t else ""
        table.add_row(
            name, fmt("gbps", ".2f"), fmt("seconds", ".3f"), fmt("median_gbps", ".2f"),
            format(t["ratio_to_limit"], ".0%") if "ratio_to_limit" in t else "",
            fmt("publish_gbps", ".2f"), fmt("fanout_seconds", ".3f"), fmt("fanout_ratio", ".2f"),
            fmt("receiver_peak_mib", ".0f"),
        )
    Console(width=160).print(table)
    limits, transports = result["limits"], result["transports"]
    if "object_store" in transports and limits.get("stock_nats_object_store_gbps"):
        print(f"object_store vs stock nats-py ObjectStore get: "
              f"{transports['object_store']['gbps'] / limits['stock_nats_object_store_gbps']:.0f}x")


def main(argv: list[str] | None = None) -> None:
    from rolectl.bus.weights.format import DIGEST_ALGORITHMS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.weights", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--explorers", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per transport (best and median)")
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--only", nargs="*", help=f"transports to run (of {', '.join(TRANSPORT_BENCHES)})")
    parser.add_argument("--no-dist", action="store_true", help="skip benchmarks.weights_dist")
    parser.add_argument("--stock-mb", type=int, default=8,
                        help="MiB the stock nats-py object store reference moves (its rate is reported)")
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="a bf16 state dict shaped like this transformers model (layers fit --size-mb)")
    parser.add_argument("--device", default="cpu", help="where explorers fetch into: cpu or cuda[:N]")
    parser.add_argument("--fresh-buffers", action="store_true",
                        help="receivers do not give their buffers back (`recycle`) and drop a CUDA fetch's "
                             "pinned staging buffer: every fetch writes fresh memory")
    parser.add_argument("--fanout", type=int, nargs="*", default=[],
                        help="also time K explorers fetching at once, for each K given")
    parser.add_argument("--sizes", type=int, nargs="*", default=[],
                        help="the size curve: run every size (MiB) in turn, one JSON with a `curve` of them")
    parser.add_argument("--beside-job", action="store_true",
                        help="run the quickstart job (rolectl up examples/quickstart.yaml) beside the transfers")
    parser.add_argument("--storage", choices=("memory", "file"), default="memory",
                        help="the object store's storage (object_store and object_store_secure)")
    parser.add_argument("--file-storage-above", type=int, default=None, metavar="MB",
                        help="with --sizes: file storage for sizes above MB (memory storage keeps two "
                             "versions in the server's RAM)")
    parser.add_argument("--fetch-connections", type=int, default=None, metavar="N",
                        help="data connections per object-store fetch (default: the transport's own choice, "
                             "one plain, under TLS one per two CPUs, 2 to 4)")
    parser.add_argument("--publish-once", action="store_true",
                        help="publish one version and fetch it --repeat times, so the server holds one "
                        "version, not two (memory storage at sizes where two do not fit in RAM)")
    parser.add_argument("--digest", choices=sorted(DIGEST_ALGORITHMS), default=None,
                        help="the publishers' chunk digest (default: the transports' own, xxh3-128)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        asyncio.run(_worker_main(json.loads(args.worker)))
        return
    if args.fetch_connections is not None and args.fetch_connections <= 0:
        parser.error("--fetch-connections must be positive")
    if args.size_mb <= 0 or args.explorers <= 0 or args.repeat <= 0 or args.stock_mb <= 0:
        parser.error("--size-mb, --explorers, --repeat and --stock-mb must be positive")
    if any(k <= 1 for k in args.fanout):
        parser.error("--fanout sizes must be at least 2 (one explorer is the single fetch)")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device!r}: use cpu or cuda[:N]")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here (torch {torch.__version__})")
    if any(size <= 0 for size in args.sizes):
        parser.error("--sizes must be positive")
    if args.shape:
        smallest = sum(s.numel() * 2 for s in _meta_params(args.shape, 1).values()) >> 20
        too_small = [size for size in (args.sizes or [args.size_mb]) if size < smallest]
        if too_small:
            parser.error(f"--shape {args.shape} needs at least {smallest} MiB (its embeddings and one layer); "
                         f"{too_small} MiB would be measured at {smallest} MiB: drop --shape for those sizes")

    def one(size_mb: int) -> dict:
        storage = args.storage
        if args.file_storage_above is not None and size_mb > args.file_storage_above:
            storage = "file"
        return asyncio.run(run(size_mb, args.explorers, args.repeat, dist=not args.no_dist, only=args.only,
                               progress=lambda m: print(m, file=sys.stderr, flush=True), stock_mb=args.stock_mb,
                               shape=args.shape, device=args.device, fanout=tuple(args.fanout),
                               beside_job=args.beside_job, storage=storage, recycle=not args.fresh_buffers,
                               fetch_connections=args.fetch_connections, publish_once=args.publish_once,
                               digest=args.digest))

    if args.sizes:
        runs = []
        for size_mb in args.sizes:
            print(f"size {size_mb} MiB...", file=sys.stderr, flush=True)
            runs.append(one(size_mb))
            render(runs[-1])
        result = {"curve": [curve_point(r) for r in runs], "beside_job": args.beside_job, "runs": runs}
        render_curve(result["curve"])
    else:
        result = one(args.size_mb)
        render(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
