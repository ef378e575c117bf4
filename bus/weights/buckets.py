"""Packing tensors into buckets and the header that describes them: shared by the rendezvous
transports (torch.distributed broadcast, CUDA IPC). Dtypes are named as in `format` (safetensors'
names), the one dtype table of the weights layer."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptWeights, TransferError
from .format import dtype_from_name, dtype_name

__all__ = ["DEFAULT_BUCKET_BYTES", "Layout", "BucketHeader", "can_send", "numel", "plan_buckets",
           "plan_stream_buckets", "pack_bucket", "layout_mismatch", "in_layout_order"]

DEFAULT_BUCKET_BYTES = 512 << 20
# 2: dtypes named as in the safetensors format (was torch's names): a receiver of another build
# refuses the header instead of misreading it
_SCHEMA = 2


Layout = Sequence[tuple[str, torch.dtype, tuple[int, ...]]]  # (name, dtype, shape) per tensor


def can_send(dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` has a name in the header (the safetensors names of `format`)."""
    try:
        dtype_name(dtype)
    except TypeError:
        return False
    return True


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def plan_buckets(layout: Layout, *, bucket_bytes: int, direct_min_bytes: int) -> list[list[int]]:
    """Group tensor indices of `layout` into buckets: one dtype per bucket, at most `bucket_bytes`
    each; a tensor of ≥ `direct_min_bytes` (or larger than a bucket) is a bucket of its own."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype, _) in enumerate(layout):
        by_dtype.setdefault(dtype, []).append(i)
    buckets: list[list[int]] = []
    for dtype, indices in by_dtype.items():
        current: list[int] = []
        filled = 0
        for i in indices:
            nbytes = numel(layout[i][2]) * dtype.itemsize
            if nbytes >= direct_min_bytes or nbytes > bucket_bytes:
                buckets.append([i])
                continue
            if current and filled + nbytes > bucket_bytes:
                buckets.append(current)
                current, filled = [], 0
            current.append(i)
            filled += nbytes
        if current:
            buckets.append(current)
    return buckets


def plan_stream_buckets(layout: Layout, *, bucket_bytes: int, direct_min_bytes: int) -> list[list[int]]:
    """Group tensor indices of `layout` into buckets in stream order: consecutive tensors of one
    dtype, at most `bucket_bytes` each; a tensor of ≥ `direct_min_bytes` (or larger than a bucket) is
    a bucket of its own. A sender fills each bucket as the stream brings its tensors, so it never
    waits for a tensor further down the stream."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, (_, dtype, shape) in enumerate(layout):
        nbytes = numel(shape) * dtype.itemsize
        if nbytes >= direct_min_bytes or nbytes > bucket_bytes:
            if current:
                buckets.append(current)
                current, filled = [], 0
            buckets.append([i])
            continue
        if current and (filled + nbytes > bucket_bytes or layout[current[0]][1] != dtype):
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += nbytes
    if current:
        buckets.append(current)
    return buckets


