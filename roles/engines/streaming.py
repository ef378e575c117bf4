"""Weights as a stream: named tensors grouped in buckets of about `bucket_bytes`, one bucket at a time.

A transport that consumes `TrainEngine.iter_weight_buckets(bucket_bytes)` holds at most the bucket it
is sending and the one being gathered, never the whole model, which is what lets a sharded trainer
publish a model no single process could hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor  # annotations only: the engine contract loads without torch

__all__ = ["NamedTensors", "DEFAULT_BUCKET_BYTES", "buckets_of", "check_bucket_bytes"]

NamedTensors = list[tuple[str, "Tensor"]]
"""One bucket: (name, tensor) pairs in the order the engine yields them."""

DEFAULT_BUCKET_BYTES = 256 << 20


def check_bucket_bytes(bucket_bytes: int) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    return bucket_bytes


def _own_nbytes(name: str, tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def buckets_of(named: Iterable[tuple[str, Tensor]], bucket_bytes: int, *,
               nbytes: Callable[[str, Tensor], int] = _own_nbytes) -> Iterator[NamedTensors]:
    """Group `named` lazily into buckets of at most `bucket_bytes` (a larger tensor is a bucket alone),
    each tensor counting `nbytes(name, tensor)` (default: its own size).

    `named` is consumed only as far as the bucket being filled needs, so a generator that gathers
    each tensor on demand never runs more than one bucket ahead of the consumer.
    """
    check_bucket_bytes(bucket_bytes)
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named:
        count = nbytes(name, tensor)
        if bucket and size + count > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += count
    if bucket:
        yield bucket
