"""A minimal blocking NATS client for bulk bytes: one connection, driven from a worker thread.

nats-py parses every inbound byte in Python, a few KiB at a time; weight chunks are megabytes. This
client speaks the ordinary NATS client protocol (INFO / CONNECT / PING / SUB / PUB / HMSG) over a
blocking socket, receives payloads straight into the caller's buffer (hashing each piece while it
is still in cache) and sends with scatter-gather `sendmsg`, so no payload is copied or joined. It is
the fast `data_plane.DataPlane`; `_natspy_plane` is the fallback on the nats-py client.

`data_endpoint` copies how an existing nats-py client connected: its server, its credentials
(user/password, token, an nkey or a JWT, whose signature over the server's nonce is made with the
client's own callback), and its TLS context (upgraded after INFO as the server asks, or handshake
first). Under TLS, sends go through the TLS socket part by part, small parts joined (a TLS socket
has no `sendmsg`); receives still land straight in the caller's buffer. Only websocket clients get
None, and the caller stays on nats-py. Errors: `Transient` (and its `ConnectionLost`) for what a
restarting server causes, `NoDataConnection` when the server rules this client out,
`TransferError` for a protocol violation.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from nats.aio.client import Client

from .._natspy_compat import nonce_credentials
from ..errors import TransferError

__all__ = [
    "ConnectionLost",
    "DataConnection",
    "Endpoint",
    "Hasher",
    "Incoming",
    "NoDataConnection",
    "Transient",
    "data_endpoint",
    "parse_headers",
]

CRLF = b"\r\n"
_IOV_MAX = 1024  # Linux limit on buffers per sendmsg
_HASH_PIECE = 256 * 1024  # hash received bytes in pieces of at least this, while cache-hot
_READ_BUFFER = 256 * 1024  # protocol lines and small payloads are read through this buffer
_TLS_JOIN = 64 * 1024  # under TLS, parts smaller than this are joined: one TLS record, not several


class NoDataConnection(Exception):
    """A plain data connection cannot be used here; fall back to the nats-py client."""


class Transient(TransferError):
    """A failure a restarting server or an electing cluster causes; the whole publish / fetch is
    tried again (`bus.retry`), and only if that keeps failing does the caller see a TransferError."""


class ConnectionLost(Transient):
    """The server closed the data connection mid-transfer."""


class Hasher(Protocol):
    """What `read_payload` feeds received bytes to (an XXH3, BLAKE3 or hashlib hasher)."""

    def update(self, data: memoryview, /) -> object: ...


@dataclass
class Incoming:
    """A message announced by the server: its payload (`size` bytes) is read next."""

    subject: str
    status: str | None
    headers: dict[str, str]
    size: int


@dataclass(frozen=True)
class Endpoint:
    """Where and as whom a data connection connects: a copy of a nats-py client's connection.

    `auth` holds the CONNECT fields that are plain values (user/pass, auth_token). A client that
    signs the server's nonce (nkeys, JWT) gives its callbacks: `sign_nonce(nonce)` returns the
    base64 signature, `user_jwt()` the JWT, and `public_nkey` names the nkey. `tls` is the context
    used when the server requires TLS (the default context if None); `tls_first` makes the TLS
    handshake before the server's INFO, as a server with `handshake_first` expects.
    """

    host: str
    port: int
    auth: Mapping[str, str] = field(default_factory=dict)
    tls: ssl.SSLContext | None = None
    tls_hostname: str | None = None
    tls_first: bool = False
    sign_nonce: Callable[[str], bytes] | None = None
    user_jwt: Callable[[], bytes | bytearray] | None = None
    public_nkey: str | None = None

    @property
    def secure(self) -> bool:
        """Whether the client connected with TLS (so will this connection): a context, or handshake first."""
        return self.tls is not None or self.tls_first

    def connect_fields(self, info: Mapping[str, object]) -> dict[str, str]:
        """The credential fields of CONNECT for a server that sent `info` (signing its nonce)."""
        fields = dict(self.auth)
        nonce = info.get("nonce")
        if nonce is not None and self.sign_nonce is not None:
            fields["sig"] = self.sign_nonce(str(nonce)).decode()
            if self.user_jwt is not None:
                fields["jwt"] = self.user_jwt().decode()
            elif self.public_nkey is not None:
                fields["nkey"] = self.public_nkey
        return fields


def data_endpoint(nc: Client) -> Endpoint | None:
    """How to open a second connection to `nc`'s server as `nc`'s identity, or None if we can't
    (not connected, or a websocket)."""
    uri = nc.connected_url
    if uri is None or uri.scheme not in ("nats", "tls") or not uri.hostname:
        return None

    def value(v: object) -> object:
        return v() if callable(v) else v

    user, password, token = (value(nc.options.get(k)) for k in ("user", "password", "token"))
    auth: dict[str, str] = {}
    if user is not None and password is not None:
        auth = {"user": str(user), "pass": str(password)}
    elif token is not None:
        auth = {"auth_token": str(token)}
    elif uri.username is not None:
        auth = {"auth_token": uri.username} if uri.password is None else {"user": uri.username, "pass": uri.password}
    sign_nonce, user_jwt, public_nkey = nonce_credentials(nc)
    tls = nc.options.get("tls")
    if not isinstance(tls, ssl.SSLContext) and uri.scheme == "tls":
        tls = ssl.create_default_context()  # what nats-py used for a tls:// URL without a context
    return Endpoint(
        uri.hostname, uri.port or 4222, auth,
        tls=tls if isinstance(tls, ssl.SSLContext) else None,
        tls_hostname=nc.options.get("tls_hostname") or uri.hostname,
        tls_first=bool(nc.options.get("tls_handshake_first")),
        sign_nonce=sign_nonce, user_jwt=user_jwt, public_nkey=public_nkey,
    )


class DataConnection:
    """A blocking NATS client connection, used by one worker thread at a time.

    `open()` connects and authenticates; `close()` is safe twice; `abort()` may be called from
    another thread to make a blocked send or receive fail at once. Every wait for the socket is
    bounded by `timeout` seconds.
    """

    def __init__(self, endpoint: Endpoint, *, timeout: float):
        self._endpoint = endpoint
        self._addr = (endpoint.host, endpoint.port)
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._tls = False
        self._buf = bytearray(_READ_BUFFER)
        self._mv = memoryview(self._buf)
        self._lo = self._hi = 0
        self._next_sid = 1
        self._aborted = False

    def __enter__(self) -> DataConnection:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def open(self) -> None:
        try:
            sock = socket.create_connection(self._addr, timeout=self._timeout)
        except OSError as exc:
            # Refused or timed out: the server is away (restarting), not unsuitable; retried.
            raise Transient(f"cannot open a data connection to {self._addr}: {exc}") from None
        self._sock = sock
        if self._aborted:  # abort() came while connecting: it found no socket to shut down
            self.close()
            raise Transient(f"data connection to {self._addr} aborted while connecting")
        # Socket buffers are left to TCP autotuning: a fixed SO_RCVBUF turns it off.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        endpoint = self._endpoint
        if endpoint.tls_first:
            self._start_tls()
        line = self._readline()
        if not line.startswith(b"INFO "):
            raise NoDataConnection(f"server greeting is not INFO: {line[:80]!r}")
        info = json.loads(line[5:])
        if not info.get("headers"):
            raise NoDataConnection("server lacks header support")
        if info.get("tls_required") and not self._tls:
            if self._lo != self._hi:
                raise TransferError(f"data connection to {self._addr}: bytes after INFO before the TLS handshake")
            self._start_tls()
        connect = {
            "verbose": False, "pedantic": False, "protocol": 1, "headers": True,
            "no_responders": True, "lang": "python3", "version": "rolectl-weights",
            "name": "rolectl-weights-data", **endpoint.connect_fields(info),
        }
        self.send([b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n"])
        while True:
            line = self._readline()
            if line == b"PONG":
                return
            if line.startswith(b"-ERR"):
                raise NoDataConnection(f"server refused the data connection: {line.decode(errors='replace')}")
            if line == b"PING":
                self.send([b"PONG\r\n"])

    def _start_tls(self) -> None:
        """Wrap the open socket in TLS with the endpoint's context (the default one if it has none)."""
        endpoint = self._endpoint
        context = endpoint.tls or ssl.create_default_context()
        try:
            self._sock = context.wrap_socket(self._connected(), server_hostname=endpoint.tls_hostname or endpoint.host)
        except ssl.SSLCertVerificationError as exc:
            # The nats-py client got through with this context, so this server is not the one it trusts.
            raise NoDataConnection(f"TLS to {self._addr} failed: {exc}") from None
        except OSError as exc:
            raise Transient(f"TLS handshake with {self._addr} failed: {exc}") from None
        self._tls = True

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def abort(self) -> None:
        """From another thread: make the blocked recv/send fail now."""
        self._aborted = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                # The plain socket's shutdown, also under TLS: SSLSocket.shutdown would drop its TLS
                # state under the thread still reading it.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    # writing --------------------------------------------------------------------------------------

    def subscribe(self, subject: str) -> None:
        """Receive messages on `subject` (wildcards allowed) from now on."""
        sid, self._next_sid = self._next_sid, self._next_sid + 1
        self.send([f"SUB {subject} {sid}\r\n".encode()])

    def publish(self, subject: str, reply: str, payload: Sequence[bytes | memoryview]) -> None:
        """Send one message whose payload is the concatenation of `payload`'s parts."""
        self.send(self.pub_parts(subject, reply, payload))

    def publish_many(self, subject: str, reply: str, bodies: Sequence[bytes]) -> None:
        """Send one message per body, all in one `send`."""
        self.send([part for body in bodies for part in self.pub_parts(subject, reply, [body])])

    @staticmethod
    def pub_parts(subject: str, reply: str, payload: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
        """The protocol parts of one PUB, for batching several messages into one `send`."""
        size = sum(len(p) for p in payload)
        return [f"PUB {subject} {reply} {size}\r\n".encode(), *payload, CRLF]

    def send(self, parts: Sequence[bytes | memoryview]) -> None:
        """Write all of `parts` with scatter-gather sends, no joining."""
        sock = self._connected()
        views = [memoryview(p) for p in parts if len(p)]
        try:
            if self._tls:
                _send_tls(sock, views)
                return
            while views:
                sent = sock.sendmsg(views[:_IOV_MAX])
                while sent:
                    head = views[0]
                    if sent >= len(head):
                        sent -= len(head)
                        views.pop(0)
                    else:
                        views[0] = head[sent:]
                        sent = 0
        except TimeoutError:
            raise Transient(f"data connection to {self._addr}: send stalled for {self._timeout} s") from None
        except OSError as exc:
            raise Transient(f"data connection to {self._addr} failed while sending: {exc}") from None

    # reading --------------------------------------------------------------------------------------

    def next_message(self) -> Incoming:
        """Read up to the next MSG/HMSG payload (answering PINGs on the way)."""
        while True:
            line = self._readline()
            if line.startswith(b"HMSG ") or line.startswith(b"MSG "):
                parts = line.split()
                if parts[0] == b"HMSG":
                    hlen, total = int(parts[-2]), int(parts[-1])
                else:
                    hlen, total = 0, int(parts[-1])
                status, headers = parse_headers(self._read_bytes(hlen)) if hlen else (None, {})
                return Incoming(parts[1].decode(), status, headers, total - hlen)
            if line == b"PING":
                self.send([b"PONG\r\n"])
            elif line.startswith(b"-ERR"):
                raise TransferError(f"server error on the data connection: {line.decode(errors='replace')}")
            elif not (line == b"PONG" or line == b"+OK" or line.startswith(b"INFO")):
                raise TransferError(f"data connection: unexpected protocol line {line[:80]!r}")

    def read_payload(self, size: int, target: memoryview | None = None, hasher: Hasher | None = None) -> bytes:
        """The payload of the message just announced: into `target` (hashed on the way; then b""
        is returned), or as bytes."""
        data = b""
        if target is not None:
            self._read_into(target, hasher)
        else:
            data = self._read_bytes(size)
        if self._read_bytes(2) != CRLF:
            raise TransferError(f"data connection to {self._addr}: payload not followed by CRLF")
        return data

    def _connected(self) -> socket.socket:
        if self._sock is None:
            raise TransferError(f"data connection to {self._addr} is not open")
        return self._sock

    def _recv_into(self, view: memoryview) -> int:
        sock = self._connected()
        try:
            got = sock.recv_into(view)
        except TimeoutError:
            raise Transient(
                f"data connection to {self._addr}: no bytes for {self._timeout} s; is the server overloaded?"
            ) from None
        except OSError as exc:
            raise Transient(f"data connection to {self._addr} failed: {exc}") from None
        if not got:
            raise ConnectionLost(
                f"server {self._addr} closed the data connection (a slow consumer even with one "
                "chunk in flight? check the server's max_pending against its max_payload)"
            )
        return got

    def _fill(self) -> None:
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi == len(self._buf):
            n = self._hi - self._lo
            self._buf[:n] = self._mv[self._lo : self._hi]
            self._lo, self._hi = 0, n
        self._hi += self._recv_into(self._mv[self._hi :])

    def _readline(self) -> bytes:
        while True:
            end = self._buf.find(CRLF, self._lo, self._hi)
            if end >= 0:
                line = bytes(self._mv[self._lo : end])
                self._lo = end + 2
                return line
            if self._hi - self._lo >= len(self._buf) - 2:
                raise TransferError(f"data connection to {self._addr}: protocol line too long")
            self._fill()

    def _read_into(self, target: memoryview, hasher: Hasher | None = None) -> None:
        n = len(target)
        have = min(self._hi - self._lo, n)
        if have:
            target[:have] = self._mv[self._lo : self._lo + have]
            self._lo += have
        pos = hashed = have
        if hasher is not None and have:
            hasher.update(target[:have])
        while pos < n:  # large payloads go from the socket straight into the target
            pos += self._recv_into(target[pos:])
            if hasher is not None and pos - hashed >= _HASH_PIECE:
                # Hash what just landed while it is still in cache, not in a cold pass later.
                hasher.update(target[hashed:pos])
                hashed = pos
        if hasher is not None and hashed < n:
            hasher.update(target[hashed:n])

    def _read_bytes(self, n: int) -> bytes:
        out = bytearray(n)
        self._read_into(memoryview(out))
        return bytes(out)


def _send_tls(sock: socket.socket, views: list[memoryview]) -> None:
    """Send `views` through a TLS socket (no sendmsg there): large parts as they are, runs of small
    ones (protocol lines, CRLFs) joined so each does not cost a TLS record and a syscall."""
    small = bytearray()
    for view in views:
        if len(view) < _TLS_JOIN:
            small += view
            continue
        if small:
            sock.sendall(small)
            small.clear()
        sock.sendall(view)
    if small:
        sock.sendall(small)


def parse_headers(raw: bytes) -> tuple[str | None, dict[str, str]]:
    """The status (e.g. "404") and headers of an HMSG's header block."""
    lines = raw.decode("latin-1").split("\r\n")
    first = lines[0].split(" ", 2)  # "NATS/1.0[ <status>[ <description>]]"
    status = first[1] if len(first) > 1 and first[1].isdigit() else None
    headers = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if sep:
            headers[key.strip()] = value.strip()
    if status:
        headers["Status"] = status
    return status, headers
