"""The fetch plan of one version: which direct-get requests to send, where each chunk lands. No I/O.

A fetch asks the weights stream for a version's chunks by stream sequence (`$JS.API.DIRECT.GET`
batches, `next_by_subj` the version's chunk subjects) and lands each reply in the destination
buffer. The plan decides everything but the sending: the next requests (`requests`, at most a
window of bytes outstanding), where a reply's payload goes (`target`), what a status reply means
(`on_status`), and when it is done. The windowed driver (`chunk_transfer`) feeds it the replies of
whichever data plane it runs on; the plan reads no socket and no clock, so the tests drive it
with hand-made headers.

- `ChunkPlan`: the whole version on one connection, with catch-up for chunks stored out of order.
- `Stripe`: one connection's contiguous part of a striped fetch (`ChunkPlan.stripes`); what a
  stripe misses is asked for by the parent afterwards (`ChunkPlan.absorb`).
- `DeltaPlan`: a delta version, whose payloads are decoded onto a base as they land.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from ._wire_client import Transient
from .base import TransferError
from .delta import ChunkDecoder, ParallelDecode
from .format import Destination, Manifest

__all__ = ["ChunkPlan", "DeltaPlan", "MissingChunks", "Stripe", "StreamGone"]


class StreamGone(Transient):
    """No stream listens on the weights subjects: a restarted in-memory server lost it (publish
    re-creates it), or a restarting server has not recovered it yet."""


class MissingChunks(Exception):
    """Chunks the stream did not give although the plan asked for everything after them."""

    def __init__(self, missing: list[int]):
        super().__init__(f"missing chunks {missing[:10]}")
        self.missing = missing


class ChunkPlan:
    """Which direct-get requests to send and where each chunk lands; the windowed driver runs it.

    Requests walk the chunks' stream sequences (contiguous when one trainer published them) in
    batches of about `request_bytes`, at most `window_bytes` outstanding. If chunks are still missing
    after that (a chunk was rewritten further down the stream, or deleted), catch-up requests go on
    from the highest sequence seen until the stream has nothing more.
    """

    def __init__(self, manifest: Manifest, dest: Destination, filter_subject: str,
                 request_bytes: int, window_bytes: int, where: str):
        self.manifest = manifest
        self.dest = dest
        self.filter_subject = filter_subject
        self.request_bytes = request_bytes
        self.where = where
        self.bounds = manifest.chunks
        n = len(self.bounds)
        chunk = max(manifest.chunk_size, 1)
        self.per_request = max(1, min(n, request_bytes // chunk))
        self.max_outstanding = max(1, window_bytes // (self.per_request * chunk))
        self.received = bytearray(n)
        self.count = 0
        first = manifest.extra.get("first_seq")
        self.first_seq: int | None = int(first) if first is not None else None
        self.next_seq: int = self.first_seq if self.first_seq is not None else 1
        self.planned_end = self.next_seq + n if self.first_seq is not None else self.next_seq
        self.outstanding = 0
        self.max_seq = self.next_seq - 1
        self.catchup_from: int | None = None if first is not None else 1
        self.catchup_progress = True

    @property
    def done(self) -> bool:
        return self.count == len(self.bounds)

    def restart(self, window_bytes: int) -> None:
        """Plan again for a new connection: nothing outstanding, from the first missing chunk."""
        chunk = max(self.manifest.chunk_size, 1)
        self.per_request = max(1, min(self.per_request, window_bytes // chunk))
        self.max_outstanding = max(1, window_bytes // (self.per_request * chunk))
        self.outstanding = 0
        self.catchup_progress = True
        missing = [i for i, got in enumerate(self.received) if not got]
        if self.first_seq is not None and missing:
            # Exact when the chunks are contiguous in the stream; catch-up covers any that are not.
            self.next_seq = min(self.next_seq, self.first_seq + missing[0])

    def _body(self, seq: int, batch: int) -> bytes:
        return json.dumps({"seq": seq, "batch": batch, "next_by_subj": self.filter_subject}).encode()

    def stripes(self, count: int, window_bytes: int) -> list[Stripe]:
        """This plan split into `count` contiguous parts to fetch at once, one per connection, each
        with its share of `window_bytes` (at least two chunks); none when it cannot be split (the
        chunks' sequences are unknown, or fewer than two chunks a part)."""
        n = len(self.bounds)
        if count < 2 or self.first_seq is None or n < 2 * count or self.count:
            return []
        share = max(window_bytes // count, 2 * max(self.manifest.chunk_size, 1))
        cuts = [n * i // count for i in range(count + 1)]
        return [Stripe(self, range(a, b), share) for a, b in zip(cuts, cuts[1:])]

    def absorb(self, stripes: Sequence[Stripe], window_bytes: int) -> None:
        """After the stripes: count what they landed, and plan the rest (on one connection, within
        `window_bytes`) from the first chunk still missing, catch-up included."""
        self.count = self.received.count(1)
        self.max_seq = max([self.max_seq, *(stripe.max_seq for stripe in stripes)])
        self.next_seq = self.planned_end  # every planned sequence was asked for by some stripe...
        self.restart(window_bytes)  # ...unless one stopped early: then again from the first missing

    def _planned(self) -> list[bytes]:
        out = []
        while self.outstanding < self.max_outstanding and self.next_seq < self.planned_end:
            batch = min(self.per_request, self.planned_end - self.next_seq)
            out.append(self._body(self.next_seq, batch))
            self.next_seq += batch
            self.outstanding += 1
        return out

    def requests(self) -> list[bytes]:
        out = self._planned()
        if not out and self.outstanding == 0 and not self.done:
            if not self.catchup_progress:
                raise MissingChunks([i for i, got in enumerate(self.received) if not got])
            self.catchup_from = self.max_seq + 1
            self.catchup_progress = False
            missing = len(self.bounds) - self.count
            out.append(self._body(self.catchup_from, min(self.per_request, missing)))
            self.outstanding += 1
        return out

    def on_status(self, status: str, headers: Mapping[str, str]) -> None:
        if status in ("204", "404"):  # end of a batch / nothing (more) at or after that sequence
            self.outstanding -= 1
            return
        if status == "503":
            raise StreamGone(f"{self.where}: no responder for direct get (stream gone, or server restarting)")
        raise TransferError(f"{self.where}: direct get failed with status {status}: {dict(headers)}")

    def target(self, headers: Mapping[str, str], size: int) -> memoryview | None:
        """Where this message's payload goes, or None to discard it (duplicate / not ours)."""
        try:
            seq = int(headers["Nats-Sequence"])
            index = int(headers["Nats-Subject"].rsplit(".", 1)[1])
        except (KeyError, ValueError):
            raise TransferError(f"{self.where}: direct get reply without sequence/subject: {dict(headers)}") from None
        if seq > self.max_seq:
            self.max_seq = seq
            self.catchup_progress = True
        if not self._wanted(index):
            return None
        a, b = self.bounds[index]
        return self.dest.view[a:b]

    def _wanted(self, index: int) -> bool:
        return 0 <= index < len(self.bounds) and not self.received[index]

    def landed_wrong_size(self, headers: Mapping[str, str], data: bytes) -> None:
        index = int(headers["Nats-Subject"].rsplit(".", 1)[1])
        self.manifest.check_chunk(index, [data], where=self.where)  # raises: size differs

    def landed(self, headers: Mapping[str, str], digest: bytes | None = None) -> None:
        index = int(headers["Nats-Subject"].rsplit(".", 1)[1])
        a, b = self.bounds[index]
        self.manifest.check_chunk(index, [self.dest.view[a:b]], where=self.where, digest=digest)
        self.received[index] = 1
        self.count += 1


class Stripe(ChunkPlan):
    """One connection's part of a striped fetch: the chunks `indices` of `parent`, asked for by
    their stream sequences, landing in the parent's destination and marked in its `received`
    (the parts are disjoint, so no two threads write the same place). It does no catch-up: a chunk
    of its part that is not where the sequences say is left to the parent (`absorb`)."""

    def __init__(self, parent: ChunkPlan, indices: range, window_bytes: int):
        super().__init__(parent.manifest, parent.dest, parent.filter_subject, parent.request_bytes,
                         window_bytes, parent.where)
        assert parent.first_seq is not None
        self.received = parent.received
        self.indices = indices
        self.next_seq = parent.first_seq + indices.start
        self.planned_end = parent.first_seq + indices.stop

    @property
    def done(self) -> bool:
        # all of its chunks, or every planned batch answered (what is still missing is the parent's)
        return self.count == len(self.indices) or (self.next_seq >= self.planned_end and self.outstanding == 0)

    def requests(self) -> list[bytes]:
        return self._planned()

    def _wanted(self, index: int) -> bool:
        return index in self.indices and not self.received[index]


class DeltaPlan(ChunkPlan):
    """A `ChunkPlan` whose chunks are delta payloads: each lands in a scratch buffer of its stored
    size, then is decoded onto the base into the destination and checked there."""

    def __init__(self, manifest: Manifest, dest: Destination, filter_subject: str, request_bytes: int,
                 window_bytes: int, where: str, decoder: ChunkDecoder):
        super().__init__(manifest, dest, filter_subject, request_bytes, window_bytes, where)
        self.decoder = decoder
        self.decoding = ParallelDecode(decoder)
        self._scratch: dict[int, memoryview] = {}

    def target(self, headers: Mapping[str, str], size: int) -> memoryview | None:
        if super().target(headers, size) is None:
            return None
        index = int(headers["Nats-Subject"].rsplit(".", 1)[1])
        buf = memoryview(bytearray(self.decoder.expected_size(index)))
        self._scratch[index] = buf
        return buf

    def stripes(self, count: int, window_bytes: int) -> list[Stripe]:
        return []  # a delta is a small fraction of a version, decoded in order: one connection

    def landed_wrong_size(self, headers: Mapping[str, str], data: bytes) -> None:
        index = int(headers["Nats-Subject"].rsplit(".", 1)[1])
        self.decoder.apply(index, data)  # raises: the stored size differs

    def landed(self, headers: Mapping[str, str], digest: bytes | None = None) -> None:
        index = int(headers["Nats-Subject"].rsplit(".", 1)[1])
        self.decoding.submit(index, self._scratch.pop(index))  # decoded and checked by `decoding.finish`
        self.received[index] = 1
        self.count += 1
