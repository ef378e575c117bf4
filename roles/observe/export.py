"""Export a job's stream to a file and read it back: from NATS (`read_job`, `export_job`) to
`.jsonl` / `.msgpack` (`write_export`) and back to records (`load_export`).

File formats (the suffix picks):

- ``.jsonl``: one JSON object per line, ``{"seq", "time_ms", "subject", "event"}`` where ``event``
  is `sync_protocol.to_plain(event)`; the decisions of a batch (one stream message) are one line
  each, in recorded order, with the message's sequence;
- ``.msgpack``: a stream of msgpack maps with the same keys.

``subject`` is the subject the stream recorded the message on (not one derived from its payload:
the subject is the evidence of who published it). It is optional on reading (older exports).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack

from rolectl.bus.archive import read_archive
from rolectl.bus.connection import connect
from rolectl.bus.events import last_sequence, read_all
from rolectl.bus.files import atomic_path
from rolectl.bus.snapshots import SnapshotStore
from rolectl.bus.subjects import JobNames
from rolectl.sync_protocol import Decision, DecodeError, Recorded, from_plain, to_plain
from rolectl.sync_protocol.state import State

__all__ = [
    "EXPORT_SUFFIXES",
    "ExportError",
    "export_job",
    "load_export",
    "read_history",
    "read_job",
    "read_job_from_snapshot",
    "write_export",
]


EXPORT_SUFFIXES = (".jsonl", ".msgpack")


class ExportError(ValueError):
    """An export file cannot be written or read: names the file, the line (or record) and the fix."""


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in EXPORT_SUFFIXES:
        raise ExportError(f"{path}: unknown export format {suffix or '(no suffix)'!r}; "
                          f"name the file *.jsonl (JSON lines) or *.msgpack")
    return suffix


def _subject(job: str | None, rec: Recorded) -> str | None:
    # The recorded subject when the reader gave one; else (records built in memory) the subject the
    # event belongs on, a pure function of the event and the job.
    if rec.subject is not None:
        return rec.subject
    if job is None:
        return None
    names = JobNames(job)
    event = rec.event
    if isinstance(event, Decision):
        return names.decision_log
    return names.event(event.member.role, event.member.id, event.KIND)


def _row(rec: Recorded, job: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"seq": rec.seq, "time_ms": rec.time_ms}
    subject = _subject(job, rec)
    if subject is not None:
        row["subject"] = subject
    row["event"] = to_plain(rec.event)
    return row


def write_export(records: Iterable[Recorded], path: str | Path, *, job: str | None = None) -> int:
    """Write records to `path` (.jsonl or .msgpack) atomically; returns how many were written."""
    path = Path(path)
    suffix = _suffix(path)
    n = 0
    try:
        with atomic_path(path) as tmp:  # a reader never sees half a file
            if suffix == ".jsonl":
                with open(tmp, "w", encoding="utf-8") as fh:
                    for rec in records:
                        fh.write(json.dumps(_row(rec, job), separators=(",", ":")) + "\n")
                        n += 1
            else:
                packer = msgpack.Packer(use_bin_type=True)
                with open(tmp, "wb") as fh:
                    for rec in records:
                        fh.write(packer.pack(_row(rec, job)))
                        n += 1
    except OSError as exc:
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    return n


async def read_history(conn, archive_dir: Path | None, *, verify_identity: bool = True) -> list[Recorded]:
    """The job's history as one: the archived segments in `archive_dir` (digests checked; a damaged
    one raises `bus.archive.ArchiveError` naming it), then the stream's records after them."""
    archived = read_archive(archive_dir) if archive_dir is not None else []
    tail = await read_all(conn, verify_identity=verify_identity)
    if not archived:
        return tail
    last = archived[-1].seq
    return archived + [rec for rec in tail if rec.seq > last]


async def read_job(job: str, nats: str, *, connect_timeout: float = 5.0, security=None,
                   archive_dir: Path | None = None) -> list[Recorded]:
    """Every record of the job (its archive, when given, then its stream) up to the stream's end as
    of now. Raises `bus.errors.BusError`, or `bus.archive.ArchiveError` for a damaged segment."""
    async with connect(nats, job=job, role="observer", member=f"export-{os.getpid()}",
                       connect_timeout=connect_timeout, security=security) as conn:
        await last_sequence(conn)  # a clear error when the job has no stream
        # Forged records are kept, with their real subject: they are evidence, and --check names them.
        return await read_history(conn, archive_dir, verify_identity=False)


