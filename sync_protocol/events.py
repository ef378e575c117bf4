"""Events of a job, named as facts: what members report (inputs) and what the synchronizer decides.

Theory of operation
-------------------
Members (trainer, explorers) and the synchronizer's own timers publish *input events* into the job's
stream. The reducer folds inputs, in stream order, into state and emits *decisions*. Decisions are
pure functions of the inputs before them, so any replica (or `rolectl replay`) recomputes them
exactly; they carry the stream sequence of the input that caused them (`cause_seq`).

Every input carries the identity of the member that published it (`MemberRef`: role, id,
incarnation). A recorded event (`Recorded`) also carries its stream sequence and server timestamp.

Wire types are frozen msgspec `Struct`s tagged by `kind`: msgspec checks every field's type when a
message is decoded (`codec`), and constructors trust their arguments, as the reducer's do. Code
that builds an event from untrusted values goes through `codec.from_plain`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, ClassVar

import msgspec

from .config import SyncConfig
from .enums import ReleaseReason, ResumeReason, Role, RoundOutcome, RunningStatus, SyncMethod
from .errors import UnboundRendezvous

__all__ = [
    "MemberRef",
    "RankAssignment",
    "membership_digest",
    "Event",
    "Decision",
    "Recorded",
    # inputs
    "JobConfigured",
    "MemberJoined",
    "StatusChanged",
    "VersionPublished",
    "NoNewVersion",
    "WeightsLoaded",
    "WeightsBroadcast",
    "SyncFailed",
    "StepFinished",
    "StalenessTally",
    "StepsRolledBack",
    "TasksTaken",
    "EvalFinished",
    "MemberExpired",
    "RoundTimedOut",
    # decisions
    "RoundOpened",
    "RendezvousReady",
    "MemberReleased",
    "RoundClosed",
    "ExplorerPaused",
    "ExplorersResumed",
    "INPUT_KINDS",
    "DECISION_KINDS",
    "KINDS",
    "AnyEvent",
    "decision_identity",
]


# --------------------------------------------------------------------------------------------------
# identities


class MemberRef(msgspec.Struct, frozen=True, kw_only=True, dict=True, rename={"incarnation": "inc"}):
    """Who published an event: role, member id (unique per role in a job) and incarnation.

    The incarnation grows each time the same member id starts again (a restart), so events of a
    dead incarnation can be told apart from the new one's. On the wire: `{role, id, inc}`.
    """

    role: Role
    id: Annotated[str, msgspec.Meta(min_length=1)]
    incarnation: int  # no default: a message without `inc` names no incarnation and is refused

    # `dict=True` gives the instance a `__dict__` for this cache alone (never sent, never compared):
    # the reducer looks the key up several times for every event it folds.
    @cached_property
    def key(self) -> str:
        """`role/id`: the member's name across incarnations."""
        return f"{self.role.value}/{self.id}"

    def __str__(self) -> str:
        return f"{self.role.value}/{self.id}#{self.incarnation}"


class RankAssignment(msgspec.Struct, frozen=True, kw_only=True):
    """One participant's place in a rendezvous group: ranks [rank_offset, rank_offset + ranks)."""

    member: MemberRef
    rank_offset: int
    ranks: int


_DIGEST_ENCODER = msgspec.msgpack.Encoder()


def membership_digest(participants: Sequence[RankAssignment]) -> str:
    """`sha256:<hex>` of a group's explorers in rank order (role, id, incarnation, offset, ranks):
    what a `RendezvousReady` names its group by, instead of listing it."""
    rows = [(p.member.role.value, p.member.id, p.member.incarnation, p.rank_offset, p.ranks)
            for p in participants]
    return "sha256:" + hashlib.sha256(_DIGEST_ENCODER.encode(rows)).hexdigest()


# --------------------------------------------------------------------------------------------------
# base classes
#
# The bases are not keyword-only, so their fields come first on the wire as they always have
# (msgspec puts keyword-only fields after positional ones); every concrete kind is keyword-only.


