"""The pure reducer: fold one recorded input into the job's state and derive the sync decisions.

Theory of operation
-------------------
`reduce(state, recorded)` is the whole protocol. It reads nothing but its arguments, so every
replica of the synchronizer, a restarted one, and `rolectl replay` compute the same states and the
same decisions from the same stream.

* Inputs are `events.Event` facts. Recorded decisions are outputs of an earlier fold; when one comes
  back in (it shares the stream) it only advances `last_seq`.
* A sequence at or below `state.last_seq` was already applied: redelivery is a no-op.
* Who may send what is the `SENDERS` table; an input from a member that never joined, from a stale
  incarnation, or from a stopped/expired one is an `IllegalEvent` (the old state stays valid).
* Members: RUNNING --StatusChanged(require_sync)--> REQUIRE_SYNC --released / round closed-->
  RUNNING; STOPPED or expiry leaves every round for good (a restart joins as a new incarnation).
* Rounds: one per sync request for pull methods (checkpoint, memory); one shared round per
  rendezvous for nccl / cuda_ipc. Every way a round moves or ends is a row of `ROUND_TRANSITIONS`,
  keyed by (kind, phase, trigger); `PULL_POLICY` says what a pull request does, per style, when no
  newer version exists. The handlers only pick the trigger; the table says what follows.
* Before a JobConfigured is folded nothing is decided (members and versions are still recorded);
  the JobConfigured then evaluates every pending REQUIRE_SYNC as if it had just arrived.
* Pace (`SyncConfig.max_ahead`): explorers and the trainer report running totals of tasks in their
  `StepFinished`; an explorer whose step leaves the explorers' tasks `(max_ahead + 1) x
  train_batch_tasks` or more past the trainer's is paused, and every paused explorer resumes when
  the trainer catches up or finishes. Every move is a row of `PACE_TRANSITIONS`.

Each call works on a `_Tx`: the predecessor's fields as typed attributes, a private copy of the
member map, and the round map copied on first write; `commit` builds the successor `State`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any

from msgspec.structs import replace

from .boundaries import needs_reload
from .config import SyncConfig
from .describe import describe, describe_config
from .enums import (
    ReleaseReason,
    ResumeReason,
    Role,
    RoundOutcome,
    RunningStatus,
    SyncStyle,
)
from .errors import IllegalEvent
from .events import (
    Decision,
    EvalFinished,
    Event,
    ExplorerPaused,
    ExplorersResumed,
    JobConfigured,
    MemberExpired,
    MemberJoined,
    MemberReleased,
    NoNewVersion,
    RankAssignment,
    Recorded,
    RendezvousReady,
    RoundClosed,
    RoundOpened,
    RoundTimedOut,
    StatusChanged,
    StepFinished,
    StepsRolledBack,
    SyncFailed,
    TasksTaken,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
)
from .members import MemberMap
from .state import GroupState, LatestVersion, MemberKeys, MemberState, RoundPhase, RoundState, State, member_keys

__all__ = [
    "reduce",
    "reduce_lenient",
    "fold",
    "fold_lenient",
    "Trigger",
    "Transition",
    "ROUND_TRANSITIONS",
    "TRIGGER_CAUSES",
    "PULL_POLICY",
    "SENDERS",
    "Pace",
    "PaceTrigger",
    "PaceTransition",
    "PACE_TRANSITIONS",
    "PACE_CAUSES",
    "transitions_markdown",
    "pace_markdown",
    "parse_rendezvous",
]

_RUNNING = RunningStatus.RUNNING
_REQUIRE_SYNC = RunningStatus.REQUIRE_SYNC
_STOPPED = RunningStatus.STOPPED
_TRAINER = Role.TRAINER
_EXPLORER = Role.EXPLORER
_SYNCHRONIZER = Role.SYNCHRONIZER
_WAITING = RoundPhase.WAITING
_TRANSFERRING = RoundPhase.TRANSFERRING


# ==================================================================================================
# The transition tables: everything the protocol decides, as data


class Trigger(str, Enum):
    """What happened to an open round (the handlers map inputs to these)."""

    NEW_VERSION = "new_version"  # a version newer than the waiter's exists (published, or already)
    NO_NEW_VERSION = "no_new_version"  # the trainer has nothing newer, or the style never waits
    TRAINER_LEFT = "trainer_left"  # the trainer finished its last step (or had when asked)
    TIMED_OUT = "timed_out"  # RoundTimedOut: the synchronizer's clock passed the deadline
    NOBODY_WAITING = "nobody_waiting"  # every waiter stopped, expired or withdrew
    NO_EXPLORERS = "no_explorers"  # a rendezvous round has no live explorer left to send to
    ALL_ARRIVED = "all_arrived"  # the trainer and every live explorer are in REQUIRE_SYNC
    ALL_REPORTED = "all_reported"  # every participant reported its part of the transfer done
    SYNC_FAILED = "sync_failed"  # a participant reported SyncFailed for this round
    PARTICIPANT_LEFT = "participant_left"  # a participant stopped or expired mid-transfer

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Transition:
    """What a trigger does to a round: its next phase, or its outcome when it closes; the reason
    every still-waiting live member is released with (None: nobody to release); whether the group
    must be re-formed next time."""

    outcome: RoundOutcome | None = None  # None: the round stays open
    next_phase: RoundPhase | None = None
    release: ReleaseReason | None = None
    breaks_group: bool = False


_PULL, _RDV = "pull", "rendezvous"

ROUND_TRANSITIONS: Mapping[tuple[str, RoundPhase, Trigger], Transition] = MappingProxyType({
    # pull rounds (checkpoint, memory): one explorer waits for a version newer than its own
    (_PULL, _WAITING, Trigger.NEW_VERSION): Transition(RoundOutcome.COMPLETED, release=ReleaseReason.NEW_VERSION),
    (_PULL, _WAITING, Trigger.NO_NEW_VERSION): Transition(RoundOutcome.NO_NEW_VERSION, release=ReleaseReason.NO_NEW_VERSION),
    (_PULL, _WAITING, Trigger.TRAINER_LEFT): Transition(RoundOutcome.TRAINER_STOPPED, release=ReleaseReason.TRAINER_STOPPED),
    (_PULL, _WAITING, Trigger.TIMED_OUT): Transition(RoundOutcome.TIMED_OUT, release=ReleaseReason.TIMED_OUT),
    (_PULL, _WAITING, Trigger.NOBODY_WAITING): Transition(RoundOutcome.ABANDONED),
    # rendezvous rounds (nccl, cuda_ipc), gathering: trainer + every live explorer must arrive
    (_RDV, _WAITING, Trigger.ALL_ARRIVED): Transition(next_phase=_TRANSFERRING),
    (_RDV, _WAITING, Trigger.NO_NEW_VERSION): Transition(RoundOutcome.NO_NEW_VERSION, release=ReleaseReason.NO_NEW_VERSION),
    (_RDV, _WAITING, Trigger.TRAINER_LEFT): Transition(RoundOutcome.TRAINER_STOPPED, release=ReleaseReason.TRAINER_STOPPED),
    (_RDV, _WAITING, Trigger.TIMED_OUT): Transition(RoundOutcome.TIMED_OUT, release=ReleaseReason.TIMED_OUT),
    # nothing to send to: free the trainer at once instead of letting it wait sync_timeout
    (_RDV, _WAITING, Trigger.NO_EXPLORERS): Transition(RoundOutcome.ABANDONED, release=ReleaseReason.NO_NEW_VERSION),
    (_RDV, _WAITING, Trigger.NOBODY_WAITING): Transition(RoundOutcome.ABANDONED),
    # rendezvous rounds, transferring: RendezvousReady was sent, every participant must report
    (_RDV, _TRANSFERRING, Trigger.ALL_REPORTED): Transition(RoundOutcome.COMPLETED),
    (_RDV, _TRANSFERRING, Trigger.SYNC_FAILED): Transition(RoundOutcome.FAILED, breaks_group=True),
    (_RDV, _TRANSFERRING, Trigger.PARTICIPANT_LEFT): Transition(RoundOutcome.FAILED, breaks_group=True),
    (_RDV, _TRANSFERRING, Trigger.TIMED_OUT): Transition(RoundOutcome.TIMED_OUT, breaks_group=True),
})

PULL_POLICY: Mapping[SyncStyle, Trigger | None] = MappingProxyType({
    # An explorer asks for weights and nothing newer than its own exists yet (and the trainer has
    # not finished). None: the round stays open until a version is published, NoNewVersion, the
    # trainer finishes, or the timeout (a trainer restart in between is waited through). In explorer_driven style the RoundOpened is the trainer's cue.
    SyncStyle.FIXED: None,
    SyncStyle.EXPLORER_DRIVEN: None,
    # The trainer drives when weights move: an explorer never waits for weights not yet produced.
    SyncStyle.TRAINER_DRIVEN: Trigger.NO_NEW_VERSION,
    SyncStyle.FULLY_ASYNC: Trigger.NO_NEW_VERSION,
})

# (tuples, not sets: membership is then an identity check; hashing an Enum calls Python code)
_MEMBERS = (_TRAINER, _EXPLORER)
_ANYONE = tuple(Role)
SENDERS: Mapping[type[Event], tuple[Role, ...]] = MappingProxyType({
    JobConfigured: _ANYONE,
    MemberJoined: _ANYONE,
    StatusChanged: _ANYONE,  # a synchronizer's status is recorded, never part of a round
    StepFinished: _ANYONE,
    EvalFinished: (_EXPLORER,),
    StepsRolledBack: (_TRAINER,),
    TasksTaken: (_TRAINER,),
    VersionPublished: (_TRAINER,),
    NoNewVersion: (_TRAINER,),
    WeightsBroadcast: (_TRAINER,),
    WeightsLoaded: (_EXPLORER,),
    SyncFailed: _MEMBERS,
    MemberExpired: (_SYNCHRONIZER,),  # clock events: the synchronizer's own
    RoundTimedOut: (_SYNCHRONIZER,),
})

# Inputs whose sender need not be a joined, live member: the job's config, a join itself, and the
# synchronizer's clock (replicas publish those without joining).
_NO_JOIN_NEEDED = frozenset({JobConfigured, MemberJoined, MemberExpired, RoundTimedOut})


TRIGGER_CAUSES: Mapping[Trigger, str] = MappingProxyType({
    Trigger.NEW_VERSION: "VersionPublished newer than the waiter's version, or one already exists "
                         "(or the waiter holds nothing yet: -1) when it asks",
    Trigger.NO_NEW_VERSION: "the trainer's NoNewVersion; for a pull request in trainer_driven / "
                            "fully_async style, at once",
    Trigger.TRAINER_LEFT: "the trainer finished: its final STOPPED after its last step (or it had "
                          "finished when asked). A trainer that expires, restarts or stops before "
                          "its last step is waited for: rounds stay open through its restart",
    Trigger.TIMED_OUT: "RoundTimedOut from the synchronizer's clock",
    Trigger.NOBODY_WAITING: "every waiter stopped, expired, restarted or went back to running",
    Trigger.NO_EXPLORERS: "no live explorer is left among the participants",
    Trigger.ALL_ARRIVED: "the trainer and every live explorer are in REQUIRE_SYNC: RendezvousReady",
    Trigger.ALL_REPORTED: "every participant sent WeightsLoaded / WeightsBroadcast for the round",
    Trigger.SYNC_FAILED: "a participant's SyncFailed for the round",
    Trigger.PARTICIPANT_LEFT: "a participant stops, expires or restarts",
})


def transitions_markdown() -> str:
    """`ROUND_TRANSITIONS` as a markdown table (the docs embed it verbatim; a test checks)."""
    lines = [
        "| round kind | phase | trigger | when | round becomes | waiting members released with "
        "| group |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (kind, phase, trigger), t in ROUND_TRANSITIONS.items():
        if t.outcome is not None:
            becomes = f"closed `{t.outcome.value}`"
        else:
            assert t.next_phase is not None, "a row that keeps the round open moves it"
            becomes = f"`{t.next_phase.value}`"
        release = f"`{t.release.value}`" if t.release else "—"
        group = "broken: next rendezvous starts a new epoch" if t.breaks_group else "—"
        lines.append(f"| {kind} | `{phase.value}` | `{trigger.value}` | {TRIGGER_CAUSES[trigger]} "
                     f"| {becomes} | {release} | {group} |")
    return "\n".join(lines)


class Pace(str, Enum):
    """Where an explorer is with respect to the bound on running ahead (`max_ahead`)."""

    EXPLORING = "exploring"
    PAUSED = "paused"

    def __str__(self) -> str:
        return self.value


class PaceTrigger(str, Enum):
    """What moves an explorer's pace (the handlers map inputs to these)."""

    AHEAD = "ahead"  # its step (or its join) left the explorers' tasks at or past the bound
    CAUGHT_UP = "caught_up"  # the tasks are below the bound again
    TRAINER_FINISHED = "trainer_finished"  # the trainer trained its last step
    LEFT = "left"  # the paused explorer stopped, expired or restarted

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class PaceTransition:
    """What a trigger does to an explorer's pace: its next pace, and the decision that says so
    (None: it just leaves the paused set, telling nobody). A resume moves every paused explorer
    at once, in one decision with `resume` as its reason."""

    becomes: Pace
    decision: type[Decision] | None = None
    resume: ResumeReason | None = None


