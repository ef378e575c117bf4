"""Files that are never seen half-written: the one atomic writer (temp file in the same directory,
fsync, rename over the final name, fsync the directory), used for checkpoints, role state and exports."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "atomic_directory", "write_bytes_atomic", "write_json_atomic", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename in directory `path` durable (a crash after it cannot bring the old name back)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str], *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `final` to write; when the block ends without an error the
    file is fsync'd and renamed over `final` (then the directory is fsync'd): a reader, or a restart
    after a crash, sees the old file or the whole new one. On an error the temporary file is removed.
    `fsync=False` keeps the atomicity and skips durability (tests, scratch files)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        if fsync:
            _fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a new empty directory beside `final` to fill; when the block ends without an error it
    takes the place of `final` (a directory of that name from before, e.g. a restart's export of the
    same step, is removed first), so nobody finds a half-written one there. On an error it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield tmp
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | os.PathLike[str], data: Any, *, fsync: bool = True) -> None:
    """Write `data` as JSON so that a reader (or a restart after a crash) sees old or new, never half."""
    write_bytes_atomic(path, json.dumps(data).encode(), fsync=fsync)