class Event(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    """An input event: a fact a member (or the synchronizer's clock) reports."""

    KIND: ClassVar[str]
    member: MemberRef


class Decision(msgspec.Struct, frozen=True, tag_field="kind", forbid_unknown_fields=True):
    """A decision the reducer made about one sync round, caused by the input at `cause_seq`."""

    KIND: ClassVar[str]
    round: int
    cause_seq: int


# --------------------------------------------------------------------------------------------------
# inputs


class JobConfigured(Event, frozen=True, kw_only=True, tag="job_configured"):
    """A member started with this sync config. The first in the stream is the job's; a different
    one later is illegal (a member runs with a config the job was not started with).

    `train_batch_tasks` is the tasks a train step takes: the unit of `config.max_ahead` (None in a
    record of an older build, or where no bound is set)."""

    config: SyncConfig
    train_batch_tasks: int | None = None


class MemberJoined(Event, frozen=True, kw_only=True, tag="member_joined"):
    """A member (incarnation) is up. `step`/`version` are where it resumes; `ranks` is how many
    receiving ranks an explorer brings to a rendezvous group (engine_num x tensor_parallel_size)."""

    host: str
    pid: int
    step: int
    version: int
    ranks: int = 1


class StatusChanged(Event, frozen=True, kw_only=True, tag="status_changed"):
    """A member's running status changed at `step`, holding weights `version`.

    A trainer entering REQUIRE_SYNC for a rendezvous method offers `rendezvous` = "host:port" where
    its rank 0 listens for the group it would form.

    `final` marks a STOPPED that ends the member's work for good: the trainer trained its last
    step, an explorer exhausted its task set. Any other STOPPED (Ctrl-C, a crash-time cleanup) is
    a pause: a restart may follow, and nobody gives up on the member because of it.

    `metrics` on a STOPPED are the member's totals at its end (a trainer's experiences dropped as
    stale after its last StepFinished are counted only here).

    `interrupted` marks a STOPPED asked for by a stop signal (Ctrl-C, SIGTERM), not by the member's
    own end or failure: what the job's summary calls "interrupted".
    """

    status: RunningStatus
    step: int
    version: int
    rendezvous: str | None = None
    final: bool = False
    metrics: Mapping[str, float] = msgspec.field(default_factory=dict)
    interrupted: bool = False


class VersionPublished(Event, frozen=True, kw_only=True, tag="version_published"):
    """The trainer stored every byte of weights `version` (after train step `step`) at `location`
    (object-store name or checkpoint path) via `method`; `digest` covers all bytes."""

    version: int
    step: int
    method: SyncMethod
    location: str
    nbytes: int
    digest: str


class NoNewVersion(Event, frozen=True, kw_only=True, tag="no_new_version"):
    """The trainer was asked for weights (explorer_driven) and has none newer than `version`."""

    version: int
    step: int


class WeightsLoaded(Event, frozen=True, kw_only=True, tag="weights_loaded"):
    """An explorer now explores with weights `version` (from round `round`, or in the background)."""

    version: int
    round: int | None = None
    nbytes: int = 0
    seconds: float = 0.0


class WeightsBroadcast(Event, frozen=True, kw_only=True, tag="weights_broadcast"):
    """The trainer finished sending weights `version` to a rendezvous round's group."""

    version: int
    round: int
    nbytes: int = 0
    seconds: float = 0.0


class SyncFailed(Event, frozen=True, kw_only=True, tag="sync_failed"):
    """A member's part of a weight transfer failed; it goes on with the weights it had."""

    version: int
    reason: str
    round: int | None = None


class StalenessTally(msgspec.Struct, frozen=True, kw_only=True):
    """The trainer's staleness verdicts while it filled one step, with the facts they follow from.

    `ages` pairs how many versions behind the trainer an experience was when it was judged with how
    many experiences were that far behind (every experience taken off the stream for the step:
    trained, corrected or dropped); `dropped` and `corrected` are the verdicts the trainer acted on.
    A verdict depends on the age and the job's config alone (`boundaries.verdict_of_age`), so
    `replay --check` recomputes both counts from `ages`."""

    ages: tuple[tuple[int, int], ...]
    dropped: int = 0
    corrected: int = 0


class StepFinished(Event, frozen=True, kw_only=True, tag="step_finished"):
    """A member finished train/explore step `step` with weights `version`; `metrics` are its figures
    (reward, loss, experiences dropped as stale, ...). It never opens a round.

    `tasks` is the member's running total of tasks (groups), given where the job bounds how far
    explorers run ahead (`SyncConfig.max_ahead`): an explorer's produced (published) so far, the
    trainer's taken off the experience stream (trained or dropped) so far. The reducer
    paces explorers by the two (`ExplorerPaused`, `ExplorersResumed`).

    `staleness` is the trainer's staleness verdicts for the step, where the job bounds staleness
    (`SyncConfig.max_staleness`; None otherwise, and from an explorer)."""

    step: int
    version: int
    metrics: Mapping[str, float] = msgspec.field(default_factory=dict)
    tasks: int | None = None
    staleness: StalenessTally | None = None


class TasksTaken(Event, frozen=True, kw_only=True, tag="tasks_taken"):
    """The trainer took `tasks` tasks off the experience stream so far (its running total, as in
    `StepFinished.tasks`) while filling a step: it dropped some as stale, and explorers the core
    paused wait for its count to move, which without this would move only with its next step (a
    step that may need what they would produce). Only where explorers are paced (`max_ahead`)."""

    tasks: int


class StepsRolledBack(Event, frozen=True, kw_only=True, tag="steps_rolled_back"):
    """The trainer resumed from a checkpoint of step `to_step` after reporting steps up to
    `from_step`: steps `to_step + 1 .. from_step` are trained again, and each one's new
    StepFinished replaces the one recorded before (a kill -9 between two checkpoints). A record
    for those who count steps: the reducer decides nothing on it."""

    from_step: int
    to_step: int


class EvalFinished(Event, frozen=True, kw_only=True, tag="eval_finished"):
    """An explorer evaluated weights `version` on the eval set after explore step `step`:
    `rewards` is each reward's mean over `responses` responses to `tasks` tasks, in `seconds`.
    A record for the eval curve only: the reducer decides nothing on it."""

    version: int
    step: int
    rewards: Mapping[str, float] = msgspec.field(default_factory=dict)
    tasks: int = 0
    responses: int = 0
    seconds: float = 0.0


class MemberExpired(Event, frozen=True, kw_only=True, tag="member_expired"):
    """The synchronizer's clock saw no heartbeat from `expired` for `silent_for` seconds."""

    expired: MemberRef
    silent_for: float


class RoundTimedOut(Event, frozen=True, kw_only=True, tag="round_timed_out"):
    """The synchronizer's clock passed round `round`'s deadline (opened_at + sync_timeout)."""

    round: int


# --------------------------------------------------------------------------------------------------
# decisions


class RoundOpened(Decision, frozen=True, kw_only=True, tag="round_opened"):
    """Round `round` opened: `opened_by` is waiting for weights via `method`. In explorer_driven
    style this is also the trainer's cue. `opened_at_ms` (server time of the cause) fixes the
    deadline `opened_at_ms + sync_timeout` identically for every replica."""

    method: SyncMethod
    opened_by: MemberRef
    version: int
    opened_at_ms: int


class RendezvousReady(Decision, frozen=True, kw_only=True, tag="rendezvous_ready", dict=True):
    """REQUIRE_SYNC is satisfied for a rendezvous method: the trainer (rank 0) and `explorers`
    explorers meet now in group `epoch` of `world_size` ranks; a new epoch means the group must be
    re-formed.

    The group's rank assignments are not in the message: at a thousand explorers they alone would
    pass the stream's 64 KiB message limit. They are `State.group`, which every reader folds from
    the same records, sorted by member id after the trainer; the decision names them by `epoch`,
    their count and `membership` (their `membership_digest`), so a reader proves it holds the very
    group decided before it takes a rank. The reducer's own decisions come bound to them; a reader
    binds a recorded one with `GroupState.bind`, and `participants` / `assignment_of` read them.
    (Schema 4 and earlier listed them; such a record decodes bound to its own list.)
    """

    method: SyncMethod
    version: int
    epoch: int
    master_addr: str
    master_port: int
    world_size: int
    explorers: int
    membership: str

    @classmethod
    def for_group(cls, *, round: int, cause_seq: int, method: SyncMethod, version: int, epoch: int,
                  master_addr: str, master_port: int,
                  participants: Sequence[RankAssignment]) -> RendezvousReady:
        """The decision for a group of `participants` (the explorers, in rank order), bound to them:
        world size, count and digest are derived from the list."""
        members = tuple(participants)
        ready = cls(round=round, cause_seq=cause_seq, method=method, version=version, epoch=epoch,
                    master_addr=master_addr, master_port=master_port,
                    world_size=1 + sum(p.ranks for p in members), explorers=len(members),
                    membership=membership_digest(members))
        ready.__dict__["_participants"] = members  # derived, never sent (see `participants`)
        return ready

    def bound(self, participants: Sequence[RankAssignment]) -> RendezvousReady:
        """A copy of this decision holding `participants`, which must be the group it names
        (count, world size and digest); `UnboundRendezvous` saying what differs otherwise."""
        members = tuple(participants)
        ranks = 1 + sum(p.ranks for p in members)
        if len(members) != self.explorers or ranks != self.world_size:
            raise UnboundRendezvous(
                f"round {self.round}: the group held here has {len(members)} explorers and {ranks} "
                f"ranks, the decision names {self.explorers} and {self.world_size} (epoch {self.epoch})")
        digest = membership_digest(members)
        if digest != self.membership:
            raise UnboundRendezvous(f"round {self.round}: the group held here ({digest}) is not the one "
                                    f"decided ({self.membership}, epoch {self.epoch})")
        copy = msgspec.structs.replace(self)
        copy.__dict__["_participants"] = members
        return copy

    @property
    def is_bound(self) -> bool:
        """Whether this decision holds its group's rank assignments."""
        return "_participants" in self.__dict__

    @property
    def participants(self) -> tuple[RankAssignment, ...]:
        """Every explorer's place in the group, in rank order (the trainer is rank 0, not listed)."""
        members: tuple[RankAssignment, ...] | None = self.__dict__.get("_participants")
        if members is None:
            raise UnboundRendezvous(
                f"round {self.round}: RendezvousReady names group epoch {self.epoch} ({self.explorers} "
                f"explorers, {self.membership}) without listing it, and was not bound to that group: bind "
                "it to the group folded from the inputs before it (GroupState.bind, as the job view does); "
                "a reader whose fold holds another group (another epoch or digest) cannot")
        return members

    # Derived, never sent: every receiver looks itself up, and a view serving many members would
    # scan the list once per member; this builds the index once per decision.
    @cached_property
    def _assignments(self) -> Mapping[MemberRef, RankAssignment]:
        index: dict[MemberRef, RankAssignment] = {}
        for p in self.participants:
            index.setdefault(p.member, p)  # the first, as a scan of the list would find
        return index

    def assignment_of(self, member: MemberRef) -> RankAssignment | None:
        """`member`'s place in the group (this exact incarnation), or None if it is not in it.
        `UnboundRendezvous` when the decision holds no group (see the class docstring)."""
        return self._assignments.get(member)


class MemberReleased(Decision, frozen=True, kw_only=True, tag="member_released"):
    """A waiting member may go on. With reason new_version it should hold `version` (fetching it
    from `location` when `reload`); otherwise it keeps the weights it has."""

    released: MemberRef
    reason: ReleaseReason
    version: int
    reload: bool
    location: str | None = None
    digest: str | None = None
    nbytes: int = 0


class RoundClosed(Decision, frozen=True, kw_only=True, tag="round_closed"):
    """Round `round` ended with `outcome`. Every round is closed exactly once."""

    outcome: RoundOutcome


class ExplorerPaused(Decision, frozen=True, kw_only=True, tag="explorer_paused"):
    """Explorer `explorer` finished explore step `step` with the explorers' tasks `produced` at or
    past `limit` beyond the `consumed` the trainer took (`limit` = (max_ahead + 1) x
    train_batch_tasks): it explores no further until an `ExplorersResumed`. `round` is 0: no sync
    round is involved."""

    explorer: MemberRef
    step: int
    produced: int
    consumed: int
    limit: int


class ExplorersResumed(Decision, frozen=True, kw_only=True, tag="explorers_resumed"):
    """Every paused explorer (`paused` of them) may explore again: the trainer caught up (produced
    is below consumed + the limit again) or finished. One decision for the whole fleet; an explorer
    knows it was paused by its `ExplorerPaused`. `round` is 0."""

    reason: ResumeReason
    paused: int
    produced: int
    consumed: int


INPUT_KINDS: dict[str, type[Event]] = {
    str(cls.__struct_config__.tag): cls
    for cls in (
        JobConfigured,
        MemberJoined,
        StatusChanged,
        VersionPublished,
        NoNewVersion,
        WeightsLoaded,
        WeightsBroadcast,
        SyncFailed,
        StepFinished,
        StepsRolledBack,
        TasksTaken,
        EvalFinished,
        MemberExpired,
        RoundTimedOut,
    )
}
DECISION_KINDS: dict[str, type[Decision]] = {
    str(cls.__struct_config__.tag): cls for cls in (RoundOpened, RendezvousReady, MemberReleased, RoundClosed,
                                                    ExplorerPaused, ExplorersResumed)
}
KINDS: dict[str, type[Event] | type[Decision]] = {**INPUT_KINDS, **DECISION_KINDS}

# `KIND` is the msgspec tag, readable as a plain class attribute (`event.KIND`, `cls.KIND`).
for _kind, _cls in KINDS.items():
    _cls.KIND = _kind
del _kind, _cls

AnyEvent = Event | Decision


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """An event as the stream recorded it: its sequence number and the server's timestamp (ms).

    `subject` is the subject it was recorded on, where the reader knows it (the bus reader and
    exports do); it is evidence about the record, not part of its meaning, so equality ignores it.
    """

    seq: int
    time_ms: int
    event: Event | Decision
    subject: str | None = field(default=None, compare=False)


def decision_identity(decision: Decision) -> tuple[str, int, int, str]:
    """What makes two decisions "the same one" (kind, round, cause, the member it releases or
    pauses): replicas and replay line decisions up by it, and the bus derives a decision's message
    id from it."""
    if isinstance(decision, MemberReleased):
        member = decision.released.key
    elif isinstance(decision, ExplorerPaused):
        member = decision.explorer.key
    else:
        member = ""
    return (decision.KIND, decision.round, decision.cause_seq, member)
