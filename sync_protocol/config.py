"""Sync configuration: the knobs that change sync decisions, a frozen struct validated all at once.

The constraint of each field sits on its annotation (`msgspec.Meta`). `from_mapping` converts a
plain mapping (YAML, msgpack) with msgspec in one pass: unknown fields refused, the enums read in
any case with the reference's aliases (`SyncMethod` / `SyncStyle` `_missing_`). msgspec stops at
the first problem, so a mapping it refuses is then checked field by field, and every problem is
reported in one `ConfigError`. The job config (`rolectl.roles.config`) reads its `synchronizer:`
section through `from_mapping`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, get_type_hints

import msgspec
from msgspec import Meta

from .enums import StalenessPolicy, SyncMethod, SyncStyle
from .errors import ConfigError

__all__ = ["SyncConfig", "HEARTBEATS_PER_S"]

HEARTBEATS_PER_S = 256
"""Heartbeats a second the synchronizer hears at most from a fleet: past `256 x heartbeat_period`
members, each beats less often (`SyncConfig.beat_period`), as Nomad bounds its servers' heartbeats
(`max_heartbeats_per_second`). Each costs the synchronizer tens of microseconds of client-library
work: 1,024 explorers beating every second took 4-7 % of a core, more than its decisions."""


class SyncConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How and when weights move. Defaults follow the reference (nccl, fixed, every step, 3600 s).

    Heartbeat period/expiry are in seconds; a member silent for `heartbeat_expiry` is declared
    expired (by an event) and leaves every round, instead of peers waiting `sync_timeout`.
    `max_staleness` bounds how many versions older than the trainer's an experience may be
    (None = unbounded); an older one is dropped and counted, or with `staleness_policy: correct` trained
    with the off-policy correction and counted as corrected. `max_ahead` bounds the other way: explorers
    pause once they have produced more than `max_ahead` train steps' worth of tasks beyond the one
    the trainer takes next (None = unbounded; the reducer decides it, see `ExplorerPaused`).
    `snapshot_every`: the active synchronizer records a reducer snapshot every
    so many stream records (0 = never), so restarts fold only the tail and the stream may be trimmed.
    """

    sync_method: Annotated[SyncMethod, Meta(
        description="How weight bytes move: nccl (online), checkpoint (offline), memory (object_store) "
                    "or cuda_ipc.")] = SyncMethod.NCCL
    sync_style: Annotated[SyncStyle, Meta(
        description="Who decides when weights move: fixed, trainer_driven (dynamic_by_trainer), "
                    "explorer_driven (dynamic_by_explorer) or fully_async.")] = SyncStyle.FIXED
    sync_interval: Annotated[int, Meta(gt=0, description="Train steps between syncs.")] = 1
    sync_offset: Annotated[int, Meta(ge=0, description="Steps before the first sync.")] = 0
    sync_timeout: Annotated[float, Meta(gt=0, description="Seconds a sync round may take before "
                                                           "it fails.")] = 3600.0
    heartbeat_period: Annotated[float, Meta(gt=0, description="Seconds between a member's "
                                                               "heartbeats; a fleet over 256 x this "
                                                               "beats less often, never under 4 beats "
                                                               "per heartbeat_expiry.")] = 1.0
    heartbeat_expiry: Annotated[float, Meta(gt=0, description="Seconds of silence after which a "
                                                               "member is declared expired; longer "
                                                               "than heartbeat_period.")] = 5.0
    max_staleness: Annotated[int, Meta(ge=0, description="Versions an experience may lag the "
                                                         "trainer's; null = unbounded.")] | None = None
    staleness_policy: Annotated[StalenessPolicy, Meta(
        description="What becomes of an experience past max_staleness: drop (counted), or correct: "
                    "trained with the off-policy correction (needs algorithm.rollout_correction).")
    ] = StalenessPolicy.DROP
    snapshot_every: Annotated[int, Meta(ge=0, description="Stream records between reducer "
                                                          "snapshots (0 = never).")] = 10_000
    max_ahead: Annotated[int, Meta(ge=0, description="Train steps' worth of tasks explorers may "
                                                     "produce beyond the trainer's next step before "
                                                     "they pause (AReaL's max_head_offpolicyness); "
                                                     "null = unbounded.")] | None = None

    def __post_init__(self) -> None:
        # msgspec checks what it converts, not a constructor's arguments: check them here (a
        # dozen fields, cheap), with what msgspec cannot say (a finite number, the rule across fields)
        problems = _problems(msgspec.structs.asdict(self))
        if problems:
            raise ConfigError(problems, where="sync config")

    def beat_period(self, members: int) -> float:
        """Seconds between one member's heartbeats in a job of `members`: `heartbeat_period`, or
        longer for a fleet whose beats would pass `HEARTBEATS_PER_S`, but never past a quarter of
        `heartbeat_expiry` (expiry, judged on the synchronizer's evidence, is unchanged)."""
        stretched = min(members / HEARTBEATS_PER_S, self.heartbeat_expiry / 4)
        return max(self.heartbeat_period, stretched)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, where: str = "synchronizer") -> SyncConfig:
        """Build from a plain mapping (YAML / msgpack), accepting the reference's enum aliases in any
        case and reporting every bad or unknown field at once."""
        if not isinstance(data, Mapping):
            raise ConfigError([(where, f"expected a mapping, got {type(data).__name__}")], where=where)
        try:
            return msgspec.convert(dict(data), cls)
        except msgspec.ValidationError as exc:
            # msgspec names the first problem only; __post_init__'s name them all, else look at each field
            found = exc.__cause__.problems if isinstance(exc.__cause__, ConfigError) else _problems(data)
            raise ConfigError([(f"{where}.{name}", why) for name, why in found], where=where) from None

    def to_mapping(self) -> dict[str, Any]:
        """Plain values (enums as strings), the inverse of `from_mapping`. Fields added after the wire
        format was fixed are left out while at their default, so the config of a job that does not
        use them is written as earlier builds wrote it (and read by them)."""
        mapping: dict[str, Any] = msgspec.to_builtins(self)
        for name, default in _ADDED_LATER.items():
            if getattr(self, name) == default:
                del mapping[name]
        return mapping


