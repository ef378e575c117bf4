"""Record and replay a job: export its stream to a file, fold it into a readable timeline, and check
that every recorded decision is exactly what the pure reducer recomputes from the recorded inputs.

File formats (`export_job` writes, `load_export` reads; the suffix picks):

- ``.jsonl``: one JSON object per line, ``{"seq", "time_ms", "subject", "event"}`` where ``event``
  is `sync_protocol.to_plain(event)`; the decisions of a batch (one stream message) are one line
  each, in recorded order, with the message's sequence;
- ``.msgpack``: a stream of msgpack maps with the same keys.

``subject`` is the subject the stream recorded the message on (not one derived from its payload:
the subject is the evidence of who published it). It is optional on reading (older exports).

`check_decisions` is the strongest test of the core: the synchronizer is stateless, so its decisions
must be a pure function of the inputs before them. It folds the recorded inputs with the reducer
(skipping illegal ones as the synchronizer does), lines the recomputed decisions up with the recorded
ones by identity (kind, round, cause_seq, released member) and reports the first difference. A record
whose subject does not vouch for its payload (`bus.subjects.identity_problem`: a member speaking for
another, a decision outside `.sync.`) is a failure too, named by its sequence; it is left out of the
fold, as the live reader leaves it out.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import msgpack
from rich.console import Console

from rolectl.bus.connection import connect
from rolectl.bus.errors import BusError
from rolectl.bus.events import last_sequence, read_all
from rolectl.bus.files import atomic_path
from rolectl.bus.logging import setup_logging
from rolectl.bus.security import redact
from rolectl.bus.snapshots import SnapshotStore
from rolectl.bus.subjects import JobNames, identity_problem

from rolectl.roles.observe.observer import JobObserver, JobOutcome
from rolectl.sync_protocol import (
    Decision,
    DecodeError,
    Recorded,
    decision_identity,
    from_plain,
    to_plain,
)
from rolectl.sync_protocol.reducer import fold_lenient
from rolectl.sync_protocol.state import State

__all__ = [
    "EXPORT_SUFFIXES",
    "ExportError",
    "Mismatch",
    "export_job",
    "read_job",
    "write_export",
    "load_export",
    "parse_until",
    "cut",
    "build_timeline",
    "check_decisions",
    "decision_identity",
    "observe",
    "job_outcome",
    "summarize",
    "run_replay",
]

EXPORT_SUFFIXES = (".jsonl", ".msgpack")


class ExportError(ValueError):
    """An export file cannot be written or read: names the file, the line (or record) and the fix."""


# --------------------------------------------------------------------------------------------------
# export


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


async def read_job(job: str, nats: str, *, connect_timeout: float = 5.0, security=None) -> list[Recorded]:
    """Every record of the job's stream up to its end as of now. Raises `bus.errors.BusError`."""
    async with connect(nats, job=job, role="observer", member=f"export-{os.getpid()}",
                       connect_timeout=connect_timeout, security=security) as conn:
        await last_sequence(conn)  # a clear error when the job has no stream
        # Forged records are kept, with their real subject: they are evidence, and --check names them.
        return await read_all(conn, verify_identity=False)


async def export_job(job: str, nats: str, path: Path, *, security=None) -> int:
    """Write the job's recorded events and decisions (stream seq, server time, subject) to `path`.

    The suffix picks the format (.jsonl or .msgpack). Returns the number of records written.
    Raises `ExportError` for a bad path and `bus.errors.BusError` when NATS or the job is missing.
    """
    path = Path(path)
    _suffix(path)  # fail before reading a long stream
    records = await read_job(job, nats, security=security)
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
    for before, after in zip(records, records[1:]):
        # one stream message may hold a batch of decisions: they share its sequence
        batched = (after.seq == before.seq and isinstance(before.event, Decision)
                   and isinstance(after.event, Decision))
        if after.seq <= before.seq and not batched:
            raise ExportError(f"{path}: sequence {after.seq} follows {before.seq}; records must be in "
                              "increasing stream order (was the file edited or concatenated?)")
    return records


# --------------------------------------------------------------------------------------------------
# --until


def parse_until(text: str | None) -> int | _dt.datetime | None:
    """`--until`: a stream sequence ("120") or an ISO 8601 time ("2026-11-22T12:00:00Z"; naive = UTC)."""
    if text is None:
        return None
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        moment = _dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"--until {text!r} is neither a stream sequence (e.g. 120) nor an ISO 8601 "
                         "time (e.g. 2026-11-22T12:00:00Z)") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=_dt.timezone.utc)


