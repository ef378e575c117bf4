"""The job's sync state as the reducer folds it: members, latest version, open rounds, the group.

Every class here is a frozen msgspec `Struct` (slotted, no `__dict__`) and every mapping a read-only
view (the members an immutable `MemberMap`, a round's member keys `MemberKeys`), so a state returned
by `reduce` can be kept, shared between threads, compared and replayed; nothing ever changes it. The
reducer builds successors with `msgspec.structs.replace`, which copies without re-validating (the
reducer only ever writes well-typed values).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from types import MappingProxyType

import msgspec

from .config import SyncConfig
from .enums import Role, RunningStatus, SyncMethod
from .errors import UnboundRendezvous
from .events import MemberRef, RankAssignment, RendezvousReady
from .members import MemberKeys, MemberMap

__all__ = [
    "MemberKeys",
    "member_keys",
    "RoundPhase",
    "LatestVersion",
    "MemberState",
    "RoundState",
    "GroupState",
    "State",
]


def _empty() -> Mapping[str, float]:
    return MappingProxyType({})


def member_keys(keys: Iterable[str] = ()) -> MemberKeys:
    """`keys`, in order, as `MemberKeys`. A rendezvous round of N explorers asks whether a key is
    there at every arrival and report, and adds or drops one: a scan (tuples) or a whole copy (dicts)
    each time made a round cost O(N^2); `MemberKeys` looks up once and copies one page."""
    return MemberKeys(keys)


_NO_KEYS = MemberKeys()  # one for every default: it never changes, and its successors share nothing with it


class RoundPhase(str, Enum):
    """Where an open round is. Pull rounds only ever wait; rendezvous rounds then transfer."""

    WAITING = "waiting"  # members are blocked in REQUIRE_SYNC
    TRANSFERRING = "transferring"  # RendezvousReady was sent; waiting for every participant's report

    def __str__(self) -> str:
        return self.value


class LatestVersion(msgspec.Struct, frozen=True, kw_only=True):
    """The newest weights the trainer published. Version 0 is the base model, present everywhere."""

    version: int = 0
    step: int = 0
    method: SyncMethod | None = None
    location: str | None = None
    digest: str | None = None
    nbytes: int = 0


class MemberState(msgspec.Struct, frozen=True, kw_only=True):
    """What the synchronizer knows about one member (its current incarnation).

    `version` is the weights it holds (an explorer starts at -1: nothing loaded yet; the base model is
    0). `rendezvous` is the "host:port" a trainer offered with its last REQUIRE_SYNC.
    """

    ref: MemberRef
    status: RunningStatus = RunningStatus.RUNNING
    step: int = 0
    version: int = -1
    ranks: int = 1
    host: str = ""
    alive: bool = True
    joined_seq: int = 0
    last_seq: int = 0
    last_time_ms: int = 0
    rendezvous: str | None = None
    metrics: Mapping[str, float] = msgspec.field(default_factory=_empty)
    finished: bool = False  # it stopped for good (StatusChanged final): its work is done
    tasks: int = 0  # its last reported running total of tasks (StepFinished.tasks), kept across restarts

    @property
    def key(self) -> str:
        return self.ref.key

    @property
    def role(self) -> Role:
        return self.ref.role

    @property
    def condition(self) -> str:
        """What a person is told: running / require_sync / stopped, or expired (gone without saying
        STOPPED). The one wording the reducer's errors, `rolectl status` and the dashboard share."""
        if self.alive:
            return self.status.value
        return "stopped" if self.status is RunningStatus.STOPPED else "expired"


class RoundState(msgspec.Struct, frozen=True, kw_only=True):
    """One open sync round.

    Pull rounds (checkpoint, memory) have one waiter, the explorer that asked. Rendezvous rounds (nccl,
    cuda_ipc) list every expected `participants` (the trainer and each live explorer, keys in arrival
    order: `MemberKeys`) and, in `waiting`, those already blocked in REQUIRE_SYNC; once all are there the round
    transfers `version` in group `epoch`, and `reported` collects who finished.
    """

    id: int
    method: SyncMethod
    opened_by: MemberRef
    opened_at_ms: int
    opened_seq: int
    waiting: MemberKeys = _NO_KEYS
    participants: MemberKeys = _NO_KEYS
    phase: RoundPhase = RoundPhase.WAITING
    version: int = 0
    epoch: int = 0
    reported: MemberKeys = _NO_KEYS

    @property
    def is_rendezvous(self) -> bool:
        return self.method.is_rendezvous


