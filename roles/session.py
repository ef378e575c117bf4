"""What every role process shares: identity, connection, event publishing, heartbeats, and a live
view of the job (a local fold of the stream plus the synchronizer's recorded decisions)."""

from __future__ import annotations

import asyncio
import bisect
import gc
import os
import signal
import socket
import time
import weakref
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TypeVar

import structlog
from msgspec.structs import replace

from rolectl.bus.archive import read_range
from rolectl.bus.connection import BusConnection, connect
from rolectl.bus.errors import BusError, describe
from rolectl.bus.events import EventPublisher, last_sequence, publish_heartbeat, read_events
from rolectl.bus.files import write_json_atomic  # re-exported: the roles write their state with it
from rolectl.bus.retry import backoff_delay
from rolectl.bus.snapshots import SnapshotStore
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import JobConfig
from rolectl.roles.waiting import WaitNotice
from rolectl.sync_protocol import (
    Decision,
    EvalFinished,
    Event,
    IllegalEvent,
    JobConfigured,
    MemberExpired,
    MemberJoined,
    MemberRef,
    Recorded,
    RendezvousReady,
    Role,
    RunningStatus,
    StatusChanged,
    StepFinished,
    VersionPublished,
    WeightsBroadcast,
)
from rolectl.sync_protocol.reducer import reduce_lenient
from rolectl.sync_protocol.state import State

T = TypeVar("T")

__all__ = [
    "write_json_atomic", "new_incarnation", "JobView", "MemberSession", "install_stop_signals",
    "finish_before_stopping",
    "RoleStopped", "MemberRejoined", "MemberReplaced", "JobIncomplete", "stop_task", "freeze_heap"]


class RoleStopped(Exception):
    """Raised inside a role's loop when it was asked to stop (signal) so cleanup runs."""


class MemberRejoined(Exception):
    """The synchronizer expired this member while it was alive (it was cut off, or starved), and the
    session joined again as a new incarnation: whatever it was waiting for must be asked again."""


class MemberReplaced(Exception):
    """A newer incarnation of this member joined while this process was paused or cut off: it is
    fenced, and stops without training, saving or acking anything more (the exit is non-zero)."""


class JobIncomplete(Exception):
    """The role ended before the job's work was done (the trainer short of `total_steps`, an
    explorer that gave up on a trainer that never came back). The process exits non-zero."""


def freeze_heap() -> None:
    """Keep what the process set up (imports, engine, model) out of Python's cyclic GC from now on.

    A full collection walks every tracked object; with torch and a model loaded that is hundreds of
    thousands, tens of ms at a random moment, and a member in the middle of a sync waits that much
    longer for its answer (seen as 40-90 ms outliers in benchmarks.sync_latency). Frozen objects are
    still freed by reference counting; only cycles among them would stay, and what setup made
    lives as long as the process anyway."""
    gc.freeze()


def new_incarnation() -> int:
    """A number that grows with every start of a process: milliseconds since the epoch.

    Restarts of the same member id get a larger incarnation, so the core can tell a stale process
    from its replacement without any coordination.
    """
    return time.time_ns() // 1_000_000


def _may_change_membership(event: Event) -> bool:
    """Whether folding `event` may change who is alive or finished (a restart is a MemberJoined of
    a new incarnation): the absences are looked at again only then, not for every request."""
    return isinstance(event, (MemberJoined, MemberExpired)) or (
        isinstance(event, StatusChanged) and event.status is RunningStatus.STOPPED)


JOIN_LOOKUP_S = 30.0
"""How long a start waits for the server to read the live incarnation's join record (host and pid)."""

DECISIONS_KEPT = 1024
"""A view keeps the decisions its live waiters have not looked at yet, plus at least this many of
the newest: a member's wait starts from its own request, published just before, so it never needs
an older one. A days-long job records millions; a member holds a few thousand at most."""

_BURST_MAX = 16
"""Waiters are answered after each burst of delivered records, and at least every this many: under
a steady flow (64 explorers) a burst never ends, and a decision must not wait for it to."""


