"""The data plane over the nats-py client itself: the fallback where no wire connection can be opened.

The windowed driver (`data_plane`) runs in a worker thread and blocks on its connection; a
`NatsPyPlane` gives it the same calls as the wire client (`_wire_client.DataConnection`) on top
of the role's nats-py client. Each call hops onto the client's event loop
(`run_coroutine_threadsafe`) and replies come back through a thread-safe queue, so one driver
serves both paths. It is slower than the wire client (nats-py parses every byte in Python) and is
used only where that cannot be opened: a websocket client, or a server that refuses it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from ._wire_client import Hasher, Incoming, Transient

__all__ = ["NatsPyPlane"]

T = TypeVar("T")


class NatsPyPlane:
    """`DataPlane` calls on a nats-py client, made from one worker thread while `loop` runs.

    `timeout` bounds each wait for a message; `waiting_for` says in that error what was awaited.
    `abort()` (from another thread) makes the blocked call fail at once; `close()` drops the
    subscriptions and leaves the client open.
    """

    def __init__(self, nc: Client, loop: asyncio.AbstractEventLoop, *, timeout: float, waiting_for: str):
        self._nc = nc
        self._loop = loop
        self._timeout = timeout
        self._waiting_for = waiting_for
        self._inbound: queue.SimpleQueue[Msg | None] = queue.SimpleQueue()  # None: aborted
        self._subs: list[Subscription] = []
        self._payload = b""  # the payload of the message `next_message` returned last
        self._in_flight: concurrent.futures.Future[Any] | None = None
        self._aborted = False

    def open(self) -> None:
        """Nothing to open: the client is connected already (the caller checked)."""

    def close(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            asyncio.run_coroutine_threadsafe(sub.unsubscribe(), self._loop).result()

    def abort(self) -> None:
        """From another thread: make the blocked wait for a message or for the loop fail now."""
        self._aborted = True
        self._inbound.put(None)
        call = self._in_flight
        if call is not None:
            call.cancel()

    # writing --------------------------------------------------------------------------------------

    def subscribe(self, subject: str) -> None:
        # Limits off: the driver's window already bounds what the server sends us.
        self._subs.append(self._call(self._nc.subscribe(
            subject, cb=self._on_message, pending_msgs_limit=0, pending_bytes_limit=0)))

    def publish(self, subject: str, reply: str, payload: Sequence[bytes | memoryview]) -> None:
        data = payload[0] if len(payload) == 1 else b"".join(payload)
        # nats-py sends any bytes-like payload; bytes() here would copy the chunk.
        self._call(self._nc.publish(subject, data, reply=reply))  # type: ignore[arg-type]

    def publish_many(self, subject: str, reply: str, bodies: Sequence[bytes]) -> None:
        async def publish_all() -> None:
            for body in bodies:
                await self._nc.publish(subject, body, reply=reply)

        self._call(publish_all())

    # reading --------------------------------------------------------------------------------------

    def next_message(self) -> Incoming:
        try:
            msg = self._inbound.get(timeout=self._timeout)
        except queue.Empty:
            raise Transient(
                f"{self._waiting_for}: nothing for {self._timeout} s; is the server overloaded or restarting?"
            ) from None
        if msg is None:
            raise Transient(f"{self._waiting_for}: aborted")
        headers = msg.headers or {}
        self._payload = msg.data
        return Incoming(msg.subject, headers.get("Status"), headers, len(msg.data))

    def read_payload(self, size: int, target: memoryview | None = None, hasher: Hasher | None = None) -> bytes:
        """The payload of the message just returned: copied into `target` (hashed; then b"" is
        returned), or as bytes."""
        data, self._payload = self._payload, b""
        if target is None:
            return data
        target[:] = data
        if hasher is not None:
            hasher.update(target)
        return b""

    async def _on_message(self, msg: Msg) -> None:
        self._inbound.put(msg)

    def _call(self, call: Coroutine[Any, Any, T]) -> T:
        """Run `call` on the client's loop and wait for it here (abort() cancels it)."""
        if self._aborted:
            call.close()
            raise Transient(f"{self._waiting_for}: aborted")
        future = asyncio.run_coroutine_threadsafe(call, self._loop)
        self._in_flight = future
        try:
            return future.result()
        finally:
            self._in_flight = None
