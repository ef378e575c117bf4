"""Look at a job: an incremental observer of its recorded stream (members, rounds, versions, figures)
shared by `rolectl status`, `rolectl replay` and the dashboard, and the `rolectl status` command.

Theory of operation
-------------------
`JobObserver.apply(recorded)` takes the job's records one at a time, in stream order. Inputs are
folded with the pure reducer, skipping illegal ones exactly as the synchronizer does (they are
counted and kept with their reason). Recorded decisions build the sync rounds as they happened:
who opened a round, whom it waited for (taken from the reducer's own round state when the round
opened), every release, the outcome and its server times. Weight transfers (`WeightsLoaded`,
`WeightsBroadcast`) are attached to their round for bytes and GB/s. Nothing here does I/O or reads
a clock; callers pass `now_ms` where "how long ago" is wanted.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from sync_protocol import (
    Decision,
    Event,
    IllegalEvent,
    JobConfigured,
    MemberExpired,
    MemberJoined,
    MemberReleased,
    NoNewVersion,
    Recorded,
    RendezvousReady,
    Role,
    RoundClosed,
    RoundOpened,
    RoundTimedOut,
    RunningStatus,
    RoundPhase,
    State,
    StatusChanged,
    StepFinished,
    SyncFailed,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
)
from sync_protocol.reducer import reduce_lenient

__all__ = [
    "JobObserver",
    "RoundView",
    "Transfer",
    "VersionView",
    "LogLine",
    "describe",
    "member_status",
    "member_rows",
    "print_status",
    "collect_status",
    "format_ago",
]


@dataclass
class Transfer:
    """One member's part of moving weights: bytes, seconds and the rate they imply."""

    member: str
    version: int
    nbytes: int
    seconds: float
    seq: int
    time_ms: int
    kind: str  # "loaded" (explorer received) or "broadcast" (trainer sent)

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 and self.nbytes > 0 else None


@dataclass
class RoundView:
    """One sync round as it happened (or as far as the records go)."""

    id: int
    method: str
    opened_by: str
    version: int  # the version the opener held when it asked
    opened_seq: int  # stream seq of the input that opened it
    opened_at_ms: int  # server time of that input
    waited_for: list[str] = field(default_factory=list)
    participants: list[str] = field(default_factory=list)
    releases: list[dict[str, Any]] = field(default_factory=list)
    rendezvous: dict[str, Any] | None = None
    outcome: str | None = None
    closed_seq: int | None = None  # stream seq of the input that closed it
    closed_at_ms: int | None = None  # server time of that input
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def duration_ms(self) -> int | None:
        return None if self.closed_at_ms is None else self.closed_at_ms - self.opened_at_ms

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.kind == "loaded")

    @property
    def transfer_seconds(self) -> float | None:
        loaded = [t.seconds for t in self.transfers if t.kind == "loaded" and t.seconds > 0]
        return max(loaded) if loaded else None

    @property
    def gbps(self) -> float | None:
        # Aggregate rate: all bytes received over the slowest receiver's time (they overlap).
        seconds = self.transfer_seconds
        return self.nbytes / seconds / 1e9 if seconds and self.nbytes else None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "method": self.method,
            "opened_by": self.opened_by,
            "version": self.version,
            "opened_seq": self.opened_seq,
            "opened_at_ms": self.opened_at_ms,
            "waited_for": list(self.waited_for),
            "participants": list(self.participants),
            "releases": list(self.releases),
            "rendezvous": self.rendezvous,
            "outcome": self.outcome,
            "closed_seq": self.closed_seq,
            "closed_at_ms": self.closed_at_ms,
            "duration_ms": self.duration_ms,
            "nbytes": self.nbytes,
            "transfer_seconds": self.transfer_seconds,
            "gbps": self.gbps,
            "transfers": [{**asdict(t), "gbps": t.gbps} for t in self.transfers],
        }


@dataclass
class VersionView:
    """A published weights version."""

    version: int
    step: int
    method: str
    nbytes: int
    seq: int
    time_ms: int


@dataclass
class LogLine:
    """One line of the event log: what was recorded, by whom, and whether the reducer refused it."""

    seq: int
    time_ms: int
    kind: str
    who: str
    text: str
    decision: bool
    illegal: str | None = None


