"""The archived history of a job's event stream: segment files with digests, written by the active
synchronizer before it trims the stream, and read back with the stream's live tail as one history.

Theory of operation
-------------------
After it saves a reducer snapshot at sequence S, the active synchronizer calls `archive_and_trim`:

1. the records after the newest archived segment, up to S, are read from the stream and written as
   one segment, `events-<first>-<last>.msgpack` (the rows of `rolectl export`'s msgpack format:
   seq, time_ms, subject, event), fsync'd and renamed into place;
2. its SHA-256 is written beside it, `<segment>.sha256`, the same way: a segment counts only once
   its digest is there (a kill -9 between the two leaves a segment that is ignored and written
   again);
3. only then is the stream purged below the first sequence not archived (never past S, and never
   the decision log's last message, which guards the next decision batch).

A kill -9 anywhere trims nothing that is not archived: the purge comes last and covers only what a
segment with its digest holds. A directory that cannot be written raises `ArchiveError` before any
purge. Reading (`read_archive`) checks every digest and stops at the first segment that does not
match, naming it.

Why files in the run directory and not an object-store bucket: the point is to move history out of
the JetStream store whose size it bounds; a bucket on the same server would fill the same disk.
Files sit beside the job's logs and checkpoints, are copied with them, and `rolectl replay --file`
tooling reads their rows. A job whose synchronizers run on several hosts needs the archive
directory on shared storage (or one host's copy read with `--archive`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from rolectl.sync_protocol import DecodeError, Recorded, from_plain, to_plain

from .connection import BusConnection
from .events import read_events
from .files import atomic_path

__all__ = ["ArchiveError", "Segment", "segments", "archived_upto", "write_segment", "read_segment",
           "read_archive", "read_range", "archive_and_trim"]

_NAME = re.compile(r"^events-(\d{12})-(\d{12})\.msgpack$")


class ArchiveError(Exception):
    """The archive cannot be written (nothing is trimmed then) or read (a segment is damaged)."""


@dataclass(frozen=True)
class Segment:
    """One archived run of the stream: records with sequences `first`..`last`."""

    path: Path
    first: int
    last: int

    @property
    def digest_path(self) -> Path:
        return self.path.with_name(self.path.name + ".sha256")


def segments(directory: Path) -> list[Segment]:
    """The complete segments in `directory` (those with their digest), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match and path.with_name(path.name + ".sha256").exists():
            found.append(Segment(path, int(match.group(1)), int(match.group(2))))
    return sorted(found, key=lambda s: (s.first, s.last))


def archived_upto(directory: Path) -> int:
    """The last stream sequence the archive holds (0 when it holds none)."""
    done = segments(directory)
    return done[-1].last if done else 0


def write_segment(directory: Path, records: list[Recorded]) -> Segment:
    """Write `records` (in stream order) as one segment with its digest; `ArchiveError` when the
    directory cannot be written (the caller then trims nothing)."""
    directory = Path(directory)
    segment = Segment(directory / f"events-{records[0].seq:012d}-{records[-1].seq:012d}.msgpack",
                      records[0].seq, records[-1].seq)
    packer = msgpack.Packer(use_bin_type=True)
    payload = b"".join(packer.pack({"seq": r.seq, "time_ms": r.time_ms, "subject": r.subject,
                                    "event": to_plain(r.event)}) for r in records)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(segment.path) as tmp:
            tmp.write_bytes(payload)
        with atomic_path(segment.digest_path) as tmp:  # last: the segment counts from here on
            tmp.write_text(hashlib.sha256(payload).hexdigest() + "\n")
    except OSError as exc:
        raise ArchiveError(f"cannot write archive segment {segment.path}: {exc.strerror or exc}; "
                           "make the directory writable (or point the job's run_dir at one that is)") from None
    return segment


