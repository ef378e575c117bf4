"""Weights wire format: a safetensors-style header, tensor bytes seen without copies, a chunk digest tree.

Theory of operation
-------------------
A state dict travels as one *logical byte stream*: every tensor's raw bytes, back to back, at the
`data_offsets` of a safetensors-style header (``{name: {"dtype", "shape", "data_offsets"}}``, dtype
names as safetensors spells them). Nothing is pickled.

- **Layout** (`plan_layout`): tensors are ordered by element size (largest first), then name. Every
  offset is then a multiple of its tensor's element size with no padding, so a receiver can view one
  freshly allocated ``uint8`` buffer as all the tensors at once (`Destination`) and a sender can hand
  each tensor's own memory to the socket (`SourceBytes.segments`): no staging copy on either side.
- **Digest tree**: the stream is cut into fixed-size chunks; each chunk has a digest, and the version's
  digest is the hash of (format, canonical header, chunk size, every chunk digest). A receiver checks
  the manifest's chunk list against that root once, then each chunk as it lands, so a corrupt chunk is
  named (version, chunk, tensors) and no second full pass over the data is needed. The digest depends
  only on the tensors and the chunk size, not on the order the caller gave them in.
- **Streams** (`StreamedChunks`): a sender that gets the weights as a stream of buckets cannot sort
  them first. It places each tensor at the current end of the stream as it arrives (so the bytes go
  out at once and the bucket can be dropped), cuts chunks as they fill and hashes each one on the
  way; the layout is complete only when the stream ends, which is fine because the manifest (or a
  checkpoint's header) is written last. A tensor whose size is not a multiple of 8 bytes would
  misalign whatever comes after it, so it waits and goes at the end, largest element size first:
  every offset is still a multiple of its element size with no padding, and receivers read the same
  format. A mapping given whole keeps the sorted layout above (and so the same digest as before).
- **Algorithm**: XXH3-128 by default. The digest detects corrupt, missing and mixed-up bytes; it
  does not authenticate them, since whoever may write a version's chunks may write its manifest too
  (TLS and the server's permissions guard against forgery). XXH3 does that job at memory speed,
  where BLAKE3 costs a receiving core a quarter of a second per GiB (docs/weights-at-size.md).
  BLAKE3 and SHA-256 can be chosen (`transport.digest`) for a cryptographic content hash of each
  version. The algorithm is written into every manifest, so a receiver always checks with the
  sender's choice.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import torch
import xxhash

from .base import CorruptWeights, TransferError, WeightBucket, WeightsSource, as_buckets
from .host_memory import host_buffer

__all__ = [
    "FORMAT",
    "DEFAULT_CHUNK_SIZE",
    "DIGEST_ALGORITHMS",
    "DEFAULT_DIGEST_ALGORITHM",
    "dtype_name",
    "dtype_from_name",
    "TensorSpec",
    "Layout",
    "plan_layout",
    "SourceBytes",
    "Destination",
    "digest_bytes",
    "root_digest",
    "Manifest",
    "build_manifest",
    "StreamedChunks",
    "streamed_chunks",
]

FORMAT = "rolectl-weights/1"
DEFAULT_CHUNK_SIZE = 8 * 1024 * 1024

# safetensors dtype names (see safetensors' Dtype enum); only those torch can represent.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("C64", "complex64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("F32", "BF16", ...)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} has no safetensors name; supported: {', '.join(sorted(_DTYPES))}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name; ValueError names the unknown one."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; supported: {', '.join(sorted(_DTYPES))}") from None


# digests ------------------------------------------------------------------------------------------


def _sha256() -> Any:
    return hashlib.sha256()


DIGEST_ALGORITHMS: dict[str, Any] = {"xxh3-128": xxhash.xxh3_128, "blake3": blake3.blake3, "sha256": _sha256}
DEFAULT_DIGEST_ALGORITHM = "xxh3-128"  # what a publisher uses unless told otherwise (module docstring)


def _hasher(algorithm: str) -> Any:
    try:
        return DIGEST_ALGORITHMS[algorithm]()
    except KeyError:
        raise TransferError(
            f"digest algorithm {algorithm!r} is not known to this rolectl (a newer publisher?); "
            f"available: {', '.join(sorted(DIGEST_ALGORITHMS))}"
        ) from None


def digest_bytes(algorithm: str, parts: Sequence[memoryview | bytes]) -> bytes:
    """Digest of the concatenation of `parts` (hashed in place; nothing is joined)."""
    h = _hasher(algorithm)
    for part in parts:
        h.update(part)
    digest: bytes = h.digest()
    return digest


def root_digest(algorithm: str, layout: Layout, chunk_size: int, chunk_digests: Sequence[bytes]) -> str:
    """The version digest: hash of format, canonical header, chunk size and every chunk digest."""
    h = _hasher(algorithm)
    h.update(FORMAT.encode())
    h.update(json.dumps(layout.header(), sort_keys=True, separators=(",", ":")).encode())
    h.update(str(chunk_size).encode())
    for d in chunk_digests:
        h.update(d)
    return f"{algorithm}:{h.hexdigest()}"


# layout -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the stream: bytes [start, end) hold `shape` elements of `dtype` (safetensors name)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass(frozen=True)
class Layout:
    """Where each tensor's bytes lie in the logical stream; `specs` keep the caller's order."""

    specs: tuple[TensorSpec, ...]
    nbytes: int
    _by_start: tuple[TensorSpec, ...] = field(init=False, repr=False, compare=False)
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_start = tuple(sorted((s for s in self.specs if s.nbytes), key=lambda s: s.start))
        object.__setattr__(self, "_by_start", by_start)
        object.__setattr__(self, "_starts", tuple(s.start for s in by_start))

    def header(self) -> dict[str, dict[str, Any]]:
        """The safetensors-style header (JSON-ready), in the caller's tensor order."""
        return {
            s.name: {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [s.start, s.end]}
            for s in self.specs
        }

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> Layout:
        """Parse and validate a header from the wire: ValueError says which entry is wrong and how."""
        if not isinstance(header, Mapping):
            raise ValueError(f"header must be a JSON object, got {type(header).__name__}")
        specs = []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = str(entry["dtype"])
                shape = tuple(int(d) for d in entry["shape"])
                start, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"tensor {name!r}: malformed header entry {entry!r} ({exc})") from None
            torch_dtype = dtype_from_name(dtype)
            if any(d < 0 for d in shape):
                raise ValueError(f"tensor {name!r}: negative dimension in shape {shape}")
            expect = math.prod(shape) * torch_dtype.itemsize
            if end - start != expect or start < 0:
                raise ValueError(
                    f"tensor {name!r}: data_offsets [{start}, {end}] hold {end - start} bytes, "
                    f"but {dtype}{list(shape)} needs {expect}"
                )
            if start % torch_dtype.itemsize:
                raise ValueError(
                    f"tensor {name!r}: offset {start} is not a multiple of its element size "
                    f"{torch_dtype.itemsize} (not written by plan_layout)"
                )
            specs.append(TensorSpec(name, dtype, shape, start, end))
        position = 0
        for spec in sorted((s for s in specs if s.nbytes), key=lambda s: s.start):
            if spec.start != position:
                raise ValueError(
                    f"tensor {spec.name!r}: starts at byte {spec.start}, expected {position} "
                    "(tensors must cover the stream without gaps or overlaps)"
                )
            position = spec.end
        return cls(tuple(specs), position)

    def tensors_in(self, start: int, end: int) -> list[str]:
        """Names of the tensors whose bytes overlap [start, end) (for error messages)."""
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        names = []
        for spec in self._by_start[i:]:
            if spec.start >= end:
                break
            if spec.end > start:
                names.append(spec.name)
        return names

    def chunk_bounds(self, chunk_size: int) -> list[tuple[int, int]]:
        """[start, end) of each chunk of `chunk_size` bytes (the last may be short; none if empty)."""
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return [(a, min(a + chunk_size, self.nbytes)) for a in range(0, self.nbytes, chunk_size)]

    def chunk_bounds_at(self, chunk_size: int, index: int) -> tuple[int, int]:
        """[start, end) of chunk `index` (IndexError if there is no such chunk)."""
        start = index * chunk_size
        if index < 0 or start >= self.nbytes:
            raise IndexError(f"chunk {index} is out of range for {self.nbytes} bytes in {chunk_size}-byte chunks")
        return start, min(start + chunk_size, self.nbytes)