def in_layout_order(layout: Layout, stream: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> Iterator[torch.Tensor]:
    """The stream's tensors one by one, each checked against `layout` (the same names, dtypes and
    shapes in the same order: what the receivers were promised); TransferError on the first that
    differs, or when the stream is shorter or longer."""
    i = 0
    for bucket in stream:
        for name, tensor in bucket:
            if i >= len(layout):
                raise TransferError(f"the weight stream has more tensors than its declared layout ({len(layout)}): "
                                    f"{name!r} is extra")
            want_name, want_dtype, want_shape = layout[i]
            if (name, tensor.dtype, tuple(tensor.shape)) != (want_name, want_dtype, tuple(want_shape)):
                raise TransferError(
                    f"the weight stream's tensor {i} is {name!r} {tensor.dtype}{list(tensor.shape)}, but its "
                    f"declared layout says {want_name!r} {want_dtype}{list(want_shape)}")
            i += 1
            yield tensor
        del bucket
    if i != len(layout):
        raise TransferError(f"the weight stream ended after {i} tensors; its declared layout has {len(layout)}")


def pack_bucket(buf: torch.Tensor, tensors: Sequence[torch.Tensor], bucket: Sequence[int]) -> None:
    """Copy the bucket's tensors (indices into `tensors`), back to back, into the flat byte buffer."""
    offset = 0
    for i in bucket:
        src = tensors[i]
        n = src.numel() * src.element_size()
        buf[offset : offset + n].view(src.dtype).view(src.shape).copy_(src)
        offset += n


# --------------------------------------------------------------------------------------------------
# header: what rank 0 is about to send, checked by every receiver before a byte is copied


@dataclass(frozen=True, slots=True)
class BucketHeader:
    """What the sender is about to send: the tensors (name, dtype, shape) and how they are packed into
    buckets. Every receiver checks it against its destination before a byte is copied."""

    round: int
    version: int
    epoch: int
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    buckets: tuple[tuple[int, ...], ...]

    def to_doc(self) -> dict[str, Any]:
        """The header as plain data (JSON here; msgpack in the CUDA IPC offer)."""
        return {
            "schema": _SCHEMA,
            "round": self.round,
            "version": self.version,
            "epoch": self.epoch,
            "tensors": [[n, dtype_name(d), list(s)] for n, d, s in self.layout],
            "buckets": [list(b) for b in self.buckets],
        }

    @classmethod
    def from_doc(cls, doc: Any) -> BucketHeader:
        """Validate plain data into a header, or raise CorruptWeights saying what is wrong."""
        try:
            if doc.get("schema") != _SCHEMA:
                raise ValueError(f"header schema {doc.get('schema')!r}, expected {_SCHEMA}")
            layout = []
            for name, dtype, shape in doc["tensors"]:
                if not isinstance(name, str):
                    raise ValueError(f"bad tensor name {name!r}")
                if not all(isinstance(s, int) and s >= 0 for s in shape):
                    raise ValueError(f"bad shape {shape!r} for {name!r}")
                layout.append((name, dtype_from_name(dtype), tuple(shape)))
            buckets = tuple(tuple(int(i) for i in b) for b in doc["buckets"])
            seen = sorted(i for b in buckets for i in b)
            if seen != list(range(len(layout))):
                raise ValueError("bucket plan does not cover every tensor exactly once")
            for b in buckets:
                if len({layout[i][1] for i in b}) != 1:
                    raise ValueError("a bucket mixes dtypes")
            return cls(
                round=int(doc["round"]),
                version=int(doc["version"]),
                epoch=int(doc["epoch"]),
                layout=tuple(layout),
                buckets=buckets,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptWeights(f"unreadable weights header: {exc}") from None

    def encode(self) -> bytes:
        return json.dumps(self.to_doc(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> BucketHeader:
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise CorruptWeights(f"unreadable weights header: {exc}") from None
        return cls.from_doc(doc)

    def bucket_nbytes(self, bucket: Sequence[int]) -> int:
        return sum(numel(self.layout[i][2]) * self.layout[i][1].itemsize for i in bucket)


def layout_mismatch(header: BucketHeader, into: Mapping[str, torch.Tensor]) -> str | None:
    """Why `into` cannot take the header's tensors, or None when names, dtypes and shapes match."""
    sent = {name: (dtype, shape) for name, dtype, shape in header.layout}
    problems = []
    missing = sorted(set(sent) - set(into))
    extra = sorted(set(into) - set(sent))
    if missing:
        problems.append(f"not in destination: {missing[:5]}")
    if extra:
        problems.append(f"not sent: {extra[:5]}")
    for name, (dtype, shape) in sent.items():
        dst = into.get(name)
        if dst is not None and (dst.dtype != dtype or tuple(dst.shape) != shape):
            problems.append(f"{name}: sent {dtype_name(dtype)}{list(shape)}, "
                            f"destination {dst.dtype}{list(dst.shape)}")
        if len(problems) >= 6:
            break
    return "; ".join(problems) or None
