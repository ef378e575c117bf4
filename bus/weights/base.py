"""The one small interface every weight transport implements, and its typed errors.

Two families share it:

- *pull* transports (object store, checkpoint): the trainer `publish`es a version and gets back a
  `WeightsRef` to announce in a `VersionPublished` event; an explorer `fetch`es by that ref.
- *rendezvous* transports (torch.distributed broadcast, CUDA IPC): the synchronizer's
  `RendezvousReady` decision names the group; the trainer `send`s and each explorer `receive`s.

Every transfer is verified: pull transports check a digest before a tensor is handed out;
rendezvous transports check tensor names/dtypes/shapes against the sender's header.

Weights leave as a stream: `publish` and `send` take `WeightsSource`, a `{name: tensor}` mapping or
an iterable of buckets (each a sequence of (name, tensor)), consumed one bucket at a time so the
sender never holds more than about two buckets of the model (`as_buckets`). A zero-argument callable
returning such an iterable lets a pull transport start the stream again when a server restart
interrupts an upload; a one-shot iterator cannot be restarted, so such a publish fails instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeAlias, runtime_checkable

import torch

from rolectl.sync_protocol import MemberRef, RendezvousReady, SyncMethod

from ..errors import CorruptWeights, PeerLost, TransferError, WeightsNotFound  # the bus's one tree

__all__ = [
    "WeightsRef",
    "StoredVersion",
    "TransferError",
    "CorruptWeights",
    "WeightsNotFound",
    "PeerLost",
    "PullTransport",
    "RendezvousTransport",
    "NamedTensor",
    "WeightBucket",
    "WeightBuckets",
    "WeightsSource",
    "TensorMeta",
    "as_buckets",
    "restartable",
    "tensor_meta",
]

NamedTensor: TypeAlias = tuple[str, torch.Tensor]
WeightBucket: TypeAlias = Sequence[NamedTensor]
"""One bucket of the stream: (name, tensor) pairs, in the order the engine made them."""
WeightBuckets: TypeAlias = Iterable[WeightBucket]
"""The weights as a stream of buckets (e.g. `TrainEngine.iter_weight_buckets(bucket_bytes)`)."""
WeightsSource: TypeAlias = Mapping[str, torch.Tensor] | WeightBuckets | Callable[[], WeightBuckets]
"""What `publish` / `send` take: a whole mapping, a bucket stream, or a callable making a fresh stream."""
TensorMeta: TypeAlias = tuple[str, torch.dtype, tuple[int, ...]]
"""(name, dtype, shape) of one tensor: what a receiver checks before the first byte."""


def as_buckets(weights: WeightsSource) -> Iterator[WeightBucket]:
    """A fresh pass over `weights` as buckets: a mapping is one bucket per tensor (in its order), a
    callable is called for a new stream, an iterable is iterated (once, if it is an iterator)."""
    if isinstance(weights, Mapping):
        return ([(name, tensor)] for name, tensor in weights.items())
    if callable(weights):
        return iter(weights())
    return iter(weights)


def restartable(weights: WeightsSource) -> bool:
    """Whether `as_buckets(weights)` can be called again for the same bytes: a mapping, a callable, or
    a re-iterable collection (a list of buckets); not a generator or other one-shot iterator."""
    if isinstance(weights, Mapping) or callable(weights):
        return True
    return not isinstance(weights, Iterator)


def tensor_meta(tensors: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    """(name, dtype, shape) of each tensor of a mapping, in its order."""
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredVersion:
    """How a pull transport stored a version it published: whole, or as a delta on an earlier one."""

    kind: Literal["keyframe", "delta"]
    stored_bytes: int  # bytes the store holds for this version (a delta's payloads; else every byte)
    changed_bytes: int  # bytes that differ from the delta's base (every byte of a keyframe)


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsRef:
    """Where a published version lives: what a `VersionPublished` event carries.

    `stored` is set on the ref a pull transport's `publish` returns (how it stored the version,
    which the trainer logs); a ref made from an event has None. It takes no part in comparing refs.
    """

    version: int
    location: str
    nbytes: int
    digest: str
    stored: StoredVersion | None = field(default=None, compare=False)


@runtime_checkable
class PullTransport(Protocol):
    """Object store / checkpoint: publish once, fetch by reference, keep the last K versions."""

    method: SyncMethod

    async def publish(self, version: int, tensors: WeightsSource) -> WeightsRef:
        """Store every byte of `tensors` (a mapping or a bucket stream) as `version`; return only after
        the last byte is stored, with how it was stored (`WeightsRef.stored`). A stream is consumed
        bucket by bucket, never held whole."""

    async def fetch(self, ref: WeightsRef, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Fetch `ref` into tensors of its own (fresh, or a buffer given back by `recycle`),
        verifying the digest before returning."""

    def recycle(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Say the tensors of the last fetch are no longer used (their bytes were copied into a
        model): the next fetch of that size may write into their memory. False when `tensors` are
        not that fetch's (then nothing changes)."""

    async def prune(self, keep: int, *, announced: Iterable[int] | None = None) -> list[int]:
        """Delete all but the newest `keep` versions; return the deleted versions. With `announced`
        (the versions the event stream announced) keep the newest `keep` of those and delete any
        other stored version, so junk with a high version number never pushes real ones out."""

    async def aclose(self) -> None:
        """Release resources; safe to call twice."""


@runtime_checkable
class RendezvousTransport(Protocol):
    """torch.distributed / CUDA IPC: every participant of a `RendezvousReady` takes part at once.

    This is everything a role calls: the trainer offers a port and sends, an explorer receives into
    its first local rank and `also_into` the others (one mapping per further rank)."""

    method: SyncMethod

    def offer_port(self) -> int:
        """A port this host can bind for the next group's rendezvous (the trainer announces it in
        its REQUIRE_SYNC; used only when the decision starts a new group epoch)."""

    async def send(
        self, ready: RendezvousReady, tensors: WeightsSource, *, layout: Sequence[TensorMeta] | None = None,
    ) -> int:
        """Trainer side (rank 0): send `tensors` (a mapping or a bucket stream) to the round's group;
        return bytes sent. `layout`: the stream's (name, dtype, shape) in stream order, known without
        gathering (e.g. from a sharded model's metadata); receivers check it before the first byte,
        so a stream without it is gathered whole first."""

    async def receive(
        self, ready: RendezvousReady, me: MemberRef, into: Mapping[str, torch.Tensor], *,
        also_into: Sequence[Mapping[str, torch.Tensor]] = (),
    ) -> int:
        """Explorer side: receive the round's weights into `into` and each of `also_into` (copied
        in place); return the bytes of one copy."""

    async def aclose(self) -> None:
        """Tear the group down (explorers before the trainer); safe to call twice."""
