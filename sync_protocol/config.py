"""Sync configuration: the knobs that change sync decisions, a frozen struct validated all at once.

The constraint of each field sits on its annotation (`msgspec.Meta`); construction and decoding
check every field against it and report every problem in one `ConfigError`. The job config
(`rolectl.roles.config`) validates the same fields from YAML through these annotations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, get_type_hints

import msgspec
from msgspec import Meta

from .enums import SyncMethod, SyncStyle
from .errors import ConfigError

__all__ = ["SyncConfig"]

class SyncConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How and when weights move. Defaults follow the reference (nccl, fixed, every step, 3600 s).

    Heartbeat period/expiry are in seconds; a member silent for `heartbeat_expiry` is declared
    expired (by an event) and leaves every round, instead of peers waiting `sync_timeout`.
    `max_staleness` bounds how many versions older than the trainer's an experience may be
    (None = unbounded). `snapshot_every`: the active synchronizer records a reducer snapshot every
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
                                                               "heartbeats.")] = 1.0
    heartbeat_expiry: Annotated[float, Meta(gt=0, description="Seconds of silence after which a "
                                                               "member is declared expired; longer "
                                                               "than heartbeat_period.")] = 5.0
    max_staleness: Annotated[int, Meta(ge=0, description="Versions an experience may lag the "
                                                         "trainer's; null = unbounded.")] | None = None
    snapshot_every: Annotated[int, Meta(ge=0, description="Stream records between reducer "
                                                          "snapshots (0 = never).")] = 10_000

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ConfigError(problems, where="sync config")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, where: str = "synchronizer") -> SyncConfig:
        """Build from a plain mapping (YAML / msgpack), accepting the reference's enum aliases in any
        case and reporting every bad or unknown field at once."""
        if not isinstance(data, Mapping):
            raise ConfigError([(where, f"expected a mapping, got {type(data).__name__}")], where=where)
        known = _annotations()
        problems = [(f"{where}.{key}", f"unknown field; known: {sorted(known)}") for key in data if key not in known]
        values = {key: _parse_enum(key, value) for key, value in data.items() if key in known}
        try:
            cfg = cls(**values)
        except ConfigError as exc:
            problems.extend((f"{where}.{name}", why) for name, why in exc.problems)
        if problems:
            raise ConfigError(problems, where=where)
        return cfg

    def to_mapping(self) -> dict[str, Any]:
        """Plain values (enums as strings), the inverse of `from_mapping`."""
        return {name: getattr(self, name).value if isinstance(getattr(self, name), (SyncMethod, SyncStyle))
                else getattr(self, name) for name in self.__struct_fields__}


_ENUMS: dict[str, type[SyncMethod] | type[SyncStyle]] = {"sync_method": SyncMethod, "sync_style": SyncStyle}


def _parse_enum(name: str, value: Any) -> Any:
    """The enum member an alias or any-case spelling names; the value itself when it names none
    (the field's check then reports it with the choices)."""
    enum_cls = _ENUMS.get(name)
    if enum_cls is None:
        return value
    try:
        return enum_cls.parse(value)
    except ValueError:
        return value


_HINTS: dict[str, Any] = {}


def _annotations() -> dict[str, Any]:
    """Each field's annotation, constraint included (resolved once: they are strings here)."""
    if not _HINTS:
        _HINTS.update(get_type_hints(SyncConfig, include_extras=True))
    return _HINTS


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


def _problems(cfg: SyncConfig) -> list[tuple[str, str]]:
    """Every field that breaks its annotation, then the one rule across fields."""
    problems: list[tuple[str, str]] = []
    for name, annotation in _annotations().items():
        value = getattr(cfg, name)
        try:
            msgspec.convert(value, annotation)
            # msgspec's bounds let infinity through; a duration of inf seconds is a typo, not a choice
            ok = not isinstance(value, float) or math.isfinite(value)
        except msgspec.ValidationError:
            ok = False
        if not ok:
            why = f"one of {_ENUMS[name].choices()}" if name in _ENUMS else _expected(annotation)
            problems.append((name, f"must be {why}, got {value!r}"))
    period, expiry = cfg.heartbeat_period, cfg.heartbeat_expiry
    if not any(name.startswith("heartbeat") for name, _ in problems) and expiry <= period:
        problems.append(("heartbeat_expiry", f"must be longer than heartbeat_period ({period} s), got {expiry!r}"))
    return problems