def describe(event: Event | Decision) -> str:
    """A short human description of an event or decision (for logs and timelines)."""
    if isinstance(event, MemberJoined):
        return f"joined on {event.host} (pid {event.pid}) at step {event.step}, version {event.version}"
    if isinstance(event, JobConfigured):
        c = event.config
        return f"config {c.sync_method.value}/{c.sync_style.value} interval {c.sync_interval}"
    if isinstance(event, StatusChanged):
        return f"{event.status.value} at step {event.step}, version {event.version}"
    if isinstance(event, VersionPublished):
        return f"published v{event.version} (step {event.step}, {_size(event.nbytes)} via {event.method.value})"
    if isinstance(event, NoNewVersion):
        return f"no version newer than v{event.version}"
    if isinstance(event, WeightsLoaded):
        where = f" (round {event.round})" if event.round is not None else " (background)"
        return f"loaded v{event.version}{where} {_size(event.nbytes)} in {event.seconds:.3f} s"
    if isinstance(event, WeightsBroadcast):
        return f"broadcast v{event.version} round {event.round} {_size(event.nbytes)} in {event.seconds:.3f} s"
    if isinstance(event, SyncFailed):
        return f"sync failed (v{event.version}, round {event.round}): {event.reason}"
    if isinstance(event, StepFinished):
        reward = event.metrics.get("reward_mean")
        extra = f", reward {reward:.3f}" if reward is not None else ""
        return f"step {event.step} done with v{event.version}{extra}"
    if isinstance(event, MemberExpired):
        return f"{event.expired} expired (silent {event.silent_for:.1f} s)"
    if isinstance(event, RoundTimedOut):
        return f"round {event.round} timed out"
    if isinstance(event, RoundOpened):
        return f"round {event.round} opened by {event.opened_by.key} ({event.method.value}, holds v{event.version})"
    if isinstance(event, RendezvousReady):
        return (f"round {event.round} rendezvous: v{event.version}, epoch {event.epoch}, "
                f"world {event.world_size} at {event.master_addr}:{event.master_port}")
    if isinstance(event, MemberReleased):
        return f"round {event.round}: release {event.released.key} ({event.reason.value}, v{event.version})"
    if isinstance(event, RoundClosed):
        return f"round {event.round} closed: {event.outcome.value}"
    return type(event).__name__


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def member_status(member) -> str:
    """running / require_sync / stopped / expired (a dead member that did not say STOPPED expired)."""
    if member.alive:
        return member.status.value
    return "stopped" if member.status is RunningStatus.STOPPED else "expired"


def format_ago(ms: int | None) -> str:
    if ms is None:
        return "never"
    seconds = max(0.0, ms / 1000)
    if seconds < 60:
        return f"{seconds:.1f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def member_rows(state: State, heartbeats: dict[str, int] | None = None, now_ms: int | None = None
                ) -> list[dict[str, Any]]:
    """One row per member (trainer, explorers, synchronizers), sorted by role then id.

    `heartbeats` maps member key -> server-independent receive time (ms) of its last heartbeat;
    `last_seen_ms` is the later of that and its last recorded event.
    """
    heartbeats = heartbeats or {}
    trainer = state.trainer_state
    latest = max(state.latest.version, trainer.version if trainer else 0)
    order = {Role.TRAINER: 0, Role.EXPLORER: 1, Role.SYNCHRONIZER: 2}
    rows = []
    for m in sorted(state.members.values(), key=lambda m: (order.get(m.ref.role, 9), m.ref.id)):
        last_seen = max(m.last_time_ms, heartbeats.get(m.key, 0)) or None
        rows.append({
            "key": m.key,
            "role": m.ref.role.value,
            "id": m.ref.id,
            "incarnation": m.ref.incarnation,
            "status": member_status(m),
            "alive": m.alive,
            "step": m.step,
            "version": m.version,
            "host": m.host,
            "last_seen_ms": last_seen,
            "last_seen_ago_ms": (now_ms - last_seen) if (now_ms is not None and last_seen) else None,
            "has_latest": m.version >= latest and m.ref.role is not Role.SYNCHRONIZER,
            "metrics": dict(m.metrics),
        })
    return rows


