"""`rolectl status`: read a job's stream to its end, listen briefly for heartbeats, and print its
members (a table, or JSON). The fold is `roles.observe.observer.JobObserver`; this module does the I/O."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rolectl.bus.archive import ArchiveError, read_archive
from rolectl.bus.connection import connect
from rolectl.bus.errors import BusError
from rolectl.bus.events import last_sequence, read_events, subscribe_heartbeats
from rolectl.bus.logging import setup_logging
from rolectl.bus.snapshots import SnapshotStore
from rolectl.roles.exit_codes import ExitCode
from rolectl.roles.observe.observer import JobObserver, mismatch_view, pace_view
from rolectl.roles.observe.render import stdout_console
from rolectl.roles.observe.views import (
    MEMBER_STATUSES,
    format_ago,
    member_counts,
    page_members,
    progress_text,
    version_text,
)
from rolectl.sync_protocol import Role

__all__ = ["collect_status", "print_status", "format_agent"]


async def collect_status(job: str, nats: str, *, heartbeat_wait_s: float | None = None,
                         connect_timeout: float = 5.0, security=None,
                         archive_dir: Path | None = None) -> tuple[JobObserver, int]:
    """Read the job's stream to its current end and listen briefly for heartbeats.

    Returns the observer and the local time (ms) the snapshot was taken. Raises `bus.errors.BusError`
    when NATS is unreachable or the job has no stream. Waits for a heartbeat from every live member
    for at most `heartbeat_wait_s` (default: 1.5 heartbeat periods of the job's config).
    """
    observer = JobObserver()
    from_seq = 1
    if archive_dir is not None:  # the archived history first (a damaged segment: ArchiveError)
        for rec in read_archive(archive_dir):
            observer.apply(rec)
            from_seq = rec.seq + 1
    async with connect(nats, job=job, role="observer", member=f"status-{os.getpid()}",
                       connect_timeout=connect_timeout, security=security) as conn:
        all_beating = asyncio.Event()

        def on_heartbeat(hb) -> None:
            observer.heartbeat(hb.member.key, time.time_ns() // 1_000_000)
            if _every_live_member_beat(observer):
                all_beating.set()

        sub = await subscribe_heartbeats(conn, on_heartbeat)
        try:
            await last_sequence(conn)  # a clear error when the job has no stream
            first = (await conn.js.stream_info(conn.names.event_stream)).state.first_seq
            if first > from_seq:  # trimmed below what we hold: start from the newest snapshot
                snapshot = await SnapshotStore(conn).latest()
                if snapshot is not None and snapshot.state.last_seq >= from_seq:
                    observer = JobObserver(start=snapshot.state)
                    from_seq = snapshot.state.last_seq + 1
            async with read_events(conn, from_seq=from_seq, include_decisions=True, stop_at_end=True) as reader:
                async for rec in reader:
                    observer.apply(rec)
            if _every_live_member_beat(observer):
                all_beating.set()
            wait = heartbeat_wait_s
            if wait is None:
                config = observer.state.config
                # the period members beat at: stretched for a large fleet (SyncConfig.beat_period)
                period = config.beat_period(len(observer.state.members)) if config else 1.0
                wait = 1.5 * period
            if any(m.alive for m in observer.state.members.values()):
                try:
                    await asyncio.wait_for(all_beating.wait(), wait)
                except asyncio.TimeoutError:
                    pass  # a member that does not beat is exactly what `status` should show
        finally:
            await sub.aclose()
    return observer, time.time_ns() // 1_000_000


def _print_pace(out, view: dict) -> None:
    """The explorers paused for running ahead of the trainer, and by how much."""
    if view["paused"]:
        out.print(f"paused, ahead of the trainer (synchronizer.max_ahead): {', '.join(view['paused'])}; "
                  f"explorers' tasks {view['produced']}, the trainer's {view['consumed']}, bound {view['limit']} "
                  "ahead", highlight=False, markup=False)


def _print_mismatch(out, view: dict) -> None:
    """The mismatch alarm (the sign of stale or wrong weights in an explorer), flagged."""
    if view["alarms"]:
        last = (f"; the last step ({view['step']}) passed it: k3 KL {view['k3_kl']:.4g}, largest logprob gap "
                f"{view['log_gap_max']:.4g}" if view["alarm"] else "")
        out.print(f"[bold red]mismatch alarm[/]: {view['alarms']} trainer step(s) passed the rollout/trainer gap "
                  f"alarm (algorithm.rollout_correction.alarm_kl){last}; an explorer may sample with stale or "
                  "wrong weights", highlight=False)


def _filtered(observer: JobObserver) -> dict[str, int]:
    """What dynamic sampling filtered and the staleness policy kept: groups, experiences, corrected."""
    return {"groups": observer.groups_filtered.total, "experiences": observer.experiences_filtered.total,
            "corrected_stale": observer.corrected_stale}


def _print_filtered(out, view: dict[str, int]) -> None:
    """Groups dynamic sampling filtered (equal rewards: no signal), stale experiences kept corrected."""
    if view["groups"]:
        out.print(f"dynamic sampling (algorithm.dynamic_sampling): {view['groups']} groups of equal rewards "
                  f"filtered ({view['experiences']} experiences)", highlight=False, markup=False)
    if view["corrected_stale"]:
        out.print(f"{view['corrected_stale']} experiences past synchronizer.max_staleness trained with the "
                  "correction (staleness_policy: correct)", highlight=False, markup=False)


def _every_live_member_beat(observer: JobObserver) -> bool:
    live = [m.key for m in observer.state.members.values() if m.alive and m.ref.role is not Role.SYNCHRONIZER]
    return bool(live) and all(k in observer.heartbeats for k in live)


DEFAULT_LIMIT = 40
"""Explorers the table lists unless asked for more (`--limit`, `--all`): the stragglers first, after
the counts of every role by status, so a fleet of a thousand stays one screen."""


async def print_status(job: str, nats: str, *, as_json: bool = False, connect_timeout: float = 5.0,
                       security=None, archive_dir: Path | None = None, limit: int | None = DEFAULT_LIMIT) -> int:
    """Print a table (or JSON) of the job's members; 0 on success, 1 when NATS or the job is missing.

    The counts of each role's members by status come first, then the members: the trainer, the
    explorers (the stragglers first: gone without finishing, furthest behind in version and step,
    silent longest), the synchronizers. `limit` explorers are listed (None: all; `rolectl status
    --json` lists all unless given `--limit`)."""
    setup_logging("warning")  # stdout is for the table (and JSON); logs go to stderr
    err = Console(stderr=True)
    try:
        observer, now_ms = await collect_status(job, nats, connect_timeout=connect_timeout, security=security,
                                                archive_dir=archive_dir)
    except (BusError, ArchiveError) as exc:
        err.print(f"rolectl status: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        return ExitCode.ERROR
    except ValueError as exc:  # a job name that cannot be a NATS token
        err.print(f"rolectl status: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        return ExitCode.ERROR
    rows = observer.members(now_ms)
    counts = member_counts(rows)
    shown, left_out = page_members(rows, limit)
    latest = observer.latest()
    pace, mismatch = pace_view(observer), mismatch_view(observer)
    if as_json:
        json.dump({"job": job, "latest": latest, "counts": counts, "members": shown, "members_left_out": left_out,
                   "last_seq": observer.state.last_seq, "open_rounds": sorted(observer.state.rounds),
                   "illegal_events": observer.illegal_total, "eval": observer.eval_curve(), "pace": pace,
                   "mismatch": mismatch, "agent": observer.agent.summary(), "filtered": _filtered(observer)},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    out = stdout_console()
    if rows:
        out.print(_counts_table(counts))
    table = Table(title=f"job {job} · latest version {latest['version']} · stream seq {observer.state.last_seq}")
    for col in ("role", "id", "status", "step", "version", "last seen", "host"):
        table.add_column(col, justify="right" if col in ("step", "version") else "left")
    for row in shown:
        status = f"[{_COLOURS.get(row['status'], 'white')}]{row['status']}[/]"
        table.add_row(row["role"], row["id"], status, progress_text(row), version_text(row),
                      format_ago(row["last_seen_ago_ms"]), row["host"])
    captions = []
    if not rows:
        captions.append("no member has joined yet")
    if left_out:
        captions.append(f"{left_out} more explorers not listed (the {limit} furthest behind are); "
                        "--limit N or --all to list more")
    if observer.state.rounds:
        captions.append(f"{len(observer.state.rounds)} open sync rounds: {_some(sorted(observer.state.rounds))}")
    table.caption = "\n".join(captions) or None
    out.print(table)
    _print_pace(out, pace)
    _print_mismatch(out, mismatch)
    _print_filtered(out, _filtered(observer))
    curve = observer.eval_curve()
    if curve:
        last = curve[-1]
        rewards = ", ".join(f"{name} {mean:.4f}" for name, mean in last["rewards"].items())
        out.print(f"last eval: v{last['version']} at step {last['step']}: {rewards} ({len(curve)} evals)",
                  highlight=False, markup=False)
    agent = observer.agent.summary()
    if agent:
        out.print(format_agent(agent), highlight=False, markup=False)
    return 0


_COLOURS = {"running": "green", "require_sync": "yellow", "paused": "yellow", "finished": "blue", "stopped": "dim",
            "expired": "red"}


def _counts_table(counts: dict[str, dict[str, int]]) -> Table:
    """Members of each role by status: the whole fleet at a glance, however many are listed."""
    table = Table(title="members by status", title_justify="left")
    table.add_column("role")
    for status in MEMBER_STATUSES:
        table.add_column(f"[{_COLOURS[status]}]{status}[/]", justify="right")
    table.add_column("total", justify="right")
    for role, by_status in counts.items():
        table.add_row(role, *(str(by_status[s]) if by_status[s] else "·" for s in MEMBER_STATUSES),
                      str(by_status["total"]))
    return table


def _some(items: list, shown: int = 10) -> str:
    """The first `shown` items, and how many more."""
    head = ", ".join(map(str, items[:shown]))
    return head + (f" … (+{len(items) - shown})" if len(items) > shown else "")


def format_agent(agent: dict) -> str:
    """An agent job's figures in a line: episodes, turns, tool calls by outcome, errors, truncations."""
    calls = "; ".join(f"{tool} " + ", ".join(f"{outcome} {n}" for outcome, n in outcomes.items())
                      for tool, outcomes in agent["tool_calls"].items()) or "none"
    errors = ", ".join(f"{reason} {n}" for reason, n in agent["env_errors"].items()) or "none"
    trained = f", trained tokens {agent['trained_tokens']}" if agent.get("trained_tokens") is not None else ""
    return (f"agent: {agent['episodes']} episodes, {agent['turns_mean']:.2f} turns each, "
            f"{agent['truncated']} truncated; tool calls: {calls}; env errors: {errors}{trained}")

