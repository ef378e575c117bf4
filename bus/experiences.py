"""Experiences: explorers publish rollout batches to the job's experience stream; the trainer
reads them with a durable pull consumer and acks after use, so nothing is lost on a restart.

Wire format: a msgpack map with a schema version. Token ids travel as raw little-endian int32 bytes
and logprobs as little-endian float32 bytes (4 bytes a token instead of msgpack's up to 9, and no
per-element decoding); no pickle anywhere. Logprobs are therefore rounded to float32 on the way.
Schema 2 adds a multi-turn episode's loss mask (one uint8 a response token) and its token versions
(int32 `(count, version)` pairs), each only on an experience that has it: a batch without them is
written as schema 1, byte for byte what older builds read, and schema-1 batches decode as
single-turn records.

Validation: bytes from the wire reach the model only as a batch that decodes (`decode_batch`) *and*
fits the trainer's engine (`validate_batch` with its `ExperienceLimits`: token ids in the vocabulary,
the prompt length it trains on, response and logprob lengths that agree, finite rewards and logprobs,
whole groups of `group_size`) and was published on its sender's own subject. The trainer's reader
terminates anything else (`msg.term()`: never redelivered), counts it and names the sender.

Delivery: at least once. A batch is stored once per (explorer, explore step) thanks to its msg id
`exp/<member>/<explore_step>`; the trainer's durable consumer redelivers anything not acked within
`ack_wait_s` (a trainer that died mid-step gets those batches again after it restarts).

Size: a batch travels as one message while it fits the stream's `max_msg_size` (and the server's
`max_payload`). One over it travels one message per group instead, `exp/<member>/<explore_step>/<g>`
for its `g`-th group: a group is what the trainer needs whole, and a replayed step stores each of
its groups once whatever its episodes' lengths came out as (a replay that lands on the other side
of the limit, whole once and by group once, is stored twice: batches belong well inside it). A
group over the limit is refused before anything of the batch is sent (`PayloadTooLarge`, naming
the settings that size it).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import Any

import msgpack
import nats.errors
import nats.js.errors
import numpy as np
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from rolectl.sync_protocol import MemberRef
from rolectl.sync_protocol.experience import Experience, ExperienceBatch, ExperienceLimits

from .aio import raise_if_cancelling
from .connection import BusConnection
from .errors import AckFailed, BusClosed, BusError, MalformedExperience, PayloadTooLarge, PublishRejected, describe
from .logging import LogBudget
from .streams import explain_refusal

__all__ = [
    "Experience",
    "ExperienceBatch",
    "ExperienceLimits",
    "validate_batch",
    "EXPERIENCE_SCHEMA",
    "encode_batch",
    "decode_batch",
    "experience_msg_id",
    "split_by_group",
    "ExperiencePublisher",
    "ExperienceReader",
    "ReceivedBatch",
]


def _finite(values: tuple[float, ...]) -> bool:
    # the sum (in C) is finite unless a value is not, or the sum overflows: then look at each
    return math.isfinite(sum(values)) or all(math.isfinite(v) for v in values)


def _outside(tokens: tuple[int, ...], vocab_size: int) -> int | None:
    """The first token id outside [0, vocab_size), or None."""
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab_size):
        return None
    return next(t for t in tokens if not 0 <= t < vocab_size)


def validate_batch(batch: ExperienceBatch, limits: ExperienceLimits) -> None:
    """Raise `MalformedExperience` naming the batch, the experience and the rule it breaks, if
    `batch` does not fit `limits`. A batch that passes cannot crash or poison the engine."""
    where = f"experience batch {batch.member}/{batch.explore_step}"
    if not batch.experiences:
        raise MalformedExperience(f"{where}: holds no experience")
    if batch.model_version < 0:
        raise MalformedExperience(f"{where}: model_version {batch.model_version} < 0")
    ids: set[str] = set()
    for i, exp in enumerate(batch.experiences):
        w = f"{where} experience {i} ({exp.id!r})"
        if exp.id in ids:
            raise MalformedExperience(f"{w}: id repeated within the batch")
        ids.add(exp.id)
        if exp.model_version < 0 or exp.model_version > batch.model_version:
            raise MalformedExperience(f"{w}: model_version {exp.model_version} outside 0..{batch.model_version} "
                                      "(the batch's version)")
        if limits.prompt_length is not None and len(exp.prompt) > limits.prompt_length:
            raise MalformedExperience(f"{w}: prompt has {len(exp.prompt)} tokens, more than the engine's "
                                      f"{limits.prompt_length}")
        if not exp.prompt:
            raise MalformedExperience(f"{w}: empty prompt")
        if len(exp.response) > limits.max_response_length:
            raise MalformedExperience(f"{w}: response has {len(exp.response)} tokens, more than the "
                                      f"engine's {limits.max_response_length}")
        if len(exp.logprobs) != len(exp.response):
            raise MalformedExperience(f"{w}: {len(exp.logprobs)} logprobs for {len(exp.response)} response tokens")
        for part in ("prompt", "response"):
            outside = _outside(getattr(exp, part), limits.vocab_size)
            if outside is not None:
                raise MalformedExperience(f"{w}: {part} token {outside} outside the vocabulary "
                                          f"[0, {limits.vocab_size})")
        _check_trajectory(exp, batch.model_version, w)
        if limits.response_tokens is not None:
            bad = [t for t, sampled in zip(exp.response, exp.mask()) if sampled and t not in limits.response_tokens]
            if bad:
                raise MalformedExperience(f"{w}: response token {bad[0]} is not one the policy samples")
        if not math.isfinite(exp.reward):
            raise MalformedExperience(f"{w}: reward {exp.reward} is not finite")
        if not _finite(exp.logprobs):
            raise MalformedExperience(f"{w}: a logprob is not finite")
    sizes = Counter(exp.group for exp in batch.experiences)
    wrong = {g: n for g, n in sizes.items() if n != limits.group_size}
    if wrong:
        group, n = next(iter(wrong.items()))
        raise MalformedExperience(f"{where}: group {group!r} has {n} responses, the engine's group size is "
                                  f"{limits.group_size}")


def _check_trajectory(exp: Experience, batch_version: int, where: str) -> None:
    """A multi-turn episode's mask and versions: one per response token, 0/1, versions between the
    experience's (the oldest) and the batch's."""
    if exp.loss_mask is not None:
        if len(exp.loss_mask) != len(exp.response):
            raise MalformedExperience(f"{where}: loss_mask has {len(exp.loss_mask)} entries for "
                                      f"{len(exp.response)} response tokens")
        if not set(exp.loss_mask) <= {0, 1}:
            raise MalformedExperience(f"{where}: loss_mask holds a value other than 0 and 1")
    if exp.token_versions is None:
        return
    if any(count < 1 for count, _ in exp.token_versions):
        raise MalformedExperience(f"{where}: token_versions holds a run of fewer than 1 token")
    covered = sum(count for count, _ in exp.token_versions)
    if covered != len(exp.response):
        raise MalformedExperience(f"{where}: token_versions cover {covered} tokens, the response has "
                                  f"{len(exp.response)}")
    versions = [version for _, version in exp.token_versions]
    if min(versions) < exp.model_version or max(versions) > batch_version:
        raise MalformedExperience(f"{where}: a token version outside {exp.model_version}..{batch_version} "
                                  "(the experience's oldest version .. the batch's)")


# --------------------------------------------------------------------------------------------------
# codec

EXPERIENCE_SCHEMA = 2
"""Bumped on any incompatible change; decoders reject newer schemas instead of guessing."""

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _pack_ids(values: tuple[int, ...], what: str) -> bytes:
    arr = np.asarray(values, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of token ids")
    if arr.size and (arr.min() < _I32_MIN or arr.max() > _I32_MAX):
        raise ValueError(f"{what} holds a token id outside int32; token ids travel as int32")
    return arr.astype(_I32).tobytes()


def _encode_experience(exp: Experience) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "id": exp.id,
        "group": exp.group,
        "prompt": _pack_ids(exp.prompt, f"experience {exp.id!r} prompt"),
        "response": _pack_ids(exp.response, f"experience {exp.id!r} response"),
        "logprobs": np.asarray(exp.logprobs, dtype=_F32).tobytes(),
        "reward": float(exp.reward),
        "model_version": int(exp.model_version),
    }
    if exp.loss_mask is not None:
        fields["loss_mask"] = np.asarray(exp.loss_mask, dtype=_U8).tobytes()
    if exp.token_versions is not None:
        runs = tuple(value for run in exp.token_versions for value in run)
        fields["token_versions"] = _pack_ids(runs, f"experience {exp.id!r} token_versions")
    return fields


def _is_trajectory(exp: Experience) -> bool:
    return exp.loss_mask is not None or exp.token_versions is not None


def encode_batch(batch: ExperienceBatch) -> bytes:
    """Serialise a batch (msgpack; token ids int32 and logprobs float32, little-endian)."""
    payload: bytes = msgpack.packb(
        {
            "schema": EXPERIENCE_SCHEMA if any(map(_is_trajectory, batch.experiences)) else 1,
            "member": batch.member,
            "explore_step": int(batch.explore_step),
            "model_version": int(batch.model_version),
            "experiences": [_encode_experience(e) for e in batch.experiences],
        },
        use_bin_type=True,
    )
    return payload


def _field(data: dict[str, Any], key: str, types: tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise MalformedExperience(f"{where}: missing field {key!r}")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, types):
        names = "/".join(t.__name__ for t in types)
        raise MalformedExperience(f"{where}: field {key!r} must be {names}, got {type(value).__name__}")
    return value


def _unpack(data: dict[str, Any], key: str, dtype: np.dtype[Any], where: str) -> tuple[Any, ...]:
    raw = _field(data, key, (bytes,), where)
    if len(raw) % dtype.itemsize:
        raise MalformedExperience(f"{where}: field {key!r} is {len(raw)} bytes, not a whole number of "
                                  f"{dtype.itemsize}-byte values")
    return tuple(np.frombuffer(raw, dtype=dtype).tolist())


def _version_runs(item: dict[str, Any], where: str) -> tuple[tuple[int, int], ...]:
    flat = _unpack(item, "token_versions", _I32, where)
    if len(flat) % 2:
        raise MalformedExperience(f"{where}: field 'token_versions' holds {len(flat)} numbers, not "
                                  "(count, version) pairs")
    return tuple(zip(flat[::2], flat[1::2]))


def decode_batch(payload: bytes) -> ExperienceBatch:
    """Parse a batch, or raise `MalformedExperience` saying what is wrong (never anything else)."""
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types; all mean "not msgpack"
        raise MalformedExperience(f"experience batch is not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise MalformedExperience(f"experience batch must be a map, got {type(data).__name__}")
    schema = _field(data, "schema", (int,), "experience batch")
    if schema > EXPERIENCE_SCHEMA or schema < 1:
        raise MalformedExperience(
            f"experience batch schema {schema} is not understood by this build (knows {EXPERIENCE_SCHEMA}); "
            "run the same rolectl version on explorers and trainer"
        )
    member = _field(data, "member", (str,), "experience batch")
    step = _field(data, "explore_step", (int,), "experience batch")
    where = f"experience batch {member}/{step}"
    version = _field(data, "model_version", (int,), where)
    items = _field(data, "experiences", (list,), where)
    out = []
    for i, item in enumerate(items):
        w = f"{where} experience {i}"
        if not isinstance(item, dict):
            raise MalformedExperience(f"{w}: must be a map, got {type(item).__name__}")
        out.append(
            Experience(
                id=_field(item, "id", (str,), w),
                group=_field(item, "group", (str,), w),
                prompt=_unpack(item, "prompt", _I32, w),
                response=_unpack(item, "response", _I32, w),
                logprobs=_unpack(item, "logprobs", _F32, w),
                reward=float(_field(item, "reward", (int, float), w)),
                model_version=_field(item, "model_version", (int,), w),
                loss_mask=_unpack(item, "loss_mask", _U8, w) if "loss_mask" in item else None,
                token_versions=_version_runs(item, w) if "token_versions" in item else None,
            )
        )
    return ExperienceBatch(member=member, explore_step=step, model_version=version, experiences=tuple(out))


def experience_msg_id(member: str, explore_step: int, group: int | None = None) -> str:
    """`exp/<member>/<explore_step>`, or `.../<group>` for the `group`-th group of a batch sent a group
    a message: a restarted explorer re-publishing a step is stored once."""
    return f"exp/{member}/{explore_step}" + ("" if group is None else f"/{group}")


def split_by_group(batch: ExperienceBatch) -> list[ExperienceBatch]:
    """`batch` as one batch per group, in the order the groups first appear."""
    groups: dict[str, list[Experience]] = {}
    for exp in batch.experiences:
        groups.setdefault(exp.group, []).append(exp)
    return [ExperienceBatch(member=batch.member, explore_step=batch.explore_step, model_version=batch.model_version,
                            experiences=tuple(members)) for members in groups.values()]


_HEADERS_ALLOWANCE = 256
"""Bytes kept free of a message's limit for its headers (the msg id)."""


# --------------------------------------------------------------------------------------------------
# publishing


class ExperiencePublisher:
    """Publishes one explorer's batches to `rft.<job>.exp.<member>`."""

    def __init__(
        self,
        conn: BusConnection,
        member: MemberRef | str,
        *,
        ack_timeout: float = 10.0,
        retry_for: float = 60.0,
    ):
        self.conn = conn
        self.member = member.id if isinstance(member, MemberRef) else member
        self.subject = conn.names.experiences(self.member)
        self.ack_timeout = ack_timeout
        self.retry_for = retry_for
        self._limit: int | None = None

    async def publish(self, batch: ExperienceBatch) -> int:
        """Store `batch`: one message, or one per group when it is over the stream's message limit;
        return the stream sequence of its (first) message, the original one if stored before.
        `PayloadTooLarge` when one group alone is over the limit (nothing of the batch is sent)."""
        if batch.member != self.member:
            raise ValueError(f"batch of member {batch.member!r} given to the publisher of {self.member!r}")
        payload = encode_batch(batch)
        limit = await self._message_limit()
        if limit is None or len(payload) <= limit:
            return await self._store(payload, experience_msg_id(self.member, batch.explore_step))
        groups = split_by_group(batch)
        parts = [encode_batch(group) for group in groups]
        for group, part in zip(groups, parts):
            if len(part) > limit:
                raise self._group_too_large(batch, group, len(part), limit)
        self.conn.log.info("bus.experience_batch_split", subject=self.subject, explore_step=batch.explore_step,
                           bytes=len(payload), limit=limit, messages=len(parts))
        seqs = [await self._store(part, experience_msg_id(self.member, batch.explore_step, index))
                for index, part in enumerate(parts)]
        return seqs[0]

    async def _store(self, payload: bytes, msg_id: str) -> int:
        try:
            ack = await self.conn.publish_acked(
                self.subject, payload, msg_id=msg_id, ack_timeout=self.ack_timeout, retry_for=self.retry_for
            )
        except PublishRejected as exc:
            raise explain_refusal(exc, self.conn.names.experience_stream, len(payload)) from exc
        if ack.duplicate:
            self.conn.log.info("bus.experience_duplicate", subject=self.subject, msg_id=msg_id, seq=ack.seq)
        return ack.seq

    async def _message_limit(self) -> int | None:
        """The largest batch payload one message carries: the stream's `max_msg_size` or the server's
        `max_payload`, whichever is smaller, less room for headers; read once. None when the stream
        cannot be asked (the server then refuses what is over, `StreamFull`)."""
        if self._limit is None:
            try:
                info = await self.conn.js.stream_info(self.conn.names.experience_stream)
            except (asyncio.TimeoutError, nats.errors.Error) as exc:
                self.conn.log.info("bus.experience_limit_unread", error=describe(exc))
                return None  # asked again at the next batch
            limits = [size for size in (info.config.max_msg_size, self.conn.nc.max_payload) if size and size > 0]
            self._limit = min(limits) - _HEADERS_ALLOWANCE if limits else 0
        return self._limit or None

    def _group_too_large(self, batch: ExperienceBatch, group: ExperienceBatch, size: int,
                         limit: int) -> PayloadTooLarge:
        stream = self.conn.names.experience_stream
        tokens = max(len(e.prompt) + len(e.response) for e in group.experiences)
        return PayloadTooLarge(
            f"experience batch {batch.member}/{batch.explore_step}: group {group.experiences[0].group!r} "
            f"({len(group.experiences)} episodes, up to {tokens} tokens each) is {size} bytes, over the "
            f"{limit} bytes one message of stream {stream} carries (its max_msg_size, or the server's "
            "max_payload), and a group travels whole: lower agent.max_tokens (or model.max_new_tokens) or "
            f"model.group_size, or raise the limit (`nats stream edit {stream} --max-msg-size <bytes>`). "
            "A smaller buffer.batch_size does not help: a batch over the limit already goes a group a message",
            subject=self.subject, msg_id=experience_msg_id(self.member, batch.explore_step), size=size,
            limit=limit)


# --------------------------------------------------------------------------------------------------
# consuming


class ReceivedBatch:
    """A batch the trainer holds: `batch`, `seq` (stream sequence), `num_delivered` (1 = first time).

    Ack it once trained on; `nak()` to have it redelivered now; `in_progress()` to keep holding it
    past `ack_wait_s` (each call restarts the ack timer).
    """

    __slots__ = ("batch", "seq", "num_delivered", "time_ms", "_msg", "_ack_timeout")

    def __init__(self, batch: ExperienceBatch, msg: Msg, *, seq: int, num_delivered: int, time_ms: int,
                 ack_timeout: float):
        self.batch = batch
        self.seq = seq
        self.num_delivered = num_delivered
        self.time_ms = time_ms
        self._msg = msg
        self._ack_timeout = ack_timeout

    async def ack(self) -> None:
        """Acknowledge and wait for the server to confirm (the batch is then deleted from the stream)."""
        try:
            await self._msg.ack_sync(timeout=self._ack_timeout)
        except nats.errors.MsgAlreadyAckdError:
            return
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            raise AckFailed(
                f"ack of experience batch {self.batch.member}/{self.batch.explore_step} (seq {self.seq}) "
                f"not confirmed ({exc}); it will be redelivered after the consumer's ack wait"
            ) from exc

    async def nak(self, delay: float | None = None) -> None:
        """Give the batch back for redelivery (after `delay` seconds if given). `AckFailed` when
        the server cannot be told (it hands the batch out again after the ack wait anyway)."""
        try:
            await self._msg.nak(delay=delay)
        except nats.errors.MsgAlreadyAckdError:
            return
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            raise AckFailed(f"nak of experience batch {self.batch.member}/{self.batch.explore_step} (seq "
                            f"{self.seq}) not sent ({exc}); it is redelivered after the consumer's ack wait") from exc

    async def in_progress(self) -> None:
        """Still working on it: restart the ack-wait timer. `AckFailed` when the server cannot be
        told (a reconnect): try again later, before the ack wait runs out."""
        try:
            await self._msg.in_progress()
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            raise AckFailed(f"in-progress of experience batch {self.batch.member}/{self.batch.explore_step} "
                            f"(seq {self.seq}) not sent ({exc}); its ack wait was not extended") from exc

    @property
    def ack_subject(self) -> str:
        """The JetStream ack subject of this delivery: any connection of the job may ack or nak
        the batch through it (a restarted trainer gives back what its predecessor held)."""
        return self._msg.reply

    def __repr__(self) -> str:
        return (f"<ReceivedBatch {self.batch.member}/{self.batch.explore_step} seq={self.seq} "
                f"delivered={self.num_delivered}>")


