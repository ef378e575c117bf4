"""The job's two JetStream streams, created if missing and verified if present.

- The **event stream** records every input event and decision (`rft.<job>.evt.>`, `rft.<job>.sync.>`)
  with limits retention: it is the job's history, replayed by a restarted synchronizer and by
  `rolectl replay`, so nothing is removed when it is read. After each reducer snapshot the active
  synchronizer archives the records the snapshot covers (`bus.archive`) and only then purges them,
  so the stream holds about `snapshot_every` records however long the job runs; age (7 days by
  default) trims it too.
- The **experience stream** (`rft.<job>.exp.>`) uses **work-queue** retention: each batch is meant
  for exactly one reader, the trainer's durable consumer, and is deleted once the trainer acks it.
  Unacked batches survive trainer and server restarts; acked ones do not pile up on disk for the
  length of a run (limits retention would keep every rollout of the run until max_age). The price:
  the stream admits only that one consumer, so observers (dashboard) read counts from stream info
  instead of consuming.

Both use file storage and `replicas` copies (1 by default; 3 on a 3-node cluster, so losing a node
loses nothing). An existing stream with at least the requested replicas is accepted. Their
duplicate windows make `Nats-Msg-Id` dedup work: events are retried within seconds (120 s window);
a restarted explorer may re-publish a step minutes later (1 h window).

**Bounded.** Anyone who may publish on a job's subjects could otherwise fill the server's disk. Both
streams cap the size of one message (`max_msg_size`) and their total (`max_bytes`), and refuse
what does not fit (`DiscardPolicy.NEW`): history is never dropped silently to make room, and a full
stream is a clear error (`StreamFull`, saying how to raise the limit) instead. The defaults are sized
from measured bytes per step (`python -m benchmarks.stream_bytes`; figures in the docs): about 100x
the largest event and the largest quickstart batch per message, and thousands of quickstart steps
of events (hundreds of batches of experiences) in all. Why not more: the server *reserves* every
stream's max_bytes against its JetStream store (`max_file_store`, by default 75 % of the free
disk) when the stream is created, so one server holds only so many jobs' worth of limits. Size a
long or wide job's streams on the server before it starts (`nats stream add`/`edit`, or
`ensure_event_stream(max_bytes=...)`): limits are checked on creation only, an existing stream's
own limits are never taken for a mismatch.
"""

from __future__ import annotations

import math

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, StreamInfo

from ._natspy_compat import client_of
from .errors import BusError, PublishRejected, RetriesExhausted, StreamMismatch, describe
from .retry import is_transient, retry_transient
from .subjects import JobNames

__all__ = [
    "ensure_event_stream",
    "ensure_experience_stream",
    "event_stream_config",
    "experience_stream_config",
    "weights_stream_config",
    "stream_differences",
    "replica_shortfall",
    "DEFAULT_EVENT_MAX_AGE_S",
    "PROVISION_HINT",
    "DEFAULT_EXPERIENCE_MAX_AGE_S",
    "DEFAULT_EVENT_MAX_MSG_SIZE",
    "DEFAULT_EVENT_MAX_BYTES",
    "DEFAULT_EXPERIENCE_MAX_MSG_SIZE",
    "DEFAULT_EXPERIENCE_MAX_BYTES",
    "StreamFull",
    "explain_refusal",
]

DEFAULT_EVENT_MAX_AGE_S = 7 * 24 * 3600.0
DEFAULT_EXPERIENCE_MAX_AGE_S = 7 * 24 * 3600.0
DEFAULT_EVENT_MAX_MSG_SIZE = 64 * 1024
DEFAULT_EVENT_MAX_BYTES = 64 * 1024**2
DEFAULT_EXPERIENCE_MAX_MSG_SIZE = 8 * 1024**2
DEFAULT_EXPERIENCE_MAX_BYTES = 64 * 1024**2
_STREAM_EXISTS_ERR = 10058  # "stream name already in use with a different configuration"
_REPLICAS_NOT_SUPPORTED_ERR = 10074  # "replicas > 1 not supported in non-clustered mode"
_MAX_BYTES_EXCEEDED = 10077  # JSStreamStoreFailedF: "maximum bytes exceeded" (discard new)
MSG_TOO_BIG = 10054  # JSStreamMessageExceedsMaximumErr: "message size exceeds maximum allowed"


class StreamFull(PublishRejected):
    """A stream refused a message because it is at its `max_bytes` (or the message is over its
    `max_msg_size`). Says which stream, which limit and how to raise it."""