class JobView:
    """A live, read-only view of a job: the fold of its recorded inputs and its recorded decisions.

    Members do not decide anything from this view — the synchronizer does — but they read it to
    know the latest version, whether the trainer is alive, and to wait for decisions about them.
    """

    def __init__(self, conn: BusConnection, *, log=None,
                 backfill: Callable[[int, int], list[Recorded]] | None = None):
        self._conn = conn
        # the records a trim purged while this view lagged behind it (see bus.events.read_events)
        self._backfill = backfill
        # on_refused(rec, error): an input the fold refused (the session republishes its own)
        self.on_refused: Callable[[Recorded, IllegalEvent], None] | None = None
        self.state = State.initial()
        # the newest recorded decisions (see DECISIONS_KEPT); `_decisions_base` were dropped before them
        self.decisions: list[Recorded] = []
        self._decisions_base = 0
        self._cursors: weakref.WeakSet[_DecisionCursor] = weakref.WeakSet()  # live first_decision waits
        self.inputs_seen = 0
        self.last_seq = 0
        self.broadcast_version = 0  # the newest version a trainer reported broadcast (rendezvous)
        # key -> the MemberJoined of its current incarnation (host and pid: who to stop)
        self.joins: dict[str, MemberJoined] = {}
        # role -> monotonic time since when every member of it has been gone without finishing
        # (killed, expired, restarting): the roles' patience (trainer_grace_s...) counts from it
        self._away_since: dict[Role, float] = {}
        # wait_for() callers: (predicate, future). The follower checks them after each burst of
        # records and resolves only those that hold: a waiter is not woken to find it still waits.
        self._waiters: list[tuple[Callable[[JobView], object], asyncio.Future, str]] = []
        # waiters whose predicate only a join, stop or expiry can change (a member's own expiry):
        # checked after bursts that folded one, not after every burst
        self._membership_waiters: list[tuple[Callable[[JobView], object], asyncio.Future, str]] = []
        self._membership_moved = False
        self._task: asyncio.Task | None = None
        self._log = log or structlog.get_logger()

    async def start(self, *, catch_up: bool = True, from_snapshot: bool = True) -> int:
        """Fold everything recorded so far (from the newest reducer snapshot, if there is one, plus
        the stream after it), then follow live. Returns the stream's last sequence at start."""
        end = await last_sequence(self._conn)
        from_seq = 1
        if from_snapshot:
            snapshot = await SnapshotStore(self._conn).latest()
            if snapshot is not None and snapshot.state.last_seq <= end:
                self.state = snapshot.state
                self.last_seq = snapshot.state.last_seq
                # what a trainer broadcast before the snapshot: the explorers hold it now
                self.broadcast_version = max((m.version for m in snapshot.state.explorers(alive_only=False)),
                                             default=0)
                from_seq = snapshot.state.last_seq + 1
        self._task = asyncio.create_task(self._follow(from_seq), name="job-view")
        if catch_up and end >= from_seq:
            await self.wait_for(lambda v: v.last_seq >= end, timeout=120.0, what=f"catch up to seq {end}")
        return end

    async def _follow(self, from_seq: int = 1) -> None:
        stopped = "it was closed"
        try:
            async with read_events(self._conn, from_seq=from_seq, include_decisions=True,
                                   backfill=self._backfill) as reader:
                # fold a burst (what is already delivered, up to _BURST_MAX) before answering anyone
                while burst := await reader.next_burst(_BURST_MAX):
                    for rec in burst:
                        self.fold(rec)
                    self._answer_waiters()
        except Exception as exc:
            stopped = str(exc)
            self._log.error("view_stopped_following", error=stopped, last_seq=self.last_seq)
            raise
        finally:
            # Tell the waiters: they see the view has stopped (wait_for raises) instead of
            # waiting out their timeout (hours for a sync decision; for ever without one).
            self._answer_waiters(stopped=stopped)

    def fold(self, rec: Recorded) -> None:
        """Take the next record of the stream (the follower calls it; a test may, without a bus)."""
        if isinstance(rec.event, Decision):
            if isinstance(rec.event, RendezvousReady):  # its ranks are the group this fold holds
                rec = Recorded(seq=rec.seq, time_ms=rec.time_ms, event=self.state.group.bind(rec.event),
                               subject=rec.subject)
            self.decisions.append(rec)
            if len(self.decisions) > 2 * DECISIONS_KEPT:
                self._forget_old_decisions()
        else:
            self.inputs_seen += 1
            if isinstance(rec.event, WeightsBroadcast):
                self.broadcast_version = max(self.broadcast_version, rec.event.version)
            # Illegal inputs are skipped exactly as the synchronizer skips them.
            self.state, _, error = reduce_lenient(self.state, rec)
            if error is not None:
                self._log.debug("view_skipped_event", seq=rec.seq, reason=str(error))
                if self.on_refused is not None:
                    self.on_refused(rec, error)
            elif _may_change_membership(rec.event):
                if isinstance(rec.event, MemberJoined):
                    self.joins[rec.event.member.key] = rec.event
                self._note_absences()
                self._membership_moved = True
        self.last_seq = rec.seq

    def _answer_waiters(self, *, stopped: str | None = None) -> None:
        self._waiters = _answer(self._waiters, self, stopped)
        if self._membership_moved or stopped is not None:
            self._membership_moved = False
            self._membership_waiters = _answer(self._membership_waiters, self, stopped)

    async def wait_for(self, predicate: Callable[[JobView], object], *, timeout: float | None,
                       what: str = "condition", membership_only: bool = False, announce: bool = True):
        """Wait until `predicate(view)` is truthy; return its value. TimeoutError after `timeout`.

        The predicate is checked now, then after each burst of records the view folds; with
        `membership_only`, only after bursts that folded a join, a stop or an expiry (for a
        predicate nothing else changes: it is not asked again for every request in the job).
        A bounded wait that lasts logs what it waits for (`WaitNotice`), unless `announce=False`
        (a caller that announces its own, longer wait); an unbounded one is a watch, not a wait."""
        value = predicate(self)
        if value:
            return value
        if self._task is not None and self._task.done():
            raise _stopped_following("it was closed" if self._task.cancelled() else str(self._task.exception()), what)
        loop = asyncio.get_running_loop()
        entry = (predicate, loop.create_future(), what)
        waiters = self._membership_waiters if membership_only else self._waiters
        waiters.append(entry)
        # A timer on the future itself, not asyncio.wait_for (a second future and two callbacks
        # per wait, and a member waits for every decision)
        timer = None if timeout is None else loop.call_later(
            timeout, _time_out, entry[1], f"timed out after {timeout} s waiting for {what}")
        notice = WaitNotice(self._log, what) if announce and timeout is not None else None
        if notice is not None:
            notice.__enter__()
        try:
            return await entry[1]
        finally:
            if notice is not None:
                notice.__exit__()
            if timer is not None:
                timer.cancel()
            # not the list appended to above: _answer_waiters replaces the lists with those still waiting
            waiters = self._membership_waiters if membership_only else self._waiters
            try:
                waiters.remove(entry)
            except ValueError:
                pass  # answered: the follower took it off the list

    async def joined_event(self, key: str) -> MemberJoined | None:
        """The MemberJoined of member `key`'s current incarnation (host and pid: who to stop). A
        view started from a snapshot did not fold it: it is read from the stream (or the archive,
        once trimmed) at the sequence the state recorded. None when it cannot be read."""
        member = self.state.members.get(key)
        if member is None:
            return None
        joined = self.joins.get(key)
        if joined is not None and joined.member.incarnation == member.ref.incarnation:
            return joined

        async def read() -> MemberJoined | None:
            async with read_events(self._conn, from_seq=member.joined_seq, include_decisions=True,
                                   stop_at_end=True, backfill=self._backfill) as reader:
                async for rec in reader:
                    if isinstance(rec.event, MemberJoined) and rec.event.member.key == key \
                            and rec.event.member.incarnation == member.ref.incarnation:
                        return rec.event
                    break  # the record at joined_seq is the join, or the history does not have it
            return None

        try:  # a server away (restarting) is waited for: without the record, a restart is refused
            joined = await self._conn.retry(read, what=f"the join record of {key}", retry_for=JOIN_LOOKUP_S)
        except Exception as exc:
            self._log.warning("join_record_unreadable", key=key, seq=member.joined_seq, error=str(exc))
            return None
        if joined is not None:
            self.joins[key] = joined
        return joined

    def decisions_after(self, seq: int):
        """Kept decisions with a stream sequence greater than `seq` (newest last)."""
        return self.decisions[bisect.bisect_right(self.decisions, seq, key=_seq_of):]

    def first_decision(self, after_seq: int, match: Callable[[Decision], object]) -> Callable[[JobView], object]:
        """A `wait_for` predicate: `match(d)` for the first decision `d` recorded after `after_seq`
        for which it is truthy (None until there is one). Each recorded decision is looked at once,
        however many bursts the wait spans: a member waiting among 64 others is not walked through
        every decision since its request at each burst. While the predicate lives, the decisions
        it has not looked at yet are kept."""
        cursor = _DecisionCursor(self._decisions_base + bisect.bisect_right(self.decisions, after_seq, key=_seq_of),
                                 match)
        self._cursors.add(cursor)
        return cursor

    def _forget_old_decisions(self) -> None:
        """Drop all but the newest `DECISIONS_KEPT` decisions, never one a live wait has yet to see."""
        drop = len(self.decisions) - DECISIONS_KEPT
        for cursor in self._cursors:
            drop = min(drop, cursor.index - self._decisions_base)
        if drop > 0:
            del self.decisions[:drop]
            self._decisions_base += drop

    def all_gone(self, role: Role) -> bool:
        """True when members of `role` have joined and none is alive any more."""
        members = [m for m in self.state.members.values() if m.ref.role is role]
        return bool(members) and not any(m.alive for m in members)

    def all_finished(self, role: Role) -> bool:
        """True when members of `role` have joined and every one stopped for good (final STOPPED):
        their work is done. A member that was killed, expired or stopped early may come back."""
        members = [m for m in self.state.members.values() if m.ref.role is role]
        return bool(members) and all(m.finished for m in members)

    def away_for(self, role: Role) -> float:
        """Seconds (this process's clock) since every member of `role` went away without finishing;
        0.0 while one is alive, or once all have finished."""
        since = self._away_since.get(role)
        return 0.0 if since is None else time.monotonic() - since

    def _note_absences(self) -> None:
        for role in (Role.TRAINER, Role.EXPLORER):
            away = self.all_gone(role) and not self.all_finished(role)
            if not away:
                self._away_since.pop(role, None)
            elif role not in self._away_since:
                self._away_since[role] = time.monotonic()

    def member(self, role: Role, member_id: str):
        return self.state.members.get(f"{role.value}/{member_id}")

    async def aclose(self) -> None:
        if self._task is not None:
            await stop_task(self._task, log=self._log)
            self._task = None