def _check_tensor(name: object, t: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {name!r}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
    if t.layout != torch.strided:
        raise TypeError(f"tensor {name!r} has layout {t.layout}; only dense (strided) tensors travel")


def plan_layout(tensors: Mapping[str, torch.Tensor]) -> Layout:
    """Offsets for `tensors`: largest element size first, then by name, so no offset needs padding."""
    for name, t in tensors.items():
        _check_tensor(name, t)
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    offsets: dict[str, tuple[int, int]] = {}
    position = 0
    for name, t in order:
        nbytes = t.numel() * t.element_size()
        offsets[name] = (position, position + nbytes)
        position += nbytes
    specs = tuple(
        TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), *offsets[name])
        for name, t in tensors.items()
    )
    return Layout(specs, position)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a CPU contiguous tensor's memory (copies only if it must)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # the one unavoidable copy for device tensors
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    # reshape(-1) of a contiguous tensor is a view; it lets 0-d tensors be viewed as bytes too.
    flat = t.contiguous().reshape(-1)
    # numpy's stubs do not declare ndarray a Buffer, which it is at runtime.
    return memoryview(flat.view(torch.uint8).numpy()).toreadonly()  # type: ignore[arg-type]


class SourceBytes:
    """A state dict seen as its logical byte stream, read in place (each tensor's own memory)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], layout: Layout | None = None):
        self.layout = layout if layout is not None else plan_layout(tensors)
        self._views: list[memoryview] = []
        self._starts: list[int] = []
        for spec in self.layout._by_start:
            view = _as_bytes(tensors[spec.name])
            if len(view) != spec.nbytes:
                raise ValueError(f"tensor {spec.name!r} has {len(view)} bytes, layout says {spec.nbytes}")
            self._views.append(view)
            self._starts.append(spec.start)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def segments(self, start: int, end: int) -> list[memoryview]:
        """Zero-copy views covering stream bytes [start, end), in order."""
        out: list[memoryview] = []
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while start < end and i < len(self._views):
            base, view = self._starts[i], self._views[i]
            lo, hi = start - base, min(end - base, len(view))
            if hi > lo:
                out.append(view[lo:hi])
                start = base + hi
            i += 1
        return out

    def read_into(self, start: int, out: memoryview) -> None:
        """Copy stream bytes [start, start + len(out)) into `out` (for transports that need one buffer)."""
        pos = 0
        for seg in self.segments(start, start + len(out)):
            out[pos : pos + len(seg)] = seg
            pos += len(seg)

    def chunk_digests(self, algorithm: str, chunk_size: int) -> list[bytes]:
        return [
            digest_bytes(algorithm, self.segments(a, b)) for a, b in self.layout.chunk_bounds(chunk_size)
        ]


class Destination:
    """Fresh storage for a layout: one flat uint8 buffer; each tensor is a typed view into it.

    Receivers write the stream straight into `view`; nothing is handed out until `tensors()` is
    called after every digest has been checked, so a failed transfer just drops the buffer.
    """

    def __init__(self, layout: Layout, *, pin_memory: bool = False, reuse: torch.Tensor | None = None):
        self.layout = layout
        if reuse is not None and reuse.numel() == layout.nbytes and reuse.is_pinned() == pin_memory:
            self.flat = reuse  # a buffer its last receiver gave back (SpareBuffer): no page to fault in
        else:
            self.flat = host_buffer(layout.nbytes, pin_memory=pin_memory)
        # numpy's stubs do not declare ndarray a Buffer, which it is at runtime.
        self.view = memoryview(self.flat.numpy()) if layout.nbytes else memoryview(bytearray())  # type: ignore[arg-type]

    def tensors(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The tensors, in the header's order: views of `flat` on CPU, copies on another device."""
        device = torch.device(device)
        flat = self.flat if device.type == "cpu" else self.flat.to(device, non_blocking=False)
        out = {}
        for spec in self.layout.specs:
            dtype = spec.torch_dtype
            out[spec.name] = flat[spec.start : spec.end].view(dtype).view(spec.shape)
        return out


