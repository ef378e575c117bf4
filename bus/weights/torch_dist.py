"""torch.distributed weight broadcast (SyncMethod.NCCL): trainer rank 0 → every explorer rank, in a private group.

Theory of operation
-------------------
A `RendezvousReady` decision names a group: `epoch`, `master_addr:master_port` (where the trainer's
TCPStore listens), `world_size`, and each explorer's ranks `[rank_offset, rank_offset + ranks)`.
The trainer is rank 0. An explorer with several local ranks (engine_num x tensor_parallel_size)
joins once per local rank, each rank with its own process-group object and its own destination.

The group is *ours*, never torch's default group: a `TCPStore` (trainer = master) plus a
`ProcessGroupGloo` / `ProcessGroupNCCL` built directly on a `PrefixStore`, as vLLM's stateless
process group does. The training engine's own `init_process_group` world is left alone.

One group per epoch, reused by every round of that epoch. A round whose epoch (or address, or
layout of ranks) differs re-forms it: explorers drop their old group before joining the new one,
and the trainer drops its old group only after the new one formed, so explorers always tear down
first. A failed collective drops the group at once; the synchronizer bumps the epoch after a failed
transfer, and the next round forms a fresh group.

A round on the wire:

1. header length (int64) and header (JSON: round, version, names, dtypes, shapes, bucket plan);
2. an all-reduce(MAX) of every rank's verdict on the header, so a rank whose destination layout
   differs stops *everyone* before a data byte moves (CorruptWeights on all sides; nothing copied;
   the group stays healthy);
3. one broadcast per bucket, all as raw bytes (uint8), so any dtype travels, bf16 and fp8 included.

Sending from a stream: receivers check the whole layout (step 2) before a data byte moves, so the
header comes first and the trainer declares the layout of a bucket stream up front (`send(...,
layout=...)`: names, dtypes and shapes, which a sharded model knows from its parameters' metadata
without gathering them). The bucket plan is then cut in stream order (consecutive tensors of one
dtype), each bucket is broadcast as soon as the stream has brought its tensors, and at most two
broadcasts are in flight, so rank 0 holds about two buckets. Receivers are unchanged: the header
carries any plan. A stream that differs from its declared layout fails the round (TransferError;
the group is dropped). Without `layout` a stream is gathered whole first.

Buckets hold one dtype each, up to `bucket_bytes`. A tensor of at least `direct_min_bytes` is a
bucket of its own and is broadcast straight from / into the tensor when it is contiguous on the
group's device (no packing copy: the big tensors are most of the bytes). Smaller tensors are packed
into two scratch buffers that alternate, so packing bucket k+1 overlaps the broadcast of bucket k
(and unpacking k-1 overlaps receiving k). Scratch buffers live as long as the group, so later
rounds allocate nothing. With nccl every buffer is on the GPU: no host copy at all. On gloo each
rank holds two process groups ("channels", two TCP streams per peer pair) and buckets alternate
between them, so one stream's idle gap between two broadcasts is filled by the other.

Blocking calls (store, group formation, collectives) run on a per-group thread pool, one thread per
local rank, so the event loop keeps serving heartbeats during a multi-second transfer. This module
forms, reuses and drops the groups; what one rank does in a round is `dist_rounds.RankLink`.

If a receive fails mid-transfer (PeerLost), the destination may hold part of the new version.
Pass `atomic_receive=True` to land all buckets in a staging copy first (2x memory) when the engine
must never see a mix.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import itertools
import json
import os
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

# torch re-exports its C extension's stores without listing them in __all__.
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from rolectl.sync_protocol import MemberRef, RendezvousReady, SyncMethod

from ..logging import get_logger
from ..server import free_port
from .base import (
    CorruptWeights,
    PeerLost,
    TensorMeta,
    TransferError,
    WeightBucket,
    WeightsSource,
    as_buckets,
    tensor_meta,
)
from .buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketHeader,
    can_send,
    pack_bucket,
    plan_buckets,
    plan_stream_buckets,
)
from .dist_rounds import CollectiveFailed, RankLink

__all__ = [
    "TorchDistTransport",
    "pack_bucket",
    "Backend",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECT_MIN_BYTES",
    "DEFAULT_CHANNELS",
    "DEFAULT_TIMEOUT_S",
    "plan_buckets",
]

Backend = Literal["auto", "gloo", "nccl"]

# From this size up a tensor is broadcast on its own, straight from/to its memory; smaller ones are
# packed, at the cost of a memory copy on each side. On CPU (gloo) a copy is as slow as the loopback
# wire, so only tiny tensors are worth packing (`benchmarks/weights_dist.py`); on GPUs (nccl) a
# device copy is far faster than the wire and per-call latency dominates, so packing pays up to a
# larger size.
DEFAULT_DIRECT_MIN_BYTES: dict[str, int] = {"gloo": 1 << 20, "nccl": 16 << 20}
# Parallel process groups ("channels") per rank; buckets take them in turn. One gloo group is one
# TCP stream per peer pair, idle between two broadcasts; a second stream fills those gaps
# (`benchmarks/weights_dist.py`). NCCL already spreads one call over several channels of its own.
DEFAULT_CHANNELS: dict[str, int] = {"gloo": 2, "nccl": 1}
DEFAULT_TIMEOUT_S = 30.0

_STORE_PREFIX = "rolectl/weights"

# --------------------------------------------------------------------------------------------------
# a formed group: store + links, keyed by what the decision said


@dataclass
class _Group:
    key: tuple[Any, ...]
    port: int  # the trainer's store port this group was formed at
    epoch: int
    backend: str
    channels: int
    store: Any
    links: list[RankLink]
    executor: ThreadPoolExecutor

    def close(self, *, failed: bool) -> None:
        for link in self.links:
            link.close(failed=failed)
        self.links = []
        self.store = None
        # Threads still stuck in a collective finish on their own (gloo timeout / nccl abort).
        self.executor.shutdown(wait=False, cancel_futures=True)


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _gloo_device(master_addr: str, interface: str | None) -> Any:
    # A loopback rendezvous means every rank is on this host: bind gloo to loopback too, which is
    # also immune to a hostname that does not resolve. Otherwise honour GLOO_SOCKET_IFNAME, the
    # variable torch's own init honours, then the host's default address.
    interface = interface or os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0])
    if _is_loopback(master_addr):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def _new_backend(backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta,
                 master_addr: str, interface: str | None) -> Any:
    """A gloo or nccl backend (torch's C types, untyped here) over `store`."""
    if backend == "gloo":
        # torch has no public options for a gloo group built by hand (devices, timeout).
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [_gloo_device(master_addr, interface)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise TransferError("backend nccl requested but this torch build has no NCCL")
        nccl_opts = dist.ProcessGroupNCCL.Options()
        # Our own timeout fires first (Work.wait(timeout)), then we abort(): the watchdog, whose
        # default reaction is to kill the whole process, never gets to act on this group.
        nccl_opts._timeout = timeout + datetime.timedelta(seconds=60)
        return dist.ProcessGroupNCCL(store, rank, world_size, nccl_opts)
    raise TransferError(f"unknown torch.distributed backend {backend!r}")


# --------------------------------------------------------------------------------------------------
# the transport


class TorchDistTransport:
    """Rendezvous transport over a private torch.distributed group (gloo on CPU, nccl on CUDA).

    One object per member process. The trainer calls `send`; an explorer calls `receive` (with
    `also_into` for its local ranks beyond the first). Use `async with` or call `aclose()`.

    - `backend`: "auto" makes the trainer pick nccl when its tensors are on CUDA, else gloo;
      explorers follow whatever the trainer announces in the store. Explicit values must agree.
    - `bucket_bytes` / `direct_min_bytes` / `channels`: see the module docstring; None takes the
      backend's default (`DEFAULT_DIRECT_MIN_BYTES`, `DEFAULT_CHANNELS`). Only the trainer's values
      matter: the bucket plan travels in the header, the channel count in the store.
    - `timeout`: seconds any one collective (and a peer's arrival) may take before `PeerLost`.
    - `connect_timeout`: seconds to wait for the group to form (default: `timeout`).
    - `atomic_receive`: stage every bucket before touching the destination (2x memory).
    - `gloo_interface`: network interface for gloo (else GLOO_SOCKET_IFNAME, else the default).
    """

    method = SyncMethod.NCCL

    def __init__(
        self,
        *,
        backend: Backend = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        direct_min_bytes: int | None = None,
        channels: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        connect_timeout: float | None = None,
        atomic_receive: bool = False,
        gloo_interface: str | None = None,
        log: Any = None,
    ) -> None:
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
        if bucket_bytes <= 0 or timeout <= 0 or any(v is not None and v <= 0 for v in (direct_min_bytes, channels)):
            raise ValueError("bucket_bytes, direct_min_bytes, channels and timeout must be positive")
        self._backend = backend
        self._bucket_bytes = bucket_bytes
        self._direct_min_bytes = direct_min_bytes
        self._channels = channels
        self._timeout = datetime.timedelta(seconds=timeout)
        self._connect_timeout = datetime.timedelta(seconds=connect_timeout or timeout)
        self._atomic = atomic_receive
        self._interface = gloo_interface
        self._log = log if log is not None else get_logger("rolectl.weights.torch_dist")
        self._group: _Group | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self.groups_formed = 0  # how many groups this object formed (tests and metrics read it)

    # ---- public ----------------------------------------------------------------------------------

    @property
    def epoch(self) -> int | None:
        """Epoch of the group currently formed, or None."""
        return None if self._group is None else self._group.epoch

    @property
    def backend(self) -> str | None:
        """Backend of the group currently formed (gloo / nccl), or None."""
        return None if self._group is None else self._group.backend

    def offer_port(self) -> int:
        # A fresh port per offer: used only when the decision starts a new group epoch (the
        # current group is reused otherwise), so a stale TCPStore port is never reused.
        return free_port("0.0.0.0")

    async def send(
        self, ready: RendezvousReady, tensors: WeightsSource, *, layout: Sequence[TensorMeta] | None = None,
    ) -> int:
        """Trainer side (rank 0): broadcast `tensors` to every explorer rank of `ready`; return bytes.

        `tensors` is a mapping or a bucket stream (see `base`). Receivers check the whole layout
        before the first byte, so a stream needs `layout`, its (name, dtype, shape) in stream order,
        known without gathering (a sharded model's metadata); the stream is then broadcast bucket by
        bucket as it comes, holding about two buckets. A stream without `layout` is gathered whole
        first. Raises CorruptWeights when an explorer rejects the layout (nothing sent; the group
        stays), PeerLost when a peer dies, hangs past `timeout`, or never joins (the group is
        dropped), TransferError when the stream differs from its declared layout (the group is
        dropped: the explorers got part of a version).
        """
        self._check_open()
        _check_ready(ready)
        stream: Iterator[WeightBucket] | None = None
        first: WeightBucket | None = None
        if not isinstance(tensors, Mapping):
            if layout is None:
                tensors = {name: t for bucket in as_buckets(tensors) for name, t in bucket}
        if isinstance(tensors, Mapping):
            meta = tensor_meta(tensors)
            sources = list(tensors.values())
        else:
            assert layout is not None
            meta = [(name, dtype, tuple(shape)) for name, dtype, shape in layout]
            buckets = as_buckets(tensors)
            # The first bucket says where the tensors are (auto backend, nccl device).
            first = await asyncio.to_thread(lambda: next(buckets, None))
            sources = [t for _, t in first] if first is not None else []
            stream = itertools.chain([first] if first is not None else [], buckets)
        for name, dtype, _ in meta:
            if not can_send(dtype):
                raise TransferError(f"tensor {name!r} has dtype {dtype}, which cannot be sent")
        backend = self._backend
        if backend == "auto":
            backend = "nccl" if sources and all(t.is_cuda for t in sources) else "gloo"
        direct = self._direct_min_bytes or DEFAULT_DIRECT_MIN_BYTES[backend]
        channels = self._channels or DEFAULT_CHANNELS[backend]
        plan = plan_buckets if stream is None else plan_stream_buckets
        header = BucketHeader(
            round=ready.round,
            version=ready.version,
            epoch=ready.epoch,
            layout=tuple(meta),
            buckets=tuple(tuple(b) for b in plan(
                meta, bucket_bytes=self._bucket_bytes, direct_min_bytes=direct)),
        )
        device = _rank0_device(backend, sources)
        async with self._lock:
            group = await self._ensure_group(ready, ranks=[0], devices=[device], backend=backend, channels=channels)
            started = time.monotonic()
            if stream is None:
                await self._run(group, [lambda link: link.send_round(header, sources)], ready)
            else:
                sources, first = [], None  # the stream holds the first bucket now, and lets it go once sent
                chained = stream
                await self._run(group, [lambda link: link.send_stream_round(header, chained)], ready)
            nbytes = sum(header.bucket_nbytes(b) for b in header.buckets)
            self._log.debug("weights.broadcast_sent", round=ready.round, version=ready.version,
                            epoch=ready.epoch, nbytes=nbytes, seconds=round(time.monotonic() - started, 4))
            return nbytes

    async def receive(
        self,
        ready: RendezvousReady,
        me: MemberRef,
        into: Mapping[str, torch.Tensor],
        *,
        also_into: Sequence[Mapping[str, torch.Tensor]] = (),
    ) -> int:
        """Explorer side: receive the round's weights in place into `into` (local rank 0) and each
        of `also_into` (local ranks 1.., one mapping per further rank, each with its own copy —
        on nccl each on its own GPU). Return the bytes of one copy.

        The number of destinations must equal the ranks `ready` assigns to `me`. Raises
        CorruptWeights when the layout differs (nothing copied), PeerLost when the group breaks.
        """
        self._check_open()
        _check_ready(ready)
        assignment = ready.assignment_of(me)
        if assignment is None:
            raise TransferError(f"{me} is not a participant of round {ready.round}")
        dests = [into, *also_into]
        if len(dests) != assignment.ranks:
            raise TransferError(
                f"{me} holds {assignment.ranks} ranks in round {ready.round} but gave "
                f"{len(dests)} destinations (into + also_into)")
        ranks = [assignment.rank_offset + j for j in range(assignment.ranks)]
        async with self._lock:
            backend, channels, store = await self._join(ready)
            devices = [_receiver_device(backend, d, j) for j, d in enumerate(dests)]
            group = await self._ensure_group(ready, ranks=ranks, devices=devices, backend=backend,
                                             channels=channels, store=store)
            started = time.monotonic()

            def receive_into(dest: Mapping[str, torch.Tensor]) -> Callable[[RankLink], int]:
                return lambda link: link.receive_round(ready.round, ready.version, dest, self._atomic, self._log)

            results = await self._run(
                group,
                [receive_into(d) for d in dests],
                ready,
            )
            self._log.debug("weights.broadcast_received", round=ready.round, version=ready.version,
                            epoch=ready.epoch, ranks=len(dests), nbytes=results[0],
                            seconds=round(time.monotonic() - started, 4))
            received: int = results[0]
            return received

    async def aclose(self) -> None:
        """Tear the group down; safe to call twice."""
        self._closed = True
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(group.close, failed=False)

    async def __aenter__(self) -> TorchDistTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # ---- group lifecycle -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("transport is closed")

    def _key(self, ready: RendezvousReady, ranks: list[int], backend: str, channels: int) -> tuple[Any, ...]:
        return (*_group_place(ready), tuple(ranks), backend, channels)

    async def _join(self, ready: RendezvousReady) -> tuple[str, int, Any]:
        """Explorer side: the backend and channel count rank 0 chose for this round's group, and a
        store client when the group must be (re-)formed (None when the current group serves)."""
        group = self._group
        if group is not None and group.key[:2] == _group_place(ready):
            return group.backend, group.channels, None
        # Joining a new group: the explorer leaves the old one first (before the trainer does).
        await self._drop_group(failed=False)
        store = await self._connect_store(ready, is_master=False)
        try:
            raw = await asyncio.to_thread(store.get, f"{_STORE_PREFIX}/{ready.epoch}/group")
        except Exception as exc:  # noqa: BLE001
            raise PeerLost(f"epoch {ready.epoch}: trainer did not announce its group at "
                           f"{ready.master_addr}:{ready.master_port}: {exc}") from None
        try:
            announced = json.loads(raw)
            backend, channels = str(announced["backend"]), int(announced["channels"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferError(f"epoch {ready.epoch}: unreadable group announcement {raw!r}: {exc}") from None
        if self._backend != "auto" and backend != self._backend:
            raise TransferError(f"trainer formed a {backend} group, this explorer is set to {self._backend}")
        if backend not in DEFAULT_CHANNELS or not 0 < channels <= 64:
            raise TransferError(f"epoch {ready.epoch}: trainer announced {backend} x {channels} channels")
        return backend, channels, store

    async def _connect_store(self, ready: RendezvousReady, *, is_master: bool) -> Any:
        def connect() -> Any:  # a TCPStore (torch's C type, untyped here)
            return TCPStore(
                ready.master_addr, ready.master_port, None, is_master, self._connect_timeout,
                wait_for_workers=False,
            )

        try:
            return await asyncio.to_thread(connect)
        except Exception as exc:  # noqa: BLE001
            where = f"{ready.master_addr}:{ready.master_port}"
            if is_master:
                raise TransferError(f"epoch {ready.epoch}: cannot listen on {where}: {exc}") from None
            raise PeerLost(f"epoch {ready.epoch}: no trainer store at {where}: {exc}") from None

    async def _ensure_group(self, ready: RendezvousReady, *, ranks: list[int], devices: list[torch.device],
                            backend: str, channels: int, store: Any = None) -> _Group:
        key = self._key(ready, ranks, backend, channels)
        if self._group is not None and self._group.key == key:
            return self._group
        is_master = ranks == [0]
        if is_master:
            # Same port as the old group: it must go first or the new store cannot bind.
            if self._group is not None and self._group.port == ready.master_port:
                await self._drop_group(failed=False)
            store = await self._connect_store(ready, is_master=True)
            announcement = json.dumps({"backend": backend, "channels": channels})
            await asyncio.to_thread(store.set, f"{_STORE_PREFIX}/{ready.epoch}/group", announcement)
        elif store is None:
            await self._drop_group(failed=False)
            store = await self._connect_store(ready, is_master=False)
        executor = ThreadPoolExecutor(max_workers=len(ranks), thread_name_prefix=f"weights-e{ready.epoch}")
        loop = asyncio.get_running_loop()
        timeout = self._connect_timeout

        def form(j: int, rank: int, device: torch.device) -> RankLink:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            # A store client is one socket, and gloo's rendezvous blocks on it in `wait`: local
            # ranks forming at the same time each need their own client.
            own = store if j == 0 else TCPStore(ready.master_addr, ready.master_port, None, False, timeout)
            pgs = []
            try:
                for c in range(channels):  # every rank forms the channels in the same order
                    prefix = PrefixStore(f"{_STORE_PREFIX}/{ready.epoch}/pg{c}", own)
                    pg = _new_backend(backend, prefix, rank, ready.world_size, timeout,
                                      ready.master_addr, self._interface)
                    if backend == "gloo":
                        # Formation used the (longer) connect timeout; collectives use the group's.
                        pg._set_default_timeout(self._timeout)
                    pgs.append(pg)
            except BaseException:
                RankLink(rank=rank, pgs=pgs, backend=backend, device=device, timeout=self._timeout).close(failed=True)
                raise
            return RankLink(rank=rank, pgs=pgs, backend=backend, device=device, timeout=self._timeout)

        started = time.monotonic()
        outcomes = await asyncio.gather(
            *(loop.run_in_executor(executor, form, j, r, d) for j, (r, d) in enumerate(zip(ranks, devices))),
            return_exceptions=True,
        )
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            for o in outcomes:
                if isinstance(o, RankLink):
                    o.close(failed=True)
            executor.shutdown(wait=False)
            self._log.warning("weights.group_failed", epoch=ready.epoch, ranks=ranks, error=str(errors[0]))
            if isinstance(errors[0], TransferError):
                raise errors[0]
            raise PeerLost(f"epoch {ready.epoch}: group of {ready.world_size} did not form within "
                           f"{self._connect_timeout.total_seconds():g}s: {errors[0]}") from None
        group = _Group(key=key, port=ready.master_port, epoch=ready.epoch, backend=backend, channels=channels,
                       store=store, links=[o for o in outcomes if isinstance(o, RankLink)], executor=executor)
        # The trainer leaves the old group only now: every explorer has joined the new one, so
        # it has left the old one already (explorers tear down first).
        await self._drop_group(failed=False)
        self._group = group
        # Safety net for an owner that never calls aclose(): a process group still alive at
        # interpreter teardown aborts the process ("terminate called ..."). Closing twice is a no-op.
        weakref.finalize(self, group.close, failed=False)
        self.groups_formed += 1
        self._log.info("weights.group_formed", epoch=ready.epoch, backend=backend, channels=channels, ranks=ranks,
                       world_size=ready.world_size, seconds=round(time.monotonic() - started, 3))
        return group

    async def _drop_group(self, *, failed: bool) -> None:
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(group.close, failed=failed)
            self._log.info("weights.group_closed", epoch=group.epoch, failed=failed)

    async def _run(self, group: _Group, jobs: list[Callable[[RankLink], Any]], ready: RendezvousReady) -> list[Any]:
        """Run one job per link on the group's threads; translate a broken collective into PeerLost."""
        loop = asyncio.get_running_loop()

        def on_thread(job: Callable[[RankLink], Any], link: RankLink) -> Any:
            if link.device.type == "cuda":
                torch.cuda.set_device(link.device)
            return job(link)

        try:
            outcomes = await asyncio.gather(
                *(loop.run_in_executor(group.executor, on_thread, job, link) for job, link in zip(jobs, group.links)),
                return_exceptions=True,
            )
        except asyncio.CancelledError:
            # The threads cannot be cancelled and would leave the group out of step: drop it, so
            # they fail out and the next round forms a fresh one.
            if self._group is group:
                self._group = None
            loop.run_in_executor(None, lambda: group.close(failed=True))
            raise
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if not errors:
            return list(outcomes)
        corrupt = [e for e in errors if isinstance(e, CorruptWeights)]
        if corrupt and len(corrupt) == len(errors):
            raise corrupt[0]  # a verdict every rank agreed on: the group is still in step
        await self._drop_group(failed=True)
        failure = next((e for e in errors if isinstance(e, CollectiveFailed)), errors[0])
        self._log.warning("weights.peer_lost", round=ready.round, epoch=ready.epoch, error=str(failure))
        if isinstance(failure, CollectiveFailed):
            raise PeerLost(f"round {ready.round} epoch {ready.epoch}: group broke mid-transfer "
                           f"(the destination may hold part of version {ready.version}): {failure}") from None
        raise failure


def _group_place(ready: RendezvousReady) -> tuple[int, int]:
    """What names a group in a decision: a new value of either means a new group.

    The synchronizer starts a new epoch whenever the membership (incarnations and ranks included)
    changes or a transfer failed, so within one epoch the formed group is still right, whatever
    address the trainer offered for this round (it offers a fresh port each time, used only when
    the epoch is new).
    """
    return (ready.epoch, ready.world_size)


def _check_ready(ready: RendezvousReady) -> None:
    if ready.method != SyncMethod.NCCL:
        raise TransferError(f"round {ready.round} uses {ready.method}, not this transport's nccl")
    expected = 1 + sum(p.ranks for p in ready.participants)
    if ready.world_size != expected:
        raise TransferError(f"round {ready.round}: world_size {ready.world_size} but the participants "
                            f"hold {expected} ranks (trainer included)")


def _rank0_device(backend: str, sources: Sequence[torch.Tensor]) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    cuda = next((t.device for t in sources if t.is_cuda), None)
    return cuda if cuda is not None else torch.device("cuda", torch.cuda.current_device())


def _receiver_device(backend: str, into: Mapping[str, torch.Tensor], local_rank: int) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TransferError("the trainer formed an nccl group but this explorer has no CUDA device")
    cuda = next((t.device for t in into.values() if t.is_cuda), None)
    return cuda if cuda is not None else torch.device("cuda", local_rank % torch.cuda.device_count())