def _answer(waiters: list, view: JobView, stopped: str | None) -> list:
    """Resolve the waiters whose predicate holds (or all, with an error, when the view stopped);
    return those still waiting."""
    waiting = []
    for predicate, future, what in waiters:
        if future.done():  # timed out or cancelled
            continue
        try:
            value = predicate(view)
        except Exception as exc:
            future.set_exception(exc)
            continue
        if value:
            future.set_result(value)
        elif stopped is not None:
            future.set_exception(_stopped_following(stopped, what))
        else:
            waiting.append((predicate, future, what))
    return waiting


class _DecisionCursor:
    """`first_decision`'s predicate: where in the view's decisions (counted from the job's first)
    the wait has looked so far."""

    __slots__ = ("index", "_match", "__weakref__")

    def __init__(self, index: int, match: Callable[[Decision], object]):
        self.index = index
        self._match = match

    def __call__(self, view: JobView) -> object:
        decisions, base = view.decisions, view._decisions_base
        self.index = max(self.index, base)
        while self.index - base < len(decisions):
            value = self._match(decisions[self.index - base].event)
            self.index += 1
            if value:
                return value
        return None


def _time_out(future: asyncio.Future, message: str) -> None:
    if not future.done():
        future.set_exception(TimeoutError(message))


def _seq_of(rec: Recorded) -> int:
    return rec.seq


