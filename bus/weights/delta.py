"""Delta versions for the pull transports: version N stored as the XOR of its chunks with N-1's, compressed.

Theory of operation
-------------------
- **What is stored.** A version is the logical byte stream of `format`, cut into chunks. A *keyframe*
  stores every chunk's bytes (exactly the format pull transports always stored). A *delta* stores,
  per chunk, ``compress(new XOR base)`` where base is the same byte range of the version published
  just before it (its *base*). After a training step most bytes of a low-precision (bf16) export are
  unchanged, so the XOR is mostly zeros and compresses to a few percent. Every ``keyframe_interval``
  versions the publisher writes a keyframe, so a receiver never needs more than that many versions.
- **The manifest is the same.** A delta's manifest holds the layout and the chunk digests *of the
  result* (the version's own bytes), so its root digest, and the `WeightsRef` announced, are exactly
  what a keyframe of the same tensors would give. The delta's facts ride in ``extra["delta"]``: base
  version and digest, keyframe version, codec, the stored size of each chunk, chunks stored whole.
- **Applying.** A receiver that holds the base (same version *and* digest) XORs each arriving chunk
  onto it; any other receiver (it skipped a version, or just started) is refused the shortcut and
  fetches the keyframe, then each delta after it in order, in place. Every resulting chunk is checked
  against the manifest's chunk digest before the next one, so a bad delta, a bad base or a wrong
  chain raises `CorruptWeights` naming version and chunk and no tensor is handed out: a delta can
  never produce a wrong model.
- **Why XOR per chunk.** It needs no knowledge of dtypes or tensors (any layout, any dtype), is its
  own inverse, and an unchanged byte is a zero byte, which a general-purpose compressor shrinks to
  almost nothing. The compressor is Zstandard (``zstandard`` package, well kept and several times
  faster than zlib at a better ratio) when installed, else zlib from the standard library; the
  codec is written into every delta manifest, so a receiver always decodes with the sender's choice.
  Before compressing, the XOR's bytes are grouped by their position in 2-byte words (``shuffle``):
  a bf16 XOR's high bytes are nearly all zero and its low bytes sparse, and apart they compress
  smaller and faster. Receivers decode chunks on worker threads while the next ones arrive.
- **Memory.** The publisher keeps a copy of the last version's bytes (one model at the wire dtype)
  to XOR against; a receiver keeps the last version it handed out. Nothing is kept when
  ``keyframe_interval`` is 1 (every version a keyframe, the default).
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .base import CorruptWeights, StoredVersion, WeightBucket, WeightsSource
from .format import Layout, Manifest, StreamedChunks

try:  # optional: faster and smaller than zlib
    import zstandard as _zstd
except ImportError:  # pragma: no cover - depends on the environment
    _zstd = None  # type: ignore[assignment]  # the optional module is absent: None says so

__all__ = [
    "CODECS",
    "DeltaInfo",
    "DeltaPublisher",
    "DeltaChunks",
    "HeldVersion",
    "ParallelDecode",
    "apply_chunk",
    "cast_source",
    "default_codec",
    "delta_info",
    "stored_version",
    "xor_into",
    "xor_shuffled",
    "xor_unshuffled",
]

_ZSTD_LEVEL = 1  # the XOR is mostly zeros: higher levels cost time and save little
# Bytes are regrouped by their position in 2-byte words before compressing: the high bytes of a bf16
# XOR are almost all zero and the low ones sparse, which compresses ~20 % smaller (and faster) apart.
_SHUFFLE = 2


def _zlib_codec() -> tuple[Any, Any]:
    return (lambda data: zlib.compress(data, 1)), (lambda data, size: zlib.decompress(data, bufsize=max(size, 1)))


def _zstd_codec() -> tuple[Any, Any]:
    compressor = _zstd.ZstdCompressor(level=_ZSTD_LEVEL)
    decompressor = _zstd.ZstdDecompressor()
    return compressor.compress, (lambda data, size: decompressor.decompress(data, max_output_size=size))


CODECS: dict[str, Any] = {"zlib": _zlib_codec}
if _zstd is not None:
    CODECS["zstd"] = _zstd_codec


def default_codec() -> str:
    """"zstd" when the zstandard package is installed, else "zlib"."""
    return "zstd" if "zstd" in CODECS else "zlib"


def _codec(name: str, where: str) -> tuple[Any, Any]:
    try:
        codec: tuple[Any, Any] = CODECS[name]()  # fresh objects: zstandard's are not shared between threads
        return codec
    except KeyError:
        hint = " (pip install zstandard)" if name == "zstd" else ""
        raise CorruptWeights(f"{where}: delta codec {name!r} is not available in this process{hint}") from None


def _u8(buffer: Any) -> np.ndarray:
    return np.frombuffer(buffer, dtype=np.uint8)


def xor_shuffled(a: Any, b: Any, width: int) -> np.ndarray:
    """a XOR b with the bytes grouped by their position within `width`-byte words (all first bytes,
    then all second bytes, ...; a trailing partial word stays at the end), in one pass."""
    x, y = _u8(a), _u8(b)
    n = len(x)
    if len(y) != n:
        raise ValueError(f"xor of {n} and {len(y)} bytes")
    out = np.empty(n, dtype=np.uint8)
    whole = n - n % width if width > 1 else 0
    h = whole // width
    for j in range(width if whole else 0):
        np.bitwise_xor(x[j:whole:width], y[j:whole:width], out=out[j * h:(j + 1) * h])
    np.bitwise_xor(x[whole:], y[whole:], out=out[whole:])
    return out


def xor_unshuffled(out: memoryview, base: Any | None, plain: Any, width: int) -> None:
    """out = base XOR (the inverse of the grouping `xor_shuffled` made) of `plain`; with no base,
    out = the ungrouped `plain`. `out` may be `base`."""
    o, p = _u8(out), _u8(plain)
    n = len(o)
    if len(p) != n or (base is not None and len(base) != n):
        raise ValueError(f"{len(p)} bytes onto {n}")
    b = _u8(base) if base is not None else None
    whole = n - n % width if width > 1 else 0
    h = whole // width
    for j in range(width if whole else 0):
        if b is None:
            o[j:whole:width] = p[j * h:(j + 1) * h]
        else:
            np.bitwise_xor(b[j:whole:width], p[j * h:(j + 1) * h], out=o[j:whole:width])
    if b is None:
        o[whole:] = p[whole:]
    else:
        np.bitwise_xor(b[whole:], p[whole:], out=o[whole:])


def xor_into(out: memoryview, a: Any, b: Any) -> None:
    """out = a XOR b, byte by byte (8 bytes at a time when the lengths allow); `out` may be `a`."""
    n = len(out)
    wide = n - n % 8
    o, x, y = _u8(out), _u8(a), _u8(b)
    if len(x) != n or len(y) != n:
        raise ValueError(f"xor of {len(x)} and {len(y)} bytes into {n}")
    if wide:
        np.bitwise_xor(x[:wide].view(np.uint64), y[:wide].view(np.uint64), out=o[:wide].view(np.uint64))
    if wide != n:
        np.bitwise_xor(x[wide:], y[wide:], out=o[wide:])


# manifests ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeltaInfo:
    """What a delta manifest's ``extra["delta"]`` says (see the module docstring)."""

    base: int
    base_digest: str
    keyframe: int
    codec: str
    sizes: tuple[int, ...]
    whole: frozenset[int]
    changed_bytes: int
    shuffle: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base, "base_digest": self.base_digest, "keyframe": self.keyframe,
                "codec": self.codec, "shuffle": self.shuffle, "sizes": list(self.sizes),
                "whole": sorted(self.whole), "changed_bytes": self.changed_bytes}

    @property
    def stored_bytes(self) -> int:
        return sum(self.sizes)