PACE_TRANSITIONS: Mapping[tuple[Pace, PaceTrigger], PaceTransition] = MappingProxyType({
    (Pace.EXPLORING, PaceTrigger.AHEAD): PaceTransition(Pace.PAUSED, ExplorerPaused),
    (Pace.PAUSED, PaceTrigger.CAUGHT_UP): PaceTransition(Pace.EXPLORING, ExplorersResumed, ResumeReason.CAUGHT_UP),
    (Pace.PAUSED, PaceTrigger.TRAINER_FINISHED): PaceTransition(Pace.EXPLORING, ExplorersResumed,
                                                                ResumeReason.TRAINER_FINISHED),
    # its pause ends with it; a restart (a new incarnation) is exploring until its own next step
    (Pace.PAUSED, PaceTrigger.LEFT): PaceTransition(Pace.EXPLORING),
})

PACE_CAUSES: Mapping[PaceTrigger, str] = MappingProxyType({
    PaceTrigger.AHEAD: "an explorer's StepFinished (or its MemberJoined: a restart, a late joiner) leaves "
                       "the explorers' tasks at or past the trainer's + (max_ahead + 1) x train_batch_tasks "
                       "(and the trainer has not finished)",
    PaceTrigger.CAUGHT_UP: "after any report of tasks (the trainer's StepFinished, or its TasksTaken when it "
                           "drops stale experiences while filling a step), the explorers' "
                           "tasks are below the trainer's + (max_ahead + 1) x train_batch_tasks",
    PaceTrigger.TRAINER_FINISHED: "the trainer's final STOPPED after its last step",
    PaceTrigger.LEFT: "the paused explorer stops, expires or restarts",
})


