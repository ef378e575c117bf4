"""Retry of transient NATS / JetStream failures with bounded, jittered backoff: the one helper every
publish and request path in `bus` goes through (events, experiences, stream ensure, object store).

What counts as *transient* is what a server restart, a cluster leader election or a lost ack looks
like from a client: a connection reset under a request, request timeouts, "no responders"
(JetStream not listening yet), "no stream listens on this subject" (a restarted server still
recovering its streams), JetStream's own 503s
("temporarily unavailable", "not leader", stream offline) and a connection that is reconnecting.
Everything else (the stream refused the message, a bad config, a closed connection) is raised at
once: retrying would only delay the error the operator has to act on.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors

from .errors import BusClosed, RetriesExhausted, describe

__all__ = ["retry_transient", "is_transient", "backoff_delay", "Interrupted", "TRANSIENT_JS_ERR_CODES"]

T = TypeVar("T")

_BACKOFF_BASE_S = 0.1
_BACKOFF_MAX_S = 2.0

# JetStream API error codes that mean "not now" rather than "no": the system or the stream's
# leader is being elected or caught up, or too few peers are up to place replicas (a node is down).
TRANSIENT_JS_ERR_CODES = frozenset({
    10005,  # insufficient resources: not enough peers up for the requested replicas
    10008,  # JetStream system temporarily unavailable (meta leader election)
    10009,  # JetStream cluster can not handle request (not leader)
    10118,  # stream is offline
    10119,  # consumer is offline
})


def backoff_delay(attempt: int, *, base: float = _BACKOFF_BASE_S, cap: float = _BACKOFF_MAX_S) -> float:
    """Capped exponential backoff with "equal jitter" (half fixed, half random); attempt 0 is ~base."""
    delay = min(cap, base * (2.0 ** min(attempt, 16)))
    return delay / 2 + random.uniform(0, delay / 2)


# A stream at a limit answers 503 too, but waiting will not make room: those are final (the
# publisher turns them into `StreamFull`, saying which limit and how to raise it).
STREAM_LIMIT_ERR_CODES = frozenset({
    10077,  # maximum bytes exceeded (DiscardPolicy.NEW)
    10054,  # message size exceeds the stream's max_msg_size
})


def is_transient(exc: BaseException) -> bool:
    """True for failures a restarting server or an electing cluster causes (see module docstring)."""
    if isinstance(exc, (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError)):
        return False
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code in STREAM_LIMIT_ERR_CODES:
        return False
    if isinstance(exc, (ConnectionError, asyncio.TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError,
                        nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError)):
        return True
    if isinstance(exc, nats.js.errors.APIError):
        return exc.code == 503 or exc.err_code in TRANSIENT_JS_ERR_CODES
    # Outbound buffer full or a write while reconnecting, a stale connection: the client reconnects.
    return isinstance(exc, (nats.errors.ConnectionReconnectingError, nats.errors.OutboundBufferLimitError,
                            nats.errors.StaleConnectionError, nats.errors.UnexpectedEOF))


async def retry_transient(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_for: float,
    is_closed: Callable[[], bool] = lambda: False,
    transient: Callable[[BaseException], bool] = is_transient,
    before_retry: Callable[[BaseException], Awaitable[Any]] | None = None,
    interrupt: Callable[[], Awaitable[Any]] | None = None,
    log: Any = None,
) -> T:
    """`await call()`; on a transient failure wait a jittered, growing delay and call again, for up
    to `retry_for` seconds in all, then raise `RetriesExhausted` naming `what` and the last failure.

    A non-transient exception propagates unchanged, at once. `is_closed()` true (the connection was
    closed for good) raises `BusClosed`. `before_retry(exc)` runs before each new attempt (e.g. to
    re-create a stream a restarted in-memory server lost). `interrupt()`, made before each attempt,
    is an awaitable that finishes when that attempt is hopeless (`BusConnection.reconnect_signal`:
    the connection reconnected, so a request sent before the outage will never be answered); the
    attempt is then cancelled and retried at once instead of waiting out its timeout. The caller
    makes `call` idempotent (a publish keeps its `Nats-Msg-Id`).
    """
    deadline = time.monotonic() + retry_for
    attempt = 0
    last: BaseException
    while True:
        if is_closed():
            raise BusClosed(f"{what}: the connection is closed")
        attempt += 1
        interrupted = False
        try:
            return await _attempt(call, interrupt)
        except Interrupted as exc:
            last, interrupted = exc, True
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
            raise BusClosed(f"{what}: the connection is closing") from exc
        except Exception as exc:
            if not transient(exc):
                raise
            last = exc
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RetriesExhausted(what=what, attempts=attempt, seconds=retry_for, last=last) from last
        if log is not None:
            log.debug("bus.retry", what=what, attempt=attempt, error=describe(last))
        if not interrupted:  # after a reconnect the server is back: ask again at once
            await asyncio.sleep(min(remaining, backoff_delay(attempt - 1)))
        if before_retry is not None:
            try:
                await before_retry(last)
            except Exception as exc:  # the repair itself hit the outage: the next attempt tells
                if not transient(exc):
                    raise


class Interrupted(Exception):
    """An attempt abandoned because the connection reconnected under it: retried at once.

    Raised by `retry_transient`'s own `interrupt` watch, or by the call itself (`BusConnection`
    fails the acks it still waits for when it reconnects: they were lost with the old socket)."""

    def __str__(self) -> str:
        return "the connection reconnected while waiting for an answer"


async def _attempt(call: Callable[[], Awaitable[T]], interrupt: Callable[[], Awaitable[Any]] | None) -> T:
    if interrupt is None:
        return await call()
    stop = asyncio.ensure_future(interrupt())
    work = asyncio.ensure_future(call())
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        work.cancel()  # no-op when done
        stop.cancel()
        await asyncio.gather(work, stop, return_exceptions=True)
    if work.cancelled():
        raise Interrupted()
    return work.result()