def delta_info(manifest: Manifest, *, where: str) -> DeltaInfo | None:
    """The delta facts of `manifest`, or None for a keyframe; CorruptWeights if they are malformed."""
    raw = manifest.extra.get("delta")
    if raw is None:
        return None
    try:
        info = DeltaInfo(
            base=int(raw["base"]), base_digest=str(raw["base_digest"]), keyframe=int(raw["keyframe"]),
            codec=str(raw["codec"]), sizes=tuple(int(s) for s in raw["sizes"]),
            whole=frozenset(int(i) for i in raw.get("whole", ())), changed_bytes=int(raw.get("changed_bytes", 0)),
            shuffle=int(raw.get("shuffle", 1)),
        )
        if info.shuffle < 1:
            raise ValueError(f"shuffle {info.shuffle} < 1")
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptWeights(f"{where}: version {manifest.version}: malformed delta facts: {exc}") from None
    if len(info.sizes) != len(manifest.chunks) or not info.keyframe <= info.base < manifest.version:
        raise CorruptWeights(
            f"{where}: version {manifest.version}: delta facts do not fit the manifest ({len(info.sizes)} "
            f"sizes for {len(manifest.chunks)} chunks, base {info.base}, keyframe {info.keyframe})")
    return info


# publisher ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Base:
    version: int
    digest: str
    keyframe: int
    chunk_size: int
    chunks: tuple[bytes, ...]


