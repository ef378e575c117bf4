"""Events of a job, named as facts: what members report (inputs) and what the synchronizer decides.

Theory of operation
-------------------
Members (trainer, explorers) and the synchronizer's own timers publish *input events* into the job's
stream. The reducer folds inputs, in stream order, into state and emits *decisions*. Decisions are
pure functions of the inputs before them, so any replica (or `rolectl replay`) recomputes them
exactly; they carry the stream sequence of the input that caused them (`cause_seq`).

Every input carries the identity of the member that published it (`MemberRef`: role, id,
incarnation). A recorded event (`Recorded`) also carries its stream sequence and server timestamp.

All classes are frozen, slotted, keyword-only dataclasses that validate (and normalise enum and
nested values) on construction, so a constructed event is always well-typed.
"""

from __future__ import annotations

from collections.abc import Mapping  # not typing's: isinstance on typing.Mapping costs ~1 µs a call
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Union

from .config import SyncConfig
from .enums import ReleaseReason, Role, RoundOutcome, RunningStatus, SyncMethod
from .errors import DecodeError

__all__ = [
    "MemberRef",
    "RankAssignment",
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
    "MemberExpired",
    "RoundTimedOut",
    # decisions
    "RoundOpened",
    "RendezvousReady",
    "MemberReleased",
    "RoundClosed",
    "INPUT_KINDS",
    "DECISION_KINDS",
    "KINDS",
    "AnyEvent",
    "decision_identity",
]


# --------------------------------------------------------------------------------------------------
# field checking: one small table of checkers, used by construction and by the codec


def is_map(value: Any) -> bool:
    """`isinstance(value, Mapping)`, at once for the plain dicts msgpack decodes to: an ABC check
    costs a few tenths of a microsecond and decoding one event made several."""
    return type(value) is dict or isinstance(value, Mapping)


def _check_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"field {name!r} must be an integer, got {type(value).__name__} {value!r}")
    return value


def _check_opt_int(value: Any, name: str) -> int | None:
    return None if value is None else _check_int(value, name)