def pace_markdown() -> str:
    """`PACE_TRANSITIONS` as a markdown table (the docs embed it verbatim; a test checks)."""
    lines = ["| pace | trigger | when | becomes | decision |", "| --- | --- | --- | --- | --- |"]
    for (pace, trigger), t in PACE_TRANSITIONS.items():
        decision = "—" if t.decision is None else f"`{t.decision.__name__}`"
        if t.resume is not None:
            decision += f" (`{t.resume.value}`; every paused explorer at once)"
        lines.append(f"| `{pace.value}` | `{trigger.value}` | {PACE_CAUSES[trigger]} | `{t.becomes.value}` "
                     f"| {decision} |")
    return "\n".join(lines)


# ==================================================================================================
# Public entry points


def reduce(state: State, recorded: Recorded) -> tuple[State, tuple[Decision, ...]]:
    """Fold one recorded input: the successor state and the decisions it causes, in order.

    Raises `IllegalEvent` (with `seq` set) for an input not allowed in `state`; `state` itself is
    untouched and stays the valid current state.
    """
    seq = recorded.seq
    if seq <= state.last_seq:
        return state, ()
    event = recorded.event
    route = _ROUTES.get(type(event)) or _route_of_subclass(recorded)
    if route is None:  # a recorded decision: derived from inputs, never an input itself
        return _with_last_seq(state, seq), ()
    assert isinstance(event, Event)  # only inputs have routes
    handler, senders, needs_member = route
    sender = event.member
    try:
        if sender.role not in senders:
            raise _illegal(event, f"only {_roles(senders)} may send {type(event).__name__}",
                           state.members.get(sender.key))
        tx = _Tx(state, seq, recorded.time_ms)
        if not needs_member:
            handler(tx, event, None)
            return tx.commit()
        key = sender.key
        member = state.members.get(key)
        if member is None or member.ref.incarnation != sender.incarnation or not member.alive:
            raise _not_live(event, member)
        handler(tx, event, tx.update_member(key, last_seq=seq, last_time_ms=recorded.time_ms))
        return tx.commit()
    except IllegalEvent as exc:
        exc.seq = seq
        raise


def _route_of_subclass(recorded: Recorded) -> _Route | None:
    """The route for a subclass of a known input; None for a decision; IllegalEvent otherwise."""
    event = recorded.event
    for cls in type(event).__mro__:
        if cls in _ROUTES:
            return _ROUTES[cls]
    if isinstance(event, Decision):
        return None
    raise IllegalEvent(f"record {recorded.seq} holds {type(event).__name__}, which is neither an "
                       "input event nor a decision", event=event, seq=recorded.seq)


def reduce_lenient(
    state: State, recorded: Recorded
) -> tuple[State, tuple[Decision, ...], IllegalEvent | None]:
    """Like `reduce`, but an illegal input is returned instead of raised and its sequence is marked
    consumed (only `last_seq` moves), so the shell goes on and a redelivery of it is a no-op."""
    try:
        new, decisions = reduce(state, recorded)
    except IllegalEvent as exc:
        return _with_last_seq(state, recorded.seq), (), exc
    return new, decisions, None


def fold(events: Iterable[Recorded], state: State | None = None) -> tuple[State, list[Decision]]:
    """Fold a stream from `state` (default: the initial state); stops at the first IllegalEvent."""
    if state is None:
        state = State.initial()
    decisions: list[Decision] = []
    extend = decisions.extend
    for recorded in events:
        state, caused = reduce(state, recorded)
        if caused:
            extend(caused)
    return state, decisions