def _stopped_following(cause: str, what: str) -> BusError:
    return BusError(f"the job view stopped following the stream ({cause}); {what} can no longer be seen")


@dataclass
class MemberSession:
    """A role's connection to its job: identity, publisher, heartbeats and view. Async context manager."""

    cfg: JobConfig
    role: Role
    member_id: str
    ranks: int = 1
    incarnation: int = field(default_factory=new_incarnation)

    step: int = 0
    version: int = -1
    status: RunningStatus = RunningStatus.RUNNING

    conn: BusConnection | None = None
    publisher: EventPublisher | None = None
    view: JobView | None = None
    log: structlog.typing.FilteringBoundLogger | None = None
    rejoins: int = 0  # times this process found itself expired and joined again
    _stack: AsyncExitStack | None = None
    _heartbeat_task: asyncio.Task | None = None
    _rejoin_task: asyncio.Task | None = None
    _rejoining: MemberRef | None = None  # the incarnation a rejoin that has not succeeded yet joins as
    _me: MemberRef | None = field(default=None, repr=False, compare=False)
    replaced_by: MemberRef | None = None  # set once a newer incarnation of this member joined
    _main_task: asyncio.Task | None = field(default=None, repr=False, compare=False)
    # monotonic time up to which a chain of heartbeats, each within `_trust_s` of the one before,
    # shows this process was not paused: past it, the record is read again before acting (fence)
    _current_at: float = field(default=0.0, repr=False, compare=False)
    # records of ours the fold refused because they landed after our expiry (or after our rejoin
    # overtook them), to be said again by the incarnation we joined as (see _note_refused)
    _refused: list[Event] = field(default_factory=list, repr=False, compare=False)
    _ours: set[int] = field(default_factory=set, repr=False, compare=False)  # incarnations of this process
    _republishing: set[asyncio.Task] = field(default_factory=set, repr=False, compare=False)

    @property
    def me(self) -> MemberRef:
        """Who we are now. Built again only when the incarnation changed (a rejoin): every event
        we publish and every decision we look for asks."""
        ref = self._me
        if ref is None or ref.incarnation != self.incarnation or ref.id != self.member_id or ref.role is not self.role:
            ref = self._me = MemberRef(role=self.role, id=self.member_id, incarnation=self.incarnation)
        return ref

    @property
    def key(self) -> str:
        """`role/id`: this member's name across incarnations (as `MemberRef.key`)."""
        return f"{self.role.value}/{self.member_id}"

    async def __aenter__(self) -> MemberSession:
        self.log = structlog.get_logger().bind(job=self.cfg.job, role=self.role.value, member=self.member_id)
        self._stack = AsyncExitStack()
        self.conn = await self._stack.enter_async_context(
            connect(self.cfg.nats_url, job=self.cfg.job, role=self.role.value, member=self.member_id,
                    security=self.cfg.nats.security)
        )
        try:
            await ensure_event_stream(self.conn.js, self.conn.names, replicas=self.cfg.nats.replicas)
            await ensure_experience_stream(self.conn.js, self.conn.names, replicas=self.cfg.nats.replicas)
        except BaseException:  # __aexit__ does not run when __aenter__ raises: close what we opened
            await self._stack.aclose()
            raise
        self.publisher = EventPublisher(self.conn, self.me)
        self._ours.add(self.incarnation)
        archive = self.cfg.event_archive_dir
        self.view = JobView(self.conn, log=self.log, backfill=lambda first, last: read_range(archive, first, last))
        self.view.on_refused = self._note_refused
        return self

    async def join(self, *, step: int, version: int) -> int:
        """Announce the config this member runs with and that it is up; start heartbeats."""
        self.step, self.version = step, version
        await self.publish(JobConfigured(member=self.me, config=self.cfg.synchronizer))
        seq = await self.publish(
            MemberJoined(member=self.me, host=socket.gethostname(), pid=os.getpid(),
                         step=step, version=version, ranks=self.ranks)
        )
        self.status = RunningStatus.RUNNING
        self._main_task = asyncio.current_task()
        self._current_at = time.monotonic()
        self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="heartbeat")
        self._rejoin_task = asyncio.create_task(self._rejoin_when_expired(), name="rejoin")
        freeze_heap()  # set up: from here on a sync's answer should not wait for a full collection
        self.log.info("joined", step=step, version=version, incarnation=self.incarnation, seq=seq)
        return seq

    async def publish(self, event: Event) -> int:
        return await self.publisher.publish(event)

    def expired(self, view: JobView) -> bool:
        """True when the job's record says our current incarnation left, and we did not stop:
        the synchronizer expired us (it could not hear us for `heartbeat_expiry`)."""
        member = view.state.members.get(self.key)
        return (member is not None and member.ref.incarnation == self.incarnation and not member.alive
                and self.status is not RunningStatus.STOPPED)

    async def refuse_if_live(self) -> None:
        """Raise `StartRefused` when the job's record shows this member alive in another process:
        two live trainers train the same steps twice. A restart goes on: the old incarnation
        stopped, expired, or (on this host) its process is gone although not yet expired."""
        from rolectl.roles.resume import StartRefused

        member = self.view.state.members.get(self.key)
        if member is None or not member.alive:
            return
        joined = await self.view.joined_event(self.key)
        if joined is not None:
            if joined.host == socket.gethostname() and not _pid_running(joined.pid):
                self.log.info("previous_process_gone", incarnation=member.ref.incarnation, pid=joined.pid)
                return
            where = f"pid {joined.pid} on host {joined.host}"
            stop = f"stop it first (Ctrl-C in its terminal, or `kill {joined.pid}` on {joined.host})"
        else:
            where, stop = f"on host {member.host or '?'}", "stop it first"
        expiry = self.cfg.synchronizer.heartbeat_expiry
        raise StartRefused(
            f"{self.role.value} {self.member_id!r} of job {self.cfg.job!r} is already running ({where}, "
            f"incarnation {member.ref.incarnation}, at step {member.step}): a second one would do its work "
            f"twice. To replace it, {stop} and start again: the new one resumes where it stopped. If it "
            f"hangs or its machine is gone, a running synchronizer expires it {expiry} s after its last "
            f"heartbeat (`rolectl status --job {self.cfg.job}` then shows it expired) and a start resumes it")

    def replaced(self, view: JobView) -> bool:
        """True when the record's current incarnation of this member is newer than ours, and not
        the join this very process made for its rejoin (see `_our_pending_join`)."""
        member = view.state.members.get(self.key)
        return member is not None and member.ref.incarnation > self.incarnation \
            and not self._our_pending_join(view)

    def _our_pending_join(self, view: JobView) -> bool:
        """The record's current incarnation is the one a rejoin of ours is still trying (its join
        stored, its ack lost), joined from this host and pid: not an identity another process has."""
        joined = view.joins.get(self.key)
        member = view.state.members.get(self.key)
        return (self._rejoining is not None and joined is not None and member is not None
                and joined.member == self._rejoining == member.ref
                and joined.host == socket.gethostname() and joined.pid == os.getpid())

    @property
    def _trust_s(self) -> float:
        # Half the expiry: within it, no synchronizer can have expired us, so no replacement joined.
        return self.cfg.synchronizer.heartbeat_expiry / 2

    async def fence(self) -> None:
        """Before an act with effects outside the stream (train a step, save, ack, publish
        experiences): raise `MemberReplaced` if a newer incarnation took over. After a pause
        (SIGSTOP, a starved loop, a long disconnect) the record is read to its end first, so a
        process that comes back learns it was replaced before it acts."""
        if self.replaced_by is None and time.monotonic() - self._current_at > self._trust_s:
            await self._read_to_end("checked after a pause")
            if self.replaced(self.view):
                self._note_replaced()
            else:
                self._current_at = time.monotonic()
        if self.replaced_by is not None:
            raise MemberReplaced(self._replaced_message())

    async def _read_to_end(self, why: str) -> None:
        """Fold the job's record up to its end as of now; a server away (restarting) is waited for
        as every other part of the role waits for it."""
        patience = self.cfg.synchronizer.sync_timeout
        end = await self.conn.retry(lambda: last_sequence(self.conn), what="the job's last sequence",
                                    retry_for=patience)
        await self.view.wait_for(lambda v: v.last_seq >= end, timeout=patience,
                                 what=f"the job's record up to seq {end} ({why})")

    def _note_replaced(self) -> None:
        if self.replaced_by is None:
            self.replaced_by = self.view.state.members[self.key].ref
            self.log.error("replaced_by_newer_incarnation", incarnation=self.incarnation,
                           new_incarnation=self.replaced_by.incarnation, hint=self._replaced_message())

    def _replaced_message(self) -> str:
        joined = self.view.joins.get(self.key)
        where = f" (pid {joined.pid} on host {joined.host})" if joined is not None else ""
        return (f"{self.role.value} {self.member_id!r}: incarnation {self.incarnation} was replaced by "
                f"incarnation {self.replaced_by.incarnation}{where} while this process was paused or cut off; "
                "it stops without training, saving or acking anything more")

    async def _rejoin_when_expired(self) -> None:
        """Expiry is not a death sentence: an expired member that is alive joins again as a new
        incarnation, keeping its step and version, and carries on — unless a newer incarnation
        joined meanwhile (a restart replaced us): then this process is fenced and its role stops.
        A try that fails (the server away or still recovering its streams: expiry comes with
        outages) is tried again; the member stays expired, and says so, until one succeeds."""
        failures = 0
        while True:
            await self.view.wait_for(lambda v: self.expired(v) or self.replaced(v) or self._rejoining is not None,
                                     timeout=None, what="our own expiry or replacement", membership_only=True)
            try:
                if await self._rejoin_or_stop():
                    return
                failures = 0
            except Exception as exc:
                self.log.warning("rejoin_failed", incarnation=self.incarnation, error=describe(exc),
                                 hint="tried again in a moment")
                # a pause between tries, growing and jittered: a fleet expired by one outage spreads out
                period = self.cfg.synchronizer.heartbeat_period
                await asyncio.sleep(backoff_delay(failures, base=period, cap=8 * period))
                failures += 1

    async def _rejoin_or_stop(self) -> bool:
        """One try at `_rejoin_when_expired`: True when a newer incarnation replaced us (stop)."""
        if not self.replaced(self.view):
            # the replacement may be recorded already and not yet folded: read to the end first
            await self._read_to_end("before rejoining")
        if self.replaced(self.view):
            self._note_replaced()
            if self._main_task is not None and not self._main_task.done():
                self._main_task.cancel()
            return True
        if self.expired(self.view) or self._rejoining is not None:
            await self._rejoin()
        return False

    async def _rejoin(self) -> None:
        """Join again as a new incarnation, keeping step and version. A try that failed is repeated
        as the same incarnation with the same message ids: a join stored before its ack was lost
        is stored once, and is ours."""
        old = self.me
        if self._rejoining is None:
            self._rejoining = MemberRef(role=self.role, id=self.member_id,
                                        incarnation=max(new_incarnation(), old.incarnation + 1))
        new = self._rejoining
        # Joined first, switched after: anything this process says from now on comes from an
        # incarnation already in the record (a waiter asking again must not overtake the join).
        publisher = EventPublisher(self.conn, new)
        await publisher.publish(JobConfigured(member=new, config=self.cfg.synchronizer))
        await publisher.publish(MemberJoined(member=new, host=socket.gethostname(), pid=os.getpid(),
                                             step=self.step, version=self.version, ranks=self.ranks))
        self._rejoining = None
        self._ours.add(new.incarnation)
        self.incarnation, self.publisher = new.incarnation, publisher
        self.status = RunningStatus.RUNNING
        self.rejoins += 1
        self.log.warning("rejoined_after_expiry", expired_incarnation=old.incarnation,
                         incarnation=self.incarnation, step=self.step, version=self.version,
                         rejoins=self.rejoins)
        self._republish_refused()

    # Facts about work this process did (a step trained or explored, an eval, a version stored): a
    # record of one that lands after our expiry is refused by the fold, yet the work happened (the
    # experiences were acked, the bytes stored). The new incarnation records it again, or the job's
    # accounting (experiences trained, produced) would miss it. Requests are not here: a waiter
    # asks again itself (MemberRejoined).
    _REPUBLISHED = (StepFinished, EvalFinished, VersionPublished)

    def _note_refused(self, rec: Recorded, error: IllegalEvent) -> None:
        event = rec.event
        if (isinstance(event, self._REPUBLISHED) and event.member.key == self.key
                and event.member.incarnation in self._ours and self.replaced_by is None):
            self.log.warning("record_refused_after_expiry", seq=rec.seq, kind=event.KIND, reason=str(error))
            self._refused.append(event)
            del self._refused[:-64]  # bounded: a rejoin follows within one expiry
            self._republish_refused()

    def _republish_refused(self) -> None:
        """Say again, as the incarnation we are now, what the fold refused from an older one of ours
        (one still expired waits for its rejoin)."""
        ready = [e for e in self._refused if e.member.incarnation < self.incarnation]
        if not ready or self.replaced_by is not None:
            return
        self._refused = [e for e in self._refused if e.member.incarnation >= self.incarnation]
        task = asyncio.get_running_loop().create_task(self._republish(ready), name="republish")
        self._republishing.add(task)
        task.add_done_callback(self._republishing.discard)

    async def _republish(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, VersionPublished) and event.version <= self.view.state.latest.version:
                continue  # published again meanwhile (the trainer's next sync does)
            try:
                seq = await self.publish(replace(event, member=self.me))
            except Exception as exc:  # the server away: the job's accounting misses it, the work stands
                self.log.warning("republish_failed", kind=event.KIND, error=describe(exc))
                continue
            self.log.info("republished_after_rejoin", kind=event.KIND, seq=seq, incarnation=self.incarnation)

    async def wait_decision(self, match: Callable[[Decision], object], *, after: int, what: str,
                            give_up: Callable[[JobView], str | None] | None = None,
                            detail: Callable[[], str | None] | None = None):
        """Wait for the synchronizer's decision about our request: the first decision recorded
        after stream sequence `after` (our request) for which `match(decision)` is truthy, and
        return that value; None if none ever comes.

        The synchronizer answers by `sync_timeout` at the latest (a timed-out round releases us).
        Silence beyond that (plus a grace period) means no synchronizer is running: withdraw the
        request and go on with the weights we have, like the reference on a failed sync.
        A wait that lasts logs what it waits for, with `detail()` (see `WaitNotice`).
        Raises `MemberRejoined` when we were expired meanwhile (ask again as the new incarnation),
        and `JobIncomplete` when `give_up(view)` says why waiting is pointless (checked every few
        seconds: it may depend on time alone, like a trainer gone longer than its grace).
        """
        incarnation = self.incarnation
        rejoined = object()
        outcome = self.view.first_decision(after, match)

        def decided(view: JobView):
            if self.incarnation != incarnation:
                return rejoined
            return outcome(view)

        with WaitNotice(self.log, what, detail=detail):
            return await self._wait_decision(decided, rejoined, what=what, give_up=give_up)

    async def _wait_decision(self, decided, rejoined, *, what: str, give_up):
        deadline = time.monotonic() + self.cfg.synchronizer.sync_timeout + 30
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.log.warning("sync_decision_timed_out", what=what,
                                 waited_s=self.cfg.synchronizer.sync_timeout + 30)
                await self.set_status(RunningStatus.RUNNING)
                return None
            try:
                result = await self.view.wait_for(decided, timeout=min(remaining, 2.0), what=what, announce=False)
            except TimeoutError:
                reason = give_up(self.view) if give_up is not None else None
                if reason:
                    await self.set_status(RunningStatus.RUNNING)
                    raise JobIncomplete(reason) from None
                continue
            if result is rejoined:
                raise MemberRejoined(f"expired while waiting for {what}; joined again as incarnation "
                                     f"{self.incarnation}")
            return result

    async def set_status(self, status: RunningStatus, *, rendezvous: str | None = None,
                         final: bool = False, metrics: dict[str, float] | None = None) -> int:
        self.status = status
        return await self.publish(
            StatusChanged(member=self.me, status=status, step=self.step, version=self.version,
                          rendezvous=rendezvous, final=final, metrics=metrics or {})
        )

    async def _heartbeat(self) -> None:
        period = self.cfg.synchronizer.heartbeat_period
        while True:
            started = time.monotonic()
            try:
                await publish_heartbeat(self.conn, self.me, step=self.step, version=self.version,
                                        status=self.status)
            except Exception as exc:  # a disconnect must not kill the role; the client reconnects
                self.log.warning("heartbeat_failed", error=describe(exc))
            else:
                # only a beat close to the last trusted one extends the trust: after a pause the
                # fence reads the record instead (a beat then says nothing about what happened)
                if started - self._current_at <= self._trust_s:
                    self._current_at = started
            await asyncio.sleep(period)

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            await self._close()
        finally:
            if self.replaced_by is not None and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
                # cancelled by our own fence, not by a signal: say why the role stopped
                if hasattr(self._main_task, "uncancel"):  # Python 3.11+: this cancel was ours, handled
                    self._main_task.uncancel()
                raise MemberReplaced(self._replaced_message())

    async def _close(self) -> None:
        for task in list(self._republishing):
            await stop_task(task, log=self.log)
        if self._rejoin_task is not None:
            await stop_task(self._rejoin_task, log=self.log)
        if self._heartbeat_task is not None:
            await stop_task(self._heartbeat_task, log=self.log)
        if self.view is not None:
            await self.view.aclose()
        if self._stack is not None:
            await self._stack.aclose()


