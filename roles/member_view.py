"""An explorer's view of its job: only the records of its own scope, so what a member does per round
does not grow with the fleet.

Theory of operation
-------------------
An explorer needs to know: the latest version, whether the trainer is alive or finished (and for
how long it has been away), whether a synchronizer is running, its own record (its incarnation:
expired? replaced?), whether the trainer waits in a round, and the decisions about it. None of
that is in another explorer's records, and at 1,024 explorers folding them all was most of every
member's CPU (each member decoded and folded the whole fleet's requests and reports, every round).

So a `MemberView` reads the job's stream through one consumer with several filter subjects: the
trainer's events, the synchronizers' (expiries, timeouts, their joins), its own member's, and every
decision. It folds those inputs with the same reducer as everyone, **with the job's config
withheld**: before a JobConfigured the reducer records members and versions and opens no round
(see `sync_protocol.reducer`), which is exactly the part of the state a scope determines — a
member's incarnation, liveness, end, step and the latest version depend only on that member's own
inputs and the synchronizers' expiries. Rounds, groups and every other explorer need the whole
stream; this view does not have them, and has no `state` to read them from by mistake.

What it knows of rounds it knows from decisions (recorded by the synchronizer from the whole fold):
whether the trainer opened a round not yet closed. A `RendezvousReady` names its group without
listing it; a view that does not fold every explorer reads the group's rank assignments from the
record the synchronizer stores before it decides (`bus.snapshots.SnapshotStore.group`) and binds
the decision with it, which checks the decision's digest.

The trainer, the synchronizer, status, the dashboard and replay fold everything (`JobView`,
`JobObserver`, the reducer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from msgspec.structs import replace

from rolectl.bus.connection import BusConnection
from rolectl.bus.events import EventReader, last_sequence, read_events
from rolectl.bus.snapshots import SnapshotStore
from rolectl.roles.stream_view import START_PATIENCE_S, StreamView
from rolectl.sync_protocol import (
    ExplorerPaused,
    ExplorersResumed,
    IllegalEvent,
    JobConfigured,
    MemberJoined,
    Recorded,
    RendezvousReady,
    Role,
    RoundClosed,
    RoundOpened,
    UnboundRendezvous,
)
from rolectl.sync_protocol.members import MemberMap
from rolectl.sync_protocol.reducer import reduce_lenient
from rolectl.sync_protocol.state import LatestVersion, MemberState, State

__all__ = ["MemberView", "OutOfScope", "GROUP_READ_S"]

GROUP_READ_S = 30.0
"""How long binding a rendezvous decision waits for the server to read its group's record."""

_SCOPE_ROLES = (Role.TRAINER, Role.SYNCHRONIZER)  # every member of these is in every scope


class OutOfScope(LookupError):
    """A `MemberView` was asked about a member outside its scope (another explorer): it does not
    fold that member's records, so it cannot say (read a `JobView` for the whole job)."""


