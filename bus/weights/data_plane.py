"""The object store's data plane: one windowed driver moves weight chunks over either connection.

Bulk bytes travel over a `DataPlane`, a small protocol (subscribe, publish, read the next message
and its payload) with two implementations: the wire client (`_wire_client.DataConnection`, a
second plain NATS connection that receives straight into the tensors) and, where that cannot be
opened, the nats-py client itself (`_natspy_plane.NatsPyPlane`). Either is driven from a worker
thread (`run_in_thread`) by the same two loops:

- `publish_chunks`: every chunk of a stream as it is cut, at most a window unacknowledged, the
  acks gathered as they come, never one round trip per chunk;
- `fetch_chunks`: a `fetch_plan.ChunkPlan`'s direct-get requests, each reply landed (and hashed)
  where the plan says.

`DataPlanes` picks the plane for one transport: wire connections while the server takes them (a
fetch striped over several, `fetch_connections_for`; a smaller window after the server dropped a
slow consumer), nats-py for good once it refuses one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar

from nats.aio.client import Client

from ._natspy_plane import NatsPyPlane
from ._wire_client import (
    ConnectionLost,
    DataConnection,
    Hasher,
    Incoming,
    NoDataConnection,
    Transient,
    data_endpoint,
)
from .base import TransferError
from .delta import DeltaChunks
from .fetch_plan import ChunkPlan, StreamGone
from .format import StreamedChunks

__all__ = [
    "DataPlane",
    "DataPlanes",
    "fetch_chunks",
    "fetch_connections_for",
    "publish_chunks",
    "run_in_thread",
]

T = TypeVar("T")
P = TypeVar("P", bound="DataPlane")

Chunks: TypeAlias = StreamedChunks | DeltaChunks
"""A version's chunks as the publisher cuts them: `(index, parts, digest)` from `chunks()`."""


class DataPlane(Protocol):
    """What the windowed driver needs of a connection. One worker thread drives it at a time;
    every wait is bounded by the plane's own timeout and fails with `Transient`."""

    def open(self) -> None: ...

    def close(self) -> None:
        """Safe twice."""

    def abort(self) -> None:
        """From another thread: make the blocked call fail now."""

    def subscribe(self, subject: str) -> None:
        """Receive messages on `subject` (wildcards allowed) from now on."""

    def publish(self, subject: str, reply: str, payload: Sequence[bytes | memoryview]) -> None:
        """Send one message whose payload is the concatenation of `payload`'s parts."""

    def publish_many(self, subject: str, reply: str, bodies: Sequence[bytes]) -> None:
        """Send one message per body (in one write where the plane can)."""

    def next_message(self) -> Incoming:
        """The next message for a subscription; its payload is read next, with `read_payload`."""

    def read_payload(self, size: int, target: memoryview | None = None, hasher: Hasher | None = None) -> bytes:
        """The payload of the message just announced: into `target` (hashed on the way; then b""
        is returned), or as bytes."""


async def run_in_thread(plane: P, work: Callable[[P], T]) -> T:
    """Open `plane` and run `work(plane)` in a worker thread, closing it after; cancellation aborts
    the plane so the thread stops at once, and returns only once the thread has."""

    def run() -> T:
        try:
            plane.open()
            return work(plane)
        finally:
            plane.close()

    future = asyncio.get_running_loop().run_in_executor(None, run)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        plane.abort()  # unblocks the thread's wait at once
        with contextlib.suppress(BaseException):
            await future
        raise


# the windowed driver (runs in the worker thread) --------------------------------------------------


