"""One member's NATS connection: fail fast at first connect, then reconnect for ever; acked publishes.

`connect()` is the only way roles open the bus::

    async with connect(url, job="demo", role="trainer", member="t0") as conn:
        await ensure_event_stream(conn.js, conn.names)
        ...

A server that cannot be reached at first connect is an operator error (no server started, wrong
URL), so it raises `BusUnavailable` within `connect_timeout`. Once connected, losing the server is
an outage to ride out: the client reconnects for ever with capped exponential backoff and jitter
(so a restarted server is not hit by every member at the same instant), rotating through the servers
of a comma-separated URL list, and `publish_acked()` retries transient failures (`bus.retry`) with
the same `Nats-Msg-Id` so a retried publish is stored once.
"""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.client import ReconnectToServerHandler, Server
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import PubAck

from rolectl.sync_protocol import Role

from ._natspy_compat import callbackless_subscriptions
from .acked_publish import AckedPublishes
from .errors import BusUnavailable, RetriesExhausted, describe
from .logging import get_logger
from .retry import Interrupted, backoff_delay, retry_transient
from .security import ENV_VARS, ClientSecurity, SecurityError, redact
from .subjects import JobNames, check_name

__all__ = ["BusConnection", "connect", "parse_server_urls", "DEFAULT_CONNECT_TIMEOUT"]

T = TypeVar("T")

DEFAULT_CONNECT_TIMEOUT = 5.0
"""Seconds a first connect may take (retries included) before `BusUnavailable`."""

_RECONNECT_BASE_S = 0.1
_RECONNECT_MAX_S = 5.0
_DRAIN_TIMEOUT_S = 5.0


def parse_server_urls(url: str) -> list[str]:
    """`nats://a:4222,nats://b:4222` -> one URL per server (a bare `host:port` gets `nats://`).

    Raises `ValueError` naming the bad entry for an empty entry or one that is not host:port.
    """
    servers = []
    for i, entry in enumerate(url.split(",")):
        entry = entry.strip()
        if not entry:
            raise ValueError(
                f"NATS URL list {url!r}: entry {i + 1} is empty; write servers as "
                "nats://host1:4222,nats://host2:4222 (comma-separated, no empty entries)"
            )
        written = entry
        if "://" not in entry:
            entry = f"nats://{entry}"
        parsed = urllib.parse.urlparse(entry)
        try:
            parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:
            raise ValueError(f"NATS URL list {url!r}: entry {written!r} is not a NATS server URL: it has a port "
                             "that is not a number") from None
        # a path only behind a websocket proxy; `nats//host:4222` (a lost colon) reads as host "nats"
        stray = parsed.query or parsed.fragment or (parsed.path not in ("", "/") and parsed.scheme in ("nats", "tls"))
        if parsed.scheme not in ("nats", "tls", "ws", "wss") or not parsed.hostname or stray:
            raise ValueError(
                f"NATS URL list {url!r}: entry {written!r} is not a NATS server URL "
                "(expected nats://host:port, tls://host:port or ws(s)://host:port)"
            )
        servers.append(entry)
    return servers


def _reconnect_chooser(last_server: list[str]) -> ReconnectToServerHandler:
    """nats-py's reconnect handler: which server to try next, and after what delay.

    nats-py's own handler-less loop waits a fixed reconnect_time_wait; with a handler it hands us
    the pool (shuffled once per outage) and its per-server count of failed attempts. We take a
    server with the fewest failures, preferring any other than the one we just lost, so a cluster
    client rotates to a live node at once instead of retrying the dead one; the delay is that
    server's capped exponential backoff with jitter (a restarted single server is not hit by every
    member at the same instant).
    """

    def choose(servers: list[Server], _info: dict[str, Any]) -> tuple[Server | None, float]:
        lost = last_server[0] if last_server else None
        server = min(servers, key=lambda s: (s.reconnects, s.uri.netloc == lost))
        return server, _backoff_delay(server.reconnects)

    return choose


def _backoff_delay(reconnects: int) -> float:
    return backoff_delay(reconnects, base=_RECONNECT_BASE_S, cap=_RECONNECT_MAX_S)


