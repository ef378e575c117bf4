"""Wire codec for events and decisions: msgpack maps with a schema version.

`decode` never raises anything but `DecodeError`: bytes that are not msgpack, an unknown kind, a
missing or mistyped field, or a schema newer than this build each get a message saying so.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Mapping

import msgpack

from .config import SyncConfig
from .errors import DecodeError
from .events import KINDS, Decision, Event, MemberRef, RankAssignment

__all__ = ["SCHEMA_VERSION", "encode", "decode", "to_plain", "from_plain"]

SCHEMA_VERSION = 2
"""Bumped on any incompatible change; decoders reject newer schemas instead of guessing.

2: `StatusChanged.final` (a member's last STOPPED). Schema-1 records still decode (the field
defaults to False), so streams recorded by older builds replay."""


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, MemberRef):
        return {"role": value.role.value, "id": value.id, "inc": value.incarnation}
    if isinstance(value, RankAssignment):
        return {"member": _plain(value.member), "rank_offset": value.rank_offset, "ranks": value.ranks}
    if isinstance(value, SyncConfig):
        return value.to_mapping()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_plain(event: Event | Decision) -> dict[str, Any]:
    """The event as a plain map (JSON/msgpack-ready): schema, kind and every field."""
    out: dict[str, Any] = {"schema": SCHEMA_VERSION, "kind": event.KIND}
    for name, _ in event._specs:
        out[name] = _plain(getattr(event, name))
    return out


def encode(event: Event | Decision) -> bytes:
    """Serialise one event or decision."""
    return msgpack.packb(to_plain(event), use_bin_type=True)


def from_plain(data: Any) -> Event | Decision:
    """Build an event from a plain map, or raise `DecodeError` saying what is wrong."""
    if not isinstance(data, Mapping):
        raise DecodeError(f"an event must be a map, got {type(data).__name__}")
    schema = data.get("schema")
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise DecodeError(f"missing or non-integer 'schema' (got {schema!r})")
    if schema > SCHEMA_VERSION:
        raise DecodeError(
            f"event schema {schema} is newer than this build understands ({SCHEMA_VERSION}); "
            "upgrade rolectl on this host"
        )
    if schema < 1:
        raise DecodeError(f"invalid schema {schema}")
    kind = data.get("kind")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise DecodeError(f"unknown event kind {kind!r}; known: {sorted(KINDS)}")
    known = {name for name, _ in cls._specs}
    unknown = [k for k in data if k not in known and k not in ("schema", "kind")]
    if unknown:
        raise DecodeError(f"{kind}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs = {k: v for k, v in data.items() if k in known}
    try:
        return cls(**kwargs)
    except DecodeError as exc:
        raise DecodeError(f"{kind}: {exc}") from None
    except TypeError as exc:  # a required field is missing
        raise DecodeError(f"{kind}: {exc}") from None


def decode(payload: bytes) -> Event | Decision:
    """Parse one wire message into an event or decision (or raise `DecodeError`)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(payload).__name__}")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types; all mean "not msgpack"
        raise DecodeError(f"not a msgpack message ({type(exc).__name__}: {exc})") from None
    return from_plain(data)