async def stop_task(task: asyncio.Task, *, log=None, poll_s: float = 0.5) -> None:
    """Cancel `task` and wait until it has ended, cancelling again if a cancellation was lost.

    Before Python 3.12, `asyncio.wait_for` returns the result instead of raising CancelledError
    when the awaited future completes in the same loop iteration as the cancellation (nats-py's
    `next_msg` awaits `wait_for(queue.get())`); the task then goes on as if never cancelled, and a
    plain `task.cancel(); await task` waits for ever (a role that finished but never exits).
    """
    attempts = 0
    while not task.done():
        task.cancel()
        attempts += 1
        await asyncio.wait({task}, timeout=poll_s)
    if attempts > 1 and log is not None:
        log.info("task_cancel_repeated", task=task.get_name(), attempts=attempts)
    if not task.cancelled() and task.exception() is not None and log is not None:
        log.debug("task_ended_with_error", task=task.get_name(), error=str(task.exception()))


def _pid_running(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one we may not signal counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def finish_before_stopping(work: Awaitable[T], *, log, what: str,
                                 unless: Callable[[], bool] | None = None) -> T:
    """Await `work` to its end even when the role is told to stop meanwhile (Ctrl-C, SIGTERM: a
    cancel), then stop: for a unit that must not be cut in two (a batch published whose step is
    never reported; a step trained but never saved nor reported). Bounded by the unit itself.
    When `unless()` holds at the stop (the member was replaced: its successor owns the work), the
    unit is cancelled instead, as any other await would be."""
    task = asyncio.ensure_future(work)
    stop_requested = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise  # the unit itself was cancelled: nothing is left to finish
            if unless is not None and unless():
                task.cancel()
                raise
            if not stop_requested:
                log.info("stopping_after_unit_in_flight", unit=what)
            stop_requested = True
    if stop_requested:
        raise asyncio.CancelledError
    return result


def install_stop_signals(task: asyncio.Task) -> None:
    """SIGINT/SIGTERM cancel the role's main task, so its cleanup publishes STOPPED."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, task.cancel)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass

