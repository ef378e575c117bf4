"""Wire codec for events and decisions: msgpack maps with a schema version.

One stream message holds one event, one decision, or a *decision batch*: several decisions, of any
rounds, in the order the reducer computed them (`encode_decisions`). A batch is recorded atomically
with one sequence, one message id and one guard on the decision log, so everything the synchronizer
decided while its previous batch was being stored (64 explorers asking at once: 64 opens, releases
and closes) costs one publish and one ack instead of a chain of them; `decode_all` reads any message
into the decisions or event it holds.

`decode` / `decode_all` never raise anything but `DecodeError`: bytes that are not msgpack, an
unknown kind, a missing or mistyped field, a schema newer than this build, or a batch that is
empty or too long each get a message saying so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

import msgpack

from .config import SyncConfig
from .errors import DecodeError
from .events import KINDS, Decision, Event, MemberRef, RankAssignment, is_map

__all__ = ["SCHEMA_VERSION", "BATCH_KIND", "MAX_BATCH", "encode", "encode_decisions", "decode", "decode_all",
           "to_plain", "from_plain"]

SCHEMA_VERSION = 4
"""Bumped on any incompatible change; decoders reject newer schemas instead of guessing.

2: `StatusChanged.final` (a member's last STOPPED). Schema-1 records still decode (the field
defaults to False), so streams recorded by older builds replay.
3: decision batches (`kind: decisions`), one round's decisions each. Schema-2 records still decode.
4: decisions go to one decision log subject (`bus.subjects`), a batch may hold several rounds'
decisions. Schema-3 records still decode; a schema-3 build cannot read a job of this one (it says
so: "upgrade rolectl")."""

BATCH_KIND = "decisions"
MAX_BATCH = 256
"""Decisions in one batch at most (the synchronizer sends at most `roles.synchronizer`'s batch size,
128); a bound keeps a hostile message from costing more than a normal one to reject."""


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


# The keys a message of each kind may hold: its fields, its schema and its kind.
_ALLOWED_KEYS: dict[str, frozenset[str]] = {
    kind: frozenset(name for name, _ in cls._specs) | {"schema", "kind"} for kind, cls in KINDS.items()
}


def from_plain(data: Any) -> Event | Decision:
    """Build an event from a plain map, or raise `DecodeError` saying what is wrong."""
    if not is_map(data):
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
    allowed = _ALLOWED_KEYS[kind]
    if not allowed.issuperset(data.keys()):
        unknown = [k for k in data if k not in allowed]
        raise DecodeError(f"{kind}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs = dict(data)  # every event is decoded on every reader's hot path: copy, drop two keys
    del kwargs["schema"], kwargs["kind"]
    try:
        return cls(**kwargs)
    except DecodeError as exc:
        raise DecodeError(f"{kind}: {exc}") from None
    except TypeError as exc:  # a required field is missing
        raise DecodeError(f"{kind}: {exc}") from None


def encode_decisions(decisions: Sequence[Decision]) -> bytes:
    """Serialise decisions as one message: a lone decision as itself, several as a batch (in the
    given order, which is the order they are recorded and read in)."""
    if not decisions:
        raise ValueError("encode_decisions needs at least one decision")
    if len(decisions) == 1:
        return encode(decisions[0])
    inputs = sorted({type(d).__name__ for d in decisions if not isinstance(d, Decision)})
    if inputs:
        raise ValueError(f"a decision batch holds decisions only, got {', '.join(inputs)}")
    if len(decisions) > MAX_BATCH:
        raise ValueError(f"a decision batch holds at most {MAX_BATCH} decisions, got {len(decisions)}")
    return msgpack.packb({"schema": SCHEMA_VERSION, "kind": BATCH_KIND, "decisions": [to_plain(d) for d in decisions]},
                         use_bin_type=True)


def _unpack(payload: bytes) -> Any:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(payload).__name__}")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types; all mean "not msgpack"
        raise DecodeError(f"not a msgpack message ({type(exc).__name__}: {exc})") from None


def decode(payload: bytes) -> Event | Decision:
    """Parse one wire message holding one event or decision (or raise `DecodeError`; a decision
    batch is refused here: read stream messages with `decode_all`)."""
    data = _unpack(payload)
    if is_map(data) and data.get("kind") == BATCH_KIND:
        raise DecodeError("a batch of decisions where one event or decision was expected (use decode_all)")
    return from_plain(data)


def decode_all(payload: bytes) -> tuple[Event | Decision, ...]:
    """Parse one stream message into what it holds: one event, one decision, or the decisions of a
    batch in recorded order (or raise `DecodeError` saying what is wrong)."""
    data = _unpack(payload)
    if not (is_map(data) and data.get("kind") == BATCH_KIND):
        return (from_plain(data),)
    schema = data.get("schema")
    if isinstance(schema, bool) or not isinstance(schema, int) or not 3 <= schema <= SCHEMA_VERSION:
        raise DecodeError(f"decision batch: schema must be an integer from 3 to {SCHEMA_VERSION}, got {schema!r}"
                          + ("; upgrade rolectl on this host" if isinstance(schema, int) and schema > SCHEMA_VERSION
                             else ""))
    unknown = [k for k in data if k not in ("schema", "kind", "decisions")]
    if unknown:
        raise DecodeError(f"decision batch: unknown field(s) {sorted(map(str, unknown))}")
    items = data.get("decisions")
    if not isinstance(items, list) or not 2 <= len(items) <= MAX_BATCH:
        got = f"{len(items)} items" if isinstance(items, list) else type(items).__name__
        raise DecodeError(f"decision batch: 'decisions' must be a list of 2 to {MAX_BATCH} decisions, got {got}")
    out = []
    for i, item in enumerate(items):
        try:
            decision = from_plain(item)
        except DecodeError as exc:
            raise DecodeError(f"decision batch, item {i}: {exc}") from None
        if not isinstance(decision, Decision):
            raise DecodeError(f"decision batch, item {i}: {decision.KIND} is an input event, not a decision")
        out.append(decision)
    return tuple(out)