class BusConnection:
    """A connected member: `nc` (core NATS), `js` (JetStream), `names` (the job's subjects), `url`.

    Use `connect()` to make one. `aclose()` drains (in-flight messages are delivered) and is safe to
    call twice and under cancellation.
    """

    def __init__(self, nc: NatsClient, *, url: str, names: JobNames, role: Role, member: str, log: Any,
                 last_server: list[str] | None = None, security: ClientSecurity | None = None):
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.url = redact(url)  # for messages and logs: never the password
        self.security = security or ClientSecurity()
        self.permission_denials: collections.deque[str] = collections.deque(maxlen=32)
        self.names = names
        self.role = role
        self.member = member
        self.log = log
        self.name = f"{names.job}/{role.value}/{member}"
        self.reconnects = 0
        self._state = asyncio.Condition()
        self._up = True
        self._closing: asyncio.Task[None] | None = None
        # The server we are (or were last) connected to, shared with the reconnect chooser.
        self._last_server = last_server if last_server is not None else []
        self._note_server()
        # Acked publishes: one reply subscription per connection (`acked_publish`).
        self._acks = AckedPublishes(nc, url=self.url, name=self.name, log=log)

    # -- state ----------------------------------------------------------------------------------

    @property
    def server(self) -> str | None:
        """`host:port` of the server this connection is (or was last) connected to."""
        return self._last_server[0] if self._last_server else None

    def _note_server(self) -> None:
        if self.nc.connected_url is not None:
            self._last_server[:] = [self.nc.connected_url.netloc]

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    @property
    def is_closed(self) -> bool:
        return self.nc.is_closed

    async def wait_connected(self, timeout: float) -> None:
        """Return once the connection is up (at once if it is); `asyncio.TimeoutError` after `timeout`."""
        await asyncio.wait_for(self.wait_for(lambda: self._up), timeout)

    async def wait_disconnected(self, timeout: float) -> None:
        """Return once the connection is down (at once if it is); `asyncio.TimeoutError` after `timeout`."""
        await asyncio.wait_for(self.wait_for(lambda: not self._up), timeout)

    async def wait_reconnected(self, after: int) -> None:
        """Return once the connection has reconnected more than `after` times (compare `reconnects`)."""
        await self.wait_for(lambda: self.reconnects > after)

    async def retry(self, call: Callable[[], Awaitable[T]], *, what: str, retry_for: float) -> T:
        """`retry_transient` bound to this connection: given up at once once it is closed, retries
        logged in its log."""
        return await retry_transient(call, what=what, retry_for=retry_for, is_closed=lambda: self.nc.is_closed,
                                     log=self.log)

    def reconnect_signal(self) -> Awaitable[None]:
        """An awaitable that finishes at the next reconnect (for `retry_transient(interrupt=...)`)."""
        return self.wait_reconnected(after=self.reconnects)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checked at each connect, disconnect and close."""
        async with self._state:
            await self._state.wait_for(predicate)

    async def _set_up(self, up: bool) -> None:
        async with self._state:
            self._up = up
            self._state.notify_all()

    # -- callbacks (nats-py calls them from its own tasks) ---------------------------------------

    async def _on_disconnected(self) -> None:
        if not self.nc.is_closed:
            self.log.warning("bus.disconnected", url=self.url)
        await self._set_up(False)

    async def _on_reconnected(self) -> None:
        self.reconnects += 1
        # Acks of publishes sent before the outage went with the old socket: retry them now
        # (same msg id, stored once) instead of after their ack timeout.
        self._acks.fail_all(Interrupted())
        self._note_server()
        server = self.server or self.url
        self.log.info("bus.reconnected", url=self.url, server=server, reconnects=self.reconnects)
        await self._set_up(True)

    async def _on_error(self, exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            # The server refused something this identity may not do; the request itself only
            # times out, so keep the server's words for the error that explains it.
            self.permission_denials.append(str(exc))
            self.log.warning("bus.permission_denied", identity=self.security.identity, error=describe(exc))
            return
        # While reconnecting every failed attempt lands here; that is expected noise, not a warning.
        level = self.log.debug if self.nc.is_reconnecting else self.log.warning
        level("bus.error", url=self.url, error=describe(exc))

    def denied(self, subject_prefix: str) -> str | None:
        """The server's last permission-violation message about a subject starting with
        `subject_prefix`, if any (nats-py reports them only to the error callback)."""
        wanted = subject_prefix.lower()  # nats-py lower-cases the server's -ERR text
        for text in reversed(self.permission_denials):
            if wanted in text.lower():
                return text
        return None

    async def _on_closed(self) -> None:
        self.log.info("bus.closed", url=self.url)
        self._acks.fail_all(nats.errors.ConnectionClosedError())
        await self._set_up(False)

    # -- publishing ------------------------------------------------------------------------------

    async def publish_acked(
        self,
        subject: str,
        payload: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        ack_timeout: float = 5.0,
        retry_for: float = 30.0,
    ) -> PubAck:
        """Publish to JetStream and return the server's PubAck.

        Timeouts and "no responders" (the server restarting, JetStream not ready yet) are retried
        for up to `retry_for` seconds with the *same* `msg_id`, so the stream stores the message once
        even when an ack was lost. A JetStream API error (the stream refused the message) raises
        `PublishRejected` at once; running out of time raises `PublishFailed`; a payload over the
        server's `max_payload` raises `PayloadTooLarge` without sending anything.
        """
        return await self._acks.publish(subject, payload, msg_id=msg_id, headers=headers,
                                        ack_timeout=ack_timeout, retry_for=retry_for)

    async def unsubscribe_quietly(self, sub: Subscription | JetStreamContext.PullSubscription | None) -> None:
        """Drop a subscription; nothing to do if the connection is already closed or going."""
        if sub is not None and not self.nc.is_closed:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    # -- lifecycle -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Drain and close. Safe twice; if the caller is cancelled, closing still completes."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        try:
            await asyncio.shield(self._closing)
        except asyncio.CancelledError:
            # The shielded task keeps running to completion; only our wait is cancelled.
            raise

    async def _close(self) -> None:
        nc = self.nc
        if nc.is_closed:
            return
        try:
            if nc.is_connected:
                # Pull and next_msg() subscriptions (readers) have no callback to process what is
                # left, and nats-py's drain waits on their queues until its timeout; drop them
                # first. Callback subscriptions (heartbeats) are drained properly.
                for sub in callbackless_subscriptions(nc):
                    try:
                        await sub.unsubscribe()
                    except Exception:
                        pass
                await asyncio.wait_for(nc.drain(), _DRAIN_TIMEOUT_S)
        except Exception as exc:  # reconnecting, or drain timed out: close without draining
            self.log.debug("bus.drain_failed", url=self.url, error=describe(exc))
        finally:
            if not nc.is_closed:
                try:
                    await nc.close()
                except Exception as exc:  # e.g. the server is gone: flushing fails, the socket is closed anyway
                    self.log.debug("bus.close_failed", url=self.url, error=describe(exc))

    async def __aenter__(self) -> BusConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self.is_closed else ("connected" if self.is_connected else "reconnecting")
        return f"<BusConnection {self.name} {self.url} {state}>"


@dataclass(frozen=True)
class _Dial:
    """What `connect()` was asked for, checked: who connects, to which servers, and how."""

    names: JobNames
    role: Role
    member: str
    servers: list[str]
    shown: str  # the URL list for messages: passwords redacted
    security: ClientSecurity
    options: dict[str, Any]  # the security's nats.connect() arguments

    @property
    def name(self) -> str:
        return f"{self.names.job}/{self.role.value}/{self.member}"


class _Callbacks:
    """nats-py's callbacks. They must exist before `nats.connect()` returns, but the BusConnection
    needs the client; so they forward to `conn` once it is set and only record failures before that."""

    def __init__(self) -> None:
        self.conn: BusConnection | None = None
        self.failures: list[BaseException] = []

    async def on_error(self, exc: Exception) -> None:
        if self.conn is None:
            self.failures.append(exc)
        else:
            await self.conn._on_error(exc)

    async def on_disconnected(self) -> None:
        if self.conn is not None:
            await self.conn._on_disconnected()

    async def on_reconnected(self) -> None:
        if self.conn is not None:
            await self.conn._on_reconnected()

    async def on_closed(self) -> None:
        if self.conn is not None:
            await self.conn._on_closed()


async def _open(
    url: str, *, job: str, role: Role | str, member: str, connect_timeout: float,
    security: ClientSecurity | None = None,
) -> BusConnection:
    dial = _checked_dial(url, job=job, role=role, member=member, security=security)
    log = get_logger("rolectl.bus", job=dial.names.job, role=dial.role.value, member=member)
    callbacks = _Callbacks()
    last_server: list[str] = []
    started = time.monotonic()
    nc = await _connect_client(dial, callbacks, last_server, connect_timeout)
    conn = BusConnection(nc, url=url, names=dial.names, role=dial.role, member=member, log=log,
                         last_server=last_server, security=dial.security)
    callbacks.conn = conn
    await _check_jetstream(nc, dial, remaining=max(0.5, connect_timeout - (time.monotonic() - started)))
    log.info("bus.connected", url=dial.shown, server=_host_port(nc), identity=dial.security.identity)
    return conn


def _checked_dial(url: str, *, job: str, role: Role | str, member: str, security: ClientSecurity | None) -> _Dial:
    """The arguments of `connect()` checked; a credential that cannot work is `BusUnavailable` now."""
    names = JobNames(job)
    role = Role.parse(role)
    check_name(member, "member id")
    servers = parse_server_urls(url)
    # Explicit settings win; ROLECTL_NATS_* fill what they leave unset.
    security = (security or ClientSecurity()).over(ClientSecurity.from_env())
    shown = redact(url)
    try:
        security.check()
        if role is not Role.OBSERVER and security.identity not in (None, member):
            # The server lets an identity publish only under its own name: fail now, clearly,
            # rather than with a permissions violation on the first event.
            raise SecurityError(
                f"member id {member!r} does not match the credential's identity {security.identity!r} "
                f"({security.creds}): run the {role.value} with --id {security.identity}, or give it "
                f"{member}'s credential"
            )
        options = security.connect_options(names.job)
    except (SecurityError, OSError, ValueError) as exc:  # ssl errors are OSErrors
        raise BusUnavailable(
            f"cannot connect to {shown} for job {names.job!r}: {exc}", url=shown, cause=exc
        ) from exc
    return _Dial(names, role, member, servers, shown, security, options)


async def _connect_client(dial: _Dial, callbacks: _Callbacks, last_server: list[str],
                          connect_timeout: float) -> NatsClient:
    """A nats-py client connected within `connect_timeout`, or `BusUnavailable` saying why not."""
    nc = NatsClient()
    connecting = asyncio.ensure_future(
        nc.connect(
            servers=dial.servers,
            # Randomized order spreads a job's members over a cluster's nodes.
            dont_randomize=False,
            name=dial.name,
            error_cb=callbacks.on_error,
            disconnected_cb=callbacks.on_disconnected,
            reconnected_cb=callbacks.on_reconnected,
            closed_cb=callbacks.on_closed,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            # First connect: nats-py retries every reconnect_time_wait until we give up; after
            # that the jittered handler paces reconnects.
            reconnect_time_wait=0.25,  # type: ignore[arg-type]  # nats-py annotates seconds as int; floats work
            reconnect_to_server_handler=_reconnect_chooser(last_server),
            connect_timeout=max(0.5, min(2.0, connect_timeout)),  # type: ignore[arg-type]  # as above
            drain_timeout=int(_DRAIN_TIMEOUT_S),
            **dial.options,
        )
    )
    try:
        # Not wait_for: it waits without bound for the cancelled connect to end, and nats-py's
        # connect loop can swallow the cancellation (its _close() catches CancelledError while it
        # waits for the reconnect task) and go on retrying: a refused nkey then hung for ever.
        done, _ = await asyncio.wait({connecting}, timeout=connect_timeout)
        if not done:
            connecting.cancel()
            await asyncio.wait({connecting}, timeout=_DRAIN_TIMEOUT_S)
            raise asyncio.TimeoutError()
        connecting.result()
    except asyncio.CancelledError:
        connecting.cancel()
        await asyncio.shield(_discard(nc))
        raise
    except Exception as exc:  # asyncio.TimeoutError included
        await _discard(nc)
        connecting.cancel()  # again, now that the client is closed and its loop can end
        raise _unreachable(dial, connect_timeout, exc, callbacks.failures) from None
    return nc


def _unreachable(dial: _Dial, connect_timeout: float, exc: Exception, failures: list[BaseException]) -> BusUnavailable:
    """The error of a first connect that failed with `exc` after the attempts' `failures`."""
    # Retries end with whatever the last attempt met (often a bare EOF); a refused credential
    # or certificate from any attempt is what the operator must fix.
    telling = [f for f in failures if _hint(f) != _hint(None)]
    fallback: list[BaseException | None] = [None if isinstance(exc, asyncio.TimeoutError) else exc]
    cause = (telling or failures or fallback)[-1]
    return BusUnavailable(
        f"cannot reach {'any NATS server of' if len(dial.servers) > 1 else 'a NATS server at'} {dial.shown} "
        f"for job {dial.names.job!r} within {connect_timeout:g} s ({dial.security.describe()}): "
        f"{describe(cause)}. {_hint(cause)}",
        url=dial.shown,
        cause=cause,
    )