def cut(records: list[Recorded], until: int | _dt.datetime | None) -> list[Recorded]:
    """The records at or before `until` (a stream sequence or a time)."""
    if until is None:
        return list(records)
    if isinstance(until, _dt.datetime):
        limit_ms = int(until.timestamp() * 1000)
        return [r for r in records if r.time_ms <= limit_ms]
    return [r for r in records if r.seq <= until]


# --------------------------------------------------------------------------------------------------
# timeline


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def build_timeline(records: list[Recorded], until: int | _dt.datetime | str | None = None) -> dict[str, Any]:
    """Fold `records` (up to `until`) into a JSON-ready timeline: rounds, versions, members at the end.

    Rounds come from the recorded decisions; a recording without any decision (inputs only) shows
    the decisions the reducer computes instead (`decisions_source` says which).
    """
    if isinstance(until, str):
        until = parse_until(until)
    records = cut(records, until)
    recorded_decisions = any(isinstance(r.event, Decision) for r in records)
    observer = JobObserver(apply_computed=not recorded_decisions, log_tail=0, max_rounds=10**9,
                           max_points=10**9).extend(records)
    state = observer.state
    end_ms = observer.last_time_ms
    members = observer.members(end_ms)
    for row in members:
        row["last_seen"] = _iso(row["last_seen_ms"])
    rounds = []
    for view in observer.rounds.values():
        row = view.to_json()
        row["opened_at"] = _iso(view.opened_at_ms)
        row["closed_at"] = _iso(view.closed_at_ms)
        rounds.append(row)
    return {
        "records": len(records),
        "first_seq": records[0].seq if records else None,
        "last_seq": records[-1].seq if records else None,
        "first_time": _iso(observer.first_time_ms),
        "last_time": _iso(end_ms),
        "until": (until.isoformat() if isinstance(until, _dt.datetime) else until),
        "decisions_source": "recorded" if recorded_decisions else "recomputed",
        "config": state.config.to_mapping() if state.config else None,
        "latest": observer.latest(),
        "versions": [vars(v) | {"at": _iso(v.time_ms)} for v in observer.versions],
        "rounds": rounds,
        "open_rounds": sorted(state.rounds),
        "members": members,
        "illegal_inputs": [{"seq": seq, "reason": reason} for seq, reason in observer.illegal],
        "background_transfers": [vars(t) | {"gbps": t.gbps} for t in observer.background_transfers],
    }


# --------------------------------------------------------------------------------------------------
# --check


@dataclass(frozen=True)
class Mismatch:
    """One difference between recorded and recomputed decisions.

    `kind`: "field" (same decision, a field differs), "unexpected" (recorded, never recomputed),
    "missing" (recomputed, never recorded), "order" (both exist, recorded out of their round's order),
    "duplicate" (recorded twice), "subject" (a record whose subject does not vouch for its payload;
    `recorded` says why). `seq` is the recorded stream sequence (for "missing": the seq of
    the input that causes it). `warning` is True for a decision the recording was plausibly cut
    before (caused by one of the last inputs, no later decision recorded): not a failure.
    """

    kind: str
    seq: int
    identity: tuple[str, int, int, str]
    field: str | None = None
    recorded: Any = None
    recomputed: Any = None
    warning: bool = False

    def describe(self) -> str:
        kind, rnd, cause, released = self.identity
        who = f" for {released}" if released else ""
        name = f"{kind} of round {rnd}{who} (caused by seq {cause})"
        if self.kind == "subject":
            return f"seq {self.seq}: {self.recorded} (a forged or misplaced record; readers reject it)"
        if self.kind == "field":
            return (f"seq {self.seq}: {name}: field {self.field!r} recorded {self.recorded!r} "
                    f"but the reducer computes {self.recomputed!r}")
        if self.kind == "unexpected":
            return f"seq {self.seq}: {name} was recorded but the reducer never computes it"
        if self.kind == "duplicate":
            return f"seq {self.seq}: {name} was recorded again (first at seq {self.recorded})"
        if self.kind == "order":
            return (f"seq {self.seq}: {name} was recorded out of order: after {self.recomputed}, which "
                    "the reducer computes later in the same round")
        if self.warning:
            return (f"after seq {self.seq}: {name} is computed but not recorded; the recording probably "
                    "ended before the synchronizer published it")
        return f"seq {self.seq}: {name} is computed but was never recorded"