def fold_lenient(
    events: Iterable[Recorded], state: State | None = None
) -> tuple[State, list[Decision], list[IllegalEvent]]:
    """Fold a stream, skipping illegal inputs (see `reduce_lenient`); returns them, in order."""
    if state is None:
        state = State.initial()
    decisions: list[Decision] = []
    errors: list[IllegalEvent] = []
    for recorded in events:
        state, caused, error = reduce_lenient(state, recorded)
        if caused:
            decisions.extend(caused)
        if error is not None:
            errors.append(error)
    return state, decisions, errors


def parse_rendezvous(address: str) -> tuple[str, int]:
    """Split a trainer's offered "host:port" ("[v6]:port" too); ValueError when malformed."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"rendezvous address {address!r} is not host:port")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"rendezvous port {port} is out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


# ==================================================================================================
# The working copy of one reduce call


def _with_last_seq(state: State, seq: int) -> State:
    return replace(state, last_seq=seq)


class _MemberWrites:
    """The member map under construction: the predecessor's `MemberMap` and this input's writes,
    read as one dict (writes first); `commit` makes the successor map, copying only what changed."""

    __slots__ = ("base", "writes")

    def __init__(self, base: MemberMap):
        self.base = base
        self.writes: dict[str, MemberState] = {}

    def __getitem__(self, key: str) -> MemberState:
        member = self.writes.get(key)
        return member if member is not None else self.base[key]

    def get(self, key: str) -> MemberState | None:
        member = self.writes.get(key)
        return member if member is not None else self.base.get(key)

    def __setitem__(self, key: str, member: MemberState) -> None:
        self.writes[key] = member

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in self.items())

    def items(self) -> Iterator[tuple[str, MemberState]]:
        """In join order, as a dict's: members joined before this input, then those it joined."""
        writes, base = self.writes, self.base
        for key, member in base.items():
            yield key, writes.get(key, member)
        for key, member in writes.items():
            if key not in base:
                yield key, member

    def commit(self) -> MemberMap:
        return self.base.with_changes(self.writes)


class _Tx:
    """The successor state under construction: the predecessor's fields, typed, changed in place.

    `members` reads through to the old member map and keeps this input's writes; `rounds` is the
    old read-only map until the first write copies it (most inputs touch no round).
    """

    __slots__ = ("config", "members", "latest", "rounds", "_old_rounds", "_own_rounds", "next_round", "group",
                 "trainer", "rounds_closed", "syncs_completed", "versions_published", "train_batch_tasks",
                 "tasks_produced", "paused", "explorer_pauses", "seq", "time_ms", "decisions")

    def __init__(self, state: State, seq: int, time_ms: int):
        self.config: SyncConfig | None = state.config
        self.members = _MemberWrites(state.members)
        self.latest: LatestVersion = state.latest
        self.rounds: Mapping[int, RoundState] = state.rounds
        self._old_rounds = state.rounds
        self._own_rounds: dict[int, RoundState] | None = None
        self.next_round: int = state.next_round
        self.group: GroupState = state.group
        self.trainer: str | None = state.trainer
        self.rounds_closed: int = state.rounds_closed
        self.syncs_completed: int = state.syncs_completed
        self.versions_published: int = state.versions_published
        self.train_batch_tasks: int | None = state.train_batch_tasks
        self.tasks_produced: int = state.tasks_produced
        self.paused: tuple[str, ...] = state.paused
        self.explorer_pauses: int = state.explorer_pauses
        self.seq = seq
        self.time_ms = time_ms
        self.decisions: list[Decision] = []

    def commit(self) -> tuple[State, tuple[Decision, ...]]:
        state = State(
            config=self.config,
            members=self.members.commit(),
            latest=self.latest,
            rounds=self._old_rounds if self._own_rounds is None else MappingProxyType(self._own_rounds),
            next_round=self.next_round,
            group=self.group,
            last_seq=self.seq,
            trainer=self.trainer,
            rounds_closed=self.rounds_closed,
            syncs_completed=self.syncs_completed,
            versions_published=self.versions_published,
            train_batch_tasks=self.train_batch_tasks,
            tasks_produced=self.tasks_produced,
            paused=self.paused,
            explorer_pauses=self.explorer_pauses,
        )
        return state, tuple(self.decisions)

    def update_member(self, key: str, **changes: Any) -> MemberState:
        member = self.members[key] = replace(self.members[key], **changes)
        return member

    def _writable_rounds(self) -> dict[int, RoundState]:
        if self._own_rounds is None:
            # the C copy of the dict under the proxy (`dict(proxy)` goes item by item): a pull
            # round of 1,024 explorers holds about 500 open rounds, copied when one opens or closes
            self.rounds = self._own_rounds = self._old_rounds.copy()
        return self._own_rounds

    def add_round(self, rnd: RoundState) -> None:
        self._writable_rounds()[rnd.id] = rnd

    def update_round(self, round_id: int, **changes: Any) -> RoundState:
        rnd = self._writable_rounds()[round_id] = replace(self.rounds[round_id], **changes)
        return rnd

    def drop_round(self, round_id: int) -> None:
        del self._writable_rounds()[round_id]

    def require_config(self) -> SyncConfig:
        """The job's config, for code that runs only once it is known."""
        assert self.config is not None, "a round decision before the job's config is known"
        return self.config

    def trainer_gone(self) -> bool:
        """True when a trainer joined and is no longer alive (stopped or expired)."""
        key = self.trainer
        return key is not None and not self.members[key].alive

    def trainer_finished(self) -> bool:
        """True when the trainer stopped for good after its last step (final STOPPED)."""
        key = self.trainer
        return key is not None and self.members[key].finished

    def live_trainer(self) -> MemberState | None:
        key = self.trainer
        if key is None:
            return None
        trainer = self.members[key]
        return trainer if trainer.alive else None


# ==================================================================================================
# Decisions: plain constructors, every field written from typed state


