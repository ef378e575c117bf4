"""The whole job as one member sees it: the fold of every recorded input and the recorded decisions,
followed as the stream grows, with bounded waits for what it shows (a decision about us, a
membership change).

The trainer reads this view (it waits for every explorer, hands out explorer-driven syncs, counts
who is gone); an explorer reads `roles.member_view.MemberView`, which folds only its own scope.
"""

from __future__ import annotations

from collections.abc import Callable

from rolectl.bus.connection import BusConnection
from rolectl.bus.events import EventReader, last_sequence, read_events
from rolectl.bus.snapshots import SnapshotStore
from rolectl.roles.stream_view import DECISIONS_KEPT, JOIN_LOOKUP_S, START_PATIENCE_S, StreamView
from rolectl.sync_protocol import IllegalEvent, Recorded, RendezvousReady, Role, WeightsBroadcast
from rolectl.sync_protocol.reducer import reduce_lenient
from rolectl.sync_protocol.state import LatestVersion, MemberState, State

__all__ = ["JobView", "DECISIONS_KEPT", "JOIN_LOOKUP_S"]


class JobView(StreamView):
    """A live, read-only view of a job: the fold of all its recorded inputs and its recorded decisions.

    Members do not decide anything from this view — the synchronizer does — but they read it to
    know the latest version, who is alive, and to wait for decisions about them.
    """

    _ABSENCE_ROLES = (Role.TRAINER, Role.EXPLORER)

    def __init__(self, conn: BusConnection, *, log=None,
                 backfill: Callable[[int, int], list[Recorded]] | None = None):
        super().__init__(conn, log=log, backfill=backfill)
        self.state = State.initial()
        self.broadcast_version = 0  # the newest version a trainer reported broadcast (rendezvous)

    async def start(self, *, catch_up: bool = True, from_snapshot: bool = True) -> int:
        """Fold everything recorded so far (from the newest reducer snapshot, if there is one, plus
        the stream after it), then follow live. Returns the stream's last sequence at start.

        A server restarting, or a cluster electing a stream leader, is waited out (`START_PATIENCE_S`),
        not taken as the end of the role that is starting."""
        end = await last_sequence(self._conn, patience_s=START_PATIENCE_S)
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
        self._start_following(from_seq)
        if catch_up and end >= from_seq:
            await self.read_to(end, timeout=START_PATIENCE_S, what=f"catch up to seq {end}")
        return end

    def _open_reader(self, from_seq: int) -> EventReader:
        return read_events(self._conn, from_seq=from_seq, include_decisions=True, backfill=self._backfill)

    def _on_decision(self, rec: Recorded) -> Recorded:
        if isinstance(rec.event, RendezvousReady):  # its ranks are the group this fold holds
            return Recorded(seq=rec.seq, time_ms=rec.time_ms, event=self.state.group.bind(rec.event),
                            subject=rec.subject)
        return rec

    def _fold_input(self, rec: Recorded) -> IllegalEvent | None:
        if isinstance(rec.event, WeightsBroadcast):
            self.broadcast_version = max(self.broadcast_version, rec.event.version)
        # Illegal inputs are skipped exactly as the synchronizer skips them.
        self.state, _, error = reduce_lenient(self.state, rec)
        return error

    # -- what the roles read -------------------------------------------------------------------------
    def _members_of(self, role: Role) -> list[MemberState]:
        return [m for m in self.state.members.values() if m.ref.role is role]

    def member_state(self, key: str) -> MemberState | None:
        return self.state.members.get(key)

    @property
    def latest(self) -> LatestVersion:
        """The newest version the trainer published."""
        return self.state.latest

    @property
    def trainer(self) -> MemberState | None:
        """The job's trainer (the last one that joined), if any."""
        return self.state.trainer_state

    def trainer_waiting(self) -> bool:
        """The trainer asked for a sync and its round is still open."""
        return any(r.opened_by.role is Role.TRAINER for r in self.state.rounds.values())