def _diff_fields(recorded: Decision, computed: Decision) -> tuple[str, Any, Any] | None:
    a, b = to_plain(recorded), to_plain(computed)
    for key in b:
        if a.get(key) != b[key]:
            return key, a.get(key), b[key]
    for key in a:
        if key not in b:
            return key, a[key], None
    return None


def observe(records: list[Recorded], start: State | None = None, **options) -> JobObserver:
    """Fold `records` (from snapshot `start` if given) into the one observer every reader shares.
    Records whose subject does not vouch for their payload are left out, as the live reader leaves
    them out: a forged "finished" counts for nothing. `options` go to `JobObserver`."""
    observer = JobObserver(start=start, **{"log_tail": 0, "max_rounds": 10**9, "max_points": 10**9, **options})
    return observer.extend(_verified(sorted(records, key=lambda r: r.seq))[0])


def job_outcome(records: list[Recorded], start: State | None = None) -> JobOutcome:
    """How the job stands or ended, folding the records as the synchronizer does."""
    return observe(records, start).outcome()


def summarize(records: list[Recorded], *, job: str) -> dict[str, Any]:
    """The run's figures (`JobObserver.summary`), from the recorded stream alone."""
    return observe(records).summary(job=job)


def check_decisions(records: list[Recorded], start: State | None = None) -> list[Mismatch]:
    """Recompute every decision from the recorded inputs and compare with the recorded decisions.

    From a reducer snapshot `start` (a trimmed stream), only the records after it are folded, and
    recorded decisions caused by inputs the snapshot already holds are not checked.
    Returns the mismatches (and warnings) sorted by stream sequence; empty when all agree.
    """
    records = sorted(records, key=lambda r: r.seq)
    out: list[Mismatch] = []
    records, forged = _verified(records)
    for rec, problem in forged:
        ev = rec.event
        out.append(Mismatch("subject", rec.seq, (ev.KIND, getattr(ev, "round", None) or 0, rec.seq, ""),
                            recorded=problem))
    if start is not None:
        records = [r for r in records if r.seq > start.last_seq and not (
            isinstance(r.event, Decision) and r.event.cause_seq <= start.last_seq)]
    # illegal inputs are skipped, as live
    _, computed, _ = fold_lenient((r for r in records if not isinstance(r.event, Decision)), start)
    recorded = [(r.seq, r.event) for r in records if isinstance(r.event, Decision)]

    index = {}
    for i, d in enumerate(computed):
        index.setdefault(decision_identity(d), i)
    seen: dict[tuple, int] = {}
    matched: list[tuple[int, int]] = []  # (recorded seq, computed index), in recorded order
    for seq, d in recorded:
        ident = decision_identity(d)
        if ident in seen:
            out.append(Mismatch("duplicate", seq, ident, recorded=seen[ident]))
            continue
        seen[ident] = seq
        i = index.get(ident)
        if i is None:
            out.append(Mismatch("unexpected", seq, ident))
            continue
        matched.append((seq, i))
        diff = _diff_fields(d, computed[i])
        if diff is not None:
            out.append(Mismatch("field", seq, ident, field=diff[0], recorded=diff[1], recomputed=diff[2]))
    # Order: each round's decisions must appear in the order the reducer computes them. Rounds are
    # held to nothing more: the decision log records all of them in computed order, but a build
    # before schema 4 guarded each round's subject alone, and a batch it had to retry (a lost ack, a
    # server restart) may have landed after a later round's, which changes nothing anyone reads.
    highest = -1
    highest_in_round: dict[int, int] = {}
    for seq, i in matched:
        round_id = computed[i].round
        before = highest_in_round.get(round_id, -1)
        if i < before:
            prev = decision_identity(computed[before])
            out.append(Mismatch("order", seq, decision_identity(computed[i]),
                                recomputed=f"{prev[0]} of round {prev[1]} (caused by seq {prev[2]})"))
        highest_in_round[round_id] = max(before, i)
        highest = max(highest, i)
    # Missing: a warning only when nothing after it was recorded (the recording was cut first).
    last_cause = max((d.cause_seq for _, d in recorded), default=0)
    for i, d in enumerate(computed):
        ident = decision_identity(d)
        if ident in seen:
            continue
        cut_off = i > highest and d.cause_seq >= last_cause
        out.append(Mismatch("missing", d.cause_seq, ident, recomputed=to_plain(d), warning=cut_off))
    out.sort(key=lambda m: (m.seq, m.warning))
    return out