def _member_released(tx: _Tx, round_id: int, member: MemberState, reason: ReleaseReason) -> MemberReleased:
    if reason is ReleaseReason.NEW_VERSION:
        latest = tx.latest
        return MemberReleased(round=round_id, cause_seq=tx.seq, released=member.ref, reason=reason,
                              version=latest.version, reload=needs_reload(member.version, latest.version),
                              location=latest.location, digest=latest.digest, nbytes=latest.nbytes)
    # it goes on with the weights it has
    return MemberReleased(round=round_id, cause_seq=tx.seq, released=member.ref, reason=reason,
                          version=member.version, reload=False)


# ==================================================================================================
# Round machinery: open, gather, and apply a row of ROUND_TRANSITIONS


def _open_round(tx: _Tx, opener: MemberState, participants: MemberKeys | None = None) -> RoundState:
    """A round `opener` waits in, among `participants` (None: the opener alone, as in a pull round)."""
    waiting = member_keys((opener.ref.key,))
    rnd = RoundState(
        id=tx.next_round,
        method=tx.require_config().sync_method,
        opened_by=opener.ref,
        opened_at_ms=tx.time_ms,
        opened_seq=tx.seq,
        waiting=waiting,
        participants=waiting if participants is None else participants,
        phase=_WAITING,
        version=opener.version,
        epoch=tx.group.epoch,
    )
    tx.next_round += 1
    tx.add_round(rnd)
    tx.decisions.append(RoundOpened(round=rnd.id, cause_seq=tx.seq, method=rnd.method,
                                    opened_by=rnd.opened_by, version=rnd.version,
                                    opened_at_ms=rnd.opened_at_ms))
    return rnd


def _apply(tx: _Tx, rnd: RoundState, trigger: Trigger) -> None:
    kind = _RDV if rnd.method.is_rendezvous else _PULL
    transition = ROUND_TRANSITIONS.get((kind, rnd.phase, trigger))
    if transition is None:  # a handler asked for a move the table does not have: a reducer bug
        raise AssertionError(f"no transition for {kind} round in {rnd.phase.value} on {trigger.value}")
    if transition.outcome is None:
        if transition.next_phase is _TRANSFERRING:
            _start_transfer(tx, rnd)
        return
    members = tx.members
    if transition.release is not None:
        for key in rnd.waiting:
            member = members[key]
            if member.alive:
                tx.decisions.append(_member_released(tx, rnd.id, member, transition.release))
                tx.update_member(key, status=_RUNNING)
    if rnd.phase is _TRANSFERRING:
        # the transfer is over either way: everyone still in it goes back to work (with the new
        # weights when completed, with the old ones otherwise, like the reference). Those who
        # reported went back when they did, and may already be asking for the next round.
        for key in rnd.participants:
            if members[key].alive and key not in rnd.reported:
                tx.update_member(key, status=_RUNNING)
    if transition.breaks_group:
        tx.group = replace(tx.group, broken=True)
    tx.decisions.append(RoundClosed(round=rnd.id, cause_seq=tx.seq, outcome=transition.outcome))
    tx.drop_round(rnd.id)
    tx.rounds_closed += 1
    if transition.outcome is RoundOutcome.COMPLETED:
        tx.syncs_completed += 1


def _start_transfer(tx: _Tx, rnd: RoundState) -> None:
    """Every participant arrived: fix version, ranks and epoch, and tell them to meet."""
    trainer = tx.live_trainer()
    assert trainer is not None
    explorers = sorted(
        (tx.members[key] for key in rnd.participants if key != trainer.ref.key),
        key=lambda m: m.ref.id,
    )
    assignments = []
    offset = 1  # the trainer is rank 0
    for member in explorers:
        assignments.append(RankAssignment(member=member.ref, rank_offset=offset, ranks=member.ranks))
        offset += member.ranks
    participants = tuple(assignments)
    group_members = (RankAssignment(member=trainer.ref, rank_offset=0, ranks=1),) + participants
    group = tx.group
    if group.broken or group.members != group_members:
        group = tx.group = GroupState(epoch=group.epoch + 1, members=group_members, broken=False)
    # the trainer's step at REQUIRE_SYNC is the version it is about to send
    rnd = tx.update_round(rnd.id, phase=_TRANSFERRING, version=trainer.step, epoch=group.epoch)
    host, port = parse_rendezvous(trainer.rendezvous or "")
    tx.decisions.append(RendezvousReady.for_group(round=rnd.id, cause_seq=tx.seq, method=rnd.method,
                                                  version=rnd.version, epoch=rnd.epoch, master_addr=host,
                                                  master_port=port, participants=participants))


def _waiting_rendezvous_round(tx: _Tx) -> RoundState | None:
    for rnd in tx.rounds.values():
        if rnd.phase is _WAITING and rnd.method.is_rendezvous:
            return rnd
    return None


def _settle_rendezvous(tx: _Tx, rnd: RoundState) -> None:
    """After someone arrived or left a gathering round: close it, start it, or keep waiting."""
    trainer_key = tx.trainer
    participants = rnd.participants
    if len(participants) == (1 if trainer_key in participants else 0):
        _apply(tx, rnd, Trigger.NO_EXPLORERS)
    elif not rnd.waiting:
        _apply(tx, rnd, Trigger.NOBODY_WAITING)
    elif len(rnd.waiting) == len(participants) and trainer_key in participants:
        _apply(tx, rnd, Trigger.ALL_ARRIVED)


def _request_sync(tx: _Tx, member: MemberState) -> None:
    """`member` just entered REQUIRE_SYNC (or did before the config was known)."""
    if tx.require_config().sync_method.is_rendezvous:
        if member.ref.role is not _SYNCHRONIZER:
            _request_rendezvous(tx, member)
    elif member.ref.role is _EXPLORER:
        _request_pull(tx, member)
    # a trainer needs no round for pull methods: it publishes and goes on


def _request_pull(tx: _Tx, member: MemberState) -> None:
    # every request gets a round, even one answered at once, so each request is visible in the log
    rnd = _open_round(tx, member)
    if tx.latest.version > member.version or member.version == -1:
        _apply(tx, rnd, Trigger.NEW_VERSION)
    elif tx.trainer_finished():
        _apply(tx, rnd, Trigger.TRAINER_LEFT)
    else:
        trigger = PULL_POLICY[tx.require_config().sync_style]
        if trigger is not None:
            _apply(tx, rnd, trigger)


