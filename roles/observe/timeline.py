"""Fold a recorded job into what its members saw: `--until` cuts, the records the live reader
folds (`verify_subjects`), the shared observer, the job's outcome and summary, and a JSON-ready
timeline of rounds, versions and members.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from rolectl.bus.subjects import identity_problem
from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.observe.views import JobOutcome
from rolectl.sync_protocol import Decision, Recorded
from rolectl.sync_protocol.state import State

__all__ = [
    "build_timeline",
    "cut",
    "job_outcome",
    "observe",
    "parse_until",
    "summarize",
    "verify_subjects",
]


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


def verify_subjects(records: list[Recorded]) -> tuple[list[Recorded], list[tuple[Recorded, str]]]:
    """The records the live reader would fold, and the rejected ones with the reason."""
    kept, forged = [], []
    for rec in records:
        problem = identity_problem(rec.subject, rec.event) if rec.subject is not None else None
        if problem is None:
            kept.append(rec)
        else:
            forged.append((rec, problem))
    return kept, forged


def observe(records: list[Recorded], start: State | None = None, **options) -> JobObserver:
    """Fold `records` (from snapshot `start` if given) into the one observer every reader shares.
    Records whose subject does not vouch for their payload are left out, as the live reader leaves
    them out: a forged "finished" counts for nothing. `options` go to `JobObserver`."""
    observer = JobObserver(start=start, **{"log_tail": 0, "max_rounds": 10**9, "max_points": 10**9, **options})
    return observer.extend(verify_subjects(sorted(records, key=lambda r: r.seq))[0])


def job_outcome(records: list[Recorded], start: State | None = None) -> JobOutcome:
    """How the job stands or ended, folding the records as the synchronizer does."""
    return observe(records, start).outcome()


def summarize(records: list[Recorded], *, job: str) -> dict[str, Any]:
    """The run's figures (`JobObserver.summary`), from the recorded stream alone."""
    return observe(records).summary(job=job)


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
        "eval": observer.eval_curve(),
        "config": state.config.to_mapping() if state.config else None,
        "latest": observer.latest(),
        "versions": [vars(v) | {"at": _iso(v.time_ms)} for v in observer.versions],
        "rounds": rounds,
        "open_rounds": sorted(state.rounds),
        "members": members,
        "illegal_inputs": [{"seq": seq, "reason": reason} for seq, reason in observer.illegal],
        "background_transfers": [vars(t) | {"gbps": t.gbps} for t in observer.background_transfers],
    }
