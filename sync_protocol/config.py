"""Sync configuration: the knobs that change sync decisions, validated all at once."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .enums import SyncMethod, SyncStyle
from .errors import ConfigError

__all__ = ["SyncConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncConfig:
    """How and when weights move. Defaults follow the reference (nccl, fixed, every step, 3600 s).

    Heartbeat period/expiry are in seconds; a member silent for `heartbeat_expiry` is declared
    expired (by an event) and leaves every round, instead of peers waiting `sync_timeout`.
    `max_staleness` bounds how many versions older than the trainer's an experience may be
    (None = unbounded). `snapshot_every`: the active synchronizer records a reducer snapshot every
    so many stream records (0 = never), so restarts fold only the tail and the stream may be trimmed.
    """

    sync_method: SyncMethod = SyncMethod.NCCL
    sync_style: SyncStyle = SyncStyle.FIXED
    sync_interval: int = 1
    sync_offset: int = 0
    sync_timeout: float = 3600.0
    heartbeat_period: float = 1.0
    heartbeat_expiry: float = 5.0
    max_staleness: int | None = None
    snapshot_every: int = 10_000

    def __post_init__(self) -> None:
        for name, enum_cls in (("sync_method", SyncMethod), ("sync_style", SyncStyle)):
            value = getattr(self, name)
            if isinstance(value, str) and not isinstance(value, enum_cls):
                try:
                    object.__setattr__(self, name, enum_cls.parse(value))
                except ValueError:
                    pass  # reported below with every other problem
        problems = _problems(self)
        if problems:
            raise ConfigError(problems, where="sync config")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, where: str = "synchronizer") -> "SyncConfig":
        """Build from a plain mapping (YAML / msgpack), reporting every bad or unknown field at once."""
        if not isinstance(data, Mapping):
            raise ConfigError([(where, f"expected a mapping, got {type(data).__name__}")], where=where)
        known = {f.name for f in fields(cls)}
        problems: list[tuple[str, str]] = []
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                problems.append((f"{where}.{key}", f"unknown field; known: {sorted(known)}"))
                continue
            if key == "sync_method":
                try:
                    value = SyncMethod.parse(value)
                except ValueError as exc:
                    problems.append((f"{where}.{key}", str(exc)))
                    continue
            elif key == "sync_style":
                try:
                    value = SyncStyle.parse(value)
                except ValueError as exc:
                    problems.append((f"{where}.{key}", str(exc)))
                    continue
            values[key] = value
        draft = object.__new__(cls)
        for f in fields(cls):
            object.__setattr__(draft, f.name, values.get(f.name, f.default))
        problems.extend((f"{where}.{name}", why) for name, why in _problems(draft))
        if problems:
            raise ConfigError(problems, where=where)
        return cls(**values)

    def to_mapping(self) -> dict[str, Any]:
        """Plain values (enums as strings), the inverse of `from_mapping`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, (SyncMethod, SyncStyle)) else value
        return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _problems(cfg: SyncConfig) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    if not isinstance(cfg.sync_method, SyncMethod):
        problems.append(("sync_method", f"must be one of {SyncMethod.choices()}, got {cfg.sync_method!r}"))
    if not isinstance(cfg.sync_style, SyncStyle):
        problems.append(("sync_style", f"must be one of {SyncStyle.choices()}, got {cfg.sync_style!r}"))
    if not _is_int(cfg.sync_interval) or cfg.sync_interval <= 0:
        problems.append(("sync_interval", f"must be an integer > 0, got {cfg.sync_interval!r}"))
    if not _is_int(cfg.sync_offset) or cfg.sync_offset < 0:
        problems.append(("sync_offset", f"must be an integer >= 0, got {cfg.sync_offset!r}"))
    for name in ("sync_timeout", "heartbeat_period", "heartbeat_expiry"):
        value = getattr(cfg, name)
        if not _is_number(value) or value <= 0:
            problems.append((name, f"must be a number of seconds > 0, got {value!r}"))
    if (
        _is_number(cfg.heartbeat_period)
        and _is_number(cfg.heartbeat_expiry)
        and cfg.heartbeat_expiry <= cfg.heartbeat_period
    ):
        problems.append(
            ("heartbeat_expiry", f"must be longer than heartbeat_period ({cfg.heartbeat_period} s), "
             f"got {cfg.heartbeat_expiry!r}")
        )
    if not _is_int(cfg.snapshot_every) or cfg.snapshot_every < 0:
        problems.append(("snapshot_every", f"must be an integer >= 0 (0 = no snapshots), got {cfg.snapshot_every!r}"))
    if cfg.max_staleness is not None and (not _is_int(cfg.max_staleness) or cfg.max_staleness < 0):
        problems.append(("max_staleness", f"must be null or an integer >= 0, got {cfg.max_staleness!r}"))
    return problems