async def _check_jetstream(nc: NatsClient, dial: _Dial, *, remaining: float) -> None:
    """A server without JetStream accepts the connection but cannot hold any stream: say so now
    (`BusUnavailable`, the client closed). A cluster that just lost its meta leader answers 503 /
    times out for a few seconds: retried within `remaining` seconds."""
    js_check = nc.jetstream(timeout=max(0.25, min(2.0, remaining / 2)))
    try:
        await asyncio.wait_for(
            retry_transient(js_check.account_info, what="JetStream account info", retry_for=remaining), remaining
        )
    except Exception as exc:
        failure = (exc.last or exc) if isinstance(exc, RetriesExhausted) else exc
        await _discard(nc)
        raise BusUnavailable(
            f"the NATS server at {dial.shown} answers but JetStream does not ({describe(failure)}). "
            f"Run nats-server with JetStream enabled (`-js`), e.g. `rolectl server`"
            + ("; keep a majority of a cluster's nodes up (a cluster without one cannot store anything)"
               if len(dial.servers) > 1 else "")
            + f"; with per-identity permissions, the identity {dial.security.identity!r} needs $JS.API.INFO.",
            url=dial.shown,
            cause=failure,
        ) from None


def _host_port(nc: NatsClient) -> str | None:
    uri = nc.connected_url
    return f"{uri.hostname}:{uri.port}" if uri is not None else None


