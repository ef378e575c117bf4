"""CUDA IPC weight hand-over (SyncMethod.CUDA_IPC): a trainer and explorers on the same GPU share bucket memory.

Theory of operation
-------------------
The trainer packs the weights into its own GPU bucket buffers (one dtype per bucket, as the
torch.distributed transport plans them), kept and reused from one version to the next. It exports
a CUDA IPC handle for each bucket (`UntypedStorage._share_cuda_()`: device, memory handle, sizes,
offsets, the producer's ref-counter file and event) and sends them, with the tensor layout, as one
msgpack message — never pickle — to each explorer through a channel the caller injects:

- trainer: `send_handles(member, payload) -> reply` (the roles pass a NATS request/reply);
- explorer: `recv_handles() -> HandleRequest(payload, reply)`.

The explorer checks the layout (mismatch → CorruptWeights; it replies so, nothing is copied), maps
each bucket (`UntypedStorage._new_shared_cuda`), copies into its own parameters, synchronizes,
drops the mapping (which releases the producer's ref-count) and only then replies "done". The
trainer returns from `send` once every explorer replied, so it never overwrites a bucket that is
being read. A missing reply within `timeout` is PeerLost; the trainer then abandons its buckets
(fresh ones next time) because a slow explorer may still be reading the old ones — torch's IPC
ref-counting keeps that memory alive until the explorer lets go.

From a bucket stream, the trainer packs each tensor into the shared buckets as the stream brings it
(buckets cut in stream order: consecutive tensors of one dtype; CPU tensors are copied to the GPU on
the way), holding at most one bucket of the stream besides the shared buckets, and sends the one
offer once the stream has ended. The explorer is unchanged: it maps every bucket of the offer at
once, so the shared buckets still hold one packed copy of the model on the GPU, as they always did.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from rolectl.sync_protocol import MemberRef, RendezvousReady, SyncMethod

from ..logging import get_logger
from ..server import free_port
from .base import CorruptWeights, PeerLost, TensorMeta, TransferError, WeightBucket, WeightsSource, as_buckets

# Layout helpers shared with the broadcast transport, so both plan and check buckets the same way.
from .buckets import DEFAULT_BUCKET_BYTES, BucketHeader, can_send, layout_mismatch, pack_bucket, plan_buckets

__all__ = ["CudaIpcTransport", "HandleRequest", "SendHandles", "RecvHandles", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 30.0
_SCHEMA = 1


@dataclass(frozen=True, slots=True)
class HandleRequest:
    """What an explorer's channel yields: the trainer's message, and how to answer it once."""

    payload: bytes
    reply: Callable[[bytes], Awaitable[None]]


SendHandles = Callable[[MemberRef, bytes], Awaitable[bytes]]
# What torch's UntypedStorage._share_cuda_() returns: (device, handle, size, offset, ref-counter
# handle, ref-counter offset, event, sync), passed back as is to _new_shared_cuda.
IpcHandle = tuple[Any, ...]
RecvHandles = Callable[[], Awaitable[HandleRequest]]


def _encode_offer(header: BucketHeader, handles: list[IpcHandle], sizes: list[int]) -> bytes:
    doc = header.to_doc()
    doc["handles"] = [list(h) for h in handles]
    doc["sizes"] = sizes
    payload: bytes = msgpack.packb(doc, use_bin_type=True)
    return payload


def _decode_offer(raw: bytes) -> tuple[BucketHeader, list[IpcHandle], list[int]]:
    try:
        doc = msgpack.unpackb(raw, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CorruptWeights(f"unreadable IPC offer: {exc}") from None
    header = BucketHeader.from_doc(doc)  # dtypes, shapes, a plan covering every tensor once
    try:
        handles = [tuple(h) for h in doc["handles"]]
        sizes = [int(n) for n in doc["sizes"]]
        if len(handles) != len(header.buckets) or len(sizes) != len(header.buckets):
            raise ValueError("one handle and one size per bucket expected")
        for h in handles:
            # (device, handle, size, offset, ref-counter handle, ref-counter offset, event, sync)
            if len(h) != 8 or not isinstance(h[1], bytes):
                raise ValueError("malformed IPC handle")
        for bucket, n in zip(header.buckets, sizes):
            if header.bucket_nbytes(bucket) != n:
                raise ValueError("bucket size does not match its tensors")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptWeights(f"unreadable IPC offer: {exc}") from None
    return header, handles, sizes


def _check_method(ready: RendezvousReady) -> None:
    if ready.method != SyncMethod.CUDA_IPC:
        raise TransferError(f"round {ready.round} uses {ready.method}, not this transport's cuda_ipc")


def _ipc_device(tensor: torch.Tensor | None) -> torch.device:
    """Where the shared buckets go: the stream's CUDA device, or this process's current one for
    CPU tensors (copied to the GPU while packing)."""
    if tensor is not None and tensor.is_cuda:
        return tensor.device
    if not torch.cuda.is_available():
        raise TransferError("CUDA IPC needs a CUDA device in the trainer; torch sees none")
    return torch.device("cuda", torch.cuda.current_device())


def _reply(ok: bool, *, error: str = "", message: str = "", nbytes: int = 0) -> bytes:
    payload: bytes = msgpack.packb({"ok": ok, "error": error, "message": message, "nbytes": nbytes})
    return payload


class CudaIpcTransport:
    """Rendezvous transport for roles sharing one GPU: buckets exported by CUDA IPC handles.

    The trainer constructs it with `send_handles`, an explorer with `recv_handles`. Buckets are
    `bucket_bytes` at most (one tensor larger than that is a bucket of its own). `timeout` bounds
    the wait for each reply / request.
    """

    method = SyncMethod.CUDA_IPC

    def __init__(
        self,
        *,
        send_handles: SendHandles | None = None,
        recv_handles: RecvHandles | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float = DEFAULT_TIMEOUT_S,
        log: Any = None,
    ) -> None:
        if bucket_bytes <= 0 or timeout <= 0:
            raise ValueError("bucket_bytes and timeout must be positive")
        self._send_handles = send_handles
        self._recv_handles = recv_handles
        self._bucket_bytes = bucket_bytes
        self._timeout = timeout
        self._log = log if log is not None else get_logger("rolectl.weights.cuda_ipc")
        self._buckets: list[torch.Tensor] = []  # the trainer's, reused across versions
        self._lock = asyncio.Lock()
        self._closed = False

    # ---- trainer ---------------------------------------------------------------------------------

    def offer_port(self) -> int:
        # Nothing binds it (handles travel over NATS), but a rendezvous names an address: the
        # reducer checks every REQUIRE_SYNC of a rendezvous method carries one.
        return free_port("0.0.0.0")

    async def send(
        self, ready: RendezvousReady, tensors: WeightsSource, *, layout: Sequence[TensorMeta] | None = None,
    ) -> int:
        """Pack `tensors` (a mapping or a bucket stream, see `base`) into the shared buckets, hand
        their IPC handles to every explorer of `ready`, and return once each copied them (bytes of
        one copy). `layout` is accepted for the Protocol and not needed: the one offer goes out
        after the stream has been packed, with the layout it had."""
        if self._closed:
            raise TransferError("transport is closed")
        if self._send_handles is None:
            raise TransferError("this CudaIpcTransport was built without send_handles (explorer side)")
        _check_method(ready)
        async with self._lock:
            started = time.monotonic()
            if isinstance(tensors, Mapping):
                header, handles, sizes = await asyncio.to_thread(self._pack_mapping, ready, tensors)
            else:
                header, handles, sizes = await asyncio.to_thread(self._pack_stream, ready, as_buckets(tensors))
            payload = _encode_offer(header, handles, sizes)
            members = [p.member for p in ready.participants]
            replies = await asyncio.gather(
                *(asyncio.wait_for(self._send_handles(m, payload), self._timeout) for m in members),
                return_exceptions=True,
            )
            failure = self._judge(replies, members, ready)
            if failure is not None:
                if isinstance(failure, PeerLost):
                    # Someone may still be reading: never write into these buckets again.
                    self._buckets = []
                raise failure
            nbytes: int = sum(sizes)
            self._log.debug("weights.ipc_sent", round=ready.round, version=ready.version, nbytes=nbytes,
                            explorers=len(members), seconds=round(time.monotonic() - started, 4))
            return nbytes

    def _pack_mapping(self, ready: RendezvousReady,
                      tensors: Mapping[str, torch.Tensor]) -> tuple[BucketHeader, list[IpcHandle], list[int]]:
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        if device is None:
            raise TransferError("CUDA IPC needs the trainer's tensors on a CUDA device")
        layout = tuple((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())
        for name, dtype, _ in layout:
            if not can_send(dtype):
                raise TransferError(f"tensor {name!r} has dtype {dtype}, which cannot be sent")
        plan = plan_buckets(layout, bucket_bytes=self._bucket_bytes, direct_min_bytes=self._bucket_bytes + 1)
        header = BucketHeader(round=ready.round, version=ready.version, epoch=ready.epoch, layout=layout,
                              buckets=tuple(tuple(b) for b in plan))
        handles, sizes = self._pack_and_share(header, list(tensors.values()), device)
        return header, handles, sizes

    def _pack_stream(self, ready: RendezvousReady,
                     stream: Iterator[WeightBucket]) -> tuple[BucketHeader, list[IpcHandle], list[int]]:
        """Pack the stream into the shared buckets as it comes (buckets cut in stream order)."""
        layout: list[TensorMeta] = []
        plan: list[tuple[int, ...]] = []
        sizes: list[int] = []
        current: list[torch.Tensor] = []
        filled = 0
        device: torch.device | None = None

        def close_bucket() -> None:
            nonlocal current, filled
            if not current:
                return
            assert device is not None
            k = len(plan)
            plan.append(tuple(range(len(layout) - len(current), len(layout))))
            sizes.append(filled)
            with torch.cuda.device(device), torch.no_grad():
                if not (k < len(self._buckets) and self._buckets[k].numel() >= filled
                        and self._buckets[k].device == device):
                    buf = torch.empty(max(filled, 1), dtype=torch.uint8, device=device)
                    if k < len(self._buckets):
                        self._buckets[k] = buf
                    else:
                        self._buckets.append(buf)
                pack_bucket(self._buckets[k], current, range(len(current)))
            current, filled = [], 0

        for bucket in stream:
            for name, tensor in bucket:
                if not can_send(tensor.dtype):
                    raise TransferError(f"tensor {name!r} has dtype {tensor.dtype}, which cannot be sent")
                if device is None:
                    device = _ipc_device(tensor)
                nbytes = tensor.numel() * tensor.element_size()
                if current and (filled + nbytes > self._bucket_bytes or current[0].dtype != tensor.dtype):
                    close_bucket()
                layout.append((name, tensor.dtype, tuple(tensor.shape)))
                current.append(tensor)
                filled += nbytes
            del bucket
        close_bucket()
        if device is None:
            device = _ipc_device(None)
        del self._buckets[len(plan):]
        header = BucketHeader(round=ready.round, version=ready.version, epoch=ready.epoch, layout=tuple(layout),
                              buckets=tuple(plan))
        with torch.cuda.device(device):
            # The explorer reads with its own streams: every byte must be in place first.
            torch.cuda.current_stream(device).synchronize()
            # torch has no public call that exports a CUDA IPC handle; multiprocessing uses this one.
            handles = [tuple(buf.untyped_storage()._share_cuda_()) for buf in self._buckets]  # type: ignore[no-untyped-call]
        return header, handles, sizes

    def _pack_and_share(self, header: BucketHeader, sources: list[torch.Tensor],
                        device: torch.device) -> tuple[list[IpcHandle], list[int]]:
        with torch.cuda.device(device), torch.no_grad():
            sizes = [header.bucket_nbytes(b) for b in header.buckets]
            for k, n in enumerate(sizes):
                if k < len(self._buckets) and self._buckets[k].numel() >= n and self._buckets[k].device == device:
                    continue
                buf = torch.empty(max(n, 1), dtype=torch.uint8, device=device)
                if k < len(self._buckets):
                    self._buckets[k] = buf
                else:
                    self._buckets.append(buf)
            del self._buckets[len(sizes):]
            for bucket, buf in zip(header.buckets, self._buckets):
                pack_bucket(buf, sources, bucket)
            # The explorer reads with its own streams: every byte must be in place first.
            torch.cuda.current_stream(device).synchronize()
            # torch has no public call that exports a CUDA IPC handle; multiprocessing uses this one.
            handles = [tuple(buf.untyped_storage()._share_cuda_()) for buf in self._buckets]  # type: ignore[no-untyped-call]
        return handles, sizes

    def _judge(self, replies: list[bytes | BaseException], members: list[MemberRef],
               ready: RendezvousReady) -> Exception | None:
        for member, reply in zip(members, replies):
            if isinstance(reply, asyncio.TimeoutError):
                self._log.warning("weights.peer_lost", round=ready.round, member=str(member))
                return PeerLost(f"round {ready.round}: {member} did not confirm within {self._timeout:g}s")
            if isinstance(reply, BaseException):
                return PeerLost(f"round {ready.round}: handing handles to {member} failed: {reply}")
            try:
                doc = msgpack.unpackb(reply, raw=False)
                ok, error, message = bool(doc["ok"]), str(doc.get("error", "")), str(doc.get("message", ""))
            except Exception as exc:  # noqa: BLE001 - a garbled reply is the peer's fault, typed below
                return TransferError(f"round {ready.round}: unreadable reply from {member}: {exc}")
            if not ok:
                cls = CorruptWeights if error == "corrupt" else TransferError
                return cls(f"round {ready.round}: {member} refused: {message}")
        return None

    # ---- explorer --------------------------------------------------------------------------------

    async def receive(self, ready: RendezvousReady, me: MemberRef, into: Mapping[str, torch.Tensor], *,
                      also_into: Sequence[Mapping[str, torch.Tensor]] = ()) -> int:
        """Wait for the trainer's handles, copy every tensor into `into` in place, confirm; return
        bytes. One GPU: the other local ranks (`also_into`) copy from `into` afterwards."""
        nbytes = await self._receive(ready, me, into)
        with torch.no_grad():
            for extra in also_into:
                for name, tensor in extra.items():
                    tensor.copy_(into[name])
        return nbytes

    async def _receive(self, ready: RendezvousReady, me: MemberRef, into: Mapping[str, torch.Tensor]) -> int:
        if self._closed:
            raise TransferError("transport is closed")
        if self._recv_handles is None:
            raise TransferError("this CudaIpcTransport was built without recv_handles (trainer side)")
        _check_method(ready)
        if ready.assignment_of(me) is None:
            raise TransferError(f"{me} is not a participant of round {ready.round}")
        async with self._lock:
            try:
                request = await asyncio.wait_for(self._recv_handles(), self._timeout)
            except asyncio.TimeoutError:
                raise PeerLost(f"round {ready.round}: no handles from the trainer within {self._timeout:g}s") from None
            started = time.monotonic()
            try:
                header, handles, sizes = _decode_offer(request.payload)
                if (header.round, header.version) != (ready.round, ready.version):
                    raise CorruptWeights(f"offer is round {header.round} version {header.version}, "
                                         f"expected round {ready.round} version {ready.version}")
                problem = layout_mismatch(header, into)
                if problem is not None:
                    raise CorruptWeights(problem)
            except CorruptWeights as exc:
                self._log.warning("weights.layout_rejected", round=ready.round, problem=str(exc))
                await request.reply(_reply(False, error="corrupt", message=str(exc)))
                raise
            try:
                await asyncio.to_thread(self._copy_out, header, handles, sizes, into)
            except Exception as exc:  # noqa: BLE001 - CUDA errors have no common type
                await request.reply(_reply(False, error="transfer", message=str(exc)))
                raise TransferError(f"round {ready.round}: reading the trainer's buckets failed: {exc}") from exc
            nbytes = sum(sizes)
            await request.reply(_reply(True, nbytes=nbytes))
            self._log.debug("weights.ipc_received", round=ready.round, version=ready.version, nbytes=nbytes,
                            seconds=round(time.monotonic() - started, 4))
            return nbytes

    @staticmethod
    def _copy_out(header: BucketHeader, handles: list[IpcHandle], sizes: list[int],
                  into: Mapping[str, torch.Tensor]) -> None:
        dests = [into[name] for name, _, _ in header.layout]
        with torch.no_grad():
            for bucket, handle, nbytes in zip(header.buckets, handles, sizes):
                if nbytes == 0:
                    continue
                storage = torch.UntypedStorage._new_shared_cuda(*handle)
                raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))
                offset = 0
                devices = {storage.device}
                for i in bucket:
                    dst = dests[i]
                    n = dst.numel() * dst.element_size()
                    dst.copy_(raw[offset : offset + n].view(dst.dtype).view(dst.shape))
                    offset += n
                    if dst.is_cuda:
                        devices.add(dst.device)
                # The copies are queued, not done: finish them before letting the mapping go.
                for device in devices:
                    torch.cuda.synchronize(device)
                del raw, storage  # unmaps, and releases the trainer's ref-count on this bucket

    # ---- both ------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Drop the buckets (memory an explorer still maps is freed when it lets go); safe twice."""
        self._closed = True
        self._buckets = []
        # torch leaves these two untyped.
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

    async def __aenter__(self) -> CudaIpcTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