class JobObserver:
    """Folds a job's records into what people want to see. Pure: no I/O, no clock.

    `apply_computed=True` builds rounds from the reducer's own decisions instead of recorded ones
    (for recordings that hold inputs only). Bounded: at most `max_rounds` rounds, `max_points`
    points per series and `log_tail` log lines are kept, so a dashboard can follow a long job.
    """

    def __init__(self, *, apply_computed: bool = False, log_tail: int = 200, max_rounds: int = 2000,
                 max_points: int = 5000):
        self.apply_computed = apply_computed
        self.state = State.initial()
        self.rounds: OrderedDict[int, RoundView] = OrderedDict()
        self.versions: deque[VersionView] = deque(maxlen=max_points)
        self.log: deque[LogLine] = deque(maxlen=log_tail)
        self.illegal: deque[tuple[int, str]] = deque(maxlen=max_points)
        self.illegal_total = 0
        self.records = 0
        self.decisions_recorded = 0
        self.first_time_ms: int | None = None
        self.last_time_ms: int | None = None
        self.reward: deque[tuple[int, float, int]] = deque(maxlen=max_points)  # (step, reward, time)
        self.staleness: deque[tuple[int, float, float]] = deque(maxlen=max_points)  # (step, mean, dropped)
        self.background_transfers: deque[Transfer] = deque(maxlen=max_points)
        self.bytes_loaded_total = 0
        self.heartbeats: dict[str, int] = {}
        self._max_rounds = max_rounds
        self._round_info: OrderedDict[int, dict[str, Any]] = OrderedDict()  # round -> reducer's view
        self._tracking: set[int] = set()  # rounds still open in the reducer's state
        self._times: OrderedDict[int, int] = OrderedDict()  # input seq -> server time (recent only)

    # -- feeding ---------------------------------------------------------------------------------

    def apply(self, rec: Recorded) -> IllegalEvent | None:
        """Take the next record (in stream order); returns the reducer's refusal, if any."""
        if rec.seq <= self.state.last_seq:
            return None  # already seen (a reader that restarted)
        self.records += 1
        if self.first_time_ms is None:
            self.first_time_ms = rec.time_ms
        self.last_time_ms = rec.time_ms
        event = rec.event
        if isinstance(event, Decision):
            self.decisions_recorded += 1
            self.state, _, _ = reduce_lenient(self.state, rec)  # only advances last_seq
            self._log(rec, None)
            if not self.apply_computed:
                self._on_decision(event, rec.seq, rec.time_ms)
            return None
        self._times[rec.seq] = rec.time_ms
        if len(self._times) > 100_000:
            self._times.popitem(last=False)
        self.state, computed, error = reduce_lenient(self.state, rec)
        if error is not None:
            self.illegal_total += 1
            self.illegal.append((rec.seq, str(error)))
        self._log(rec, str(error) if error else None)
        self._note_rounds(computed)
        if self.apply_computed:
            for decision in computed:
                self._on_decision(decision, None, rec.time_ms)
        if error is None:
            self._on_input(event, rec)
        return error

    def extend(self, records: Iterable[Recorded]) -> "JobObserver":
        for rec in records:
            self.apply(rec)
        return self

    def heartbeat(self, key: str, received_ms: int) -> None:
        """A member's heartbeat arrived at `received_ms` (the caller's clock)."""
        self.heartbeats[key] = received_ms

    # -- internals -------------------------------------------------------------------------------

    def _log(self, rec: Recorded, illegal: str | None) -> None:
        event = rec.event
        who = "synchronizer" if isinstance(event, Decision) else event.member.key
        self.log.append(LogLine(seq=rec.seq, time_ms=rec.time_ms, kind=event.KIND, who=who,
                                text=describe(event), decision=isinstance(event, Decision), illegal=illegal))

    def _note_rounds(self, computed: tuple[Decision, ...]) -> None:
        # The reducer's round state says whom a round waits for; keep it from when the round
        # opened, updated while it stays open (explorers joining or leaving change a rendezvous).
        for decision in computed:
            if isinstance(decision, RoundOpened):
                self._tracking.add(decision.round)
                self._round_info[decision.round] = {"waited_for": [], "participants": [decision.opened_by.key]}
                while len(self._round_info) > self._max_rounds:
                    self._round_info.popitem(last=False)
        for rid in list(self._tracking):
            rnd = self.state.rounds.get(rid)
            if rnd is None:
                self._tracking.discard(rid)  # closed: its last known waiting list stays
                continue
            if rnd.is_rendezvous:
                participants = list(rnd.participants)
                # once everyone arrived (transferring) nobody is waited for any more
                waited_for = ([k for k in rnd.participants if k not in rnd.waiting]
                              if rnd.phase is RoundPhase.WAITING else [])
            else:
                trainer = self.state.trainer or "trainer"
                participants = list(rnd.waiting)
                waited_for = [f"{trainer} (a version newer than v{rnd.version})"]
            info = self._round_info.setdefault(rid, {})
            info["participants"] = participants
            if rnd.is_rendezvous:
                # whom it waited for: the union over its life (members arriving shrink the list)
                waited_for = list(dict.fromkeys([*info.get("waited_for", []), *waited_for]))
            info["waited_for"] = waited_for
            view = self.rounds.get(rid)
            if view is not None:
                view.waited_for, view.participants = list(info["waited_for"]), list(participants)

    def _cause_time(self, seq: int, fallback: int) -> int:
        return self._times.get(seq, fallback)

    def _on_decision(self, d: Decision, seq: int | None, time_ms: int) -> None:
        if isinstance(d, RoundOpened):
            info = self._round_info.get(d.round, {})
            view = RoundView(id=d.round, method=d.method.value, opened_by=d.opened_by.key, version=d.version,
                             opened_seq=d.cause_seq, opened_at_ms=d.opened_at_ms,
                             waited_for=list(info.get("waited_for", [])),
                             participants=list(info.get("participants", [d.opened_by.key])))
            self.rounds[d.round] = view
            while len(self.rounds) > self._max_rounds:
                self.rounds.popitem(last=False)
            return
        view = self.rounds.get(d.round)
        if view is None:
            return  # its opening is before the records we have
        at = self._cause_time(d.cause_seq, time_ms)
        if isinstance(d, MemberReleased):
            view.releases.append({"member": d.released.key, "reason": d.reason.value, "version": d.version,
                                  "reload": d.reload, "cause_seq": d.cause_seq, "seq": seq, "at_ms": at,
                                  "waited_ms": at - view.opened_at_ms})
        elif isinstance(d, RendezvousReady):
            view.rendezvous = {"version": d.version, "epoch": d.epoch, "world_size": d.world_size,
                               "master": f"{d.master_addr}:{d.master_port}", "cause_seq": d.cause_seq,
                               "at_ms": at, "waited_ms": at - view.opened_at_ms,
                               "participants": [p.member.key for p in d.participants]}
            view.participants = [p.member.key for p in d.participants]
        elif isinstance(d, RoundClosed):
            view.outcome = d.outcome.value
            view.closed_seq = d.cause_seq
            view.closed_at_ms = at

    def _on_input(self, event: Event, rec: Recorded) -> None:
        if isinstance(event, VersionPublished):
            self.versions.append(VersionView(version=event.version, step=event.step, method=event.method.value,
                                             nbytes=event.nbytes, seq=rec.seq, time_ms=rec.time_ms))
        elif isinstance(event, (WeightsLoaded, WeightsBroadcast)):
            kind = "loaded" if isinstance(event, WeightsLoaded) else "broadcast"
            t = Transfer(member=event.member.key, version=event.version, nbytes=event.nbytes,
                         seconds=event.seconds, seq=rec.seq, time_ms=rec.time_ms, kind=kind)
            if kind == "loaded":
                self.bytes_loaded_total += event.nbytes
            view = self.rounds.get(event.round) if event.round is not None else None
            if view is not None:
                view.transfers.append(t)
            elif kind == "loaded" and event.nbytes:
                self.background_transfers.append(t)
        elif isinstance(event, StepFinished) and event.member.role is Role.TRAINER:
            m = event.metrics
            if "reward_mean" in m:
                self.reward.append((event.step, m["reward_mean"], rec.time_ms))
            if "mean_staleness" in m or "dropped_stale_total" in m:
                self.staleness.append((event.step, m.get("mean_staleness", 0.0), m.get("dropped_stale_total", 0.0)))

    # -- views -----------------------------------------------------------------------------------

    def members(self, now_ms: int | None = None) -> list[dict[str, Any]]:
        return member_rows(self.state, self.heartbeats, now_ms)

    def latest(self) -> dict[str, Any]:
        """The newest weights: the last published version, or for rendezvous methods (which move
        weights by broadcast, never publishing) the version the trainer holds."""
        latest = self.state.latest
        trainer = self.state.trainer_state
        version = max(latest.version, trainer.version if trainer else 0)
        holders = [m.key for m in self.state.members.values()
                   if m.ref.role is not Role.SYNCHRONIZER and m.version >= version]
        return {"version": version, "step": latest.step if version == latest.version else trainer.step,
                "method": latest.method.value if latest.method else None, "nbytes": latest.nbytes,
                "location": latest.location, "digest": latest.digest, "held_by": holders}