class ExperienceReader:
    """The trainer's durable pull consumer on the experience stream.

    `ack_wait_s` is how long a fetched batch may stay unacked before the server hands it out again
    (default 300 s: longer than a training step, short enough that a restarted trainer does not wait
    long for what its previous incarnation held). Call `in_progress()` on batches held longer.
    `max_ack_pending` bounds how many batches may be out unacked at once. `malformed` counts batches
    that did not decode; with `limits`, `invalid` counts batches that decode but do not fit the
    engine (`validate_batch`) or were sent on another member's subject. Both are terminated (never
    redelivered) and logged, naming the sender, at a bounded rate; `rejected` is their sum.
    """

    def __init__(
        self,
        conn: BusConnection,
        durable: str | None = None,
        *,
        ack_wait_s: float = 300.0,
        max_ack_pending: int = 1024,
        ack_timeout: float = 5.0,
        limits: ExperienceLimits | None = None,
    ):
        self.conn = conn
        self.durable = durable or conn.names.trainer_experience_durable
        self.limits = limits
        self.invalid = 0
        self._rejected_log = LogBudget(conn.log, "bus.experience_rejected")
        self.ack_wait_s = ack_wait_s
        self.max_ack_pending = max_ack_pending
        self.ack_timeout = ack_timeout
        self.malformed = 0
        self._stream = conn.names.experience_stream
        self._sub: JetStreamContext.PullSubscription | None = None

    @property
    def rejected(self) -> int:
        """Batches refused so far (malformed or invalid): none of them reached the model."""
        return self.malformed + self.invalid

    def _problem(self, msg: Msg) -> tuple[ExperienceBatch | None, str | None, str | None]:
        """(batch, None, None) for a good batch, else (None, which counter, why)."""
        try:
            batch = decode_batch(msg.data)
        except MalformedExperience as exc:
            return None, "malformed", str(exc)
        if self.limits is None:
            return batch, None, None
        if msg.subject != self.conn.names.experiences(batch.member):
            return None, "invalid", (f"batch claims to be from {batch.member!r} but was published on "
                                     f"{msg.subject}")
        try:
            validate_batch(batch, self.limits)
        except MalformedExperience as exc:
            return None, "invalid", str(exc)
        return batch, None, None

    async def _ensure(self) -> JetStreamContext.PullSubscription:
        if self._sub is not None:
            return self._sub
        config = ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            description=f"rolectl job {self.conn.names.job}: trainer's experience consumer",
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=self.max_ack_pending,
            filter_subject=self.conn.names.all_experiences,
        )
        try:
            # Create, or update the existing durable (e.g. a restarted trainer with another ack wait).
            await self.conn.js.add_consumer(self._stream, config)
        except nats.js.errors.NotFoundError as exc:
            raise BusError(
                f"experience stream {self._stream} does not exist on {self.conn.url}; "
                "call ensure_experience_stream first"
            ) from exc
        except nats.js.errors.ServiceUnavailableError:
            raise  # JetStream (re)starting: transient, fetch() retries
        except nats.js.errors.APIError as exc:
            raise BusError(
                f"cannot create or update consumer {self.durable!r} on {self._stream}: {exc.description} "
                f"(err_code {exc.err_code}). A work-queue stream allows one consumer per subject: is "
                "another consumer with a different name attached?"
            ) from exc
        self._sub = await self.conn.js.pull_subscribe_bind(durable=self.durable, stream=self._stream)
        return self._sub

    async def fetch(self, max_batches: int, timeout: float) -> list[ReceivedBatch]:
        """Up to `max_batches` batches, waiting at most `timeout` s for the first; [] if none came."""
        if self.conn.nc.is_closed:
            raise BusClosed(f"cannot fetch experiences: connection {self.conn.name} to {self.conn.url} is closed")
        try:
            sub = await self._ensure()
            msgs = await sub.fetch(max_batches, timeout=timeout)
        except asyncio.TimeoutError:
            raise_if_cancelling()
            return []
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
            raise BusClosed(f"cannot fetch experiences: connection {self.conn.name} is closed") from exc
        except (nats.js.errors.APIError, nats.errors.Error) as exc:
            # Server restarting (503), consumer recreated elsewhere (409), buffer full while
            # reconnecting: bind again on the next call. The trainer's loop just sees "nothing yet".
            self.conn.log.info("bus.experience_fetch_failed", stream=self._stream, durable=self.durable,
                               error=describe(exc))
            await self.aclose()
            await asyncio.sleep(min(timeout, 1.0))
            return []
        raise_if_cancelling()  # unacked messages are redelivered: nothing is lost by stopping here
        out = []
        for msg in msgs:
            meta = msg.metadata
            batch, counter, reason = self._problem(msg)
            if batch is None:
                if counter == "malformed":
                    self.malformed += 1
                else:
                    self.invalid += 1
                self._rejected_log.warn(sender=msg.subject.rsplit(".", 1)[-1], subject=msg.subject,
                                        seq=meta.sequence.stream, what=counter, reason=reason,
                                        rejected_total=self.rejected)
                try:
                    await msg.term()
                except nats.errors.Error:
                    pass  # not terminated: it comes back after ack_wait and is dropped again
                continue
            out.append(
                ReceivedBatch(batch, msg, seq=meta.sequence.stream, num_delivered=meta.num_delivered,
                              time_ms=int(meta.timestamp.timestamp() * 1000), ack_timeout=self.ack_timeout)
            )
        return out

    async def ack_floor(self) -> int:
        """The stream sequence up to which every delivery of this consumer is acked (0 when none)."""
        await self._ensure()
        info = await self.conn.js.consumer_info(self._stream, self.durable)
        return int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0

    async def give_back(self, ack_subjects: list[str]) -> int:
        """Nak deliveries a previous trainer process held (by their ack subjects), so the server
        redelivers them now instead of after `ack_wait_s`. Returns how many were given back; a
        subject that is not one of this consumer's ack subjects is skipped (naks of batches that
        were acked since are ignored by the server)."""
        given = 0
        for subject in ack_subjects:
            if not self._is_own_ack_subject(subject):
                continue
            try:
                await self.conn.nc.publish(subject, b"-NAK")
            except nats.errors.Error as exc:  # they still come back, after ack_wait
                self.conn.log.info("bus.experience_give_back_failed", subject=subject, error=describe(exc))
                continue
            given += 1
        if given:
            await self.conn.nc.flush(timeout=5)
        return given

    def _is_own_ack_subject(self, subject: object) -> bool:
        # v1 `$JS.ACK.<stream>.<consumer>.<6 more>`, v2 `$JS.ACK.<domain>.<account>.<stream>.<consumer>...`
        if not isinstance(subject, str):
            return False
        t = subject.split(".")
        if t[:2] != ["$JS", "ACK"]:
            return False
        named = t[2:4] if len(t) == 9 else t[4:6]
        return named == [self._stream, self.durable]

    async def aclose(self) -> None:
        """Stop fetching (the durable consumer stays: unacked batches wait for the next trainer)."""
        sub, self._sub = self._sub, None
        await self.conn.unsubscribe_quietly(sub)

    async def __aenter__(self) -> ExperienceReader:
        await self._ensure()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
