"""A member's live view of its job: the fold of the recorded inputs and the recorded decisions,
followed as the stream grows, with bounded waits for what it shows (a decision about us, a
membership change)."""

from __future__ import annotations

import asyncio
import bisect
import time
import weakref
from collections.abc import Callable

import structlog

from rolectl.bus.connection import BusConnection
from rolectl.bus.errors import BusError
from rolectl.bus.events import last_sequence, read_events
from rolectl.bus.snapshots import SnapshotStore
from rolectl.roles.stopping import stop_task
from rolectl.roles.waiting import WaitNotice
from rolectl.sync_protocol import (
    Decision,
    Event,
    IllegalEvent,
    MemberExpired,
    MemberJoined,
    Recorded,
    RendezvousReady,
    Role,
    RunningStatus,
    StatusChanged,
    WeightsBroadcast,
)
from rolectl.sync_protocol.reducer import reduce_lenient
from rolectl.sync_protocol.state import State

__all__ = ["JobView", "DECISIONS_KEPT", "JOIN_LOOKUP_S"]


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