# --------------------------------------------------------------------------------------------------
# `rolectl status`


async def collect_status(job: str, nats: str, *, heartbeat_wait_s: float | None = None,
                         connect_timeout: float = 5.0, security=None) -> tuple[JobObserver, int]:
    """Read the job's stream to its current end and listen briefly for heartbeats.

    Returns the observer and the local time (ms) the snapshot was taken. Raises `bus.errors.BusError`
    when NATS is unreachable or the job has no stream. Waits for a heartbeat from every live member
    for at most `heartbeat_wait_s` (default: 1.5 heartbeat periods of the job's config).
    """
    from bus.connection import connect
    from bus.events import last_sequence, read_events, subscribe_heartbeats

    observer = JobObserver()
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
            async with read_events(conn, from_seq=1, include_decisions=True, stop_at_end=True) as reader:
                async for rec in reader:
                    observer.apply(rec)
            if _every_live_member_beat(observer):
                all_beating.set()
            wait = heartbeat_wait_s
            if wait is None:
                period = observer.state.config.heartbeat_period if observer.state.config else 1.0
                wait = 1.5 * period
            if any(m.alive for m in observer.state.members.values()):
                try:
                    await asyncio.wait_for(all_beating.wait(), wait)
                except asyncio.TimeoutError:
                    pass  # a member that does not beat is exactly what `status` should show
        finally:
            await sub.aclose()
    return observer, time.time_ns() // 1_000_000


