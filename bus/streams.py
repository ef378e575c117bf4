"""The job's two JetStream streams, created if missing and verified if present.

- The **event stream** records every input event and decision (`rft.<job>.evt.>`, `rft.<job>.sync.>`)
  with limits retention: it is the job's history, replayed by a restarted synchronizer and by
  `rolectl replay`, so nothing is removed when it is read; only age (7 days by default) trims it.
- The **experience stream** (`rft.<job>.exp.>`) uses **work-queue** retention: each batch is meant
  for exactly one reader, the trainer's durable consumer, and is deleted once the trainer acks it.
  Unacked batches survive trainer and server restarts; acked ones do not pile up on disk for the
  length of a run (limits retention would keep every rollout of the run until max_age). The price:
  the stream admits only that one consumer, so observers (dashboard) read counts from stream info
  instead of consuming.

Both use file storage. Their duplicate windows make `Nats-Msg-Id` dedup work: events are retried
within seconds (120 s window); a restarted explorer may re-publish a step minutes later (1 h window).
"""

from __future__ import annotations

import math

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, StreamInfo

from .errors import BusError, StreamMismatch
from .subjects import JobNames

__all__ = [
    "ensure_event_stream",
    "ensure_experience_stream",
    "event_stream_config",
    "experience_stream_config",
    "DEFAULT_EVENT_MAX_AGE_S",
    "PROVISION_HINT",
    "DEFAULT_EXPERIENCE_MAX_AGE_S",
]

DEFAULT_EVENT_MAX_AGE_S = 7 * 24 * 3600.0
DEFAULT_EXPERIENCE_MAX_AGE_S = 7 * 24 * 3600.0
_STREAM_EXISTS_ERR = 10058  # "stream name already in use with a different configuration"
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
) -> StreamConfig:
    """The event stream's configuration (what `ensure_event_stream` creates or expects)."""
    return StreamConfig(
        name=names.event_stream,
        description=f"rolectl job {names.job}: member events and synchronizer decisions",
        subjects=list(names.event_stream_subjects),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
        duplicate_window=duplicate_window_s,
        num_replicas=replicas,
    )


def experience_stream_config(
    names: JobNames,
    *,
    max_age_s: float = DEFAULT_EXPERIENCE_MAX_AGE_S,
    duplicate_window_s: float = 3600.0,
    max_bytes: int = -1,
    replicas: int = 1,
) -> StreamConfig:
    """The experience stream's configuration (what `ensure_experience_stream` creates or expects)."""
    return StreamConfig(
        name=names.experience_stream,
        description=f"rolectl job {names.job}: explorer rollouts for the trainer",
        subjects=[names.all_experiences],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=max_age_s,
        max_bytes=max_bytes,
        duplicate_window=duplicate_window_s,
        num_replicas=replicas,
    )


async def ensure_event_stream(
    js: JetStreamContext,
    names: JobNames,
    *,
    max_age_s: float = DEFAULT_EVENT_MAX_AGE_S,
    duplicate_window_s: float = 120.0,
    replicas: int = 1,
) -> StreamInfo:
    """Create the job's event stream, or check the existing one matches (`StreamMismatch` if not)."""
    config = event_stream_config(
        names, max_age_s=max_age_s, duplicate_window_s=duplicate_window_s, replicas=replicas
    )
    return await _ensure(js, config)


async def ensure_experience_stream(
    js: JetStreamContext,
    names: JobNames,
    *,
    max_age_s: float = DEFAULT_EXPERIENCE_MAX_AGE_S,
    duplicate_window_s: float = 3600.0,
    max_bytes: int = -1,
    replicas: int = 1,
) -> StreamInfo:
    """Create the job's experience stream, or check the existing one matches (`StreamMismatch` if not)."""
    config = experience_stream_config(
        names,
        max_age_s=max_age_s,
        duplicate_window_s=duplicate_window_s,
        max_bytes=max_bytes,
        replicas=replicas,
    )
    return await _ensure(js, config)


async def _ensure(js: JetStreamContext, config: StreamConfig) -> StreamInfo:
    # Requests use the JetStream context's timeout (nats-py's `nc.jetstream(timeout=...)`, 5 s).
    assert config.name
    try:
        info = await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        try:
            return await js.add_stream(config)
        except nats.errors.TimeoutError as exc:
            # A create this identity may not send is dropped by the server (a permissions
            # violation reported to the error callback) and only times out here.
            raise BusError(
                f"stream {config.name} does not exist and could not be created (no answer: this "
                f"identity may not create streams, or JetStream is not ready); {PROVISION_HINT}"
            ) from exc
        except nats.js.errors.APIError as exc:
            if exc.err_code != _STREAM_EXISTS_ERR:
                raise BusError(
                    f"cannot create stream {config.name} ({exc.description}, err_code {exc.err_code}); "
                    "check the server's JetStream limits and storage"
                ) from exc
            # Another member created it between our lookup and our create: verify theirs.
            info = await js.stream_info(config.name)
    except nats.errors.TimeoutError as exc:
        raise BusError(
            f"no answer from JetStream about stream {config.name}: is the server up and JetStream "
            f"enabled, and may this identity read stream info ($JS.API.STREAM.INFO.{config.name})?"
        ) from exc
    differences = _differences(config, info.config)
    if differences:
        raise StreamMismatch(config.name, differences)
    return info


def _plain(value):
    return value.value if hasattr(value, "value") else value


def _differences(want: StreamConfig, got: StreamConfig) -> list[tuple[str, object, object]]:
    """Every field we set that the existing stream has otherwise, as (field, expected, found)."""
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
    if want.max_bytes is not None and (want.max_bytes or -1) != (got.max_bytes or -1):
        out.append(("max_bytes", want.max_bytes, got.max_bytes))
    if (want.num_replicas or 1) != (got.num_replicas or 1):
        out.append(("num_replicas", want.num_replicas or 1, got.num_replicas or 1))
    return out