def _hint(cause: BaseException | None) -> str:
    text = str(cause or "").lower()
    if "authorization" in text or "authentication" in text:
        return ("The server refused the credentials: pass the identity's file with --creds FILE "
                f"(or {ENV_VARS['creds']} / nats.creds), as written by `rolectl auth init`.")
    if "certificate" in text or "ssl" in text or "tls" in text:
        return ("TLS failed: pass the CA that signed the server's certificate with --tls-ca FILE "
                f"(or {ENV_VARS['tls_ca']} / nats.tls_ca), e.g. ca.pem from `rolectl auth init`.")
    return ("Start one with `rolectl server` (or `rolectl up`), or pass --nats URL pointing at a "
            "running nats-server with JetStream.")


async def _discard(nc: NatsClient) -> None:
    # Bounded: a client whose TLS or auth handshake failed mid-way can wait on its reader for ever.
    try:
        await asyncio.wait_for(nc.close(), _DRAIN_TIMEOUT_S)
    except Exception:
        pass


class _Connect:
    """What `connect()` returns: `async with connect(...) as conn`, or `conn = await connect(...)`."""

    def __init__(self, **kwargs: Any):
        self._kwargs = kwargs
        self._conn: BusConnection | None = None

    def __await__(self) -> Generator[Any, None, BusConnection]:
        return _open(**self._kwargs).__await__()

    async def __aenter__(self) -> BusConnection:
        self._conn = await _open(**self._kwargs)
        return self._conn

    async def __aexit__(self, *exc_info: object) -> None:
        if self._conn is not None:
            await self._conn.aclose()


def connect(
    url: str,
    *,
    job: str,
    role: Role | str,
    member: str,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    security: ClientSecurity | None = None,
) -> _Connect:
    """Connect member `member` (of `role`, in `job`) to the NATS server at `url`.

    `url` may list several servers of one cluster, comma-separated (`nats://a:4222,nats://b:4222`);
    the first connect tries them in random order, and a lost connection rotates to another server
    (one that has failed least, not the one just lost) with jittered backoff. A malformed list
    raises `ValueError` naming the bad entry. The connection is named `<job>/<role>/<member>`
    (visible in the server's /connz). Raises
    `BusUnavailable` if no server with JetStream answers within `connect_timeout` seconds; once
    connected it reconnects for ever. `security` (credential and TLS files) defaults to the
    ROLECTL_NATS_* environment variables; URL passwords never appear in logs or errors.
    """
    return _Connect(url=url, job=job, role=role, member=member, connect_timeout=connect_timeout,
                    security=security)