def _every_live_member_beat(observer: JobObserver) -> bool:
    live = [m.key for m in observer.state.members.values() if m.alive and m.ref.role is not Role.SYNCHRONIZER]
    return bool(live) and all(k in observer.heartbeats for k in live)


async def print_status(job: str, nats: str, *, as_json: bool = False, connect_timeout: float = 5.0,
                       security=None) -> int:
    """Print a table (or JSON) of the job's members; 0 on success, 1 when NATS or the job is missing."""
    from rich.console import Console
    from rich.table import Table

    from bus.errors import BusError
    from bus.logging import setup_logging

    setup_logging("warning")  # stdout is for the table (and JSON); logs go to stderr
    err = Console(stderr=True)
    try:
        observer, now_ms = await collect_status(job, nats, connect_timeout=connect_timeout, security=security)
    except BusError as exc:
        err.print(f"rolectl status: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        return 1
    except ValueError as exc:  # a job name that cannot be a NATS token
        err.print(f"rolectl status: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        return 1
    rows = observer.members(now_ms)
    latest = observer.latest()
    if as_json:
        json.dump({"job": job, "latest": latest, "members": rows, "last_seq": observer.state.last_seq,
                   "open_rounds": sorted(observer.state.rounds), "illegal_events": observer.illegal_total},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    out = Console()
    table = Table(title=f"job {job} · latest version {latest['version']} · stream seq {observer.state.last_seq}")
    for col in ("role", "id", "status", "step", "version", "last seen", "host"):
        table.add_column(col, justify="right" if col in ("step", "version") else "left")
    colour = {"running": "green", "require_sync": "yellow", "stopped": "dim", "expired": "red"}
    for row in rows:
        status = f"[{colour.get(row['status'], 'white')}]{row['status']}[/]"
        table.add_row(row["role"], row["id"], status, str(row["step"]), str(row["version"]),
                      format_ago(row["last_seen_ago_ms"]), row["host"])
    if not rows:
        table.caption = "no member has joined yet"
    elif observer.state.rounds:
        table.caption = f"open sync rounds: {', '.join(map(str, sorted(observer.state.rounds)))}"
    out.print(table)
    return 0