def _request_rendezvous(tx: _Tx, member: MemberState) -> None:
    key = member.ref.key
    rnd = _waiting_rendezvous_round(tx)
    if rnd is None:
        trainer_key = tx.trainer
        trainer = tx.live_trainer()
        participants = member_keys(
            k for k, m in tx.members.items()
            if m.alive and (m.ref.role is _EXPLORER or k == trainer_key)
        )
        rnd = _open_round(tx, member, participants)
        if trainer is None and tx.trainer_gone():
            if tx.trainer_finished():
                _apply(tx, rnd, Trigger.TRAINER_LEFT)
                return
            # a trainer away (restarting) is waited for: its next incarnation joins this round
    elif key not in rnd.waiting:
        rnd = tx.update_round(rnd.id, waiting=rnd.waiting.with_key(key),
                              participants=rnd.participants.with_key(key))
    _settle_rendezvous(tx, rnd)


def _leave(tx: _Tx, member: MemberState) -> None:
    """`member` (already marked not alive) stopped, expired or was replaced: it leaves every round."""
    key = member.ref.key
    is_trainer = member.ref.role is _TRAINER and key == tx.trainer
    if key in tx.paused:
        _move_pace(tx, PaceTrigger.LEFT, member)
    elif is_trainer and member.finished and tx.paused:
        _move_pace(tx, PaceTrigger.TRAINER_FINISHED)
    for rnd in list(tx.rounds.values()):
        if rnd.phase is _TRANSFERRING:
            # one that already reported its part leaves nothing unfinished behind
            if key in rnd.participants and key not in rnd.reported:
                _apply(tx, rnd, Trigger.PARTICIPANT_LEFT)
        elif is_trainer and member.finished:
            # the trainer is done: nobody will publish again, let the waiting explorers go
            _apply(tx, rnd, Trigger.TRAINER_LEFT)
        # A trainer that may come back (expired, restarted, stopped early) is waited for: a pull
        # round waits for the next version; a gathering rendezvous drops it below and its next
        # incarnation becomes a participant again when it joins.
        elif key in rnd.waiting or key in rnd.participants:
            rnd = tx.update_round(
                rnd.id,
                waiting=rnd.waiting.without_key(key),
                participants=rnd.participants.without_key(key),
            )
            if rnd.method.is_rendezvous:
                _settle_rendezvous(tx, rnd)  # may now be complete without it
            elif not rnd.waiting:
                _apply(tx, rnd, Trigger.NOBODY_WAITING)


def _in_round(tx: _Tx, key: str) -> bool:
    return any(key in rnd.waiting or key in rnd.participants for rnd in tx.rounds.values())


def _withdraw(tx: _Tx, key: str) -> None:
    """A waiting member went back to RUNNING on its own: it no longer waits (it may still be an
    expected rendezvous participant)."""
    for rnd in list(tx.rounds.values()):
        if rnd.phase is _WAITING and key in rnd.waiting:
            rnd = tx.update_round(rnd.id, waiting=rnd.waiting.without_key(key))
            if not rnd.waiting:
                _apply(tx, rnd, Trigger.NOBODY_WAITING)


def _report_done(tx: _Tx, event: WeightsLoaded | WeightsBroadcast, member: MemberState) -> None:
    """A participant finished its part of rendezvous round `event.round`."""
    rnd = tx.rounds.get(event.round) if event.round is not None else None
    key = member.ref.key
    if rnd is None or not rnd.method.is_rendezvous:
        raise _illegal(event, f"round {event.round} is not open", member)
    if rnd.phase is not _TRANSFERRING:
        raise _illegal(event, f"round {rnd.id} is still {rnd.phase.value} (no RendezvousReady yet)",
                       member)
    if key not in rnd.participants:
        raise _illegal(event, f"it is not a participant of round {rnd.id}", member)
    if event.version != rnd.version:
        raise _illegal(event, f"round {rnd.id} transfers version {rnd.version}", member)
    if key in rnd.reported:
        return  # a repeated report changes nothing
    rnd = tx.update_round(rnd.id, reported=rnd.reported.with_key(key), waiting=rnd.waiting.without_key(key))
    # Its part is done: it is running again, so its next REQUIRE_SYNC is a new request (for the
    # next round) even while slower peers are still receiving this one.
    tx.update_member(key, status=_RUNNING)
    if len(rnd.reported) == len(rnd.participants):
        _apply(tx, rnd, Trigger.ALL_REPORTED)


# ==================================================================================================
# Pace: how far explorers may run ahead of the trainer (a row of PACE_TRANSITIONS per move)


def _consumed(tx: _Tx) -> int:
    key = tx.trainer
    return tx.members[key].tasks if key is not None else 0


def _ahead_limit(tx: _Tx) -> int | None:
    """`State.ahead_limit` of the state under construction."""
    config = tx.config
    if config is None or config.max_ahead is None or not tx.train_batch_tasks:
        return None
    return (config.max_ahead + 1) * tx.train_batch_tasks


def _move_pace(tx: _Tx, trigger: PaceTrigger, explorer: MemberState | None = None) -> None:
    """Pause `explorer` (AHEAD), let a paused one go silently (LEFT), or resume every paused one."""
    pace = Pace.EXPLORING if trigger is PaceTrigger.AHEAD else Pace.PAUSED
    row = PACE_TRANSITIONS.get((pace, trigger))
    if row is None:  # a handler asked for a move the table does not have: a reducer bug
        raise AssertionError(f"no pace transition for {pace.value} on {trigger.value}")
    if row.decision is ExplorerPaused:
        assert explorer is not None and _ahead_limit(tx) is not None
        tx.paused = tx.paused + (explorer.ref.key,)
        tx.explorer_pauses += 1
        tx.decisions.append(ExplorerPaused(round=0, cause_seq=tx.seq, explorer=explorer.ref, step=explorer.step,
                                           produced=tx.tasks_produced, consumed=_consumed(tx),
                                           limit=_ahead_limit(tx) or 0))
    elif row.decision is ExplorersResumed:
        assert row.resume is not None
        tx.decisions.append(ExplorersResumed(round=0, cause_seq=tx.seq, reason=row.resume, paused=len(tx.paused),
                                             produced=tx.tasks_produced, consumed=_consumed(tx)))
        tx.paused = ()
    else:
        assert explorer is not None
        tx.paused = tuple(k for k in tx.paused if k != explorer.ref.key)  # a few keys: a tuple is enough