async def export_job(job: str, nats: str, path: Path, *, security=None, archive_dir: Path | None = None) -> int:
    """Write the job's recorded events and decisions (stream seq, server time, subject) to `path`.

    The suffix picks the format (.jsonl or .msgpack). Returns the number of records written.
    Raises `ExportError` for a bad path and `bus.errors.BusError` when NATS or the job is missing.
    """
    path = Path(path)
    _suffix(path)  # fail before reading a long stream
    records = await read_job(job, nats, security=security, archive_dir=archive_dir)
    return write_export(records, path, job=job)


def _record(row: Any, where: str) -> Recorded:
    if not isinstance(row, dict):
        raise ExportError(f"{where}: expected an object with seq, time_ms and event, got {type(row).__name__}")
    missing = [k for k in ("seq", "time_ms", "event") if k not in row]
    if missing:
        raise ExportError(f"{where}: missing {', '.join(missing)} (each record needs seq, time_ms and event)")
    for key in ("seq", "time_ms"):
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ExportError(f"{where}: {key} must be a non-negative integer, got {value!r}")
    if row["seq"] == 0:
        raise ExportError(f"{where}: seq must be >= 1 (stream sequences start at 1)")
    try:
        event = from_plain(row["event"])
    except DecodeError as exc:
        raise ExportError(f"{where} (seq {row['seq']}): bad event: {exc}") from None
    subject = row.get("subject")
    if subject is not None and not isinstance(subject, str):
        raise ExportError(f"{where} (seq {row['seq']}): subject must be a string, got {subject!r}")
    return Recorded(seq=row["seq"], time_ms=row["time_ms"], event=event, subject=subject)


def load_export(path: str | Path) -> list[Recorded]:
    """Read an export (.jsonl or .msgpack) back into records, in file order.

    Raises `ExportError` naming the file, the line (JSON) or record number (msgpack), and what is
    wrong: not JSON/msgpack, a missing or mistyped field, an unknown event kind, or sequences that
    do not increase.
    """
    path = Path(path)
    suffix = _suffix(path)
    records: list[Recorded] = []
    try:
        if suffix == ".jsonl":
            with open(path, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ExportError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
                    records.append(_record(row, where))
        else:
            with open(path, "rb") as fh:
                unpacker = msgpack.Unpacker(fh, raw=False, strict_map_key=False)
                index = 0
                try:
                    for row in unpacker:
                        index += 1
                        records.append(_record(row, f"{path}: record {index}"))
                except (msgpack.UnpackException, ValueError) as exc:
                    if isinstance(exc, ExportError):
                        raise
                    raise ExportError(f"{path}: record {index + 1} is not msgpack ({exc})") from None
    except OSError as exc:
        raise ExportError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ExportError(f"{path}: not UTF-8 text ({exc.reason}); is it a .msgpack file named .jsonl?") from None
    for before, after in itertools.pairwise(records):
        # one stream message may hold a batch of decisions: they share its sequence
        batched = (after.seq == before.seq and isinstance(before.event, Decision)
                   and isinstance(after.event, Decision))
        if after.seq <= before.seq and not batched:
            raise ExportError(f"{path}: sequence {after.seq} follows {before.seq}; records must be in "
                              "increasing stream order (was the file edited or concatenated?)")
    return records


async def read_job_from_snapshot(job: str, nats: str, *, security=None, archive_dir: Path | None = None
                                 ) -> tuple[list[Recorded], State | None]:
    """The job's history (archive, when given, and stream), and the reducer snapshot to fold it
    from when it no longer starts at the first record (trimmed, and not archived where we look)."""
    async with connect(nats, job=job, role="observer", member=f"replay-{os.getpid()}",
                       security=security) as conn:
        await last_sequence(conn)  # a clear error when the job has no stream
        records = await read_history(conn, archive_dir)
        if not records or records[0].seq <= 1:
            return records, None
        snapshot = await SnapshotStore(conn).latest()
        if snapshot is None or snapshot.state.last_seq + 1 < records[0].seq:
            raise ExportError(f"the stream of job {job} starts at seq {records[0].seq} (trimmed) and no "
                              "snapshot covers what was trimmed: the job's state cannot be rebuilt; "
                              "pass the job's archive (--archive RUN_DIR/JOB/archive)")
        return records, snapshot.state
