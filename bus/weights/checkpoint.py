"""Checkpoint weight transport (`SyncMethod.CHECKPOINT`): one safetensors file per version in a shared dir.

Theory of operation
-------------------
- **Files.** Version N is ``<root>/weights-v<N, 12 digits>.safetensors``: a standard safetensors file
  (any safetensors reader loads it) whose ``__metadata__`` holds the digest tree of `format`
  (algorithm, chunk size, chunk digests, root digest). Tensors sit in `format.plan_layout` order,
  which safetensors accepts, so a reader can ``readinto`` the data region straight into one fresh
  buffer.
- **Atomic publish.** Written under a hidden temporary name in the same directory, fsync'd, renamed
  over the final name, then the directory is fsync'd: a reader sees the old file or the whole new
  one, never a partial version; a crashed writer leaves only a temporary file, which `prune` removes.
- **Streams.** `publish` takes a mapping or a bucket stream (see `base`). The data is written as the
  buckets come (each chunk hashed while it is in cache, then written from the tensors' memory), so
  the writer holds about one bucket. The header must precede the data but is known only at the end
  (offsets of a stream's tensors, every chunk digest): the data starts after room reserved for the
  header, and the header, padded with spaces to fill that room (JSON allows it; so does every
  safetensors reader), is written last, before the rename. A mapping's header size is known up
  front, so its room is exact (the file is what it always was). A stream's room is what the
  previous version's header needed plus an eighth, or `STREAM_HEADER_ROOM` for the first one; a
  header that does not fit (the first version of a very large model) is written to a new file
  followed by the data copied in the kernel (`os.copy_file_range`), once.
- **Why our own writer.** ``safetensors.torch.save_file`` first turns every tensor into a Python
  ``bytes`` copy (2x the model in RAM) and refuses tensors that share memory (tied weights, or the
  views `fetch` returns). Writing the same format from the tensors' own memory avoids both; the
  tests load our files with the ``safetensors`` package to keep the format honest.
- **Deltas.** With ``keyframe_interval`` K > 1 (see `delta`), a version that is not a keyframe is
  ``weights-v<N>.delta`` instead: each chunk's compressed XOR against the version before, back to
  back, then the manifest JSON (layout, digests of the version's own bytes, the delta facts), then
  its length as 8 bytes little-endian (the sizes are known only at the end). Written atomically like
  a keyframe. A keyframe is the safetensors file above, unchanged.
- **Verified fetch.** Each chunk is read into the destination and its digest checked while it is
  still in cache; the chunk list was checked against the root digest first. On any mismatch the
  caller gets `CorruptWeights` naming the file, chunk and tensors, and no tensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rolectl.sync_protocol import SyncMethod

from ..files import atomic_path
from .base import CorruptWeights, StoredVersion, TransferError, WeightsNotFound, WeightsRef, WeightsSource
from .delta import (
    ChunkDecoder,
    DeltaChunks,
    DeltaInfo,
    DeltaPublisher,
    HeldVersion,
    ParallelDecode,
    delta_info,
    stored_version,
)
from .format import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DIGEST_ALGORITHM,
    FORMAT,
    Destination,
    Layout,
    Manifest,
    build_manifest,
    digest_bytes,
    plan_layout,
    root_digest,
    streamed_chunks,
)
from .host_memory import SpareBuffer

__all__ = ["CheckpointTransport", "STREAM_HEADER_ROOM"]

STREAM_HEADER_ROOM = 256 * 1024  # room for a streamed version's header before its size is known

_FINAL = re.compile(r"^weights-v(\d{12})\.safetensors$")
_DELTA = re.compile(r"^weights-v(\d{12})\.delta$")
_TEMP = re.compile(r"^\.weights-v(\d{12})\.(?:safetensors|delta)\..+\.tmp$")
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the header size


class CheckpointTransport:
    """Publish / fetch weight versions as safetensors files under `root_dir` (a shared filesystem).

    The publisher calls `prune` to bound the directory. `fsync=False` skips the durability syncs
    (tests, tmpfs); atomicity does not depend on it.
    """

    method = SyncMethod.CHECKPOINT

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        algorithm: str | None = None,
        fsync: bool = True,
        keyframe_interval: int = 1,
        delta_codec: str | None = None,
    ):
        self.root = Path(root_dir)
        self._chunk_size = chunk_size
        self._algorithm = algorithm or DEFAULT_DIGEST_ALGORITHM
        self._fsync = fsync
        self._closed = False
        self._stream_room = STREAM_HEADER_ROOM
        self.header_rewrites = 0  # streamed versions whose header outgrew its room (tests read it)
        self._deltas = DeltaPublisher(keyframe_interval, delta_codec)
        self._spare = SpareBuffer()
        self._held: HeldVersion | None = None
        self.last_publish: dict[str, Any] = {}  # what the last publish stored (kind, bytes; see WeightsRef.stored)
        self.last_fetch: dict[str, Any] = {}  # how the last fetch got its version (route, bytes)

    def path_of(self, version: int) -> Path:
        return self.root / f"weights-v{int(version):012d}.safetensors"

    def delta_path_of(self, version: int) -> Path:
        return self.root / f"weights-v{int(version):012d}.delta"

    async def publish(self, version: int, tensors: WeightsSource) -> WeightsRef:
        """Write `version` (a mapping or a bucket stream, see `base`) atomically (temp file, fsync,
        rename); returns once it is durable. A stream is written as its buckets come."""
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0 (the trainer step), got {version!r}")
        return await asyncio.to_thread(self._write, version, tensors)

    async def fetch(self, ref: WeightsRef, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Read `ref`'s file into fresh tensors, every chunk digest-checked; nothing on failure.

        On CPU the tensors are views into one fresh buffer, as with the object store.
        """
        self._check_open()
        dest = await asyncio.to_thread(self._fetch, ref)
        return self._spare.hand_out(dest, device, reusable=not self._deltas.enabled)  # a held version is no spare

    def recycle(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """The caller is done with the tensors of the last CPU fetch (it copied them into its model):
        the next fetch of that size reads into their memory. Tensors of any other memory are left
        alone (False)."""
        return self._spare.give_back(tensors)

    async def latest(self) -> WeightsRef | None:
        """The newest complete version on disk, or None (reads only its header)."""
        self._check_open()
        for version in reversed(await self.versions()):
            try:
                manifest = await asyncio.to_thread(self._manifest_of, version)
            except FileNotFoundError:
                continue  # pruned just now
            return self._ref(manifest)
        return None

    async def versions(self) -> list[int]:
        """Complete versions on disk, oldest first (temporary files are not versions)."""
        return sorted({v for pattern in (_FINAL, _DELTA) for v, _ in await asyncio.to_thread(self._scan, pattern)})

    async def prune(self, keep: int = 2, *, announced: Iterable[int] | None = None) -> list[int]:
        """Delete all but the newest `keep` versions, and temp files older than the newest version.

        With `announced` (the versions the event stream announced), keep the newest `keep` of those
        and delete every other version file, whatever its number.
        """
        self._check_open()
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        kept = None
        if announced is not None:
            kept = set(sorted(set(announced))[-keep:]) if keep else set()
        return await asyncio.to_thread(self._prune, keep, kept)

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> CheckpointTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # blocking work (runs in a worker thread) ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("checkpoint transport is closed; make a new CheckpointTransport")

    def _ref(self, manifest: Manifest) -> WeightsRef:
        path = self.delta_path_of(manifest.version) if "delta" in manifest.extra else self.path_of(manifest.version)
        return WeightsRef(
            version=manifest.version,
            location=str(path.resolve()),
            nbytes=manifest.nbytes,
            digest=manifest.digest,
        )

    def _header(self, version: int, layout: Layout, digests: Sequence[bytes], digest: str) -> bytes:
        header: dict[str, Any] = dict(layout.header())
        header["__metadata__"] = {
            "format": FORMAT,
            "version": str(version),
            "chunk_size": str(self._chunk_size),
            "algorithm": self._algorithm,
            "digest": digest,
            "chunk_digests": ",".join(d.hex() for d in digests),
        }
        return json.dumps(header, separators=(",", ":")).encode()

    def _room(self, version: int, tensors: WeightsSource) -> int:
        """Bytes to reserve for the header: exact for a mapping (digests have a fixed length)."""
        if not isinstance(tensors, Mapping):
            return self._stream_room
        layout = plan_layout(tensors)
        size = len(digest_bytes(self._algorithm, []))
        chunks = len(layout.chunk_bounds(self._chunk_size))
        blob = self._header(version, layout, [bytes(size)] * chunks, f"{self._algorithm}:{'0' * 2 * size}")
        return len(blob) + (-len(blob) % 8)

    def _write(self, version: int, tensors: WeightsSource) -> WeightsRef:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_of(version)
        chunks = self._deltas.wrap(version, streamed_chunks(
            tensors, chunk_size=self._chunk_size, algorithm=self._algorithm,
            where=f"publish of version {version} to {final}"))
        if isinstance(chunks, DeltaChunks) and chunks.base is not None:
            return self._write_delta(version, chunks)
        room = self._room(version, tensors)
        # atomic: readers see the old file or the whole new one (durable too, unless fsync=False)
        with atomic_path(final, fsync=self._fsync) as temp:
            with open(temp, "wb", buffering=0) as f:
                f.seek(8 + room)  # the data first (safetensors aligns it to 8); the header last
                for _, parts, _ in chunks.chunks():
                    _write_all(f, parts)
                    del parts
                layout = chunks.layout
                digest = root_digest(self._algorithm, layout, self._chunk_size, chunks.chunk_digests)
                blob = self._header(version, layout, chunks.chunk_digests, digest)
                if len(blob) <= room:
                    f.seek(0)
                    _write_all(f, [struct.pack("<Q", room), blob, b" " * (room - len(blob))])
            if len(blob) > room:
                self._rewrite_with_header(temp, blob, room, layout.nbytes)
        if not isinstance(tensors, Mapping):
            grown = len(blob) + len(blob) // 8
            self._stream_room = max(self._stream_room, grown + (-grown % 8))
        self.delta_path_of(version).unlink(missing_ok=True)  # a republished version is this file alone
        self._deltas.commit(chunks, build_manifest(version, layout, chunk_size=self._chunk_size,
                                                   algorithm=self._algorithm, chunk_digests=chunks.chunk_digests))
        return self._published(version, final, layout.nbytes, digest, stored_version(chunks, layout.nbytes))

    def _write_delta(self, version: int, chunks: DeltaChunks) -> WeightsRef:
        """Write a delta version: the payloads, then the manifest, then its length (see the docstring)."""
        final = self.delta_path_of(version)
        with atomic_path(final, fsync=self._fsync) as temp:
            with open(temp, "wb", buffering=0) as f:
                for _, parts, _ in chunks.chunks():
                    _write_all(f, parts)
                    del parts
                manifest = build_manifest(version, chunks.layout, chunk_size=self._chunk_size,
                                          algorithm=self._algorithm, chunk_digests=chunks.chunk_digests,
                                          extra=chunks.manifest_extra())
                blob = manifest.to_bytes()
                _write_all(f, [blob, struct.pack("<Q", len(blob))])
        self.path_of(version).unlink(missing_ok=True)  # a republished version is this file alone
        self._deltas.commit(chunks, manifest)
        return self._published(version, final, manifest.nbytes, manifest.digest,
                               stored_version(chunks, manifest.nbytes))

    def _published(self, version: int, final: Path, nbytes: int, digest: str, stored: StoredVersion) -> WeightsRef:
        """The ref of a version just written to `final` (and `last_publish` saying how it was stored)."""
        self.last_publish = {"version": version, "nbytes": nbytes, **dataclasses.asdict(stored)}
        return WeightsRef(version=version, location=str(final.resolve()), nbytes=nbytes, digest=digest, stored=stored)

    def _read_delta_manifest(self, path: Path, f: io.FileIO | None = None) -> tuple[Manifest, DeltaInfo]:
        """Parse a delta file's trailing manifest (checked against its root digest) and delta facts."""
        own = f is None
        if f is None:
            f = open(path, "rb", buffering=0)
        try:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CorruptWeights(f"{path}: truncated ({size} bytes); republish this version")
            f.seek(size - 8)
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, _MAX_HEADER):
                raise CorruptWeights(f"{path}: manifest length {length} is not plausible; the file is corrupt")
            f.seek(size - 8 - length)
            manifest = Manifest.from_bytes(f.read(length), where=str(path))
            info = delta_info(manifest, where=str(path))
            if info is None:
                raise CorruptWeights(f"{path}: a delta file whose manifest has no delta facts; republish it")
            if info.stored_bytes != size - 8 - length:
                raise CorruptWeights(f"{path}: holds {size - 8 - length} bytes of chunks, its manifest says "
                                     f"{info.stored_bytes}; the file is corrupt")
            return manifest, info
        finally:
            if own:
                f.close()

    def _manifest_of(self, version: int) -> Manifest:
        """The manifest of `version`, keyframe or delta (FileNotFoundError if neither exists)."""
        delta = self.delta_path_of(version)
        if delta.exists():
            return self._read_delta_manifest(delta)[0]
        return self._read_manifest(self.path_of(version))

    def _fetch(self, ref: WeightsRef) -> Destination:
        """`ref` as a keyframe, as a delta on the held version, or rebuilt from its keyframe."""
        path = self.delta_path_of(ref.version)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            dest = self._read(ref)
            self.last_fetch = {"version": ref.version, "route": "full", "versions": [ref.version],
                               "bytes_moved": dest.layout.nbytes, "nbytes": dest.layout.nbytes, "refused": None}
            self._hold(ref, dest)
            return dest
        with f:
            manifest, info = self._read_delta_manifest(path, f)
            if manifest.version != ref.version:
                raise CorruptWeights(f"{path}: its manifest says version {manifest.version}, not {ref.version}")
            if manifest.digest != ref.digest:
                raise WeightsNotFound(
                    f"{path} holds digest {manifest.digest}, but the announced ref says {ref.digest}: "
                    "the version was republished; fetch the latest announced ref")
            held, refused = self._held, None
            if held is not None and held.is_base_of(info):
                self._held = None  # a failure below leaves nothing held
                dest = Destination(manifest.layout)
                self._apply_file(f, manifest, info, dest, held.view, path)
                route, moved, versions = "delta", info.stored_bytes, [ref.version]
            else:
                refused = (f"holds version {held.version}, the delta is on version {info.base}"
                           if held is not None else "holds no version")
                dest, moved, versions = self._rebuild(manifest, info, f, path)
                route = "keyframe"
        self.last_fetch = {"version": ref.version, "route": route, "versions": versions, "bytes_moved": moved,
                           "nbytes": manifest.nbytes, "refused": refused}
        self._hold(ref, dest)
        return dest

    def _hold(self, ref: WeightsRef, dest: Destination) -> None:
        self._held = HeldVersion(ref.version, ref.digest, dest.flat) if self._deltas.enabled else None

    def _apply_file(self, f: io.FileIO, manifest: Manifest, info: DeltaInfo, dest: Destination,
                    base: memoryview, path: Path) -> None:
        """Decode every chunk of the delta file `f` onto `base` into `dest`, each checked."""
        decoding = ParallelDecode(ChunkDecoder(manifest, info, dest.view, base, str(path)))
        try:
            f.seek(0)
            for index, size in enumerate(info.sizes):
                decoding.submit(index, f.read(size))
        except BaseException:
            decoding.abandon()
            raise
        decoding.finish()  # CorruptWeights of the first bad chunk

    def _rebuild(self, manifest: Manifest, info: DeltaInfo, f: io.FileIO,
                 path: Path) -> tuple[Destination, int, list[int]]:
        """Read the keyframe `manifest` descends from and apply each delta after it in place."""
        chain: list[tuple[Manifest, DeltaInfo, Path]] = [(manifest, info, path)]
        link = info
        while True:
            base_path = self.delta_path_of(link.base)
            base: Manifest | None
            base_info: DeltaInfo | None
            try:
                if base_path.exists():
                    base, base_info = self._read_delta_manifest(base_path)
                else:
                    base_path = self.path_of(link.base)
                    base, base_info = self._read_manifest(base_path), None
            except FileNotFoundError:
                base = None
            if base is None or base.digest != link.base_digest:
                raise WeightsNotFound(
                    f"version {manifest.version} is stored as a delta, and version {link.base} it builds on "
                    f"is not in {self.root} (pruned, or republished); fetch the latest announced version")
            if base_info is None:
                keyframe_manifest = base
                break
            chain.append((base, base_info, base_path))
            link = base_info
            if len(chain) > 10_000:
                raise CorruptWeights(f"{path}: the delta chain of version {manifest.version} does not end")
        chain.reverse()
        keyframe = self._read(self._ref(keyframe_manifest))
        moved = keyframe.layout.nbytes
        dest = keyframe
        for step, step_info, step_path in chain:
            if step.nbytes == dest.layout.nbytes:  # in place: the buffer is ours until handed out
                target = dest
                target.layout = step.layout
            else:
                target = Destination(step.layout)
            with open(step_path, "rb", buffering=0) as step_file:
                self._apply_file(step_file, step, step_info, target, dest.view, step_path)
            dest = target
            moved += step_info.stored_bytes
        return dest, moved, [keyframe_manifest.version] + [m.version for m, _, _ in chain]

    def tamper_delta_chunk_for_tests(self, version: int, index: int) -> None:
        """Flip one byte of delta chunk `index` of `version` (tests of corruption handling)."""
        path = self.delta_path_of(version)
        _, info = self._read_delta_manifest(path)
        offset = sum(info.sizes[:index]) + info.sizes[index] // 2
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))

    def _rewrite_with_header(self, temp: Path, blob: bytes, room: int, nbytes: int) -> None:
        """`temp` holds the data after `room` bytes too few for `blob`: a new `temp` with the header,
        then the data copied in the kernel."""
        self.header_rewrites += 1
        body = temp.with_name(temp.name + ".body.tmp")  # a temp name `prune` cleans after a crash
        os.replace(temp, body)
        try:
            padded = blob + b" " * (-len(blob) % 8)
            with open(body, "rb", buffering=0) as src, open(temp, "wb", buffering=0) as dst:
                _write_all(dst, [struct.pack("<Q", len(padded)), padded])
                _copy_range(src, dst, 8 + room, nbytes)
        finally:
            body.unlink(missing_ok=True)

    def _read_manifest(self, path: Path, f: io.FileIO | None = None) -> Manifest:
        """Parse (and check against its root digest) the header of a version file."""
        own = f is None
        if f is None:
            f = open(path, "rb", buffering=0)
        try:
            head = f.read(8)
            if len(head) != 8:
                raise CorruptWeights(f"{path}: truncated ({len(head)} bytes); republish this version")
            (size,) = struct.unpack("<Q", head)
            if size > _MAX_HEADER:
                raise CorruptWeights(f"{path}: header length {size} is not plausible; the file is corrupt")
            raw = f.read(size)
            try:
                header = json.loads(raw)
                meta = header.pop("__metadata__")
                data = {
                    "format": meta["format"],
                    "version": int(meta["version"]),
                    "nbytes": None,
                    "chunk_size": int(meta["chunk_size"]),
                    "algorithm": meta["algorithm"],
                    "digest": meta["digest"],
                    "chunk_digests": meta["chunk_digests"].split(",") if meta["chunk_digests"] else [],
                    "header": header,
                }
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CorruptWeights(
                    f"{path}: not a rolectl weights file (header/metadata unreadable: {exc}); "
                    "republish this version"
                ) from None
            # nbytes is implied by the header here; Manifest.from_json checks the rest.
            try:
                data["nbytes"] = Layout.from_header(header).nbytes
            except ValueError as exc:
                raise CorruptWeights(f"{path}: bad tensor header: {exc}") from None
            return Manifest.from_json(data, where=str(path))
        finally:
            if own:
                f.close()

    def _read(self, ref: WeightsRef) -> Destination:
        path = self.path_of(ref.version)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise WeightsNotFound(
                f"version {ref.version} is not in {self.root} (never published, or pruned); "
                "fetch the latest announced version"
            ) from None
        with f:
            manifest = self._read_manifest(path, f)
            if manifest.version != ref.version:
                raise CorruptWeights(f"{path}: metadata says version {manifest.version}, not {ref.version}")
            if manifest.digest != ref.digest:
                raise WeightsNotFound(
                    f"{path} holds digest {manifest.digest}, but the announced ref says {ref.digest}: "
                    "the version was republished; fetch the latest announced ref"
                )
            dest = Destination(manifest.layout, reuse=self._spare.take(manifest.nbytes, pin_memory=False))
            for index, (a, b) in enumerate(manifest.chunks):
                view = dest.view[a:b]
                got = _read_into(f, view)
                # Short chunks are reported by check_chunk with the tensors they hold.
                manifest.check_chunk(index, [view[:got]], where=str(path))
            if f.read(1):
                raise CorruptWeights(f"{path}: trailing bytes after the last tensor; the file is corrupt")
        return dest

    def _scan(self, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            m = pattern.match(name)
            if m:
                out.append((int(m.group(1)), self.root / name))
        return out

    def _prune(self, keep: int, kept: set[int] | None = None) -> list[int]:
        complete = sorted(self._scan(_FINAL) + self._scan(_DELTA))
        if kept is None:
            versions = sorted({v for v, _ in complete})
            kept = set(versions[max(len(versions) - keep, 0):])
        kept = kept | self._chains_of(kept)
        doomed = [(v, path) for v, path in complete if v not in kept]
        complete = [(v, path) for v, path in complete if v in kept]
        for _, path in doomed:
            path.unlink(missing_ok=True)
        newest = complete[-1][0] if complete else -1
        for version, path in self._scan(_TEMP):
            if version < newest:  # a crashed writer's leftover; newer ones may be writes in progress
                path.unlink(missing_ok=True)
        return sorted({v for v, _ in doomed})

    def _chains_of(self, versions: set[int]) -> set[int]:
        """The versions the deltas among `versions` build on, down to their keyframes."""
        needed: set[int] = set()
        for version in versions:
            path = self.delta_path_of(version)
            while True:
                try:
                    info = self._read_delta_manifest(path)[1]
                except (FileNotFoundError, CorruptWeights):
                    break
                if info.base in needed or info.base in versions:
                    break
                needed.add(info.base)
                path = self.delta_path_of(info.base)
        return needed


def _write_all(f: io.FileIO, parts: Iterable[bytes | memoryview]) -> None:
    for part in parts:
        view = memoryview(part)
        while len(view):
            view = view[f.write(view) :]


def _copy_range(src: io.FileIO, dst: io.FileIO, offset: int, count: int) -> None:
    """Append `count` bytes of `src` from `offset` to `dst`, in the kernel where it can."""
    try:
        while count:
            got = os.copy_file_range(src.fileno(), dst.fileno(), count, offset)
            if not got:
                raise CorruptWeights(f"{src.name}: ended {count} bytes early while being copied")
            offset += got
            count -= got
        return
    except (AttributeError, OSError):  # no copy_file_range here (another OS, an old kernel, some filesystems)
        pass
    src.seek(offset)
    buf = memoryview(bytearray(min(count, 8 << 20)))
    while count:
        got = src.readinto(buf[: min(count, len(buf))])
        if not got:
            raise CorruptWeights(f"{src.name}: ended {count} bytes early while being copied")
        _write_all(dst, [buf[:got]])
        count -= got


def _read_into(f: io.FileIO, view: memoryview) -> int:
    pos = 0
    while pos < len(view):
        got = f.readinto(view[pos:])
        if not got:
            break
        pos += got
    return pos



