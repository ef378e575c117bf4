"""What a member's views of its job share: following the job's stream in bursts, the recorded
decisions (the newest kept), and bounded waits for what the view shows.

Two views build on it: `roles.job_view.JobView` folds every record (the trainer's view: it needs
every explorer), `roles.member_view.MemberView` only an explorer's own scope (its cost per round
does not grow with the fleet). Both keep every decision, and both wake a wait only when something
it may be waiting for was folded:

- a wait `about` a member (`first_decision(..., about=key)`) is handed the decisions that name that
  member (its release, the rounds it opened and their close) and those that name no one member (a
  `RendezvousReady` names its group), as they are folded: a view that serves many members (the
  benchmarks' simulated fleets) does not walk every member's wait through every decision;
- a wait with `wake_on=key` is asked again only after a burst that folded something about that
  member (a decision addressed to it or to everyone, an input it sent, its expiry).
"""

from __future__ import annotations

import asyncio
import bisect
import time
import weakref
from collections import deque
from collections.abc import Callable

import structlog

from rolectl.bus.connection import BusConnection
from rolectl.bus.errors import BusError
from rolectl.bus.events import EventReader, read_events
from rolectl.roles.stopping import stop_task
from rolectl.roles.waiting import WaitNotice
from rolectl.sync_protocol import (
    Decision,
    Event,
    ExplorerPaused,
    IllegalEvent,
    MemberExpired,
    MemberJoined,
    MemberReleased,
    Recorded,
    Role,
    RoundClosed,
    RoundOpened,
    RunningStatus,
    StatusChanged,
)

__all__ = ["StreamView", "DECISIONS_KEPT", "JOIN_LOOKUP_S", "START_PATIENCE_S"]

START_PATIENCE_S = 120.0
"""How long a view's `start` waits for the server to answer (a restart, a cluster's leader election)
and then for its catch-up."""

JOIN_LOOKUP_S = 30.0
"""How long a start waits for the server to read the live incarnation's join record (host and pid)."""

DECISIONS_KEPT = 1024
"""A view keeps the decisions its live waiters have not looked at yet, plus at least this many of
the newest: a member's wait starts from its own request, published just before, so it never needs
an older one. A days-long job records millions; a member holds a few thousand at most."""

_BURST_MAX = 16
"""Waiters are answered after each burst of delivered records, and at least every this many: under
a steady flow (64 explorers) a burst never ends, and a decision must not wait for it to."""

_EVERYONE = None  # the addressee of a decision that names no one member (a RendezvousReady)


def may_change_membership(event: Event) -> bool:
    """Whether folding `event` may change who is alive or finished (a restart is a MemberJoined of
    a new incarnation): the absences are looked at again only then, not for every request."""
    return isinstance(event, (MemberJoined, MemberExpired)) or (
        isinstance(event, StatusChanged) and event.status is RunningStatus.STOPPED)


_Waiter = tuple[Callable[["StreamView"], object], asyncio.Future, str]