def read_segment(segment: Segment) -> list[Recorded]:
    """The records of `segment`, after checking its digest (`ArchiveError` naming it otherwise)."""
    try:
        payload = segment.path.read_bytes()
        expected = segment.digest_path.read_text().strip()
    except OSError as exc:
        raise ArchiveError(f"cannot read archive segment {segment.path}: {exc.strerror or exc}") from None
    actual = hashlib.sha256(payload).hexdigest()
    if actual != expected:
        raise ArchiveError(
            f"archive segment {segment.path} (seq {segment.first}..{segment.last}) is damaged: its SHA-256 is "
            f"{actual}, {segment.digest_path.name} says {expected}. The history stops here rather than go on "
            "with a hole; restore the segment from a copy")
    records = []
    try:
        for row in _rows(payload):
            records.append(Recorded(seq=row["seq"], time_ms=row["time_ms"], event=from_plain(row["event"]),
                                    subject=row.get("subject")))
    except (DecodeError, KeyError, TypeError, ValueError) as exc:
        raise ArchiveError(f"archive segment {segment.path} has a record that does not decode: {exc}") from None
    return records


def _rows(payload: bytes) -> Iterator[Any]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(payload)
    yield from unpacker


def read_archive(directory: Path) -> list[Recorded]:
    """Every archived record, oldest first; `ArchiveError` at the first damaged segment."""
    records: list[Recorded] = []
    for segment in segments(directory):
        # Segments may overlap (a replica paused mid-archive finishes after its successor archived
        # further): they hold the same records of the same stream, so each sequence is taken once.
        last = records[-1].seq if records else 0
        records.extend(rec for rec in read_segment(segment) if rec.seq > last)
    return records


def read_range(directory: Path, first: int, last: int) -> list[Recorded]:
    """The archived records with sequences `first`..`last`, oldest first, reading only the segments
    that hold them: what a reader left behind by a trim fills its gap with. `ArchiveError` when the
    archive does not cover the whole range (a hole in the history: nobody may fold past it)."""
    records: list[Recorded] = []
    covered = first - 1  # the archive holds every sequence up to here
    for segment in segments(directory):
        if segment.last <= covered or segment.first > last:
            continue
        if segment.first > covered + 1:
            break
        # segments may overlap (see read_archive): each sequence is taken from the first that has it
        records.extend(rec for rec in read_segment(segment) if covered < rec.seq <= last)
        covered = max(covered, min(segment.last, last))
        if covered >= last:
            return records
    raise ArchiveError(
        f"records {first}..{last} were trimmed from the event stream and the archive in {directory} holds "
        f"them only up to {covered} (segments: {', '.join(s.path.name for s in segments(directory)) or 'none'}); "
        "point this process at the job's archive directory (run_dir or archive_dir on shared storage)")


async def archive_and_trim(conn: BusConnection, directory: Path, upto_seq: int, *, keep_from: int = 0) -> int:
    """Archive the stream's records up to `upto_seq` that the archive lacks, then purge the stream
    below the first sequence not archived (and below `keep_from`, when given: a message that must
    stay). Returns the stream's new first sequence (0 when nothing was purged). Raises `ArchiveError`
    (nothing purged) when the segment cannot be written."""
    name = conn.names.event_stream
    info = await conn.js.stream_info(name)
    start = max(archived_upto(directory) + 1, info.state.first_seq)
    if start <= upto_seq:
        records: list[Recorded] = []
        async with read_events(conn, from_seq=start, include_decisions=True, stop_at_end=True,
                               verify_identity=False) as reader:
            async for rec in reader:
                if rec.seq > upto_seq:
                    break
                records.append(rec)
        if records:
            write_segment(directory, records)
    trim_below = min(archived_upto(directory), upto_seq) + 1
    if keep_from:
        trim_below = min(trim_below, keep_from)
    if trim_below <= info.state.first_seq:
        return 0
    await conn.js.purge_stream(name, seq=trim_below)
    return trim_below