class DeltaPublisher:
    """The publisher's side: decides keyframe or delta, encodes the chunks, remembers the base.

    One per transport. `interval` 1 makes every version a keyframe and keeps nothing.
    """

    def __init__(self, interval: int = 1, codec: str | None = None):
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"keyframe_interval must be an int >= 1, got {interval!r}")
        self.interval = interval
        self.codec = codec or default_codec()
        _codec(self.codec, "delta publisher")  # an unknown codec fails here, not mid-upload
        self._base: _Base | None = None
        self._since_keyframe = 0

    @property
    def enabled(self) -> bool:
        return self.interval > 1

    def forget(self) -> None:
        """Make the next version a keyframe (its base may be gone, e.g. a lost in-memory stream)."""
        self._base = None

    def wrap(self, version: int, inner: StreamedChunks) -> StreamedChunks | DeltaChunks:
        """The chunks to send for `version`: `inner` itself when no base is kept, else a
        `DeltaChunks` (a keyframe that records its bytes, or a delta against the base)."""
        if not self.enabled:
            return inner
        base = self._base
        if (base is None or base.version >= version or base.chunk_size != inner.chunk_size
                or self._since_keyframe + 1 >= self.interval):
            base = None
        return DeltaChunks(version, inner, base, self.codec)

    def commit(self, chunks: StreamedChunks | DeltaChunks, manifest: Manifest) -> None:
        """The version of `chunks` is stored under `manifest`: it is the next base."""
        if not isinstance(chunks, DeltaChunks):
            return
        if chunks.base is None:
            keyframe, self._since_keyframe = manifest.version, 0
        else:
            keyframe, self._since_keyframe = chunks.base.keyframe, self._since_keyframe + 1
        self._base = _Base(manifest.version, manifest.digest, keyframe, manifest.chunk_size, tuple(chunks.kept))


def stored_version(chunks: StreamedChunks | DeltaChunks, nbytes: int) -> StoredVersion:
    """How `chunks`, every one sent, stored their version of `nbytes`: as a delta, or whole."""
    if isinstance(chunks, DeltaChunks) and chunks.base is not None:
        return StoredVersion(kind="delta", stored_bytes=chunks.stored_bytes, changed_bytes=chunks.changed_bytes)
    return StoredVersion(kind="keyframe", stored_bytes=nbytes, changed_bytes=nbytes)


class DeltaChunks:
    """`StreamedChunks` seen through the delta encoder: the same `(index, parts, digest)` stream
    (digests of the version's own bytes), with each chunk's payload a compressed XOR against the
    base (or the chunk itself on a keyframe); every chunk's bytes are kept as the next base."""

    def __init__(self, version: int, inner: StreamedChunks, base: _Base | None, codec: str):
        self.version = version
        self.inner = inner
        self.base = base
        self.codec = codec
        self.kept: list[bytes] = []
        self.sizes: list[int] = []
        self.whole: list[int] = []
        self.changed_bytes = 0

    @property
    def chunk_size(self) -> int:
        return self.inner.chunk_size

    @property
    def layout(self) -> Layout:
        return self.inner.layout

    @property
    def chunk_digests(self) -> list[bytes]:
        return self.inner.chunk_digests

    @property
    def buckets_read(self) -> int:
        return self.inner.buckets_read

    @property
    def stored_bytes(self) -> int:
        return sum(self.sizes) if self.base is not None else self.inner.nbytes

    def chunks(self) -> Generator[tuple[int, list[memoryview], bytes], None, None]:
        compress, _ = _codec(self.codec, "delta publisher")
        base = self.base
        for index, parts, digest in self.inner.chunks():
            data = b"".join(parts)  # a copy: the parts are the tensors' memory, gone after this chunk
            del parts
            self.kept.append(data)
            if base is None:
                yield index, [memoryview(data)], digest
                continue
            if index < len(base.chunks) and len(base.chunks[index]) == len(data):
                diff = xor_shuffled(data, base.chunks[index], _SHUFFLE)
                self.changed_bytes += int(np.count_nonzero(diff))
                payload = compress(diff)
            else:  # the stream grew or shrank: this chunk has no counterpart, it is stored whole
                self.whole.append(index)
                self.changed_bytes += len(data)
                payload = compress(xor_shuffled(data, bytes(len(data)), _SHUFFLE))
            self.sizes.append(len(payload))
            yield index, [memoryview(payload)], digest

    def manifest_extra(self) -> dict[str, Any]:
        """What goes into the manifest's ``extra`` (nothing for a keyframe: its format is unchanged)."""
        if self.base is None:
            return {}
        info = DeltaInfo(self.base.version, self.base.digest, self.base.keyframe, self.codec,
                         tuple(self.sizes), frozenset(self.whole), self.changed_bytes, _SHUFFLE)
        return {"delta": info.to_json()}


# receiver -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeldVersion:
    """The last version a receiver handed out: its bytes are the base of the next delta."""

    version: int
    digest: str
    flat: torch.Tensor

    @property
    def view(self) -> memoryview:
        return memoryview(self.flat.numpy())  # type: ignore[arg-type]  # ndarray is a Buffer at runtime

    def is_base_of(self, info: DeltaInfo) -> bool:
        return self.version == info.base and self.digest == info.base_digest


class ChunkDecoder:
    """Decodes one delta version's chunks onto a base (a held version, or the destination itself)."""

    def __init__(self, manifest: Manifest, info: DeltaInfo, dest: memoryview, base: memoryview, where: str):
        self.manifest = manifest
        self.info = info
        self.dest = dest
        self.base = base
        self.where = where
        _codec(info.codec, where)  # an unknown codec fails before the first chunk
        self._local = threading.local()  # zstandard's objects must not be shared between threads

    def expected_size(self, index: int) -> int:
        return self.info.sizes[index]

    def apply(self, index: int, payload: Any) -> None:
        """Decode chunk `index` into the destination and check it; CorruptWeights names version and chunk."""
        a, b = self.manifest.chunks[index]
        decompress = getattr(self._local, "decompress", None)
        if decompress is None:
            decompress = self._local.decompress = _codec(self.info.codec, self.where)[1]
        apply_chunk(self.manifest, self.info, index, payload, self.dest[a:b],
                    None if index in self.info.whole else self.base[a:b], decompress, where=self.where)


class ParallelDecode:
    """Decodes a version's chunks on a few worker threads while the next ones arrive (zstandard,
    numpy and the digests release the GIL on large buffers). `finish` waits for every chunk and
    raises the failure of the lowest-numbered bad chunk; `abandon` stops a failed transfer's work."""

    def __init__(self, decoder: ChunkDecoder, workers: int | None = None):
        self.decoder = decoder
        self._pool = ThreadPoolExecutor(max_workers=workers or max(1, min(4, (os.cpu_count() or 2) // 2)),
                                        thread_name_prefix="delta-decode")
        self._futures: dict[int, Future[None]] = {}

    def submit(self, index: int, payload: Any) -> None:
        self._futures[index] = self._pool.submit(self.decoder.apply, index, payload)

    def finish(self) -> None:
        try:
            for index in sorted(self._futures):
                self._futures[index].result()
        finally:
            self.abandon()

    def abandon(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=True)


def apply_chunk(manifest: Manifest, info: DeltaInfo, index: int, payload: Any, out: memoryview,
                base: memoryview | None, decompress: Any, *, where: str) -> None:
    """out = base XOR decompress(payload) (or the decompressed chunk itself when stored whole), then
    the result is checked against the manifest's chunk digest; CorruptWeights names version and chunk."""
    n = len(out)
    problem = None
    if len(payload) != info.sizes[index]:
        problem = f"has {len(payload)} stored bytes, the manifest says {info.sizes[index]}"
    else:
        try:
            plain = decompress(bytes(payload) if not isinstance(payload, bytes) else payload, n)
        except Exception as exc:  # noqa: BLE001 - zlib.error / zstd.ZstdError: the payload is corrupt
            problem = f"does not decompress ({type(exc).__name__}: {exc})"
        else:
            if len(plain) != n:
                problem = f"decompresses to {len(plain)} bytes, expected {n}"
            elif base is not None and len(base) != n:
                problem = f"has no base bytes to apply to ({len(base)} of {n})"
            else:
                xor_unshuffled(out, base, plain, info.shuffle)
    if problem is not None:
        raise CorruptWeights(
            f"{where}: version {manifest.version} delta chunk {index} of {len(manifest.chunks)} {problem}; "
            f"no tensors were returned — republish version {manifest.version} or fetch a newer one")
    manifest.check_chunk(index, [out], where=f"{where} (delta on version {info.base})")


# wire dtype ---------------------------------------------------------------------------------------


def cast_source(weights: WeightsSource, dtype: torch.dtype | None) -> WeightsSource:
    """`weights` with every floating-point tensor cast to `dtype` as its bucket is made (the wire
    dtype: the trainer keeps its own precision, receivers get `dtype`); unchanged when None."""
    if dtype is None:
        return weights

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    if isinstance(weights, Mapping):
        return {name: cast(t) for name, t in weights.items()}

    def buckets(stream: Iterable[WeightBucket]) -> Generator[Sequence[tuple[str, torch.Tensor]], None, None]:
        for bucket in stream:
            yield [(name, cast(t)) for name, t in bucket]

    if callable(weights):
        return lambda: buckets(weights())
    if not isinstance(weights, Iterator):  # a re-iterable collection stays restartable
        return lambda: buckets(weights)
    return buckets(weights)