def _settle_pace(tx: _Tx, stepped: MemberState | None) -> None:
    """After a report of tasks: resume the paused explorers once below the bound; pause `stepped`
    (an explorer that just finished a step, or joined) when at or past it."""
    limit = _ahead_limit(tx)
    if limit is None or tx.trainer_finished():
        return
    ahead = tx.tasks_produced - _consumed(tx)
    if tx.paused and ahead < limit:
        _move_pace(tx, PaceTrigger.CAUGHT_UP)
    if stepped is not None and ahead >= limit and stepped.ref.key not in tx.paused:
        _move_pace(tx, PaceTrigger.AHEAD, stepped)


# ==================================================================================================
# Handlers: one per input kind. Each validates, records, and picks the trigger.


def _on_job_configured(tx: _Tx, event: JobConfigured, _: None) -> None:
    current = tx.config
    if current is not None and current != event.config:
        raise _illegal(event, f"the job runs with {describe_config(current)}", tx.members.get(event.member.key))
    unit = event.train_batch_tasks
    if unit is not None:
        if unit < 1 or tx.train_batch_tasks not in (None, unit):
            raise _illegal(event, f"the job trains {tx.train_batch_tasks} tasks a step" if unit >= 1
                           else "train_batch_tasks must be at least 1", tx.members.get(event.member.key))
        tx.train_batch_tasks = unit
    if current is None:
        tx.config = event.config
        # requests made before the job's config was known are evaluated now, in join order
        for key in list(tx.members):
            member = tx.members[key]  # re-read: an earlier request may have released it
            if member.alive and member.status is _REQUIRE_SYNC:
                if (member.ref.role is _TRAINER and event.config.sync_method.is_rendezvous
                        and not _valid_rendezvous(member.rendezvous)):
                    continue  # it cannot be met without an address; its next request will be
                _request_sync(tx, member)


def _on_member_joined(tx: _Tx, event: MemberJoined, _: None) -> None:
    ref = event.member
    key = ref.key
    members = tx.members
    old = members.get(key)
    if old is not None:
        if ref.incarnation < old.ref.incarnation:
            raise _illegal(event, f"incarnation {old.ref} already joined (stale process)", old)
        if ref.incarnation == old.ref.incarnation:
            # even after it left: a restart joins as a new incarnation, so that events of the old
            # process can never be taken for the new one's
            raise _illegal(event, "this incarnation already joined", old)
    if ref.role is _TRAINER:
        current = tx.trainer
        if current is not None and current != key and members[current].alive:
            raise _illegal(event, f"{members[current].ref} is alive (one trainer per job)",
                           old)
    if ref.role is _EXPLORER and event.ranks < 1:
        raise _illegal(event, "an explorer brings at least one rank", old)
    if old is not None and old.alive:
        # a restart: the old incarnation is gone as if it had expired, then the new one joins
        _leave(tx, tx.update_member(key, alive=False))
    # its tasks so far stay its own: a restart resumes them (its next report says how many)
    members[key] = MemberState(ref=ref, status=_RUNNING, step=event.step, version=event.version,
                               ranks=event.ranks, host=event.host, alive=True, joined_seq=tx.seq,
                               last_seq=tx.seq, last_time_ms=tx.time_ms, metrics=_EMPTY_METRICS,
                               tasks=old.tasks if old is not None else 0)
    if ref.role is _TRAINER:
        tx.trainer = key
    elif ref.role is _EXPLORER:
        _settle_pace(tx, members[key])  # one that joins (a restart too) while the explorers are ahead waits
    if tx.config is not None and ref.role is not _SYNCHRONIZER:
        # a late joiner becomes a participant of the rendezvous being gathered: it waits for it too
        rnd = _waiting_rendezvous_round(tx)
        if rnd is not None and key not in rnd.participants:
            tx.update_round(rnd.id, participants=rnd.participants.with_key(key))


def _on_status_changed(tx: _Tx, event: StatusChanged, member: MemberState) -> None:
    if event.version < member.version:
        raise _illegal(event, f"it already holds version {member.version} (versions never go down)",
                       member)
    status = event.status
    previous = member.status
    key = member.ref.key
    config = tx.config
    if status is _REQUIRE_SYNC:
        rendezvous = event.rendezvous
        if rendezvous is not None and not _valid_rendezvous(rendezvous):
            raise _illegal(event, f"rendezvous {rendezvous!r} is not host:port", member)
        if (rendezvous is None and member.ref.role is _TRAINER and config is not None
                and config.sync_method.is_rendezvous):
            raise _illegal(event, f"a trainer asking for a {config.sync_method.value} sync must offer "
                           "a rendezvous host:port", member)
        member = tx.update_member(key, status=status, step=event.step, version=event.version,
                                  rendezvous=rendezvous if rendezvous is not None else member.rendezvous)
        # a repeated request from a member already in a round is being served: nothing new
        if config is not None and (previous is not _REQUIRE_SYNC or not _in_round(tx, key)):
            _request_sync(tx, member)
    elif status is _STOPPED:
        _leave(tx, tx.update_member(key, status=status, step=event.step, version=event.version,
                                    alive=False, finished=event.final))
    else:
        tx.update_member(key, status=status, step=event.step, version=event.version)
        if config is not None and previous is _REQUIRE_SYNC:
            _withdraw(tx, key)


def _on_version_published(tx: _Tx, event: VersionPublished, member: MemberState) -> None:
    if event.version <= tx.latest.version:
        raise _illegal(event, f"version {tx.latest.version} is already published (versions only grow)",
                       member)
    tx.latest = LatestVersion(version=event.version, step=event.step, method=event.method,
                              location=event.location, digest=event.digest, nbytes=event.nbytes)
    tx.versions_published += 1
    if event.version > member.version:
        tx.update_member(member.ref.key, version=event.version)
    if tx.config is None:
        return
    members = tx.members
    for rnd in list(tx.rounds.values()):
        if rnd.phase is _WAITING and not rnd.method.is_rendezvous:
            for key in rnd.waiting:
                if members[key].version < event.version:
                    _apply(tx, rnd, Trigger.NEW_VERSION)
                    break


