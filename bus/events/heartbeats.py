"""Heartbeats: core NATS liveness messages (not stream records), published and subscribed.

Liveness is noise as history: the synchronizer turns a silence into a `MemberExpired` event, which
is what replay sees. A heartbeat whose payload names another member than its subject is rejected.
"""

from __future__ import annotations

import inspect
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rolectl.sync_protocol import DecodeError, MemberRef, RunningStatus, member_from_plain

from ..connection import BusConnection
from ..errors import BusClosed, describe
from ..logging import LogBudget

__all__ = [
    "HEARTBEAT_SCHEMA",
    "Heartbeat",
    "HeartbeatSubscription",
    "decode_heartbeat",
    "encode_heartbeat",
    "publish_heartbeat",
    "subscribe_heartbeats",
]

HEARTBEAT_SCHEMA = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """A member's "still alive" beacon: where it is (step, weights version, status) and on which host."""

    member: MemberRef
    step: int
    version: int
    status: RunningStatus
    host: str


def encode_heartbeat(hb: Heartbeat) -> bytes:
    member = {"role": hb.member.role.value, "id": hb.member.id, "inc": hb.member.incarnation}
    payload: bytes = msgpack.packb(
        {"schema": HEARTBEAT_SCHEMA, "member": member, "step": hb.step, "version": hb.version,
         "status": hb.status.value, "host": hb.host},
        use_bin_type=True,
    )
    return payload


def _int(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"heartbeat field {key!r} must be an integer, got {value!r}")
    return value


class _Wire(msgspec.Struct, frozen=True):
    """A well-formed heartbeat as `encode_heartbeat` writes it: msgspec checks every field in C."""

    schema: int
    member: MemberRef
    step: int
    version: int
    status: RunningStatus
    host: str


_WIRE = msgspec.msgpack.Decoder(_Wire)


def decode_heartbeat(payload: bytes) -> Heartbeat:
    """Parse a heartbeat, or raise `sync_protocol.DecodeError` saying what is wrong.

    The synchronizer hears every member every heartbeat period (1,024 explorers: a thousand a
    second), so what every member sends is decoded by msgspec in one call; anything else (an alias
    of a status, a field of the wrong type) takes the field-by-field path below, which accepts and
    refuses exactly what it always did and says why."""
    try:
        wire = _WIRE.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _decode_slowly(payload)
    if wire.schema > HEARTBEAT_SCHEMA:
        return _decode_slowly(payload)  # refused there, with the reason
    return Heartbeat(member=wire.member, step=wire.step, version=wire.version, status=wire.status, host=wire.host)


def _decode_slowly(payload: bytes) -> Heartbeat:
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types; all mean "not msgpack"
        raise DecodeError(f"heartbeat is not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise DecodeError(f"heartbeat must be a map, got {type(data).__name__}")
    schema = _int(data, "schema")
    if schema > HEARTBEAT_SCHEMA:
        raise DecodeError(f"heartbeat schema {schema} is newer than this build ({HEARTBEAT_SCHEMA}); upgrade")
    member = data.get("member")
    if not isinstance(member, dict):
        raise DecodeError(f"heartbeat field 'member' must be a map {{role, id, inc}}, got {member!r}")
    try:
        ref = member_from_plain(member)  # checks each field's type; constructors do not
        status_text: Any = data.get("status")  # parse() refuses anything but a status name
        status = RunningStatus.parse(status_text)
    except (DecodeError, ValueError) as exc:
        raise DecodeError(f"heartbeat: {exc}") from None
    host = data.get("host")
    if not isinstance(host, str):
        raise DecodeError(f"heartbeat field 'host' must be a string, got {host!r}")
    return Heartbeat(member=ref, step=_int(data, "step"), version=_int(data, "version"), status=status, host=host)


async def publish_heartbeat(
    conn: BusConnection,
    member: MemberRef,
    step: int,
    version: int,
    status: RunningStatus | str,
    *,
    host: str | None = None,
) -> None:
    """Send one heartbeat on `rft.<job>.hb.<role>.<member>` (fire and forget; lost ones are fine)."""
    hb = Heartbeat(member=member, step=step, version=version, status=RunningStatus.parse(status),
                   host=host or socket.gethostname())
    try:
        await conn.nc.publish(conn.names.heartbeat(member.role, member.id), encode_heartbeat(hb))
    except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
        raise BusClosed(f"cannot send a heartbeat: connection {conn.name} to {conn.url} is closed") from exc


class HeartbeatSubscription:
    """A live heartbeat subscription: `malformed` counts messages that did not decode, `forged`
    those whose payload names another member than their subject; both are skipped and logged at a
    bounded rate. `aclose()` unsubscribes."""

    def __init__(self, conn: BusConnection, callback: Callable[[Heartbeat], Any]):
        self.conn = conn
        self.callback = callback
        self.malformed = 0
        self.forged = 0
        self.received = 0
        self._sub: Subscription | None = None
        self._malformed_log = LogBudget(conn.log, "bus.heartbeat_malformed")
        self._forged_log = LogBudget(conn.log, "bus.heartbeat_forged")

    async def _on_msg(self, msg: Msg) -> None:
        try:
            hb = decode_heartbeat(msg.data)
        except DecodeError as exc:
            self.malformed += 1
            self._malformed_log.warn(subject=msg.subject, reason=str(exc))
            return
        if msg.subject != self.conn.names.heartbeat(hb.member.role, hb.member.id):
            self.forged += 1
            self._forged_log.warn(subject=msg.subject, claimed=str(hb.member),
                                  reason="heartbeat payload names another member than its subject")
            return
        self.received += 1
        try:
            result = self.callback(hb)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # a failing callback must not end the subscription
            self.conn.log.exception("bus.heartbeat_callback_failed", member=str(hb.member), error=describe(exc))

    async def aclose(self) -> None:
        sub, self._sub = self._sub, None
        await self.conn.unsubscribe_quietly(sub)

    async def __aenter__(self) -> HeartbeatSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def subscribe_heartbeats(
    conn: BusConnection, callback: Callable[[Heartbeat], Awaitable[None] | None]
) -> HeartbeatSubscription:
    """Call `callback(heartbeat)` for every heartbeat of the job (sync or async callback)."""
    hs = HeartbeatSubscription(conn, callback)
    hs._sub = await conn.nc.subscribe(conn.names.all_heartbeats, cb=hs._on_msg)
    return hs