def explain_refusal(exc: PublishRejected, stream: str, payload_bytes: int) -> PublishRejected:
    """`exc` rephrased as a `StreamFull` when a stream limit refused the message, else `exc`."""
    description = (exc.description or "").lower()
    if exc.err_code == _MAX_BYTES_EXCEEDED or "maximum bytes" in description:
        what = (f"stream {stream} is full: it holds its max_bytes limit and refuses new messages rather "
                "than drop recorded ones. Raise the limit on the server "
                f"(`nats stream edit {stream} --max-bytes <bytes>`; rolectl's default is sized in "
                "bus/streams.py from measured bytes per step), or find who fills it (`rolectl replay`)")
    elif exc.err_code == MSG_TOO_BIG or "message size exceeds" in description:
        what = (f"a {payload_bytes}-byte message is over stream {stream}'s max_msg_size; send smaller "
                f"messages or raise it (`nats stream edit {stream} --max-msg-size <bytes>`)")
    else:
        return exc
    return StreamFull(f"{what} (on {exc.subject}: {exc.description}, err_code {exc.err_code})",
                      subject=exc.subject, msg_id=exc.msg_id, code=exc.code, err_code=exc.err_code,
                      description=exc.description)


PROVISION_HINT = (
    "run `rolectl provision --config JOB.yaml` with the admin identity (--creds DIR/admin.nk) "
    "first: with per-identity permissions only admin creates streams"
)


def event_stream_config(
    names: JobNames,
    *,
    max_age_s: float = DEFAULT_EVENT_MAX_AGE_S,
    duplicate_window_s: float = 120.0,
    replicas: int = 1,
    max_msg_size: int = DEFAULT_EVENT_MAX_MSG_SIZE,
    max_bytes: int = DEFAULT_EVENT_MAX_BYTES,
) -> StreamConfig:
    """The event stream's configuration (what `ensure_event_stream` creates or expects)."""
    return StreamConfig(
        name=names.event_stream,
        description=f"rolectl job {names.job}: member events and synchronizer decisions",
        subjects=list(names.event_stream_subjects),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,  # full: refuse, never drop history
        max_msg_size=max_msg_size,
        max_bytes=max_bytes,
        max_age=max_age_s,
        duplicate_window=duplicate_window_s,
        num_replicas=replicas,
    )


def experience_stream_config(
    names: JobNames,
    *,
    max_age_s: float = DEFAULT_EXPERIENCE_MAX_AGE_S,
    duplicate_window_s: float = 3600.0,
    max_bytes: int = DEFAULT_EXPERIENCE_MAX_BYTES,
    replicas: int = 1,
    max_msg_size: int = DEFAULT_EXPERIENCE_MAX_MSG_SIZE,
) -> StreamConfig:
    """The experience stream's configuration (what `ensure_experience_stream` creates or expects)."""
    return StreamConfig(
        name=names.experience_stream,
        description=f"rolectl job {names.job}: explorer rollouts for the trainer",
        subjects=[names.all_experiences],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,  # full: the explorer is told, no unread rollout is dropped
        max_age=max_age_s,
        max_bytes=max_bytes,
        max_msg_size=max_msg_size,
        duplicate_window=duplicate_window_s,
        num_replicas=replicas,
    )


def weights_stream_config(names: JobNames, *, storage: StorageType, replicas: int, max_msg_size: int) -> StreamConfig:
    """The object store transport's stream: one message per chunk subject (a rewritten chunk
    replaces the old one), read by direct get; chunks and manifests are at most `max_msg_size`
    (the server's max_payload), so nothing bigger is ours."""
    return StreamConfig(
        name=names.weights_stream,
        description=f"rolectl weights of job {names.job} (object store transport)",
        subjects=[names.all_weights],
        retention=RetentionPolicy.LIMITS,
        storage=storage,
        discard=DiscardPolicy.OLD,
        max_msgs_per_subject=1,
        max_msg_size=max_msg_size,
        allow_direct=True,
        duplicate_window=120.0,  # the server's default, stated so an existing stream compares equal
        num_replicas=replicas,
    )


async def ensure_event_stream(
    js: JetStreamContext,
    names: JobNames,
    *,
    max_age_s: float = DEFAULT_EVENT_MAX_AGE_S,
    duplicate_window_s: float = 120.0,
    replicas: int = 1,
    max_msg_size: int = DEFAULT_EVENT_MAX_MSG_SIZE,
    max_bytes: int = DEFAULT_EVENT_MAX_BYTES,
) -> StreamInfo:
    """Create the job's event stream, or check the existing one matches (`StreamMismatch` if not)."""
    config = event_stream_config(
        names, max_age_s=max_age_s, duplicate_window_s=duplicate_window_s, replicas=replicas,
        max_msg_size=max_msg_size, max_bytes=max_bytes,
    )
    return await _ensure(js, config)


async def ensure_experience_stream(
    js: JetStreamContext,
    names: JobNames,
    *,
    max_age_s: float = DEFAULT_EXPERIENCE_MAX_AGE_S,
    duplicate_window_s: float = 3600.0,
    max_bytes: int = DEFAULT_EXPERIENCE_MAX_BYTES,
    replicas: int = 1,
    max_msg_size: int = DEFAULT_EXPERIENCE_MAX_MSG_SIZE,
) -> StreamInfo:
    """Create the job's experience stream, or check the existing one matches (`StreamMismatch` if not)."""
    config = experience_stream_config(
        names,
        max_age_s=max_age_s,
        duplicate_window_s=duplicate_window_s,
        max_bytes=max_bytes,
        replicas=replicas,
        max_msg_size=max_msg_size,
    )
    return await _ensure(js, config)