def publish_chunks(
    plane: DataPlane, inbox: str, chunks: Chunks, subject: Callable[[int], str], window: int, where: str,
) -> dict[int, int]:
    """Publish every chunk of the stream as it is cut (at most `window` unacknowledged); return
    each chunk's stream sequence (their digests are in `chunks`)."""
    plane.subscribe(f"{inbox}.*")
    seqs: dict[int, int] = {}
    outstanding = 0

    def take_ack() -> None:
        nonlocal outstanding
        msg = plane.next_message()
        data = plane.read_payload(msg.size)
        index = int(msg.subject.rsplit(".", 1)[1])
        seqs[index] = parse_ack(data, msg.status, where, index)
        outstanding -= 1

    it = chunks.chunks()
    try:
        for index, parts, _ in it:
            plane.publish(subject(index), f"{inbox}.{index}", parts)  # sent (or queued) once this returns
            del parts
            outstanding += 1
            while outstanding >= window:
                take_ack()
        while outstanding:
            take_ack()
    finally:
        it.close()
    return seqs


def fetch_chunks(plane: DataPlane, inbox: str, api_subject: str, plan: ChunkPlan) -> None:
    """Send the plan's direct-get requests and land each reply where the plan says, until done."""
    plane.subscribe(inbox)
    while not plan.done:
        requests = plan.requests()
        if requests:  # one send for the whole batch of requests
            plane.publish_many(api_subject, inbox, requests)
        msg = plane.next_message()
        if msg.status:
            plane.read_payload(msg.size)
            plan.on_status(msg.status, msg.headers)
            continue
        target = plan.target(msg.headers, msg.size)
        if target is None or len(target) != msg.size:
            data = plane.read_payload(msg.size)
            if target is not None:
                plan.landed_wrong_size(msg.headers, data)
            continue
        hasher = plan.manifest.hasher()
        plane.read_payload(msg.size, target, hasher)
        plan.landed(msg.headers, hasher.digest())


def parse_ack(data: bytes, status: str | None, where: str, index: int) -> int:
    """The stream sequence a JetStream publish ack gives chunk `index`; raises what it reports."""
    if status == "503":
        raise StreamGone(f"{where}: chunk {index}: no stream listens on its subject (server restarted?)")
    try:
        ack = json.loads(data)
    except ValueError:
        raise TransferError(f"{where}: chunk {index}: unreadable publish ack {data[:200]!r}") from None
    if "error" in ack:
        raise TransferError(f"{where}: chunk {index} was not stored: {ack['error']}")
    return int(ack["seq"])


# which plane: wire connections, or nats-py --------------------------------------------------------