class StreamView:
    """Follows the job's stream; subclasses say which records (`_open_reader`) and how an input is
    folded (`_fold_input`). Read-only: members decide nothing from a view — the synchronizer does."""

    def __init__(self, conn: BusConnection, *, log=None,
                 backfill: Callable[[int, int], list[Recorded]] | None = None):
        self._conn = conn
        # the records a trim purged while this view lagged behind it (see bus.events.read_events)
        self._backfill = backfill
        # on_refused(rec, error): an input the fold refused (the session republishes its own)
        self.on_refused: Callable[[Recorded, IllegalEvent], None] | None = None
        # the newest recorded decisions (see DECISIONS_KEPT); `_decisions_base` were dropped before them
        self.decisions: list[Recorded] = []
        self._addressees: list[str | None] = []  # beside `decisions`: whom each names (see _address)
        self._decisions_base = 0
        self._forget_at = 2 * DECISIONS_KEPT  # decisions held when forgetting is tried next
        self._cursors: weakref.WeakSet[_DecisionCursor] = weakref.WeakSet()  # live first_decision waits
        # member key -> the live waits handed that member's decisions (first_decision(about=key))
        self._inboxes: dict[str | None, weakref.WeakSet[_AddressedCursor]] = {}
        self._openers: dict[int, str] = {}  # open round -> who opened it (its close is addressed to them)
        self.inputs_seen = 0
        self.last_seq = 0
        # key -> the MemberJoined of its current incarnation (host and pid: who to stop)
        self.joins: dict[str, MemberJoined] = {}
        # role -> monotonic time since when every member of it has been gone without finishing
        # (killed, expired, restarting): the roles' patience (trainer_grace_s...) counts from it
        self._away_since: dict[Role, float] = {}
        # wait_for() callers: (predicate, future, what). The follower checks them after each burst
        # of records and resolves only those that hold: a waiter is not woken to find it still waits.
        self._waiters: list[_Waiter] = []
        # waiters whose predicate only a join, stop or expiry can change: checked after bursts
        # that folded one, not after every burst
        self._membership_waiters: list[_Waiter] = []
        self._membership_moved = False
        # waiters asked again only after a burst that folded something about their member
        self._keyed_waiters: dict[str, list[_Waiter]] = {}
        self._touched: set[str] = set()  # members the burst folded something about
        self._touched_everyone = False  # the burst folded a decision that names no one member
        self._task: asyncio.Task | None = None
        self._folding = False  # the follower is between taking a burst and answering the waiters
        self.bursts = 0  # bursts folded so far
        self._log = log or structlog.get_logger()

    # -- what a subclass provides --------------------------------------------------------------------
    def _open_reader(self, from_seq: int) -> EventReader:
        """The reader of the records this view folds, from `from_seq`."""
        raise NotImplementedError

    def _fold_input(self, rec: Recorded) -> IllegalEvent | None:
        """Fold one input; the error when the fold refused it (it is skipped, as the synchronizer does)."""
        raise NotImplementedError

    def _on_decision(self, rec: Recorded) -> Recorded:
        """A recorded decision as this view keeps it and waiters are shown it (a RendezvousReady
        bound to its group), after noting what it says."""
        return rec

    async def _prepare(self, rec: Recorded) -> None:
        """Before `fold(rec)` in the follower: fetch what binding it needs (MemberView: a group)."""

    _ABSENCE_ROLES: tuple[Role, ...] = ()  # the roles whose absence `away_for` times

    # -- following -----------------------------------------------------------------------------------
    def _start_following(self, from_seq: int) -> None:
        self._task = asyncio.create_task(self._follow(from_seq), name="job-view")

    async def _follow(self, from_seq: int = 1) -> None:
        stopped = "it was closed"
        try:
            async with self._open_reader(from_seq) as reader:
                # fold a burst (what is already delivered, up to _BURST_MAX) before answering anyone
                while burst := await reader.next_burst(_BURST_MAX):
                    self._folding = True
                    for rec in burst:
                        await self._prepare(rec)
                        self.fold(rec)
                    self._folding = False
                    self.bursts += 1
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
        event = rec.event
        if isinstance(event, Decision):
            self._keep_decision(self._on_decision(rec))
        else:
            self.inputs_seen += 1
            self._touched.add(event.member.key)
            error = self._fold_input(rec)
            if error is not None:
                self._log.debug("view_skipped_event", seq=rec.seq, reason=str(error))
                if self.on_refused is not None:
                    self.on_refused(rec, error)
            elif may_change_membership(event):
                if isinstance(event, MemberJoined):
                    self.joins[event.member.key] = event
                elif isinstance(event, MemberExpired):
                    self._touched.add(event.expired.key)
                self._note_absences()
                self._membership_moved = True
        self.last_seq = rec.seq

    def _keep_decision(self, rec: Recorded) -> None:
        addressee = self._address(rec.event)
        self.decisions.append(rec)
        self._addressees.append(addressee)
        if addressee is _EVERYONE:
            self._touched_everyone = True
            for inbox in self._inboxes.values():
                for cursor in inbox:
                    cursor.inbox.append(rec.event)
        else:
            self._touched.add(addressee)
            for cursor in self._inboxes.get(addressee, ()):
                cursor.inbox.append(rec.event)
        if len(self.decisions) >= self._forget_at:
            self._forget_old_decisions()

    def _address(self, decision: Decision) -> str | None:
        """The member a decision is about, or `_EVERYONE`: a release names its member, a round's
        opening and close the member that opened it, a pause its explorer; a RendezvousReady names its
        whole group (and an ExplorersResumed every paused explorer)."""
        if isinstance(decision, MemberReleased):
            return decision.released.key
        if isinstance(decision, ExplorerPaused):
            return decision.explorer.key
        if isinstance(decision, RoundOpened):
            key = self._openers[decision.round] = decision.opened_by.key
            return key
        if isinstance(decision, RoundClosed):
            # a round opened before this view started (it began from a snapshot) names no one it knows
            return self._openers.pop(decision.round, _EVERYONE)
        return _EVERYONE

    # -- waiting -------------------------------------------------------------------------------------
    def _answer_waiters(self, *, stopped: str | None = None) -> None:
        self._waiters = _answer(self._waiters, self, stopped)
        if self._membership_moved or stopped is not None:
            self._membership_moved = False
            self._membership_waiters = _answer(self._membership_waiters, self, stopped)
        keyed = self._keyed_waiters
        if keyed:
            if stopped is not None or self._touched_everyone:
                keys = list(keyed)
            else:
                keys = [key for key in self._touched if key in keyed]
            for key in keys:
                waiting = _answer(keyed[key], self, stopped)
                if waiting:
                    keyed[key] = waiting
                else:
                    del keyed[key]
        self._touched.clear()
        self._touched_everyone = False

    async def wait_for(self, predicate: Callable[[StreamView], object], *, timeout: float | None,
                       what: str = "condition", membership_only: bool = False, wake_on: str | None = None,
                       announce: bool = True):
        """Wait until `predicate(view)` is truthy; return its value. TimeoutError after `timeout`.

        The predicate is checked now, then after each burst of records the view folds; with
        `membership_only`, only after bursts that folded a join, a stop or an expiry (for a
        predicate nothing else changes: it is not asked again for every request in the job); with
        `wake_on=key`, only after bursts that folded something about member `key` (a decision
        addressed to it or to everyone, an input of its own, its expiry).
        A bounded wait that lasts logs what it waits for (`WaitNotice`), unless `announce=False`
        (a caller that announces its own, longer wait); an unbounded one is a watch, not a wait."""
        value = predicate(self)
        if value:
            return value
        self._raise_if_stopped(what)
        loop = asyncio.get_running_loop()
        entry = (predicate, loop.create_future(), what)
        self._waiting_list(membership_only, wake_on).append(entry)
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
            self._forget_waiter(entry, membership_only, wake_on)

    def _raise_if_stopped(self, what: str) -> None:
        """BusError when the follower has stopped: `what` can no longer be seen."""
        if self._task is not None and self._task.done():
            raise _stopped_following("it was closed" if self._task.cancelled() else str(self._task.exception()), what)

    async def read_to(self, end: int, *, timeout: float, what: str) -> None:
        """Return once every record up to stream sequence `end` that this view reads is folded;
        TimeoutError after `timeout`."""
        await self.wait_for(lambda v: v.last_seq >= end, timeout=timeout, what=what)

    def _waiting_list(self, membership_only: bool, wake_on: str | None) -> list[_Waiter]:
        if wake_on is not None:
            return self._keyed_waiters.setdefault(wake_on, [])
        return self._membership_waiters if membership_only else self._waiters

    def _forget_waiter(self, entry: _Waiter, membership_only: bool, wake_on: str | None) -> None:
        waiters = self._keyed_waiters.get(wake_on, []) if wake_on is not None \
            else self._membership_waiters if membership_only else self._waiters
        try:
            waiters.remove(entry)
        except ValueError:
            return  # answered: the follower took it off the list
        if wake_on is not None and not waiters:
            self._keyed_waiters.pop(wake_on, None)

    # -- decisions -----------------------------------------------------------------------------------
    def decisions_after(self, seq: int):
        """Kept decisions with a stream sequence greater than `seq` (newest last)."""
        return self.decisions[bisect.bisect_right(self.decisions, seq, key=_seq_of):]

    def first_decision(self, after_seq: int, match: Callable[[Decision], object], *,
                       about: str | None = None) -> Callable[[StreamView], object]:
        """A `wait_for` predicate: `match(d)` for the first decision `d` recorded after `after_seq`
        for which it is truthy (None until there is one). Each recorded decision is looked at once,
        however many bursts the wait spans. With `about=key` only the decisions naming member
        `key`, and those naming no one member, are looked at (see the module docstring): `match`
        must look for nothing else. Without it, the decisions the wait has not looked at yet are
        kept while it lives."""
        start = bisect.bisect_right(self.decisions, after_seq, key=_seq_of)
        if about is None:
            cursor = _DecisionCursor(self._decisions_base + start, match)
            self._cursors.add(cursor)
            return cursor
        addressed = _AddressedCursor(match)
        for rec, addressee in zip(self.decisions[start:], self._addressees[start:]):
            if addressee is _EVERYONE or addressee == about:
                addressed.inbox.append(rec.event)
        self._inboxes.setdefault(about, weakref.WeakSet()).add(addressed)
        return addressed

    def _forget_old_decisions(self) -> None:
        """Drop all but the newest `DECISIONS_KEPT` decisions, never one a live wait has yet to see
        (tried again `DECISIONS_KEPT` decisions later when a wait holds them)."""
        drop = len(self.decisions) - DECISIONS_KEPT
        for cursor in self._cursors:
            drop = min(drop, cursor.index - self._decisions_base)
        if drop > 0:
            del self.decisions[:drop]
            del self._addressees[:drop]
            self._decisions_base += drop
        self._forget_at = len(self.decisions) + DECISIONS_KEPT
        for key in [key for key, inbox in self._inboxes.items() if not inbox]:
            del self._inboxes[key]  # no live wait about that member any more

    # -- membership ----------------------------------------------------------------------------------
    def _members_of(self, role: Role) -> list:
        raise NotImplementedError

    def all_gone(self, role: Role) -> bool:
        """True when members of `role` have joined and none is alive any more."""
        members = self._members_of(role)
        return bool(members) and not any(m.alive for m in members)

    def all_finished(self, role: Role) -> bool:
        """True when members of `role` have joined and every one stopped for good (final STOPPED):
        their work is done. A member that was killed, expired or stopped early may come back."""
        members = self._members_of(role)
        return bool(members) and all(m.finished for m in members)

    def away_for(self, role: Role) -> float:
        """Seconds (this process's clock) since every member of `role` went away without finishing;
        0.0 while one is alive, or once all have finished."""
        since = self._away_since.get(role)
        return 0.0 if since is None else time.monotonic() - since

    def _note_absences(self) -> None:
        for role in self._ABSENCE_ROLES:
            away = self.all_gone(role) and not self.all_finished(role)
            if not away:
                self._away_since.pop(role, None)
            elif role not in self._away_since:
                self._away_since[role] = time.monotonic()

    def member_state(self, key: str):
        """The `MemberState` of member `key` ("role/id"), or None."""
        raise NotImplementedError

    def member(self, role: Role, member_id: str):
        return self.member_state(f"{role.value}/{member_id}")

    def synchronizers_alive(self) -> int:
        return sum(m.alive for m in self._members_of(Role.SYNCHRONIZER))

    async def joined_event(self, key: str) -> MemberJoined | None:
        """The MemberJoined of member `key`'s current incarnation (host and pid: who to stop). A
        view started from a snapshot did not fold it: it is read from the stream (or the archive,
        once trimmed) at the sequence the state recorded. None when it cannot be read."""
        member = self.member_state(key)
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

    async def aclose(self) -> None:
        if self._task is not None:
            await stop_task(self._task, log=self._log)
            self._task = None


def _answer(waiters: list[_Waiter], view: StreamView, stopped: str | None) -> list[_Waiter]:
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

    def __call__(self, view: StreamView) -> object:
        decisions, base = view.decisions, view._decisions_base
        self.index = max(self.index, base)
        while self.index - base < len(decisions):
            value = self._match(decisions[self.index - base].event)
            self.index += 1
            if value:
                return value
        return None


class _AddressedCursor:
    """`first_decision(about=key)`'s predicate: the view hands it the decisions about its member
    (and those about everyone) as it folds them; it looks at each once."""

    __slots__ = ("inbox", "_match", "__weakref__")

    def __init__(self, match: Callable[[Decision], object]):
        self.inbox: deque[Decision] = deque()
        self._match = match

    def __call__(self, view: StreamView) -> object:
        inbox = self.inbox
        while inbox:
            value = self._match(inbox.popleft())
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
