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
from typing import Any

import msgspec

from .config import SyncConfig
from .errors import DecodeError
from .events import (
    KINDS,
    Decision,
    Event,
    JobConfigured,
    MemberRef,
    RankAssignment,
    RendezvousReady,
    membership_digest,
)

__all__ = ["SCHEMA_VERSION", "BATCH_KIND", "MAX_BATCH", "encode", "encode_decisions", "decode", "decode_all",
           "to_plain", "from_plain", "member_from_plain"]

SCHEMA_VERSION = 5
"""Bumped on any incompatible change; decoders reject newer schemas instead of guessing.

2: `StatusChanged.final` (a member's last STOPPED). Schema-1 records still decode (the field
defaults to False), so streams recorded by older builds replay.
3: decision batches (`kind: decisions`), one round's decisions each. Schema-2 records still decode.
4: decisions go to one decision log subject (`bus.subjects`), a batch may hold several rounds'
decisions. Schema-3 records still decode; a schema-3 build cannot read a job of this one (it says
so: "upgrade rolectl").
5: `RendezvousReady` names its group (`explorers`, `membership` digest) instead of listing every
participant, so its size does not grow with the fleet. A record of schema 4 or earlier decodes to
the same decision, bound to the list it carries (`_rendezvous_listed`), so old jobs replay."""

BATCH_KIND = "decisions"
MAX_BATCH = 256
"""Decisions in one batch at most (the synchronizer sends at most `roles.synchronizer`'s batch size,
128); a bound keeps a hostile message from costing more than a normal one to reject."""


def _enc_hook(value: Any) -> Any:
    # msgspec writes structs, enums and dataclasses itself; these are what else a field may hold
    if isinstance(value, SyncConfig):
        return value.to_mapping()
    if isinstance(value, Mapping):
        return dict(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def _dec_hook(type_: type, value: Any) -> Any:
    # `JobConfigured.config` arrives already built by `SyncConfig.from_mapping` (see `from_plain`)
    if isinstance(value, type_):
        return value
    raise NotImplementedError(f"cannot decode {type_.__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder()


# Fields added to a kind after its schema was fixed: left out while at their default, so such a
# record is byte-identical to what earlier builds wrote (and read by them).
_ADDED_LATER: dict[str, tuple[str, ...]] = {"status_changed": ("metrics", "interrupted"),
                                            "job_configured": ("train_batch_tasks",),
                                            "step_finished": ("tasks", "staleness")}


def to_plain(event: Event | Decision) -> dict[str, Any]:
    """The event as a plain map (JSON/msgpack-ready): schema, kind and every field."""
    fields: dict[str, Any] = msgspec.to_builtins(event, enc_hook=_enc_hook)
    if isinstance(event, JobConfigured):  # msgspec writes the struct whole; its own mapping leaves out
        fields["config"] = event.config.to_mapping()  # what was added later and is left at its default
    for name in _ADDED_LATER.get(event.KIND, ()):
        value = fields.get(name)
        if value is None or value is False or value == {}:  # its default (a 0 is a value: kept)
            fields.pop(name, None)
    return {"schema": SCHEMA_VERSION, **fields}  # msgspec puts the tag (`kind`) first


def encode(event: Event | Decision) -> bytes:
    """Serialise one event or decision."""
    return _ENCODER.encode(to_plain(event))


def _explain(error: msgspec.ValidationError) -> str:
    """msgspec's message with its JSON path (`... - at `$.released.inc``) turned into the field's
    name in front: "field 'released.inc': Expected `int`, got `bool`"."""
    what, sep, where = str(error).rpartition(" - at `")
    if not sep:
        return what or str(error)
    path = where.rstrip("`").replace("`", "").replace("$.", "").replace("$", "the message")
    if path.startswith("key in "):
        return f"a key in {path[len('key in '):]}: {what}"
    return f"field {path!r}: {what}"


def _job_config(value: Any) -> SyncConfig:
    # SyncConfig validates itself and reports every problem at once (`config.py`)
    if isinstance(value, SyncConfig):
        return value
    try:
        return SyncConfig.from_mapping(value, where="config")
    except ValueError as exc:  # ConfigError is a ValueError
        raise DecodeError(f"field 'config': {exc}") from None


def member_from_plain(data: Any) -> MemberRef:
    """A member map `{role, id, inc}` from the wire (a heartbeat's, say), or `DecodeError`."""
    try:
        return msgspec.convert(data, MemberRef)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"member: {_explain(exc)}") from None


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
    body = dict(data)
    del body["schema"]  # every kind's own fields and its tag remain
    try:
        if cls is JobConfigured and "config" in body:
            body["config"] = _job_config(body["config"])
        if cls is RendezvousReady and schema < _GROUP_BY_REFERENCE:
            return _rendezvous_listed(body)
        return msgspec.convert(body, cls, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"{kind}: {_explain(exc)}") from None
    except DecodeError as exc:
        raise DecodeError(f"{kind}: {exc}") from None


_GROUP_BY_REFERENCE = 5  # the schema from which a RendezvousReady names its group instead of listing it


def _rendezvous_listed(body: dict[str, Any]) -> RendezvousReady:
    """A RendezvousReady as schema 4 and earlier recorded it, every participant listed: the same
    decision a schema-5 reducer computes (count and digest of the list), bound to the list."""
    if "participants" not in body:
        raise DecodeError("field 'participants': Object missing required field `participants` "
                          "(schema 4 and earlier list the group)")
    try:
        listed = msgspec.convert(body.pop("participants"), tuple[RankAssignment, ...])
    except msgspec.ValidationError as exc:
        raise DecodeError(f"in 'participants': {_explain(exc)}") from None
    ready = msgspec.convert({**body, "explorers": len(listed), "membership": membership_digest(listed)},
                            RendezvousReady)
    ranks = 1 + sum(p.ranks for p in listed)
    if ready.world_size != ranks:
        raise DecodeError(f"world_size {ready.world_size}, but its participants hold {ranks} ranks "
                          "(trainer included)")
    return ready.bound(listed)


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
    return _ENCODER.encode({"schema": SCHEMA_VERSION, "kind": BATCH_KIND,
                            "decisions": [to_plain(d) for d in decisions]})


def _unpack(payload: bytes) -> Any:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(payload).__name__}")
    try:
        return _DECODER.decode(payload)
    except Exception as exc:  # msgspec.DecodeError mostly; anything here means "not msgpack"
        raise DecodeError(f"not a msgpack message ({type(exc).__name__}: {exc})") from None


def decode(payload: bytes) -> Event | Decision:
    """Parse one wire message holding one event or decision (or raise `DecodeError`; a decision
    batch is refused here: read stream messages with `decode_all`)."""
    data = _unpack(payload)
    if isinstance(data, dict) and data.get("kind") == BATCH_KIND:
        raise DecodeError("a batch of decisions where one event or decision was expected (use decode_all)")
    return from_plain(data)


def decode_all(payload: bytes) -> tuple[Event | Decision, ...]:
    """Parse one stream message into what it holds: one event, one decision, or the decisions of a
    batch in recorded order (or raise `DecodeError` saying what is wrong)."""
    data = _unpack(payload)
    if not (isinstance(data, dict) and data.get("kind") == BATCH_KIND):
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
    out: list[Decision] = []
    for i, item in enumerate(items):
        try:
            decision = from_plain(item)
        except DecodeError as exc:
            raise DecodeError(f"decision batch, item {i}: {exc}") from None
        if not isinstance(decision, Decision):
            raise DecodeError(f"decision batch, item {i}: {decision.KIND} is an input event, not a decision")
        out.append(decision)
    return tuple(out)
