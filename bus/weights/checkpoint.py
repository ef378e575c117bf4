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
- **Why our own writer.** ``safetensors.torch.save_file`` first turns every tensor into a Python
  ``bytes`` copy (2x the model in RAM) and refuses tensors that share memory (tied weights, or the
  views `fetch` returns). Writing the same format from the tensors' own memory avoids both; the
  tests load our files with the ``safetensors`` package to keep the format honest.
- **Verified fetch.** Each chunk is read into the destination and its digest checked while it is
  still in cache; the chunk list was checked against the root digest first. On any mismatch the
  caller gets `CorruptWeights` naming the file, chunk and tensors, and no tensors.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from rolectl.sync_protocol import SyncMethod

from ..files import atomic_path
from .base import CorruptWeights, TransferError, WeightsNotFound, WeightsRef
from .format import (
    DEFAULT_CHUNK_SIZE,
    FORMAT,
    Destination,
    Layout,
    Manifest,
    SourceBytes,
    default_digest_algorithm,
    digest_bytes,
    root_digest,
)

__all__ = ["CheckpointTransport"]

_FINAL = re.compile(r"^weights-v(\d{12})\.safetensors$")
_TEMP = re.compile(r"^\.weights-v(\d{12})\.safetensors\..+\.tmp$")
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
    ):
        self.root = Path(root_dir)
        self._chunk_size = chunk_size
        self._algorithm = algorithm or default_digest_algorithm()
        self._fsync = fsync
        self._closed = False

    def path_of(self, version: int) -> Path:
        return self.root / f"weights-v{int(version):012d}.safetensors"

    async def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightsRef:
        """Write `version` atomically (temp file, fsync, rename); returns once it is durable."""
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0 (the trainer step), got {version!r}")
        return await asyncio.to_thread(lambda: self._write(version, SourceBytes(tensors)))

    async def fetch(self, ref: WeightsRef, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Read `ref`'s file into fresh tensors, every chunk digest-checked; nothing on failure.

        On CPU the tensors are views into one fresh buffer, as with the object store.
        """
        self._check_open()
        dest = await asyncio.to_thread(self._read, ref)
        return dest.tensors(device)

    async def latest(self) -> WeightsRef | None:
        """The newest complete version on disk, or None (reads only its header)."""
        self._check_open()
        for version in reversed(await self.versions()):
            try:
                manifest = await asyncio.to_thread(self._read_manifest, self.path_of(version))
            except FileNotFoundError:
                continue  # pruned just now
            return self._ref(manifest)
        return None

    async def versions(self) -> list[int]:
        """Complete versions on disk, oldest first (temporary files are not versions)."""
        return sorted(v for v, _ in await asyncio.to_thread(self._scan, _FINAL))

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

    async def __aenter__(self) -> "CheckpointTransport":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # blocking work (runs in a worker thread) ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("checkpoint transport is closed; make a new CheckpointTransport")

    def _ref(self, manifest: Manifest) -> WeightsRef:
        return WeightsRef(
            version=manifest.version,
            location=str(self.path_of(manifest.version).resolve()),
            nbytes=manifest.nbytes,
            digest=manifest.digest,
        )

    def _write(self, version: int, source: SourceBytes) -> WeightsRef:
        self.root.mkdir(parents=True, exist_ok=True)
        layout, chunk_size, algorithm = source.layout, self._chunk_size, self._algorithm
        bounds = layout.chunk_bounds(chunk_size)
        # Header size must be known before the data, and the digests go in the header: hash first
        # (one cold pass), then write from the tensors' memory.
        digests = [digest_bytes(algorithm, source.segments(a, b)) for a, b in bounds]
        digest = root_digest(algorithm, layout, chunk_size, digests)
        header: dict[str, Any] = dict(layout.header())
        header["__metadata__"] = {
            "format": FORMAT,
            "version": str(version),
            "chunk_size": str(chunk_size),
            "algorithm": algorithm,
            "digest": digest,
            "chunk_digests": ",".join(d.hex() for d in digests),
        }
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # safetensors pads the header so the data is 8-aligned
        final = self.path_of(version)
        # atomic: readers see the old file or the whole new one (durable too, unless fsync=False)
        with atomic_path(final, fsync=self._fsync) as temp, open(temp, "wb", buffering=0) as f:
            _write_all(f, [struct.pack("<Q", len(blob)), blob])
            for a, b in bounds:
                _write_all(f, source.segments(a, b))
        return WeightsRef(version=version, location=str(final.resolve()), nbytes=layout.nbytes, digest=digest)

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
            dest = Destination(manifest.layout)
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
        complete = sorted(self._scan(_FINAL))
        if kept is not None:
            doomed = [(v, path) for v, path in complete if v not in kept]
            complete = [(v, path) for v, path in complete if v in kept]
        else:
            doomed = complete[: max(len(complete) - keep, 0)]
        for _, path in doomed:
            path.unlink(missing_ok=True)
        newest = complete[-1][0] if complete else -1
        for version, path in self._scan(_TEMP):
            if version < newest:  # a crashed writer's leftover; newer ones may be writes in progress
                path.unlink(missing_ok=True)
        return [v for v, _ in doomed]


def _write_all(f: io.FileIO, parts: Iterable[bytes | memoryview]) -> None:
    for part in parts:
        view = memoryview(part)
        while len(view):
            view = view[f.write(view) :]


def _read_into(f: io.FileIO, view: memoryview) -> int:
    pos = 0
    while pos < len(view):
        got = f.readinto(view[pos:])
        if not got:
            break
        pos += got
    return pos