class MemberView(StreamView):
    """The job as explorer(s) `explorers` see it: the trainer's, the synchronizers' and their own
    records, and every decision (see the module docstring). A process serving several simulated
    explorers (the benchmarks) gives all of them; a role gives its one."""

    _ABSENCE_ROLES = (Role.TRAINER,)

    def __init__(self, conn: BusConnection, explorers: Sequence[str], *, log=None,
                 backfill: Callable[[int, int], list[Recorded]] | None = None):
        super().__init__(conn, log=log, backfill=backfill)
        if not explorers:
            raise ValueError("a MemberView needs the explorer(s) whose view it is")
        self.explorers = tuple(explorers)
        self._own_keys = frozenset(f"{Role.EXPLORER.value}/{e}" for e in self.explorers)
        self._partial = State.initial()  # the scope's fold, config withheld: never read as the job's state
        self._trainer_rounds: set[int] = set()  # rounds the trainer opened, not closed yet (decisions)
        self._groups: dict[int, tuple] = {}  # epoch -> rank assignments read from the group records
        self._pauses: dict[str, ExplorerPaused] = {}  # own explorer key -> its pause, until a resume (decisions)
        self._snapshots: SnapshotStore | None = None
        self._reader: EventReader | None = None

    @property
    def subjects(self) -> list[str]:
        """The subjects this view reads: its scope's events and the decisions."""
        names = self._conn.names
        return [names.member_events(Role.TRAINER), names.member_events(Role.SYNCHRONIZER),
                *(names.member_events(Role.EXPLORER, e) for e in self.explorers), names.all_decisions]

    async def start(self, *, catch_up: bool = True, from_snapshot: bool = True) -> int:
        """Fold the scope's records so far (from the newest snapshot, narrowed to the scope, if
        there is one), then follow live. Returns the stream's last sequence at start. A server away
        (restarting, electing a stream leader) is waited out, as `JobView.start` does."""
        end = await last_sequence(self._conn, patience_s=START_PATIENCE_S)
        from_seq = 1
        self._snapshots = SnapshotStore(self._conn)
        if from_snapshot:
            snapshot = await self._snapshots.latest()
            if snapshot is not None and snapshot.state.last_seq <= end:
                self._partial = self._narrowed(snapshot.state)
                self.last_seq = snapshot.state.last_seq
                self._trainer_rounds = {r.id for r in snapshot.state.rounds.values()
                                        if r.opened_by.role is Role.TRAINER}
                from_seq = snapshot.state.last_seq + 1
        self._start_following(from_seq)
        if catch_up and end >= from_seq:
            await self.read_to(end, timeout=START_PATIENCE_S, what=f"catch up to seq {end}")
        return end

    def _narrowed(self, state: State) -> State:
        """A snapshot's state as this scope's fold would be: its members, config and rounds withheld."""
        members = MemberMap((key, m) for key, m in state.members.items()
                            if m.ref.role in _SCOPE_ROLES or key in self._own_keys)
        return replace(State.initial(), members=members, latest=state.latest, last_seq=state.last_seq,
                       trainer=state.trainer)

    def _open_reader(self, from_seq: int) -> EventReader:
        self._reader = read_events(self._conn, from_seq=from_seq, include_decisions=True, backfill=self._backfill,
                                   subjects=self.subjects)
        return self._reader

    async def read_to(self, end: int, *, timeout: float, what: str) -> None:
        """Return once every record of this view's scope up to stream sequence `end` is folded.
        The last record up to `end` may be outside the scope, so `last_seq` need not reach it: the
        server's count of what the view's consumer has yet to deliver says when nothing is left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.last_seq < end:
            self._raise_if_stopped(what)
            bursts = self.bursts
            if not self._folding and self._reader is not None and await self._reader.at_end() \
                    and not self._folding and self.bursts == bursts:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            try:  # something is on its way (or the consumer is being made): wait for the next burst
                await self.wait_for(lambda v, seen=bursts: v.bursts > seen or v.last_seq >= end,
                                    timeout=min(remaining, 1.0), what=what, announce=False)
            except TimeoutError:
                pass

    # -- folding -------------------------------------------------------------------------------------
    def _fold_input(self, rec: Recorded) -> IllegalEvent | None:
        if isinstance(rec.event, JobConfigured):
            return None  # withheld: with it, the reducer would open rounds it cannot see whole
        if isinstance(rec.event, MemberJoined):  # a restart leaves the paused set (its join may pause it again)
            self._pauses.pop(rec.event.member.key, None)
        self._partial, _, error = reduce_lenient(self._partial, rec)
        return error

    def _on_decision(self, rec: Recorded) -> Recorded:
        event = rec.event
        if isinstance(event, RoundOpened) and event.opened_by.role is Role.TRAINER:
            self._trainer_rounds.add(event.round)
        elif isinstance(event, RoundClosed):
            self._trainer_rounds.discard(event.round)
        elif isinstance(event, ExplorerPaused) and event.explorer.key in self._own_keys:
            self._pauses[event.explorer.key] = event
        elif isinstance(event, ExplorersResumed):
            self._pauses.clear()
        elif isinstance(event, RendezvousReady) and not event.is_bound:
            participants = self._groups.get(event.epoch)
            if participants is not None:
                try:
                    event = event.bound(participants)
                except UnboundRendezvous as exc:
                    self._log.error("rendezvous_group_mismatch", round=event.round, epoch=event.epoch, error=str(exc))
                    return rec
                return Recorded(seq=rec.seq, time_ms=rec.time_ms, event=event, subject=rec.subject)
        return rec

    async def _prepare(self, rec: Recorded) -> None:
        event = rec.event
        if not isinstance(event, RendezvousReady) or event.is_bound or event.epoch in self._groups:
            return
        assert self._snapshots is not None
        store = self._snapshots
        group = await self._conn.retry(lambda: store.group(event.epoch), what=f"rendezvous group {event.epoch}",
                                       retry_for=GROUP_READ_S)
        if group is None:
            # a synchronizer older than this member stores no group: the decision stays unbound
            # and the explorer reports the sync failed, saying why (a new epoch forms next time)
            self._log.error("rendezvous_group_not_stored", round=event.round, epoch=event.epoch,
                            hint="is the synchronizer older than this explorer? restart it with this rolectl")
            return
        self._groups = {epoch: g for epoch, g in self._groups.items() if epoch > event.epoch - 2}
        self._groups[event.epoch] = group

    # -- what the roles read -------------------------------------------------------------------------
    def _in_scope(self, key: str) -> bool:
        role = key.partition("/")[0]
        return role in (Role.TRAINER.value, Role.SYNCHRONIZER.value) or key in self._own_keys

    def member_state(self, key: str) -> MemberState | None:
        """The record of member `key`: the trainer, a synchronizer or an explorer of this view;
        `OutOfScope` for another explorer."""
        if not self._in_scope(key):
            raise OutOfScope(f"{key} is outside this explorer view's scope ({', '.join(sorted(self._own_keys))}, "
                             "the trainer and the synchronizers): it does not fold that member's records")
        return self._partial.members.get(key)

    def _members_of(self, role: Role) -> list[MemberState]:
        if role not in _SCOPE_ROLES:
            raise OutOfScope(f"an explorer's view does not fold every {role.value}: it cannot say whether "
                             f"all {role.value}s are gone or finished")
        return [m for m in self._partial.members.values() if m.ref.role is role]

    @property
    def latest(self) -> LatestVersion:
        """The newest version the trainer published."""
        return self._partial.latest

    @property
    def trainer(self) -> MemberState | None:
        """The job's trainer (the last one that joined), if any."""
        return self._partial.trainer_state

    def pause_of(self, key: str) -> ExplorerPaused | None:
        """The decision that paused our explorer `key` for running ahead of the trainer, while no
        `ExplorersResumed` has come since (a pace decision: the view does not fold the fleet's tasks)."""
        return self._pauses.get(key)

    def trainer_waiting(self) -> bool:
        """The trainer asked for a sync and the synchronizer has not closed its round yet."""
        return bool(self._trainer_rounds)