class DataPlanes:
    """The data planes of one object store transport on `nc`.

    `wire=False` keeps every transfer on nats-py (and so does the first wire connection the server
    refuses). `window_bytes` bounds the bytes in flight, `timeout` every wait for bulk bytes;
    `fetch_connections` splits a fetch over that many wire connections (None: by the client's TLS
    settings and this host's CPUs). `connections_opened` counts the wire connections tried since
    it was last set to 0.
    """

    def __init__(self, nc: Client, *, api_subject: str, timeout: float, window_bytes: int, wire: bool,
                 fetch_connections: int | None):
        self._nc = nc
        self._api_subject = api_subject
        self._timeout = timeout
        self._window_bytes = window_bytes
        self.wire = wire
        self._fetch_connections = fetch_connections
        self.connections_opened = 0

    async def publish(self, open_chunks: Callable[[], Chunks], subject: Callable[[int], str], chunk_size: int,
                      where: str) -> tuple[Chunks, dict[int, int]]:
        """Publish the chunks `open_chunks()` makes; return them and each one's stream sequence."""
        inbox = self._nc.new_inbox()  # here, not in the thread: nats-py's NUID is not thread-safe
        window = max(1, self._window_bytes // max(chunk_size, 1))
        opened: list[Chunks] = []

        def publish_all(plane: DataPlane) -> dict[int, int]:
            # Made only once the plane is open: a refused wire connection falls back before any bucket is read.
            opened.append(open_chunks())
            return publish_chunks(plane, inbox, opened[-1], subject, window, where)

        seqs = await self._either(lambda: self.on_wire(publish_all), publish_all, f"{where}: waiting for chunk acks")
        return opened[-1], seqs

    async def fetch(self, plan: ChunkPlan) -> None:
        """Land every chunk of `plan` (see `fetch_plan`)."""
        inbox = self._nc.new_inbox()
        work = functools.partial(fetch_chunks, inbox=inbox, api_subject=self._api_subject, plan=plan)
        await self._either(lambda: self._fetch_on_wire(plan), work, f"{plan.where}: waiting for chunks")

    async def on_wire(self, work: Callable[[DataConnection], T]) -> T:
        """Run `work` on a fresh wire connection in a worker thread; cancellation aborts the socket."""
        endpoint = data_endpoint(self._nc)
        if endpoint is None:
            if not self._nc.is_connected:
                raise Transient("the NATS connection is reconnecting")
            raise NoDataConnection("client options rule out a data connection")
        self.connections_opened += 1
        return await run_in_thread(DataConnection(endpoint, timeout=self._timeout), work)

    async def _either(self, on_wire: Callable[[], Awaitable[T]], work: Callable[[DataPlane], T],
                      waiting_for: str) -> T:
        """`on_wire()` where a wire connection can be opened, else `work` on the nats-py client."""
        if self.wire and data_endpoint(self._nc) is not None:
            try:
                return await on_wire()
            except NoDataConnection:
                self.wire = False
        plane = NatsPyPlane(self._nc, asyncio.get_running_loop(), timeout=self._timeout, waiting_for=waiting_for)
        return await run_in_thread(plane, work)

    async def _fetch_on_wire(self, plan: ChunkPlan) -> None:
        """Fetch over wire connections: in stripes first where that is asked for (see the object
        store's docstring), then what is left on one. If the server drops a connection (a slow
        consumer: more than its max_pending queued for us, seen here when explorers starve for CPU),
        go on with the missing chunks on a new connection with half the window, down to one chunk
        in flight."""
        window = await self._fetch_striped(plan)
        while not plan.done:
            inbox = self._nc.new_inbox()  # here, not in the thread: nats-py's NUID is not thread-safe
            try:
                await self.on_wire(functools.partial(fetch_chunks, inbox=inbox, api_subject=self._api_subject,
                                                     plan=plan))
            except ConnectionLost:
                if window <= plan.manifest.chunk_size:
                    raise
                window //= 2
                plan.restart(window)

    async def _fetch_striped(self, plan: ChunkPlan) -> int:
        """Fetch `plan`'s stripes at once, one wire connection each (none when it has none); return
        the window for what is left."""
        window = self._window_bytes
        endpoint = data_endpoint(self._nc)
        count = self._fetch_connections or fetch_connections_for(secure=endpoint is not None and endpoint.secure)
        stripes = plan.stripes(count, window)
        if not stripes:
            return window
        inboxes = [self._nc.new_inbox() for _ in stripes]
        try:
            await _together([self.on_wire(functools.partial(fetch_chunks, inbox=inbox, plan=stripe,
                                                            api_subject=self._api_subject))
                             for stripe, inbox in zip(stripes, inboxes)])
        except ConnectionLost:
            window = max(window // 2, plan.manifest.chunk_size)
        except NoDataConnection:
            # The server refused one of several (a connection limit?): one may still be allowed;
            # this transport stops striping, and falls back to nats-py only if one is refused too.
            self._fetch_connections = 1
        finally:  # whoever goes on (one connection, or the nats-py path) sees what landed
            plan.absorb(stripes, window)
        return window


def fetch_connections_for(*, secure: bool) -> int:
    """How many data connections one fetch uses by default: one plain (more were slower on 2
    cores), under TLS one per two CPUs of this host, at least 2 and at most 4: each connection
    decrypts on its own thread while the server encrypts it on its own core (two were faster than
    one even on 2 cores; figures in docs/weights-at-size.md)."""
    if not secure:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(4, max(2, cpus // 2))


async def _together(awaitables: Sequence[Awaitable[Any]]) -> None:
    """Await all; the first failure cancels the rest (waited for) and is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