def _check_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DecodeError(f"field {name!r} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _check_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise DecodeError(f"field {name!r} must be a string, got {type(value).__name__} {value!r}")
    return value


def _check_opt_str(value: Any, name: str) -> str | None:
    return None if value is None else _check_str(value, name)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise DecodeError(f"field {name!r} must be a boolean, got {type(value).__name__} {value!r}")
    return value


def _enum_checker(enum_cls):
    def check(value: Any, name: str):
        try:
            return enum_cls.parse(value)
        except ValueError as exc:
            raise DecodeError(f"field {name!r}: {exc}") from None

    return check


# Member maps already decoded, by their exact (role, id, inc): every event names a member, and a job
# has a few dozen, so a reader following it builds each MemberRef once instead of once per event.
_MEMBER_REFS: dict[tuple[str, str, int], "MemberRef"] = {}
_MEMBER_REFS_MAX = 4096  # a bound, not a working set: emptied when reached (hostile input included)


def _check_member(value: Any, name: str) -> "MemberRef":
    if isinstance(value, MemberRef):
        return value
    if not is_map(value):
        raise DecodeError(f"field {name!r} must be a member map {{role, id, inc}}, got {value!r}")
    role, member_id, inc = value.get("role"), value.get("id"), value.get("inc")
    # exact types only: True == 1 and 1.0 == 1 as keys, and they are no incarnation
    key = (role, member_id, inc) if type(role) is str and type(member_id) is str and type(inc) is int else None
    ref = _MEMBER_REFS.get(key) if key is not None else None
    if ref is not None:
        return ref
    missing = [k for k in ("role", "id", "inc") if k not in value]
    if missing:
        raise DecodeError(f"field {name!r} lacks {missing}")
    ref = MemberRef(
        role=_check_role(role, f"{name}.role"),
        id=_check_str(member_id, f"{name}.id"),
        incarnation=_check_int(inc, f"{name}.inc"),
    )
    if key is not None:
        if len(_MEMBER_REFS) >= _MEMBER_REFS_MAX:
            _MEMBER_REFS.clear()
        _MEMBER_REFS[key] = ref
    return ref


def _check_metrics(value: Any, name: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise DecodeError(f"field {name!r} must be a map of name -> number, got {value!r}")
    return {_check_str(k, f"{name} key"): _check_float(v, f"{name}[{k!r}]") for k, v in value.items()}


def _check_config(value: Any, name: str) -> SyncConfig:
    if isinstance(value, SyncConfig):
        return value
    try:
        return SyncConfig.from_mapping(value, where=name)
    except ValueError as exc:  # ConfigError is a ValueError
        raise DecodeError(f"field {name!r}: {exc}") from None


def _check_participants(value: Any, name: str) -> tuple["RankAssignment", ...]:
    if not isinstance(value, (list, tuple)):
        raise DecodeError(f"field {name!r} must be a list, got {value!r}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, RankAssignment):
            out.append(item)
            continue
        if not is_map(item):
            raise DecodeError(f"field {name}[{i}] must be a map, got {item!r}")
        for k in ("member", "rank_offset", "ranks"):
            if k not in item:
                raise DecodeError(f"field {name}[{i}] lacks {k!r}")
        out.append(
            RankAssignment(
                member=_check_member(item["member"], f"{name}[{i}].member"),
                rank_offset=_check_int(item["rank_offset"], f"{name}[{i}].rank_offset"),
                ranks=_check_int(item["ranks"], f"{name}[{i}].ranks"),
            )
        )
    return tuple(out)


_check_role = _enum_checker(Role)

_CHECKERS: dict[str, Any] = {
    "int": _check_int,
    "int | None": _check_opt_int,
    "float": _check_float,
    "str": _check_str,
    "str | None": _check_opt_str,
    "bool": _check_bool,
    "MemberRef": _check_member,
    "Role": _check_role,
    "RunningStatus": _enum_checker(RunningStatus),
    "SyncMethod": _enum_checker(SyncMethod),
    "ReleaseReason": _enum_checker(ReleaseReason),
    "RoundOutcome": _enum_checker(RoundOutcome),
    "Mapping[str, float]": _check_metrics,
    "SyncConfig": _check_config,
    "tuple[RankAssignment, ...]": _check_participants,
}


# --------------------------------------------------------------------------------------------------
# identities


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberRef:
    """Who published an event: role, member id (unique per role in a job) and incarnation.

    The incarnation grows each time the same member id starts again (a restart), so events of a
    dead incarnation can be told apart from the new one's.
    """

    role: Role
    id: str
    incarnation: int = 0
    # `role/id`: the member's name across incarnations. Derived once here, not per access: the
    # reducer looks it up several times for every event it folds.
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", _check_role(self.role, "role"))
        _check_str(self.id, "id")
        if not self.id:
            raise DecodeError("field 'id' must be a non-empty string")
        _check_int(self.incarnation, "incarnation")
        object.__setattr__(self, "key", f"{self.role.value}/{self.id}")

    def __str__(self) -> str:
        return f"{self.role.value}/{self.id}#{self.incarnation}"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankAssignment:
    """One participant's place in a rendezvous group: ranks [rank_offset, rank_offset + ranks)."""

    member: MemberRef
    rank_offset: int
    ranks: int


# --------------------------------------------------------------------------------------------------
# base classes


class _Validated:
    """Mixin: run each field's checker once on construction (normalising enums and nested maps)."""

    __slots__ = ()
    KIND: ClassVar[str]
    _specs: ClassVar[tuple[tuple[str, Any], ...]]

    def __post_init__(self) -> None:
        for name, check in self._specs:
            value = getattr(self, name)
            checked = check(value, name)
            if checked is not value:
                object.__setattr__(self, name, checked)


def _register(cls):
    # the wire fields: a field with init=False is derived from them (an index), never sent
    cls._specs = tuple((f.name, _CHECKERS[f.type if isinstance(f.type, str) else f.type.__name__])
                       for f in fields(cls) if f.init)
    return cls


@dataclass(frozen=True, slots=True, kw_only=True)
class Event(_Validated):
    """An input event: a fact a member (or the synchronizer's clock) reports."""

    member: MemberRef


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision(_Validated):
    """A decision the reducer made about one sync round, caused by the input at `cause_seq`."""

    round: int
    cause_seq: int


# --------------------------------------------------------------------------------------------------
# inputs


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class JobConfigured(Event):
    """A member started with this sync config. The first in the stream is the job's; a different
    one later is illegal (a member runs with a config the job was not started with)."""

    KIND: ClassVar[str] = "job_configured"
    config: SyncConfig


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class MemberJoined(Event):
    """A member (incarnation) is up. `step`/`version` are where it resumes; `ranks` is how many
    receiving ranks an explorer brings to a rendezvous group (engine_num x tensor_parallel_size)."""

    KIND: ClassVar[str] = "member_joined"
    host: str
    pid: int
    step: int
    version: int
    ranks: int = 1


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class StatusChanged(Event):
    """A member's running status changed at `step`, holding weights `version`.

    A trainer entering REQUIRE_SYNC for a rendezvous method offers `rendezvous` = "host:port" where
    its rank 0 listens for the group it would form.

    `final` marks a STOPPED that ends the member's work for good: the trainer trained its last
    step, an explorer exhausted its task set. Any other STOPPED (Ctrl-C, a crash-time cleanup) is
    a pause: a restart may follow, and nobody gives up on the member because of it.
    """

    KIND: ClassVar[str] = "status_changed"
    status: RunningStatus
    step: int
    version: int
    rendezvous: str | None = None
    final: bool = False


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class VersionPublished(Event):
    """The trainer stored every byte of weights `version` (after train step `step`) at `location`
    (object-store name or checkpoint path) via `method`; `digest` covers all bytes."""

    KIND: ClassVar[str] = "version_published"
    version: int
    step: int
    method: SyncMethod
    location: str
    nbytes: int
    digest: str


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class NoNewVersion(Event):
    """The trainer was asked for weights (explorer_driven) and has none newer than `version`."""

    KIND: ClassVar[str] = "no_new_version"
    version: int
    step: int


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsLoaded(Event):
    """An explorer now explores with weights `version` (from round `round`, or in the background)."""

    KIND: ClassVar[str] = "weights_loaded"
    version: int
    round: int | None = None
    nbytes: int = 0
    seconds: float = 0.0


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsBroadcast(Event):
    """The trainer finished sending weights `version` to a rendezvous round's group."""

    KIND: ClassVar[str] = "weights_broadcast"
    version: int
    round: int
    nbytes: int = 0
    seconds: float = 0.0


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class SyncFailed(Event):
    """A member's part of a weight transfer failed; it goes on with the weights it had."""

    KIND: ClassVar[str] = "sync_failed"
    version: int
    reason: str
    round: int | None = None


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class StepFinished(Event):
    """A member finished train/explore step `step` with weights `version`; `metrics` are its figures
    (reward, loss, experiences dropped as stale, ...). Progress only: it never opens a round."""

    KIND: ClassVar[str] = "step_finished"
    step: int
    version: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class MemberExpired(Event):
    """The synchronizer's clock saw no heartbeat from `expired` for `silent_for` seconds."""

    KIND: ClassVar[str] = "member_expired"
    expired: MemberRef
    silent_for: float


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class RoundTimedOut(Event):
    """The synchronizer's clock passed round `round`'s deadline (opened_at + sync_timeout)."""

    KIND: ClassVar[str] = "round_timed_out"
    round: int


# --------------------------------------------------------------------------------------------------
# decisions


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class RoundOpened(Decision):
    """Round `round` opened: `opened_by` is waiting for weights via `method`. In explorer_driven
    style this is also the trainer's cue. `opened_at_ms` (server time of the cause) fixes the
    deadline `opened_at_ms + sync_timeout` identically for every replica."""

    KIND: ClassVar[str] = "round_opened"
    method: SyncMethod
    opened_by: MemberRef
    version: int
    opened_at_ms: int


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class RendezvousReady(Decision):
    """REQUIRE_SYNC is satisfied for a rendezvous method: the trainer (rank 0) and every listed
    explorer meet now. `epoch` names the group; a new epoch means the group must be re-formed."""

    KIND: ClassVar[str] = "rendezvous_ready"
    method: SyncMethod
    version: int
    epoch: int
    master_addr: str
    master_port: int
    world_size: int
    participants: tuple[RankAssignment, ...]
    # member -> its assignment. Every receiver looks itself up, and a view serving many members
    # (one process driving several, the benchmark's 65) would scan the list once per member:
    # built once per decision instead.
    _assignments: Mapping[MemberRef, RankAssignment] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _Validated.__post_init__(self)  # (zero-argument super() fails in a slots dataclass)
        index: dict[MemberRef, RankAssignment] = {}
        for p in self.participants:
            index.setdefault(p.member, p)  # the first, as a scan of the list would find
        object.__setattr__(self, "_assignments", index)

    def assignment_of(self, member: MemberRef) -> RankAssignment | None:
        """`member`'s place in the group (this exact incarnation), or None if it is not in it."""
        return self._assignments.get(member)


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class MemberReleased(Decision):
    """A waiting member may go on. With reason new_version it should hold `version` (fetching it
    from `location` when `reload`); otherwise it keeps the weights it has."""

    KIND: ClassVar[str] = "member_released"
    released: MemberRef
    reason: ReleaseReason
    version: int
    reload: bool
    location: str | None = None
    digest: str | None = None
    nbytes: int = 0


@_register
@dataclass(frozen=True, slots=True, kw_only=True)
class RoundClosed(Decision):
    """Round `round` ended with `outcome`. Every round is closed exactly once."""

    KIND: ClassVar[str] = "round_closed"
    outcome: RoundOutcome


INPUT_KINDS: dict[str, type[Event]] = {
    cls.KIND: cls
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
        MemberExpired,
        RoundTimedOut,
    )
}
DECISION_KINDS: dict[str, type[Decision]] = {
    cls.KIND: cls for cls in (RoundOpened, RendezvousReady, MemberReleased, RoundClosed)
}
KINDS: dict[str, type] = {**INPUT_KINDS, **DECISION_KINDS}

AnyEvent = Union[Event, Decision]


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
    """What makes two decisions "the same one" (kind, round, cause, released member): replicas and
    replay line decisions up by it, and the bus derives a decision's message id from it."""
    released = decision.released.key if isinstance(decision, MemberReleased) else ""
    return (decision.KIND, decision.round, decision.cause_seq, released)