def _verified(records: list[Recorded]) -> tuple[list[Recorded], list[tuple[Recorded, str]]]:
    """The records the live reader would fold, and the rejected ones with the reason."""
    kept, forged = [], []
    for rec in records:
        problem = identity_problem(rec.subject, rec.event) if rec.subject is not None else None
        if problem is None:
            kept.append(rec)
        else:
            forged.append((rec, problem))
    return kept, forged


# --------------------------------------------------------------------------------------------------
# `rolectl replay`


def _load(job: str | None, nats: str, file: str | Path | None,
          security=None) -> tuple[list[Recorded], State | None]:
    """The records, and the reducer snapshot to fold them from when the job's stream no longer
    starts at its first record (trimmed by age or size): None when the records are complete."""
    if file is not None:
        records = load_export(file)
        if not records:  # nothing to replay is not a replay that passed
            raise ExportError(f"{file} holds no records: write one with `rolectl export --job JOB -o FILE` "
                              "(or use the events.jsonl in a `rolectl up` run directory)")
        return records, None
    return asyncio.run(read_job_from_snapshot(job, nats, security=security))


async def read_job_from_snapshot(job: str, nats: str, *, security=None) -> tuple[list[Recorded], State | None]:
    async with connect(nats, job=job, role="observer", member=f"replay-{os.getpid()}",
                       security=security) as conn:
        await last_sequence(conn)  # a clear error when the job has no stream
        records = await read_all(conn)
        if not records or records[0].seq <= 1:
            return records, None
        snapshot = await SnapshotStore(conn).latest()
        if snapshot is None or snapshot.state.last_seq + 1 < records[0].seq:
            raise ExportError(f"the stream of job {job} starts at seq {records[0].seq} (trimmed) and no "
                              "snapshot covers what was trimmed: the job's state cannot be rebuilt")
        return records, snapshot.state