# manifest -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What a receiver needs before the first byte: layout, chunking and digests of one version.

    `extra` carries transport-specific facts (e.g. the stream sequences of the chunks).
    """

    version: int
    layout: Layout
    chunk_size: int
    algorithm: str
    chunk_digests: tuple[bytes, ...]
    digest: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def chunks(self) -> list[tuple[int, int]]:
        return self.layout.chunk_bounds(self.chunk_size)

    def hasher(self) -> Any:
        """A fresh incremental hasher of this manifest's algorithm (update(), digest())."""
        return _hasher(self.algorithm)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "nbytes": self.nbytes,
            "chunk_size": self.chunk_size,
            "algorithm": self.algorithm,
            "digest": self.digest,
            "chunk_digests": [d.hex() for d in self.chunk_digests],
            "header": self.layout.header(),
            "extra": dict(self.extra),
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str) -> Manifest:
        """Parse and verify a manifest (its chunk list against its digest); CorruptWeights if bad."""
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {FORMAT!r}")
            layout = Layout.from_header(data["header"])
            manifest = cls(
                version=int(data["version"]),
                layout=layout,
                chunk_size=int(data["chunk_size"]),
                algorithm=str(data["algorithm"]),
                chunk_digests=tuple(bytes.fromhex(d) for d in data["chunk_digests"]),
                digest=str(data["digest"]),
                extra=dict(data.get("extra") or {}),
            )
            if int(data["nbytes"]) != layout.nbytes:
                raise ValueError(f"nbytes {data['nbytes']} but the header covers {layout.nbytes}")
            if len(manifest.chunk_digests) != len(manifest.chunks):
                raise ValueError(
                    f"{len(manifest.chunk_digests)} chunk digests for {len(manifest.chunks)} chunks"
                )
        except CorruptWeights:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptWeights(f"{where}: malformed manifest: {exc}") from None
        expect = root_digest(manifest.algorithm, layout, manifest.chunk_size, manifest.chunk_digests)
        if expect != manifest.digest:
            raise CorruptWeights(
                f"{where}: manifest chunk list hashes to {expect}, but the manifest says "
                f"{manifest.digest}; the manifest is corrupt, republish version {manifest.version}"
            )
        return manifest

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptWeights(f"{where}: manifest is not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise CorruptWeights(f"{where}: manifest is not a JSON object")
        return cls.from_json(parsed, where=where)

    def check_chunk(
        self, index: int, data: Sequence[memoryview | bytes], *, where: str, digest: bytes | None = None
    ) -> None:
        """Raise CorruptWeights naming the version, chunk and tensors if chunk `index` is wrong.

        `digest` is the chunk's digest when the receiver hashed it while it arrived (cache-hot).
        """
        start, end = self.layout.chunk_bounds_at(self.chunk_size, index)
        size = sum(len(p) for p in data)
        problem = None
        if size != end - start:
            problem = f"has {size} bytes, expected {end - start}"
        elif (digest if digest is not None else digest_bytes(self.algorithm, data)) != self.chunk_digests[index]:
            problem = f"{self.algorithm} digest mismatch"
        if problem:
            tensors = self.layout.tensors_in(start, end)
            shown = ", ".join(tensors[:5]) + (f" and {len(tensors) - 5} more" if len(tensors) > 5 else "")
            raise CorruptWeights(
                f"{where}: version {self.version} chunk {index} of {len(self.chunks)} "
                f"(bytes {start}..{end}, tensors {shown}) {problem}; no tensors were returned — "
                f"republish version {self.version} or fetch a newer one"
            )


def build_manifest(
    version: int,
    source: SourceBytes | Layout,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    algorithm: str | None = None,
    chunk_digests: Sequence[bytes] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Manifest:
    """The manifest of `source` (chunk digests computed unless given, e.g. hashed while sending; a
    bare `Layout` has no bytes to hash, so its digests must be given)."""
    algorithm = algorithm or DEFAULT_DIGEST_ALGORITHM
    layout = source if isinstance(source, Layout) else source.layout
    if chunk_digests is None:
        if isinstance(source, Layout):
            raise ValueError("build_manifest of a Layout needs the chunk_digests hashed while streaming")
        chunk_digests = source.chunk_digests(algorithm, chunk_size)
    digests = tuple(chunk_digests)
    return Manifest(
        version=version,
        layout=layout,
        chunk_size=chunk_size,
        algorithm=algorithm,
        chunk_digests=digests,
        digest=root_digest(algorithm, layout, chunk_size, digests),
        extra=dict(extra or {}),
    )


# streams ------------------------------------------------------------------------------------------

_ALIGN = 8  # the largest element size of a dtype that travels: an offset that is a multiple of it fits all


class StreamedChunks:
    """A bucket stream cut into the chunks of its logical byte stream, each hashed as it is made.

    Iterate `chunks()` once: it yields ``(index, parts, digest)`` in stream order, pulling the next
    bucket only when the chunk being filled needs it. `parts` are views of the tensors' own memory
    (or of a small copy, see below) and stay valid until the next chunk is asked for; send or write
    them before that. When the stream ends, `layout` and `chunk_digests` describe what was sent (see
    the module docstring for the placement rule).

    `planned`: the layout when it is known before the first byte (a mapping given whole: the stream
    must then bring the tensors in the planned order of offsets). Memory: the bucket being cut, at
    most one chunk copied out of the previous bucket (so the previous bucket can be freed while the
    next one is made), and the tensors held for the end (sizes not a multiple of 8 bytes; tiny ones).
    """

    def __init__(self, buckets: Iterable[WeightBucket], *, chunk_size: int, algorithm: str,
                 planned: Layout | None = None, where: str = "weights stream"):
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self._buckets = buckets
        self.chunk_size = chunk_size
        self.algorithm = algorithm
        self._planned = planned
        self._planned_by_name = {s.name: s for s in planned.specs} if planned is not None else {}
        self._where = where
        self._specs: list[TensorSpec] = []
        self._names: set[str] = set()
        self._held: list[tuple[str, torch.Tensor]] = []
        self._position = 0
        self._parts: list[memoryview] = []
        self._filled = 0
        self._index = 0
        self.chunk_digests: list[bytes] = []
        self.buckets_read = 0
        self._done = False

    @property
    def layout(self) -> Layout:
        """Where every tensor went; only once `chunks()` has run to its end."""
        if not self._done:
            raise RuntimeError(f"{self._where}: the layout is known only once the stream has ended")
        if self._planned is not None:
            return self._planned
        return Layout(tuple(self._specs), self._position)

    @property
    def nbytes(self) -> int:
        """Bytes placed so far (all of them once the stream has ended)."""
        return self._position

    def chunks(self) -> Generator[tuple[int, list[memoryview], bytes], None, None]:
        for bucket in self._buckets:
            self.buckets_read += 1
            yield from self._take_bucket(bucket)
            del bucket  # let the stream free this bucket while it makes the next
            if self._parts:
                # The open chunk's views would keep the bucket's tensors alive: copy them (< 1 chunk).
                self._parts = [memoryview(b"".join(self._parts))]
        if self._planned is not None:
            missing = sorted(set(self._planned_by_name) - self._names)
            if missing:
                raise ValueError(f"{self._where}: the stream ended without tensors {missing[:5]}")
        for name, tensor in sorted(self._held, key=lambda nt: (-nt[1].element_size(), nt[0])):
            yield from self._place(name, tensor)
        self._held = []
        if self._filled:
            yield self._emit()
        self._done = True

    def _take_bucket(self, bucket: WeightBucket) -> Iterator[tuple[int, list[memoryview], bytes]]:
        for name, tensor in bucket:
            yield from self._take(name, tensor)

    def _take(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[int, list[memoryview], bytes]]:
        _check_tensor(name, tensor)
        if name in self._names:
            raise ValueError(f"{self._where}: tensor {name!r} appears twice in the stream")
        self._names.add(name)
        if self._planned is None and (tensor.numel() * tensor.element_size()) % _ALIGN:
            dtype_name(tensor.dtype)  # an unsupported dtype fails now, not at the end
            self._held.append((name, tensor))  # it would misalign what follows: it goes last
            return
        yield from self._place(name, tensor)

    def _place(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[int, list[memoryview], bytes]]:
        view = _as_bytes(tensor)
        spec = TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape), self._position,
                          self._position + len(view))
        if self._planned is not None:
            want = self._planned_by_name.get(name)
            if want != spec:
                raise ValueError(f"{self._where}: tensor {name!r} arrived as {spec}, the plan says {want}")
        elif spec.start % max(tensor.element_size(), 1):
            raise AssertionError(f"{self._where}: {name!r} placed at misaligned offset {spec.start}")
        self._specs.append(spec)
        self._position = spec.end
        while len(view):
            take = min(len(view), self.chunk_size - self._filled)
            self._parts.append(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_size:
                yield self._emit()

    def _emit(self) -> tuple[int, list[memoryview], bytes]:
        parts, index = self._parts, self._index
        digest = digest_bytes(self.algorithm, parts)
        self.chunk_digests.append(digest)
        self._parts, self._filled, self._index = [], 0, index + 1
        return index, parts, digest



def streamed_chunks(weights: WeightsSource, *, chunk_size: int, algorithm: str,
                    where: str = "weights stream") -> StreamedChunks:
    """`StreamedChunks` of a bucket stream (a fresh one from a callable), or of a whole mapping in
    `plan_layout`'s order and layout (one tensor per bucket), so a mapping keeps the layout and
    digest it always had."""
    if isinstance(weights, Mapping):
        planned = plan_layout(weights)
        order = sorted(weights.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
        return StreamedChunks(([item] for item in order), chunk_size=chunk_size, algorithm=algorithm,
                              planned=planned, where=where)
    return StreamedChunks(as_buckets(weights), chunk_size=chunk_size, algorithm=algorithm, where=where)
