"""Acked JetStream publishes of one connection, every ack on one shared reply subscription.

nats-py's `js.publish` makes a task and a reply subscription per call, which is most of an acked
publish's CPU (the synchronizer's decisions, every member's events). `AckedPublishes` does the same
publish on the connection's one reply subscription, ``<inbox>.<token>`` per publish, and matches
each ack to its waiting publish (the multiplexer). One timer expires every overdue ack, armed at
the nearest deadline: a timer per publish costs a heap push and a cancel each, which adds up
across many members.

`publish` retries transient failures (`bus.retry`) with the same `Nats-Msg-Id`, so the stream
stores a message once even when its ack was lost, and translates what is left into the bus's
errors (`PublishRejected`, `PublishFailed`, `PayloadTooLarge`, `BusClosed`). The connection fails
the acks still awaited when it reconnects (`fail_all`): they went with the old socket, so the
publish is sent again at once instead of after its ack timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import Header, PubAck

from .errors import BusClosed, PayloadTooLarge, PublishFailed, PublishRejected, RetriesExhausted, describe
from .retry import is_transient, retry_transient

__all__ = ["AckedPublishes"]


class AckedPublishes:
    """The acked JetStream publishes of the connection `nc` (named `name`, at `url`, for errors);
    `len()` is how many publishes are waiting for their ack now."""

    def __init__(self, nc: NatsClient, *, url: str, name: str, log: Any):
        self._nc = nc
        self._url = url
        self._name = name
        self._log = log
        self._prefix: str | None = None
        self._inbox_ready: asyncio.Future[None] | None = None
        # token -> (the ack's future, its deadline on the loop's clock)
        self._waiting: dict[str, tuple[asyncio.Future[PubAck], float]] = {}
        self._tokens = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def __len__(self) -> int:
        return len(self._waiting)

    async def publish(
        self,
        subject: str,
        payload: bytes,
        *,
        msg_id: str | None,
        headers: Mapping[str, str] | None,
        ack_timeout: float,
        retry_for: float,
    ) -> PubAck:
        """`BusConnection.publish_acked` (see there): publish, retried, and its PubAck."""
        hdrs = dict(headers or {})
        if msg_id is not None:
            hdrs["Nats-Msg-Id"] = msg_id
        self._check_size(subject, payload, msg_id)
        where = f"publish to {subject} (msg id {msg_id}) via {self._url}"

        async def publish_once() -> PubAck:
            return await self._publish_once(subject, payload, hdrs or None, ack_timeout)

        def transient(exc: BaseException) -> bool:
            # Any other client-side error (e.g. outbound buffer full while reconnecting) is the
            # connection's business: it reconnects by itself, so a retry is right.
            return is_transient(exc) or (
                isinstance(exc, nats.errors.Error) and not isinstance(exc, nats.js.errors.APIError)
            )

        try:
            return await retry_transient(
                publish_once, what=where, retry_for=retry_for, is_closed=lambda: self._nc.is_closed,
                transient=transient, log=self._log,
            )
        except BusClosed as exc:
            raise BusClosed(f"cannot publish to {subject}: connection {self._name} to {self._url} is closed") from exc
        except nats.js.errors.APIError as exc:
            raise PublishRejected(
                f"the stream refused a message on {subject} (msg id {msg_id}): "
                f"{exc.description} (code {exc.code}, err_code {exc.err_code})",
                subject=subject,
                msg_id=msg_id,
                code=exc.code,
                err_code=exc.err_code,
                description=exc.description or "",
            ) from exc
        except RetriesExhausted as exc:
            raise PublishFailed(
                f"no acknowledgement for a message on {subject} (msg id {msg_id}) from {self._url} after "
                f"{exc.attempts} attempt(s) in {retry_for:g} s (last: {describe(exc.last)}). Is the server "
                f"up, with JetStream, and does a stream capture this subject (ensure_event_stream / "
                f"ensure_experience_stream)?",
                subject=subject,
                msg_id=msg_id,
            ) from exc.last

    def fail_all(self, exc: BaseException) -> None:
        """Fail every ack still awaited with `exc` (the connection reconnected, or closed)."""
        for ack, _ in self._waiting.values():
            if not ack.done():
                ack.set_exception(exc)

    def _check_size(self, subject: str, payload: bytes, msg_id: str | None) -> None:
        max_payload = self._nc.max_payload
        if max_payload and len(payload) > max_payload:
            raise PayloadTooLarge(
                f"message for {subject} is {len(payload)} bytes but the server at {self._url} accepts "
                f"at most {max_payload} (max_payload): send smaller pieces or raise max_payload",
                subject=subject,
                msg_id=msg_id,
                size=len(payload),
                limit=max_payload,
            )

    async def _publish_once(self, subject: str, payload: bytes, headers: dict[str, str] | None,
                            timeout: float) -> PubAck:
        """One JetStream publish and its ack, as nats-py's `js.publish` but on the one reply
        subscription. Raises what `js.publish` raises, plus `Interrupted` when the connection
        reconnected meanwhile."""
        if self._prefix is None:
            await self._open_inbox()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        ack: asyncio.Future[PubAck] = loop.create_future()
        deadline = loop.time() + timeout
        self._waiting[token] = (ack, deadline)
        if self._timer is None or deadline < self._timer_at:
            self._arm_timer(loop, deadline)
        try:
            await self._nc.publish(subject, payload, reply=f"{self._prefix}.{token}", headers=headers)
            return await ack
        finally:
            self._waiting.pop(token, None)
            if ack.done() and not ack.cancelled():
                ack.exception()  # retrieved: an ack that failed after its publish raised is no news

    async def _open_inbox(self) -> None:
        if self._inbox_ready is None:  # the first caller subscribes; others wait for it
            self._inbox_ready = asyncio.ensure_future(self._subscribe())
        try:
            await asyncio.shield(self._inbox_ready)
        except Exception:
            self._inbox_ready = None  # e.g. closed meanwhile: the next publish tries again
            raise

    async def _subscribe(self) -> None:
        prefix = self._nc.new_inbox()
        await self._nc.subscribe(f"{prefix}.*", cb=self._on_ack)
        self._prefix = prefix

    async def _on_ack(self, msg: Msg) -> None:
        pending = self._waiting.get(msg.subject.rpartition(".")[2])
        if pending is None or pending[0].done():
            return  # timed out or interrupted already: the retry has its own token
        ack = pending[0]
        if msg.headers and msg.headers.get(Header.STATUS) == "503":
            ack.set_exception(nats.js.errors.NoStreamResponseError())  # no stream took it (yet)
            return
        try:
            resp = json.loads(msg.data)
            if "error" in resp:
                nats.js.errors.APIError.from_error(resp["error"])  # raises the typed error
            ack.set_result(PubAck.from_response(resp))
        except Exception as exc:
            ack.set_exception(exc)

    def _arm_timer(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(at, self._expire, loop), at

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Time out every ack past its deadline; re-arm for the nearest one still waiting."""
        self._timer = None
        now, nearest = loop.time(), None
        for ack, deadline in self._waiting.values():
            if ack.done():
                continue
            if deadline <= now:
                ack.set_exception(nats.errors.TimeoutError())
            elif nearest is None or deadline < nearest:
                nearest = deadline
        if nearest is not None:
            self._arm_timer(loop, nearest)