_ADDED_LATER: dict[str, Any] = {"max_ahead": None, "staleness_policy": StalenessPolicy.DROP.value}

_ENUMS: dict[str, type[SyncMethod] | type[SyncStyle] | type[StalenessPolicy]] = {
    "sync_method": SyncMethod, "sync_style": SyncStyle, "staleness_policy": StalenessPolicy}


_HINTS: dict[str, Any] = {}
_DEFAULTS: dict[str, Any] = {}


def _annotations() -> dict[str, Any]:
    """Each field's annotation, constraint included (resolved once: they are strings here)."""
    if not _HINTS:
        _HINTS.update(get_type_hints(SyncConfig, include_extras=True))
    return _HINTS


def _defaults() -> dict[str, Any]:
    """Each field's default, read once: `msgspec.structs.fields` resolves the annotations again at
    every call (about 10 ms), and every member's JobConfigured is checked when it is decoded."""
    if not _DEFAULTS:
        _DEFAULTS.update({field.name: field.default for field in msgspec.structs.fields(SyncConfig)})
    return _DEFAULTS


_KINDS = {msgspec.inspect.IntType: "an integer", msgspec.inspect.FloatType: "a finite number"}
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _expected(annotation: Any) -> str:
    """What an annotation accepts, in words: `an integer > 0`, `null or an integer >= 0`."""
    info = msgspec.inspect.type_info(annotation)
    if isinstance(info, msgspec.inspect.Metadata):
        info = info.type
    options = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    words = []
    for option in options:
        if isinstance(option, msgspec.inspect.Metadata):
            option = option.type
        if isinstance(option, msgspec.inspect.NoneType):
            words.append("null")
            continue
        bounds = [f"{sign} {getattr(option, key)}" for key, sign in _BOUNDS if getattr(option, key, None) is not None]
        words.append(" ".join([_KINDS.get(type(option), "a value"), *bounds]))
    return " or ".join(sorted(words, key=lambda w: w != "null"))


def _fits(value: Any, annotation: Any) -> bool:
    try:
        msgspec.convert(value, annotation)
    except msgspec.ValidationError:
        return False
    # msgspec's bounds let infinity through; a duration of inf seconds is a typo, not a choice
    return not isinstance(value, float) or math.isfinite(value)


def _problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every unknown field, every field that breaks its annotation, then the one rule across fields."""
    known = _annotations()
    problems = [(str(name), f"unknown field; known: {sorted(known)}") for name in values if name not in known]
    for name, annotation in known.items():
        if name in values and not _fits(values[name], annotation):
            why = f"one of {_ENUMS[name].choices()}" if name in _ENUMS else _expected(annotation)
            problems.append((name, f"must be {why}, got {values[name]!r}"))
    defaults = _defaults()
    period = values.get("heartbeat_period", defaults["heartbeat_period"])
    expiry = values.get("heartbeat_expiry", defaults["heartbeat_expiry"])
    if not any(name.startswith("heartbeat") for name, _ in problems) and expiry <= period:
        problems.append(("heartbeat_expiry", f"must be longer than heartbeat_period ({period} s), got {expiry!r}"))
    return problems