_ENSURE_RETRY_S = 60.0


def _create_denied(js: JetStreamContext, stream: str) -> bool:
    """Whether the server's last error on this connection is a permissions violation for creating
    `stream` (nats-py keeps it as the client's `last_error`; the context exposes no public handle)."""
    last = str(client_of(js).last_error or "").lower()
    return "permissions violation" in last and f"stream.create.{stream}".lower() in last


async def _ensure(js: JetStreamContext, config: StreamConfig, *, retry_for: float = _ENSURE_RETRY_S) -> StreamInfo:
    """Look the stream up, create it if missing, verify it; transient failures (server restarting,
    a cluster electing its leader, too few nodes up for the replicas) are retried for `retry_for` s."""
    # Requests use the JetStream context's timeout (nats-py's `nc.jetstream(timeout=...)`).
    assert config.name
    name = config.name
    replicas = config.num_replicas or 1

    async def lookup_or_create() -> StreamInfo:
        try:
            return await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            pass
        try:
            return await js.add_stream(config)
        except nats.errors.TimeoutError as exc:
            # A create this identity may not send is dropped by the server: it only times out here,
            # and the server's permissions violation goes to the connection's error callback (and
            # `last_error`). Without one, the answer is just slow (a loaded host, a cluster placing
            # the stream's replicas with a node down): retried, and the next lookup finds the
            # stream if that create went through.
            if _create_denied(js, name):
                raise BusError(
                    f"stream {config.name} does not exist and this identity may not create it (the "
                    f"server refused $JS.API.STREAM.CREATE.{config.name}); {PROVISION_HINT}"
                ) from exc
            raise
        except nats.js.errors.APIError as exc:
            if exc.err_code == _STREAM_EXISTS_ERR:
                # Another member created it between our lookup and our create: verify theirs.
                return await js.stream_info(name)
            if is_transient(exc):
                raise
            if exc.err_code == _REPLICAS_NOT_SUPPORTED_ERR:
                raise BusError(
                    f"cannot create stream {config.name} with {replicas} replicas: the server is not "
                    "part of a JetStream cluster. Set nats.replicas: 1, or run a cluster "
                    "(`rolectl server --cluster 3`, deploy/nats/cluster)"
                ) from exc
            raise BusError(
                f"cannot create stream {config.name} ({exc.description}, err_code {exc.err_code}); "
                "check the server's JetStream limits and storage"
            ) from exc

    try:
        info = await retry_transient(lookup_or_create, what=f"ensure stream {config.name}", retry_for=retry_for)
    except RetriesExhausted as exc:
        raise BusError(
            f"no usable answer from JetStream about stream {config.name} for {retry_for:g} s "
            f"(last: {describe(exc.last)}): is the server up with JetStream, (replicas {replicas}) are "
            f"enough cluster nodes up, and may this identity read stream info "
            f"($JS.API.STREAM.INFO.{config.name})?"
        ) from exc.last
    differences = stream_differences(config, info.config)
    if differences:
        raise StreamMismatch(config.name, differences)
    return info


def _plain(value: object) -> object:
    """An enum's value, anything else as it is (a server's config and ours compare as plain values)."""
    return value.value if hasattr(value, "value") else value


def stream_differences(want: StreamConfig, got: StreamConfig) -> list[tuple[str, object, object]]:
    """Every field we set that the existing stream has otherwise, as (field, expected, found): the
    one rule every stream of a job is checked by (events, experiences, weights)."""
    out: list[tuple[str, object, object]] = []
    if sorted(want.subjects or []) != sorted(got.subjects or []):
        out.append(("subjects", sorted(want.subjects or []), sorted(got.subjects or [])))
    for name in ("retention", "storage", "discard"):
        a, b = _plain(getattr(want, name)), _plain(getattr(got, name))
        if a != b:
            out.append((name, a, b))
    for name in ("max_age", "duplicate_window"):
        a, b = float(getattr(want, name) or 0), float(getattr(got, name) or 0)
        if not math.isclose(a, b, rel_tol=0, abs_tol=1e-3):
            out.append((f"{name} (s)", a, b))
    for name in ("allow_direct", "max_msgs_per_subject"):  # what the object store's reads rely on
        a, b = getattr(want, name), getattr(got, name)
        if a is not None and a != b:
            out.append((name, a, b))
    # max_bytes / max_msg_size are not compared: the operator may size a stream otherwise.
    # More replicas than asked for is more safety, not a mismatch (an operator may pre-create R3).
    out.extend(replica_shortfall(want.num_replicas, got.num_replicas))
    return out


def replica_shortfall(want: int | None, got: int | None) -> list[tuple[str, object, object]]:
    """The replica rule for every stream and bucket of a job: more copies than asked for is more
    safety (an operator may pre-create R3), fewer is a difference (one copy dies with its node)."""
    if (got or 1) < (want or 1):
        return [("num_replicas (at least)", want or 1, got or 1)]
    return []
