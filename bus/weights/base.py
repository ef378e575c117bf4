"""The one small interface every weight transport implements, and its typed errors.

Two families share it:

- *pull* transports (object store, checkpoint): the trainer `publish`es a version and gets back a
  `WeightsRef` to announce in a `VersionPublished` event; an explorer `fetch`es by that ref.
- *rendezvous* transports (torch.distributed broadcast, CUDA IPC): the synchronizer's
  `RendezvousReady` decision names the group; the trainer `send`s and each explorer `receive`s.

Every transfer is verified: pull transports check a digest before a tensor is handed out;
rendezvous transports check tensor names/dtypes/shapes against the sender's header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from rolectl.sync_protocol import MemberRef, RendezvousReady, SyncMethod

from ..errors import CorruptWeights, PeerLost, TransferError, WeightsNotFound  # the bus's one tree

__all__ = [
    "WeightsRef",
    "TransferError",
    "CorruptWeights",
    "WeightsNotFound",
    "PeerLost",
    "PullTransport",
    "RendezvousTransport",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsRef:
    """Where a published version lives: what a `VersionPublished` event carries."""

    version: int
    location: str
    nbytes: int
    digest: str


@runtime_checkable
class PullTransport(Protocol):
    """Object store / checkpoint: publish once, fetch by reference, keep the last K versions."""

    method: SyncMethod

    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightsRef:
        """Store every byte of `tensors` as `version`; return only after the last byte is stored."""

    async def fetch(self, ref: WeightsRef, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Fetch `ref` into freshly allocated tensors, verifying the digest before returning."""

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

    async def send(self, ready: RendezvousReady, tensors: Mapping[str, torch.Tensor]) -> int:
        """Trainer side (rank 0): send `tensors` to the round's group; return bytes sent."""

    async def receive(
        self, ready: RendezvousReady, me: MemberRef, into: Mapping[str, torch.Tensor], *,
        also_into: Sequence[Mapping[str, torch.Tensor]] = (),
    ) -> int:
        """Explorer side: receive the round's weights into `into` and each of `also_into` (copied
        in place); return the bytes of one copy."""

    async def aclose(self) -> None:
        """Tear the group down (explorers before the trainer); safe to call twice."""