class GroupState(msgspec.Struct, frozen=True, kw_only=True):
    """The last rendezvous group formed: its epoch and ranks (trainer at rank 0 first, then the
    explorers sorted by member id).

    `broken` is set when a transfer in this group failed; the next rendezvous then starts a new epoch
    even if membership is unchanged, so every member re-forms the group instead of reusing a dead one.

    This is the membership record a `RendezvousReady` refers to: every reader folds it from the
    same records, so the decision names it (epoch, count, digest) instead of listing it.
    """

    epoch: int = 0
    members: tuple[RankAssignment, ...] = ()
    broken: bool = False

    @property
    def participants(self) -> tuple[RankAssignment, ...]:
        """The explorers' places, in rank order (the members after the trainer's rank 0)."""
        return self.members[1:]

    def bind(self, ready: RendezvousReady) -> RendezvousReady:
        """`ready` holding this group's rank assignments when it names this group (its epoch,
        count and digest), else `ready` as it is: a decision bound already (the reducer's own, or
        one recorded by schema 4 with its list) is returned unchanged, and one naming another
        group stays unbound, so asking it for ranks raises `UnboundRendezvous` saying why."""
        if ready.is_bound or ready.epoch != self.epoch:
            return ready
        try:
            return ready.bound(self.participants)
        except UnboundRendezvous:
            return ready


class State(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the reducer knows about one job, as of stream sequence `last_seq`.

    `members` is keyed by `MemberRef.key` ("role/id"); `rounds` holds open rounds only, by id. Round
    ids are handed out 1, 2, 3, ... in fold order, so every replica names rounds identically.
    `trainer` is the key of the job's trainer (the last one that joined), if any.

    The pace of explorers (`SyncConfig.max_ahead`): `tasks_produced` is the sum of every explorer's
    reported tasks, the trainer's own `tasks` what it took; `paused` the explorers an
    `ExplorerPaused` stopped (keys, in pause order) until the next `ExplorersResumed`;
    `train_batch_tasks` the unit of the bound (from `JobConfigured`); `explorer_pauses` counts pauses.
    """

    config: SyncConfig | None = None
    members: MemberMap = msgspec.field(default_factory=MemberMap)
    latest: LatestVersion = msgspec.field(default_factory=LatestVersion)
    rounds: MappingProxyType[int, RoundState] = msgspec.field(default_factory=lambda: MappingProxyType({}))
    next_round: int = 1
    group: GroupState = msgspec.field(default_factory=GroupState)
    last_seq: int = 0
    trainer: str | None = None
    rounds_closed: int = 0
    syncs_completed: int = 0
    versions_published: int = 0
    train_batch_tasks: int | None = None
    tasks_produced: int = 0
    paused: tuple[str, ...] = ()
    explorer_pauses: int = 0

    @classmethod
    def initial(cls, config: SyncConfig | None = None) -> State:
        """The state before any event: no members, base model (version 0) only, no rounds.

        Passing `config` stands for a JobConfigured already folded (handy in tests and tools); a
        later JobConfigured must then carry the same config.
        """
        return cls(config=config)

    # Read helpers for roles and the dashboard; the reducer itself reads fields directly.

    def member(self, who: MemberRef | str) -> MemberState | None:
        """The state of a member, by `MemberRef` or "role/id" key."""
        return self.members.get(who if isinstance(who, str) else who.key)

    @property
    def trainer_state(self) -> MemberState | None:
        return self.members.get(self.trainer) if self.trainer is not None else None

    def explorers(self, *, alive_only: bool = True) -> tuple[MemberState, ...]:
        """Explorers in join order (only live ones unless `alive_only` is False)."""
        return tuple(
            m for m in self.members.values()
            if m.ref.role is Role.EXPLORER and (m.alive or not alive_only)
        )

    @property
    def tasks_consumed(self) -> int:
        """The tasks the trainer reported it took off the experience stream (0 before it reported)."""
        trainer = self.trainer_state
        return trainer.tasks if trainer is not None else 0

    def ahead_limit(self) -> int | None:
        """How far the explorers' tasks may run past the trainer's before one pauses:
        `(max_ahead + 1) x train_batch_tasks` (its next step's batch and `max_ahead` more); None
        when unbounded, or before the job's config and its unit are known."""
        config = self.config
        if config is None or config.max_ahead is None or not self.train_batch_tasks:
            return None
        return (config.max_ahead + 1) * self.train_batch_tasks

    def round_of(self, who: MemberRef | str) -> RoundState | None:
        """The open round `who` is waiting in or taking part in, if any."""
        key = who if isinstance(who, str) else who.key
        for rnd in self.rounds.values():
            if key in rnd.waiting or key in rnd.participants:
                return rnd
        return None
