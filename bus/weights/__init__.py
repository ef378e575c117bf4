"""Out-of-band weight transports: object store, checkpoint, torch.distributed, CUDA IPC."""

from .base import (
    CorruptWeights,
    PeerLost,
    PullTransport,
    RendezvousTransport,
    TransferError,
    WeightsNotFound,
    WeightsRef,
)

__all__ = [
    "CorruptWeights",
    "PeerLost",
    "PullTransport",
    "RendezvousTransport",
    "TransferError",
    "WeightsNotFound",
    "WeightsRef",
]