def run_replay(*, job: str | None, nats: str, file: str | Path | None, until: str | None, check: bool,
               as_json: bool, security=None) -> int:
    """`rolectl replay`: 0 when fine (and, with `check`, every decision matches and the job did not
    end short of its last step), 1 on a mismatch or an incomplete job or when NATS or the job cannot
    be reached (as every command: roles.runner.EXIT_CODES), 2 when the input is wrong (a bad or empty
    file, a bad --until, a job name that cannot be one)."""
    setup_logging("warning")  # stdout is for the timeline (and JSON); logs go to stderr
    err = Console(stderr=True)
    try:
        moment = parse_until(until)
        records, start = _load(job, nats, file, security)
    except BusError as exc:
        err.print(f"rolectl replay: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        return 1
    except (ExportError, ValueError) as exc:
        err.print(f"rolectl replay: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        return 2
    records = cut(records, moment)
    timeline = build_timeline(_verified(records)[0])  # the state members saw: forged records left out
    timeline["until"] = until
    timeline["source"] = str(file) if file is not None else f"job {job} on {redact(nats)}"
    mismatches = check_decisions(records, start) if check else []
    errors = [m for m in mismatches if not m.warning]
    outcome = job_outcome(records, start)
    # a job that ended short of its last step is a failed job, even when every decision matches
    failed = bool(errors) or (check and moment is None and outcome.status == "incomplete")
    if as_json:
        timeline["outcome"] = {"status": outcome.status, "reason": outcome.reason}
        if check:
            timeline["check"] = {
                "ok": not failed,
                "mismatches": [{**vars(m), "identity": list(m.identity), "message": m.describe()}
                               for m in mismatches],
            }
        json.dump(timeline, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        _print_timeline(timeline)
        if check:
            _print_check(records, mismatches)
        style = {"complete": "green", "running": "yellow"}.get(outcome.status, "bold red")
        err.print(f"job {outcome.status}: {outcome.reason}", style=style, highlight=False, markup=False)
    return 1 if failed else 0


_OUTCOME_STYLE = {"completed": "green", "no_new_version": "cyan", "timed_out": "red", "failed": "red",
                  "trainer_stopped": "yellow", "abandoned": "yellow", "open": "white"}


def _line(out, text: str, style: str | None = None) -> None:
    """One line, cut to the terminal's width (80 columns without a terminal): a row never folds
    into a column of words, and the full record is in `--json`."""
    out.print(text, style=style, markup=False, highlight=False, no_wrap=True, overflow="ellipsis")


def _round_line(r: dict[str, Any], show_method: bool) -> tuple[str, str]:
    got = {x["version"] for x in r["releases"] if x["reason"] == "new_version"}
    if r["rendezvous"]:
        got.add(r["rendezvous"]["version"])
    versions = f"v{r['version']}" + (f"→v{max(got)}" if got else "")
    waited = f"{r['duration_ms'] / 1000:.3f}s" if r["duration_ms"] is not None else "…"
    outcome = r["outcome"] or "open"
    moved = f"{r['nbytes'] / 1e6:.2f}MB" if r["nbytes"] else ""
    method = f" {r['method']:<10}" if show_method else ""
    return (f"{r['id']:>5} {(r['opened_at'] or '')[11:23]:<12} {_short(r['opened_by']):<12.12}{method} "
            f"{versions:<11} {waited:>8} {outcome:<15} {moved}").rstrip(), _OUTCOME_STYLE.get(outcome, "white")


def _print_timeline(t: dict[str, Any]) -> None:
    out = Console()
    cfg = t["config"] or {}
    _line(out, f"replay {t['source']}: {t['records']} records, seq {t['first_seq']}..{t['last_seq']}", "bold")
    _line(out, f"  from {t['first_time']} to {t['last_time']}")
    if cfg:
        _line(out, f"config: {cfg.get('sync_method')} / {cfg.get('sync_style')}, interval {cfg.get('sync_interval')}"
                   f", offset {cfg.get('sync_offset')}, timeout {cfg.get('sync_timeout')} s")
    if t["until"] is not None:
        _line(out, f"state as of --until {t['until']}", "bold yellow")
    if t["decisions_source"] == "recomputed":
        _line(out, "no decision is recorded: rounds below are the reducer's own decisions", "yellow")

    rounds = t["rounds"]
    if rounds:
        outcomes: dict[str, int] = {}
        for r in rounds:
            outcomes[r["outcome"] or "open"] = outcomes.get(r["outcome"] or "open", 0) + 1
        _line(out, f"sync rounds: {len(rounds)} (" + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
              + ")", "bold")
        show_method = len({r["method"] for r in rounds}) > 1
        method = f" {'method':<10}" if show_method else ""
        _line(out, f"{'round':>5} {'opened (UTC)':<12} {'opened by':<12}{method} {'version':<11} {'waited':>8} "
                   f"{'outcome':<15} moved", "dim")
        for r in rounds:
            text, style = _round_line(r, show_method)
            _line(out, text, style)
    else:
        _line(out, "no sync round in this recording")

    latest = t["latest"]
    _line(out, f"members at the end: latest version v{latest['version']} "
               f"(held by {', '.join(map(_short, latest['held_by'])) or 'nobody'})", "bold")
    _line(out, f"  {'role':<12} {'id':<14} {'status':<12} {'step':>6} {'version':>7}  last seen (UTC, before end)",
          "dim")
    for m in t["members"]:
        _line(out, f"  {m['role']:<12} {m['id']:<14.14} {m['status']:<12} {m['step']:>6} {m['version']:>7}  {_seen(m)}")
    _line(out, "(--json: every release, whom each round waited for, transfer rates)", "dim")
    if t["illegal_inputs"]:
        _line(out, f"{len(t['illegal_inputs'])} input(s) refused by the reducer (skipped):", "yellow")
        for x in t["illegal_inputs"][:20]:
            out.print(f"  seq {x['seq']}: {x['reason']}", highlight=False, markup=False, soft_wrap=True)


def _short(key: str) -> str:
    """`explorer/explorer-0` -> `explorer-0` (ids are unique within a role, and say it anyway)."""
    return key.split("/", 1)[1] if "/" in key else key


def _seen(member: dict[str, Any]) -> str:
    if member["last_seen"] is None:
        return "never"
    before = member["last_seen_ago_ms"] or 0
    return f"{member['last_seen'][11:23]} {before / 1000:.1f}s"


def _print_check(records: list[Recorded], mismatches: list[Mismatch]) -> None:
    out = Console()
    decisions = sum(isinstance(r.event, Decision) for r in records)
    errors = [m for m in mismatches if not m.warning]
    for m in mismatches:
        if m.warning:
            out.print(f"warning: {m.describe()}", style="yellow", highlight=False, markup=False, soft_wrap=True)
    if not errors:
        out.print(f"check OK: all {decisions} recorded decisions equal the recomputed ones", style="bold green")
        return
    first = errors[0]
    out.print(f"check FAILED: {len(errors)} mismatch(es); first at recorded seq {first.seq}", soft_wrap=True,
              style="bold red", highlight=False)
    for m in errors[:50]:
        out.print(f"  {m.describe()}", highlight=False, markup=False, soft_wrap=True)
    if len(errors) > 50:
        out.print(f"  ... and {len(errors) - 50} more")
