"""The bus's exception tree, one root (`BusError`): every failure leaves `bus` as one of these, never
as a nats-py error — NATS connections and streams, the embedded server, and weight transfers alike.

Each message says what was wrong, where (URL, subject, stream) and what to do about it, so a log
line alone is enough to act on.
"""

from __future__ import annotations

import asyncio
import socket

from .security import redact

__all__ = [
    "describe",
    "BusError",
    "BusUnavailable",
    "BusClosed",
    "StreamMismatch",
    "PublishFailed",
    "PayloadTooLarge",
    "PublishRejected",
    "RetriesExhausted",
    "HistoryGap",
    "AckFailed",
    "MalformedExperience",
    "SubjectMoved",
    "DecisionSuperseded",
    "NatsServerError",
    "TransferError",
    "CorruptWeights",
    "WeightsNotFound",
    "PeerLost",
]


class BusError(Exception):
    """Base of every error raised by `bus` (connections, streams, publishing, consuming)."""


class BusUnavailable(BusError):
    """No NATS server (with JetStream) could be reached at first connect."""

    def __init__(self, message: str, *, url: str, cause: BaseException | None = None):
        super().__init__(message)
        self.url = url
        self.cause = cause


class BusClosed(BusError):
    """The connection was closed (by `aclose()` or for good by the client); nothing more can be sent."""


class StreamMismatch(BusError):
    """A stream exists with a configuration other than the one this build needs.

    `differences` lists every differing field as (field, expected, found).
    """

    def __init__(self, stream: str, differences: list[tuple[str, object, object]]):
        self.stream = stream
        self.differences = list(differences)
        detail = "; ".join(f"{name}: expected {want!r}, found {got!r}" for name, want, got in differences)
        super().__init__(
            f"stream {stream} exists with a different configuration ({detail}). "
            f"Another rolectl version or a manual edit created it: delete it "
            f"(`nats stream rm {stream}`, which drops its history) or start with matching settings."
        )


class PublishFailed(BusError):
    """A JetStream publish was not acknowledged: every retry timed out, or the server refused it."""

    def __init__(self, message: str, *, subject: str, msg_id: str | None = None):
        super().__init__(message)
        self.subject = subject
        self.msg_id = msg_id


class PayloadTooLarge(PublishFailed):
    """The message is larger than the server (`max_payload`) or its stream (`max_msg_size`) takes;
    it was not stored. `limit` is the limit in bytes where known."""

    def __init__(self, message: str, *, subject: str, msg_id: str | None = None, size: int,
                 limit: int | None = None):
        super().__init__(message, subject=subject, msg_id=msg_id)
        self.size = size
        self.limit = limit


class PublishRejected(PublishFailed):
    """The stream answered and refused the message (a JetStream API error); retrying will not help.

    `err_code` is the JetStream error code (for example 10071, wrong last sequence).
    """

    def __init__(
        self,
        message: str,
        *,
        subject: str,
        msg_id: str | None = None,
        code: int | None = None,
        err_code: int | None = None,
        description: str = "",
    ):
        super().__init__(message, subject=subject, msg_id=msg_id)
        self.code = code
        self.err_code = err_code
        self.description = description


class HistoryGap(BusError):
    """A reader that must see every record found a stretch of the stream trimmed (archived and
    purged while it lagged behind) and could not read it back from the archive."""


class RetriesExhausted(BusError):
    """A transient failure (server restarting, leader election, lost ack) outlasted the retry budget.

    `what` names the operation, `attempts` how often it was tried, `last` the final failure.
    """

    def __init__(self, *, what: str, attempts: int, seconds: float, last: BaseException | None):
        self.what = what
        self.attempts = attempts
        self.seconds = seconds
        self.last = last
        super().__init__(
            f"{what}: still failing after {attempts} attempt(s) in {seconds:g} s (last: {describe(last)}). "
            "Is the NATS server (or a majority of the cluster) up, with JetStream?"
        )


class AckFailed(BusError):
    """The server did not confirm an ack, nak or in-progress: the message will be redelivered
    after its ack wait."""


class MalformedExperience(BusError, ValueError):
    """Bytes on the experience subject are not a valid `ExperienceBatch` (or a newer schema)."""


class SubjectMoved(PublishRejected):
    """A publish guarded by its subject's last sequence (`Nats-Expected-Last-Subject-Sequence`) was
    not stored: the subject holds a message the publisher did not know of (another writer's)."""


class DecisionSuperseded(SubjectMoved):
    """A decision was not stored because the decision log holds a message this replica did not
    know of (another replica's decision, or a foreign message): re-read the log to decide."""


class NatsServerError(BusError):
    """The embedded server could not be found, started or stopped."""


class TransferError(BusError):
    """A weight transfer failed; the caller keeps the weights it had."""


class CorruptWeights(TransferError):
    """Bytes arrived but do not match their header or digest. No tensor was handed out."""


class WeightsNotFound(TransferError):
    """The announced version is not (or no longer) stored."""


class PeerLost(TransferError):
    """A peer of a rendezvous group died or timed out mid-transfer."""


def describe(exc: BaseException | None) -> str:
    """A short, readable name for a failure, for logs and error messages, with URL secrets masked."""
    return redact(_name(exc))  # an error may quote a URL with its password


def _name(exc: BaseException | None) -> str:
    # Imported here: the exception tree itself loads no NATS client (engines import it alone).
    import nats.errors
    import nats.js.errors

    if exc is None:
        return "no answer"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens on that port)"
    if isinstance(exc, socket.gaierror):
        return f"host name not resolved ({exc})"
    if isinstance(exc, (asyncio.TimeoutError, nats.errors.TimeoutError)):
        return "timed out"
    if isinstance(exc, nats.errors.NoRespondersError):
        return "no responders (JetStream not ready, or no such stream)"
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return "no stream listens on the subject (server restarting, or the stream is gone)"
    if isinstance(exc, nats.js.errors.APIError):
        # nats-py raises some of these bare, with none of the server's fields (KeyNotFoundError)
        code, err_code = getattr(exc, "code", None), getattr(exc, "err_code", None)
        text = getattr(exc, "description", None) or str(exc) or type(exc).__name__
        return text if code is None and err_code is None else f"{text} (code {code}, err_code {err_code})"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"
