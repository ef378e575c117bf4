"""Out-of-band weight transports: object store, checkpoint, torch.distributed, CUDA IPC."""

from .base import (
    CorruptWeights,
    PeerLost,
    PullTransport,
    RendezvousTransport,
    StoredVersion,
    TransferError,
    WeightBucket,
    WeightBuckets,
    WeightsNotFound,
    WeightsRef,
    WeightsSource,
    as_buckets,
)

__all__ = [
    "CorruptWeights",
    "PeerLost",
    "PullTransport",
    "RendezvousTransport",
    "StoredVersion",
    "TransferError",
    "WeightBucket",
    "WeightBuckets",
    "WeightsNotFound",
    "WeightsRef",
    "WeightsSource",
    "as_buckets",
]