def _on_no_new_version(tx: _Tx, event: NoNewVersion, member: MemberState) -> None:
    tx.update_member(member.ref.key, step=event.step)
    if tx.config is None:
        return
    for rnd in list(tx.rounds.values()):
        if rnd.phase is _WAITING:
            _apply(tx, rnd, Trigger.NO_NEW_VERSION)


def _on_weights_loaded(tx: _Tx, event: WeightsLoaded, member: MemberState) -> None:
    if event.version < member.version:
        raise _illegal(event, f"it already holds version {member.version} (versions never go down)",
                       member)
    config = tx.config
    if event.round is not None and config is not None and config.sync_method.is_rendezvous:
        _report_done(tx, event, member)
    # pull rounds close when the member is released, so a round id here is only a label
    tx.update_member(member.ref.key, version=event.version)


def _on_weights_broadcast(tx: _Tx, event: WeightsBroadcast, member: MemberState) -> None:
    _report_done(tx, event, member)


def _on_sync_failed(tx: _Tx, event: SyncFailed, member: MemberState) -> None:
    if event.round is None:
        return  # a background pull failed: it keeps its weights, nothing to decide
    rnd = tx.rounds.get(event.round)
    if (rnd is not None and rnd.phase is _TRANSFERRING and member.ref.key in rnd.participants):
        _apply(tx, rnd, Trigger.SYNC_FAILED)
    # otherwise the round already ended (another participant's failure came first): nothing to do


def _on_step_finished(tx: _Tx, event: StepFinished, member: MemberState) -> None:
    # a step can finish with the weights it started with after newer ones were loaded in the
    # background (fully_async), so the held version is the larger of the two
    metrics = MappingProxyType(dict(event.metrics)) if event.metrics else _EMPTY_METRICS
    key = member.ref.key
    if event.tasks is None:
        tx.update_member(key, step=event.step, version=max(event.version, member.version), metrics=metrics)
        return
    if event.tasks < 0:
        raise _illegal(event, "a count of tasks is never negative", member)
    explorer = member.ref.role is _EXPLORER
    if explorer:
        tx.tasks_produced += event.tasks - member.tasks
    stepped = tx.update_member(key, step=event.step, version=max(event.version, member.version), metrics=metrics,
                               tasks=event.tasks)
    if explorer or key == tx.trainer:
        _settle_pace(tx, stepped if explorer else None)


def _on_tasks_taken(tx: _Tx, event: TasksTaken, member: MemberState) -> None:
    if event.tasks < 0:
        raise _illegal(event, "a count of tasks is never negative", member)
    tx.update_member(member.ref.key, tasks=event.tasks)
    _settle_pace(tx, None)


def _on_eval_finished(tx: _Tx, event: EvalFinished, member: MemberState) -> None:
    pass  # a record for the eval curve (observers fold it); no sync decision depends on it


def _on_steps_rolled_back(tx: _Tx, event: StepsRolledBack, member: MemberState) -> None:
    pass  # a record for step counts (observers fold it); the join already said where the trainer resumed


def _on_member_expired(tx: _Tx, event: MemberExpired, _: None) -> None:
    target = event.expired
    member = tx.members.get(target.key)
    if member is None or member.ref.incarnation != target.incarnation or not member.alive:
        return  # already stopped, replaced or expired: a benign race with the clock
    _leave(tx, tx.update_member(target.key, alive=False))


def _on_round_timed_out(tx: _Tx, event: RoundTimedOut, _: None) -> None:
    rnd = tx.rounds.get(event.round)
    if rnd is not None:  # closed before its deadline fired: a benign race with the clock
        _apply(tx, rnd, Trigger.TIMED_OUT)


_Handler = Callable[[_Tx, Any, Any], None]  # (tx, the input, its sender's MemberState or None)
_Route = tuple[_Handler, tuple[Role, ...], bool]

_HANDLERS: dict[type[Event], _Handler] = {
    JobConfigured: _on_job_configured,
    MemberJoined: _on_member_joined,
    StatusChanged: _on_status_changed,
    VersionPublished: _on_version_published,
    NoNewVersion: _on_no_new_version,
    WeightsLoaded: _on_weights_loaded,
    WeightsBroadcast: _on_weights_broadcast,
    SyncFailed: _on_sync_failed,
    StepFinished: _on_step_finished,
    TasksTaken: _on_tasks_taken,
    EvalFinished: _on_eval_finished,
    StepsRolledBack: _on_steps_rolled_back,
    MemberExpired: _on_member_expired,
    RoundTimedOut: _on_round_timed_out,
}

_EMPTY_METRICS: Mapping[str, float] = MappingProxyType({})

# one lookup per input: (handler, roles allowed to send it, whether the sender must be a live member)
_ROUTES: dict[type, _Route] = {
    cls: (handler, SENDERS[cls], cls not in _NO_JOIN_NEEDED) for cls, handler in _HANDLERS.items()
}


# ==================================================================================================
# Checks and messages


def _not_live(event: Event, member: MemberState | None) -> IllegalEvent:
    """Why the sender is not the current, joined, live incarnation of its member."""
    ref = event.member
    if member is None:
        return _illegal(event, f"{ref.key} never joined", None)
    current = member.ref.incarnation
    if ref.incarnation < current:
        return _illegal(event, f"it is a stale incarnation: {member.ref} joined at seq "
                        f"{member.joined_seq}", member)
    if ref.incarnation > current:
        return _illegal(event, f"incarnation {ref.incarnation} never joined (last joined: "
                        f"{member.ref})", member)
    return _illegal(event, "it already left the job; a restart must join again", member)


def _valid_rendezvous(address: str | None) -> bool:
    if address is None:
        return False
    try:
        parse_rendezvous(address)
    except ValueError:
        return False
    return True


def _member_status(member: MemberState | None) -> str:
    return "not joined" if member is None else member.condition


def _illegal(event: Event, why: str, member: MemberState | None) -> IllegalEvent:
    status = _member_status(member)
    return IllegalEvent(
        f"{event.member} sent {describe(event)} but {why} (member status {status})",
        role=event.member.role.value,
        state=status,
        event=event,
    )


def _roles(roles: tuple[Role, ...]) -> str:
    return " or ".join(sorted(r.value for r in roles))
