"""One round of the torch.distributed transport on one rank: the header, the verdict, the buckets.

A `RankLink` is one local rank's place in a formed group (`torch_dist`): its process groups, one
per channel, and the scratch buffers it reuses round after round. Its methods are the blocking
work of a round, run on the rank's own thread: rank 0 broadcasts the header, waits for every
rank's verdict on it, then broadcasts the buckets (from a mapping, or from a bucket stream as it
comes); a receiver checks the header against its destination, gives its verdict, and lands the
buckets in place (or staged first, when atomic). The wire format and the reasons for buckets,
scratch slots and channels are in `torch_dist`'s theory of operation.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp, Work

from .base import CorruptWeights, WeightBucket
from .buckets import BucketHeader, in_layout_order, layout_mismatch, pack_bucket
from .host_memory import PinnedStaging

__all__ = ["CollectiveFailed", "RankLink"]

_MAX_HEADER_BYTES = 64 << 20


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _contiguous_on(t: torch.Tensor, device: torch.device) -> bool:
    return t.is_contiguous() and t.device == device


class CollectiveFailed(Exception):
    """A collective or the group formation failed: the group is unusable."""


@dataclass
class RankLink:
    """One rank's process-group object and the scratch buffers it reuses round after round."""

    rank: int
    pgs: list[Any]  # one process group per channel; channel 0 also carries header and verdict
    backend: str
    device: torch.device
    timeout: datetime.timedelta
    staging: list[PinnedStaging | torch.Tensor | None] = field(default_factory=lambda: [None, None])

    # ---- collectives -----------------------------------------------------------------------------

    def _broadcast(self, t: torch.Tensor, channel: int = 0) -> Work:
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        try:
            work: Work = self.pgs[channel % len(self.pgs)].broadcast([t], opts)
            return work
        except Exception as exc:  # noqa: BLE001 - backend errors have no common type
            raise CollectiveFailed(f"broadcast: {exc}") from exc

    def _wait(self, work: Work) -> None:
        try:
            # With a timeout, nccl's wait blocks this thread (not just the stream) and raises
            # instead of letting the watchdog kill the process; gloo honours it too.
            work.wait(self.timeout)
        except Exception as exc:  # noqa: BLE001
            raise CollectiveFailed(str(exc)) from exc

    def _verdict(self, bad: bool) -> bool:
        """All-reduce(MAX) of every rank's 'I reject this header': True when any rank rejected."""
        flag = torch.tensor([1 if bad else 0], dtype=torch.int32, device=self.device)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MAX  # type: ignore[assignment]  # torch's stubs name the enum member's type apart
        try:
            work = self.pgs[0].allreduce([flag], opts)
        except Exception as exc:  # noqa: BLE001
            raise CollectiveFailed(f"allreduce: {exc}") from exc
        self._wait(work)
        return bool(flag.item())

    # ---- scratch ---------------------------------------------------------------------------------

    def scratch(self, slot: int, nbytes: int) -> torch.Tensor:
        """Scratch buffer `slot` with at least `nbytes` (kept for later rounds)."""
        if self.device.type == "cpu":
            holder = self.staging[slot]
            if not isinstance(holder, PinnedStaging):
                holder = self.staging[slot] = PinnedStaging()
            return holder.buffer(nbytes)
        buf = self.staging[slot]
        if not isinstance(buf, torch.Tensor) or buf.numel() < nbytes:
            self.staging[slot] = None
            buf = self.staging[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ---- rank 0 ----------------------------------------------------------------------------------

    def send_header(self, header: BucketHeader) -> None:
        """The header, then every rank's verdict on it: CorruptWeights when any rank rejected it."""
        raw = header.encode()
        length = torch.tensor([len(raw)], dtype=torch.int64, device=self.device)
        self._wait(self._broadcast(_as_bytes(length)))
        body = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
        self._wait(self._broadcast(body))
        if self._verdict(False):
            raise CorruptWeights(
                f"round {header.round}: an explorer rank rejected the layout of version "
                f"{header.version} (see its log); nothing was sent"
            )

    def send_round(self, header: BucketHeader, tensors: Sequence[torch.Tensor]) -> None:
        self.send_header(header)
        with torch.no_grad():
            pending = []
            slot_work: list[Any] = [None, None]
            slot = 0
            channel = -1  # buckets take the channels in turn; receivers count the same way
            for bucket in header.buckets:
                nbytes = header.bucket_nbytes(bucket)
                if nbytes == 0:
                    continue
                channel += 1
                if len(bucket) == 1 and _contiguous_on(tensors[bucket[0]], self.device):
                    pending.append(self._broadcast(_as_bytes(tensors[bucket[0]]), channel))
                    continue
                if slot_work[slot] is not None:
                    self._wait(slot_work[slot])  # its previous bucket is on the wire still
                buf = self.scratch(slot, nbytes)
                pack_bucket(buf, tensors, bucket)
                work = self._broadcast(buf, channel)
                pending.append(work)
                slot_work[slot] = work
                slot ^= 1
            for work in pending:
                self._wait(work)
        self._sync_device()

    def send_stream_round(self, header: BucketHeader, stream: Iterable[WeightBucket]) -> None:
        """`send_round` from a bucket stream whose tensors come in `header.layout` order (buckets
        planned in stream order): each bucket is broadcast as soon as its tensors have come, and at
        most two broadcasts (with their tensors) are in flight, so about two buckets are held."""
        self.send_header(header)
        tensors = in_layout_order(header.layout, stream)
        with torch.no_grad():
            in_flight: deque[tuple[Work, list[torch.Tensor]]] = deque()
            slot_work: list[Any] = [None, None]
            slot = 0
            channel = -1
            for bucket in header.buckets:
                members = [next(tensors) for _ in bucket]
                nbytes = header.bucket_nbytes(bucket)
                if nbytes == 0:
                    continue
                channel += 1
                if len(members) == 1 and _contiguous_on(members[0], self.device):
                    in_flight.append((self._broadcast(_as_bytes(members[0]), channel), members))
                else:
                    if slot_work[slot] is not None:
                        self._wait(slot_work[slot])  # its previous bucket is on the wire still
                    buf = self.scratch(slot, nbytes)
                    pack_bucket(buf, members, range(len(members)))
                    work = self._broadcast(buf, channel)
                    slot_work[slot] = work
                    slot ^= 1
                    in_flight.append((work, []))
                del members
                while len(in_flight) > 2:
                    self._wait(in_flight.popleft()[0])
            while in_flight:
                self._wait(in_flight.popleft()[0])
            for _ in tensors:  # the stream must end here: in_layout_order raises if it does not
                pass
        self._sync_device()

    # ---- receivers -------------------------------------------------------------------------------

    def receive_round(
        self, expect_round: int, expect_version: int, into: Mapping[str, torch.Tensor], atomic: bool, log: Any
    ) -> int:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._wait(self._broadcast(_as_bytes(length)))
        size = int(length.item())
        if not 0 < size <= _MAX_HEADER_BYTES:
            # Not a header we can even receive: the ranks are out of step, the group is unusable.
            raise CollectiveFailed(f"garbled header length {size}")
        problem: str | None = None
        header: BucketHeader | None = None
        body = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._wait(self._broadcast(body))
        try:
            header = BucketHeader.decode(body.cpu().numpy().tobytes())
        except CorruptWeights as exc:
            problem = str(exc)
        if header is not None:
            if (header.round, header.version) != (expect_round, expect_version):
                problem = (f"sender is in round {header.round} version {header.version}, "
                           f"this rank expects round {expect_round} version {expect_version}")
            else:
                problem = layout_mismatch(header, into)
        if problem is not None:
            log.warning("weights.layout_rejected", rank=self.rank, problem=problem)
        if self._verdict(problem is not None):
            raise CorruptWeights(problem or "another rank rejected the layout; nothing was copied")
        assert header is not None
        dests = [into[name] for name, _, _ in header.layout]
        with torch.no_grad():
            return self._receive_buckets(header, dests, atomic)

    def _receive_buckets(self, header: BucketHeader, dests: list[torch.Tensor], atomic: bool) -> int:
        total = 0
        pending: list[Work] = []
        # (work, bucket, buffer) waiting to be unpacked, per scratch slot (or all, when atomic)
        unpack_later: list[tuple[Work, Sequence[int], torch.Tensor]] = []
        slot_pending: list[tuple[Work, Sequence[int], torch.Tensor] | None] = [None, None]
        slot = 0
        channel = -1
        if atomic:
            staged_bytes = sum(header.bucket_nbytes(b) for b in header.buckets)
            whole = self.scratch(0, staged_bytes)
            cursor = 0
        for bucket in header.buckets:
            nbytes = header.bucket_nbytes(bucket)
            total += nbytes
            if nbytes == 0:
                continue
            channel += 1
            if not atomic and len(bucket) == 1 and _contiguous_on(dests[bucket[0]], self.device):
                pending.append(self._broadcast(_as_bytes(dests[bucket[0]]), channel))
                continue
            if atomic:
                buf = whole[cursor : cursor + nbytes]
                cursor += nbytes
                unpack_later.append((self._broadcast(buf, channel), bucket, buf))
                continue
            waiting = slot_pending[slot]
            if waiting is not None:
                self._unpack(*waiting, dests)
            buf = self.scratch(slot, nbytes)
            slot_pending[slot] = (self._broadcast(buf, channel), bucket, buf)
            slot ^= 1
        for work in pending:
            self._wait(work)
        for entry in unpack_later + [p for p in slot_pending if p is not None]:
            self._wait(entry[0])  # every byte is here before an atomic unpack begins
        for entry in unpack_later + [p for p in slot_pending if p is not None]:
            self._unpack(*entry, dests)
        self._sync_device()
        return total

    def _unpack(self, work: Work, bucket: Sequence[int], buf: torch.Tensor, dests: list[torch.Tensor]) -> None:
        self._wait(work)
        offset = 0
        for i in bucket:
            dst = dests[i]
            n = dst.numel() * dst.element_size()
            dst.copy_(buf[offset : offset + n].view(dst.dtype).view(dst.shape))
            offset += n

    def close(self, *, failed: bool) -> None:
        # abort() unblocks nccl kernels stuck on a dead peer; shutdown() is the orderly way out.
        for pg in self.pgs:
            try:
                if failed and self.backend == "nccl":
                    pg.abort()
                else:
                    pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort: the group is being thrown away anyway
                pass
        self.pgs = []
        self.staging = [None, None]
