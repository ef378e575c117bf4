"""Events on the bus: members publish inputs, the synchronizer publishes decisions, anyone reads them back.

- `EventPublisher` puts a member's input events into the job's event stream with a deterministic
  `Nats-Msg-Id` (`<role>/<id>#<incarnation>/<counter>`), so a publish retried after a lost ack or a
  reconnect is stored once.
- `DecisionPublisher` appends decisions to the decision log `rft.<job>.sync.log` with a
  deterministic msg id *and* `Nats-Expected-Last-Subject-Sequence`: two synchronizer replicas racing
  produce one sequence of decisions; the loser's publish is refused and it reads what the winner
  recorded. Whatever was decided while the previous append was being stored goes as one message (a
  decision batch, `sync_protocol.encode_decisions`, rounds mixed): one guard, one ack.
- Heartbeats are core NATS, not stream messages: liveness is noise as history. The synchronizer
  turns a silence into a `MemberExpired` *event*, which is what replay sees.
- `read_events()` yields `Recorded(seq, time_ms, event)` in stream order from a sequence or a time
  (each decision of a batch as its own record, all with the batch's sequence),
  optionally stopping at the end that existed when reading began. It is an "ordered consumer" built
  on an ephemeral pull consumer with one pull request kept outstanding (records flow as the server
  stores them, no request per record): any gap in delivery (a lost pull response, a server restart
  that took the in-memory consumer with it) re-creates the consumer just after the last sequence seen.
- **Verified identity.** A record counts only if its subject says what its payload says: an input
  event on `rft.<job>.evt.<role>.<member>.<kind>` must name that role, member and kind; a decision
  must be on the decision log (or, recorded by an older build, on `rft.<job>.sync.<its round>`).
  The reader rejects anything else before it reaches a fold (`identity_problem`), counts it
  (`reader.rejected`) and logs it at a bounded rate; the same
  holds for a heartbeat whose payload names another member than its subject. With per-member
  publish permissions on the server (`rolectl auth init`), the subject is the credential, so a
  member cannot speak for another.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import inspect
import json
import socket
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import msgpack
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header, StatusCode

from rolectl.sync_protocol import (
    Decision,
    DecodeError,
    Event,
    MemberRef,
    Recorded,
    RunningStatus,
    decision_identity,
    decode_all,
    encode,
    encode_decisions,
)

from .aio import raise_if_cancelling
from .connection import BusConnection
from ._natspy_compat import unique_name
from .errors import BusClosed, BusError, DecisionSuperseded, PayloadTooLarge, PublishRejected, describe
from .logging import LogBudget
from .streams import MSG_TOO_BIG, explain_refusal
from .subjects import identity_problem

__all__ = [
    "EventPublisher",
    "DecisionPublisher",
    "Heartbeat",
    "HeartbeatSubscription",
    "publish_heartbeat",
    "subscribe_heartbeats",
    "encode_heartbeat",
    "decode_heartbeat",
    "EventReader",
    "read_all",
    "read_events",
    "last_sequence",
    "decision_msg_id",
    "identity_problem",
    "HEARTBEAT_SCHEMA",
]

_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
# How long past its expiry a pull request may stay silent before the reader asks whether its
# consumer still exists (the server answers an expired request with a 408 at once).
_REQUEST_GRACE_S = 0.5
# JetStream error codes that mean "another writer got to this subject first".
_WRONG_LAST_SEQUENCE = {10071, 10164}


# --------------------------------------------------------------------------------------------------
# publishing inputs


class EventPublisher:
    """Publishes one member's input events into the job's event stream."""

    def __init__(
        self,
        conn: BusConnection,
        member: MemberRef,
        *,
        ack_timeout: float = 5.0,
        retry_for: float = 30.0,
    ):
        self.conn = conn
        self.member = member
        self.ack_timeout = ack_timeout
        self.retry_for = retry_for
        self._counter = 0

    def next_msg_id(self) -> str:
        """The msg id the next publish without an override will use (and consume)."""
        self._counter += 1
        return f"{self.member.key}#{self.member.incarnation}/{self._counter}"

    async def publish(self, event: Event, *, msg_id: str | None = None) -> int:
        """Store `event` and return its stream sequence (the original one if it was a duplicate).

        `msg_id` overrides the member counter for events whose identity is not "the n-th thing this
        member said": the synchronizer's timer events use `timeout/<round>` or `expired/<key>#<inc>`
        so every replica publishes the same fact once.
        """
        if not isinstance(event, Event):
            raise TypeError(f"EventPublisher publishes input events, not {type(event).__name__}; "
                            "use DecisionPublisher for decisions")
        if event.member.key != self.member.key:
            raise ValueError(f"event from {event.member} given to the publisher of {self.member}: "
                             "each member publishes only its own events")
        if msg_id is None:
            msg_id = self.next_msg_id()
        subject = self.conn.names.event(self.member.role, self.member.id, event.KIND)
        payload = encode(event)
        try:
            ack = await self.conn.publish_acked(
                subject, payload, msg_id=msg_id, ack_timeout=self.ack_timeout, retry_for=self.retry_for
            )
        except PublishRejected as exc:
            raise explain_refusal(exc, self.conn.names.event_stream, len(payload)) from exc
        if ack.duplicate:
            self.conn.log.debug("bus.event_duplicate", subject=subject, msg_id=msg_id, seq=ack.seq)
        return ack.seq


# --------------------------------------------------------------------------------------------------
# publishing decisions


def decision_msg_id(decisions: Decision | Sequence[Decision]) -> str:
    """`d/<round>/<kind>/<cause_seq>/<released member key or empty>`: equal for equal decisions.

    A batch (decisions in computed order) is named by its first and last decision and its length,
    `d/<first>..<n>/<last>`: replicas that batch alike send the same id (stored once); a batch that
    differs has another id, and the log's guard tells."""
    if isinstance(decisions, Decision):
        decisions = (decisions,)
    first = decision_identity(decisions[0])
    name = f"d/{first[1]}/{first[0]}/{first[2]}/{first[3]}"
    if len(decisions) > 1:
        last = decision_identity(decisions[-1])
        name += f"..{len(decisions)}/{last[1]}/{last[0]}/{last[2]}/{last[3]}"
    return name


class DecisionPublisher:
    """Appends the synchronizer's decisions to the decision log, each once even with several replicas."""

    def __init__(self, conn: BusConnection, *, ack_timeout: float = 5.0, retry_for: float = 30.0):
        self.conn = conn
        self.ack_timeout = ack_timeout
        self.retry_for = retry_for

    async def publish(self, decisions: Decision | Sequence[Decision], *,
                      expected_last_subject_seq: int | None) -> int | None:
        """Append a decision, or several as one message, to the decision log; return its
        sequence, or `None` if the stream already holds this very message.

        `expected_last_subject_seq` is the sequence of the last message on the decision log this
        replica knows of (0 for a new job); `None` skips the check. When the log holds something
        newer than expected, `DecisionSuperseded` is raised: `on_subject_after` tells what it is
        (another replica's decisions, or something else). A message over the server's
        `max_payload` or the stream's `max_msg_size` raises `PayloadTooLarge` (send fewer at once).
        """
        if isinstance(decisions, Decision):
            decisions = (decisions,)
        if not decisions or not all(isinstance(d, Decision) for d in decisions):
            kinds = ", ".join(sorted({type(d).__name__ for d in decisions})) or "nothing"
            raise TypeError(f"DecisionPublisher publishes decisions, not {kinds}; use EventPublisher for inputs")
        subject = self.conn.names.decision_log
        msg_id = decision_msg_id(decisions)
        payload = encode_decisions(decisions)
        headers = {}
        if expected_last_subject_seq is not None:
            headers[_EXPECTED_LAST_SUBJECT_SEQ] = str(int(expected_last_subject_seq))
        try:
            ack = await self.conn.publish_acked(
                subject,
                payload,
                msg_id=msg_id,
                headers=headers,
                ack_timeout=self.ack_timeout,
                retry_for=self.retry_for,
            )
        except PublishRejected as exc:
            if exc.err_code in _WRONG_LAST_SEQUENCE or "wrong last sequence" in exc.description.lower():
                # The log does not end where this replica knew it did: something it did not know
                # of is there (maybe these very decisions from another replica, maybe junk), or
                # messages aged out. Only the caller can tell.
                raise DecisionSuperseded(
                    f"decision {msg_id} not stored: {subject} does not end at seq "
                    f"{expected_last_subject_seq} ({exc.description})",
                    subject=subject, msg_id=msg_id, code=exc.code, err_code=exc.err_code,
                    description=exc.description) from exc
            refusal = explain_refusal(exc, self.conn.names.event_stream, len(payload))
            if exc.err_code == MSG_TOO_BIG or "message size exceeds" in (exc.description or "").lower():
                raise PayloadTooLarge(str(refusal), subject=subject, msg_id=msg_id, size=len(payload)) from exc
            if refusal is not exc:
                raise refusal from exc
            raise
        if ack.duplicate:
            self.conn.log.info("bus.decision_duplicate", subject=subject, msg_id=msg_id, seq=ack.seq)
            return None
        return ack.seq

    async def last_on_log(self) -> int:
        """The sequence of the decision log's newest message, 0 when it holds none."""
        subject = self.conn.names.decision_log
        try:
            msg = await self.conn.retry(
                lambda: self.conn.js.get_last_msg(self.conn.names.event_stream, subject),
                what=f"read the last message on {subject}", retry_for=self.retry_for)
        except nats.js.errors.NotFoundError:
            return 0
        return msg.seq

    async def on_subject_after(self, after_seq: int, *,
                               limit: int = 64) -> list[tuple[int, tuple[Decision, ...]]]:
        """What the decision log holds after stream sequence `after_seq`, oldest first: each
        message's sequence and the decisions it holds (none for a foreign or malformed message).
        At most `limit` messages: a guard that failed is about one or two."""
        subject = self.conn.names.decision_log
        stream = self.conn.names.event_stream
        found: list[tuple[int, tuple[Decision, ...]]] = []
        seq = after_seq
        while len(found) < limit:
            after = seq
            try:
                msg = await self.conn.retry(
                    lambda: self.conn.js.get_msg(stream, seq=after + 1, subject=subject, next=True),
                    what=f"read {subject} after seq {after}", retry_for=self.retry_for)
            except nats.js.errors.NotFoundError:
                break
            seq = msg.seq
            try:
                held = decode_all(msg.data)
            except DecodeError:
                held = ()
            if not all(isinstance(d, Decision) for d in held):
                held = ()
            found.append((seq, held))  # type: ignore[arg-type]
        return found


# --------------------------------------------------------------------------------------------------
# heartbeats (core NATS)

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
    return msgpack.packb(
        {"schema": HEARTBEAT_SCHEMA, "member": member, "step": hb.step, "version": hb.version,
         "status": hb.status.value, "host": hb.host},
        use_bin_type=True,
    )


def _int(data: dict, key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"heartbeat field {key!r} must be an integer, got {value!r}")
    return value


def decode_heartbeat(payload: bytes) -> Heartbeat:
    """Parse a heartbeat, or raise `sync_protocol.DecodeError` saying what is wrong."""
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
        ref = MemberRef(role=member.get("role"), id=member.get("id"), incarnation=member.get("inc"))
        status = RunningStatus.parse(data.get("status"))
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
        self._sub = None
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

    async def __aenter__(self) -> "HeartbeatSubscription":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


async def subscribe_heartbeats(
    conn: BusConnection, callback: Callable[[Heartbeat], Awaitable[None] | None]
) -> HeartbeatSubscription:
    """Call `callback(heartbeat)` for every heartbeat of the job (sync or async callback)."""
    hs = HeartbeatSubscription(conn, callback)
    hs._sub = await conn.nc.subscribe(conn.names.all_heartbeats, cb=hs._on_msg)
    return hs


# --------------------------------------------------------------------------------------------------
# reading


@dataclass(frozen=True, slots=True)
class _Delivery:
    consumer: str
    stream_seq: int
    consumer_seq: int
    time_ns: int
    pending: int


def _delivery(reply: str | None) -> _Delivery | None:
    """Parse a JetStream ack subject (v1 `$JS.ACK.<stream>.<consumer>.<n>.<sseq>.<dseq>.<ts>.<pending>`
    or v2 with domain and account hash in front); None for anything else (status messages)."""
    if not reply:
        return None
    t = reply.split(".")
    if len(t) < 9 or t[0] != "$JS" or t[1] != "ACK":
        return None
    if len(t) == 9:
        consumer, sseq, dseq, ts, pending = t[3], t[5], t[6], t[7], t[8]
    elif len(t) < 11:
        return None
    else:
        consumer, sseq, dseq, ts, pending = t[5], t[7], t[8], t[9], t[10]
    try:
        return _Delivery(consumer, int(sseq), int(dseq), int(ts), int(pending))
    except ValueError:
        return None


def _start_time(value: _dt.datetime | int | float) -> _dt.datetime:
    if isinstance(value, _dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=_dt.timezone.utc)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"from_time must be a datetime or epoch milliseconds, got {value!r}")
    return _dt.datetime.fromtimestamp(value / 1000.0, _dt.timezone.utc)


class EventReader:
    """Async iterator of `Recorded` events and decisions, in stream order. See `read_events()`.

    Attributes: `malformed` (messages skipped because they did not decode), `rejected` (records
    skipped because their subject does not vouch for their payload, see `identity_problem`),
    `last_seq` (stream sequence of the last message consumed, decoded or not).
    """

    def __init__(
        self,
        conn: BusConnection,
        *,
        from_seq: int | None = None,
        from_time: _dt.datetime | int | float | None = None,
        include_decisions: bool = True,
        stop_at_end: bool = False,
        verify_identity: bool = True,
        batch: int = 256,
        poll_s: float = 5.0,
        known: Callable[[int], bool] | None = None,
    ):
        if from_seq is not None and from_time is not None:
            raise ValueError("give from_seq or from_time, not both")
        self.conn = conn
        self.from_seq = from_seq
        self.from_time = _start_time(from_time) if from_time is not None else None
        self.include_decisions = include_decisions
        self.stop_at_end = stop_at_end
        self.batch = batch
        self.poll_s = poll_s
        self.verify_identity = verify_identity
        # known(seq): the caller already has this record (e.g. a publisher reading its own acked
        # messages back); it is passed over without being decoded
        self.known = known
        self.malformed = 0
        self.rejected = 0
        self._malformed_log = LogBudget(conn.log, "bus.event_malformed")
        self._rejected_log = LogBudget(conn.log, "bus.event_rejected")
        self._skipped_in_a_row = 0
        self.last_seq = 0
        self.end_seq: int | None = None
        self._stream = conn.names.event_stream
        self._buf: deque[Msg] = deque()
        self._ready: deque[Recorded] = deque()  # accepted by record_ready(), not yet returned
        self._sub = None
        self._consumer: str | None = None
        self._next_subject = ""  # where pull requests for our consumer go
        self._dseq = 0
        # The outstanding pull request: how many more messages it may bring, and when it expires
        # (loop time). One request stays outstanding while following, so a record is delivered as
        # soon as the server stores it; a new one is sent when it is used up or ends.
        self._credit = 0
        self._request_ends_at = 0.0
        self._consumer_lost = False  # the server said our consumer was deleted (409) or is unserved (503)
        self._lost_in_a_row = 0  # consumers lost since the last delivered record
        self._reconnects_seen = conn.reconnects
        self._waiter: asyncio.Future | None = None
        self._watcher: asyncio.Task | None = None
        self._started = False
        self._done = False
        self._closed = False

    # -- consumer lifecycle ----------------------------------------------------------------------

    def _config(self) -> ConsumerConfig:
        config = ConsumerConfig(
            name=unique_name(),
            ack_policy=AckPolicy.NONE,
            mem_storage=True,
            num_replicas=1,
            # Nobody deletes the consumer of a reader that was abandoned: the server does, later.
            inactive_threshold=max(30.0, 4 * self.poll_s),
            filter_subject=None if self.include_decisions else self.conn.names.all_events,
        )
        if self.last_seq:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self.last_seq + 1
        elif self.from_seq is not None and self.from_seq > 1:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self.from_seq
        elif self.from_time is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = self.from_time
        else:
            config.deliver_policy = DeliverPolicy.ALL
        return config

    async def _create_consumer(self) -> None:
        """Create the consumer (retrying while the server is away); `BusError` if there is no stream."""
        await self._drop_consumer()
        attempt = 0
        while True:
            config = self._config()
            try:
                info = await self.conn.js.add_consumer(self._stream, config)
                # Deliveries land in _buf from the subscription's callback: no task per message
                # or per request, and the reader wakes at once (see _fill).
                sub = await self.conn.nc.subscribe(self.conn.nc.new_inbox(), cb=self._on_delivery)
                break
            except nats.js.errors.NotFoundError as exc:
                raise BusError(
                    f"cannot read events of job {self.conn.names.job!r}: stream {self._stream} does not "
                    f"exist on {self.conn.url}. Has any member of this job started (ensure_event_stream)?"
                ) from exc
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
                raise BusClosed(f"event reader stopped: connection {self.conn.name} is closed") from exc
            except (asyncio.TimeoutError, nats.errors.Error) as exc:
                # Server restarting or JetStream not ready yet (503): the connection reconnects by
                # itself, so wait and try again rather than end a live reader.
                if self.conn.nc.is_closed:
                    raise BusClosed(f"event reader stopped: connection {self.conn.name} is closed") from exc
                attempt += 1
                self.conn.log.debug("bus.reader_create_retry", stream=self._stream, attempt=attempt, error=describe(exc))
                await asyncio.sleep(min(2.0, 0.05 * 2**attempt))
        self._consumer = info.name
        self._sub = sub
        self._next_subject = f"{self.conn.js._prefix}.CONSUMER.MSG.NEXT.{self._stream}.{info.name}"
        self._dseq = 0
        self._credit = 0
        self._consumer_lost = False
        if self.end_seq is not None and not info.num_pending:
            self._done = True  # nothing (left) to read up to the end as it was

    async def _drop_consumer(self) -> None:
        sub, name = self._sub, self._consumer
        self._sub = self._consumer = None
        self._buf.clear()
        self._credit = 0
        if self.conn.nc.is_closed:
            return
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        # Only admin may delete consumers under per-identity permissions; other identities' reader
        # consumers go away by inactive_threshold (a denied delete would only time out).
        if name is not None and self.conn.security.may_delete_consumers:
            try:
                await asyncio.wait_for(self.conn.js.delete_consumer(self._stream, name), 2.0)
            except Exception:  # gone already, or the server is away: inactive_threshold cleans up
                pass

    async def _start(self) -> None:
        self._started = True
        self._watcher = asyncio.create_task(self._wake_on_reconnect(), name="event-reader-reconnects")
        if self.stop_at_end:
            self.end_seq = await last_sequence(self.conn)
            if self.end_seq < max(1, self.from_seq or 1):
                self._done = True
                return
        await self._create_consumer()

    async def _on_delivery(self, msg: Msg) -> None:
        """Subscription callback: a record joins _buf; a status message ends or refuses our request."""
        status = msg.headers.get(Header.STATUS) if msg.headers else None
        if not status:
            self._buf.append(msg)
            self._credit -= 1
            self._lost_in_a_row = 0
        elif status == StatusCode.CONTROL_MESSAGE:
            return  # an idle heartbeat or flow control: nothing to wake up for
        elif status == StatusCode.CONFLICT and "deleted" in (msg.headers.get(Header.DESCRIPTION) or "").lower():
            self._consumer_lost = True
        elif status == StatusCode.SERVICE_UNAVAILABLE:
            # "no responders": nobody serves our consumer, e.g. its one copy was on a cluster node
            # that died. Asking again would get the same answer at once, forever: make a new one.
            self._consumer_lost = True
        else:
            # 408 (the request expired), 409 (leadership change, too many requests...), 404: the
            # request is over; the reader sends another one.
            self._credit = 0
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wake_on_reconnect(self) -> None:
        """Wake the reader at each reconnect (or the close): a pull request sent before an outage
        is never answered, and a restarted server (or a cluster node that took over) may not have
        our consumer; checking at once saves up to poll_s of stall."""
        seen = self.conn.reconnects
        while not self.conn.is_closed:
            await self.conn.wait_for(lambda: self.conn.reconnects > seen or self.conn.is_closed)
            seen = self.conn.reconnects
            self._wake()

    async def _fill(self) -> None:
        """Wait for the next delivery (or news that needs acting on), keeping a pull request out."""
        assert self._sub is not None
        if self.conn.nc.is_closed:
            raise BusClosed(f"event reader stopped: connection {self.conn.name} to {self.conn.url} is closed")
        if self._consumer_lost:
            self.conn.log.info("bus.reader_consumer_lost", stream=self._stream, last_seq=self.last_seq,
                               lost_in_a_row=self._lost_in_a_row)
            if self._lost_in_a_row:  # lost again before a record came: back off (JetStream may be starting)
                await asyncio.sleep(min(2.0, 0.05 * 2 ** self._lost_in_a_row))
            self._lost_in_a_row += 1
            await self._create_consumer()
            return
        loop = asyncio.get_running_loop()
        if self.conn.reconnects != self._reconnects_seen:
            self._reconnects_seen = self.conn.reconnects
            self._credit = 0  # requests sent before the outage are gone with the old connection
            await self._check_consumer()
            return
        if self._credit > 0 and loop.time() > self._request_ends_at + _REQUEST_GRACE_S:
            # Our request expired without a word from the server: is our consumer still there?
            self._credit = 0
            await self._check_consumer()
            return
        if self._credit <= 0:
            await self._request_next()
        if self._buf or self._credit <= 0 or self._consumer_lost or self.conn.reconnects != self._reconnects_seen:
            return  # something came meanwhile
        waiter = self._waiter = loop.create_future()
        timer = loop.call_at(self._request_ends_at + _REQUEST_GRACE_S, self._wake)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        raise_if_cancelling()

    async def _request_next(self) -> None:
        """Send one pull request for up to `batch` records, lasting poll_s."""
        request = json.dumps({"batch": self.batch, "expires": int(self.poll_s * 1e9)}).encode()
        try:
            await self.conn.nc.publish(self._next_subject, request, reply=self._sub.subject)
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError) as exc:
            raise BusClosed(f"event reader stopped: connection {self.conn.name} to {self.conn.url} is closed") from exc
        except nats.errors.Error as exc:  # e.g. outbound buffer full while reconnecting: wait, retry
            self.conn.log.debug("bus.reader_request_failed", stream=self._stream, error=describe(exc))
            await asyncio.sleep(min(self.poll_s, 0.5))
            return
        self._credit = self.batch
        self._request_ends_at = asyncio.get_running_loop().time() + self.poll_s

    async def _check_consumer(self) -> None:
        """After an idle fetch: is our consumer still there? (A restarted server forgets it.)"""
        if self.conn.nc.is_closed:
            raise BusClosed(f"event reader stopped: connection {self.conn.name} to {self.conn.url} is closed")
        if not self.conn.nc.is_connected or self._consumer is None:
            return
        try:
            await asyncio.wait_for(self.conn.js.consumer_info(self._stream, self._consumer), self.poll_s)
        except nats.js.errors.NotFoundError:
            self.conn.log.info("bus.reader_consumer_lost", stream=self._stream, last_seq=self.last_seq)
            await self._create_consumer()
        except Exception:
            pass  # server busy or away; the next fetch tries again

    async def _accept(self, msg: Msg) -> list[Recorded]:
        """The records one delivered message holds (one, or a decision batch's several, all with
        its sequence); none for a status message, junk, or a late delivery to a dropped consumer."""
        d = _delivery(msg.reply)
        if d is None or d.consumer != self._consumer:
            return []  # a status message, or a late delivery to a consumer we dropped
        if d.consumer_seq != self._dseq + 1:
            # A gap: deliveries were lost (AckNone never redelivers). Restart after the last seen.
            self.conn.log.info("bus.reader_gap", expected=self._dseq + 1, got=d.consumer_seq, last_seq=self.last_seq)
            await self._create_consumer()
            return []
        self._dseq = d.consumer_seq
        if self.end_seq is not None and d.stream_seq > self.end_seq:
            self._done = True
            return []
        self.last_seq = d.stream_seq
        if self.end_seq is not None and (d.stream_seq >= self.end_seq or d.pending == 0):
            self._done = True
        if self.known is not None and self.known(d.stream_seq):
            return []
        try:
            held = decode_all(msg.data)
        except DecodeError as exc:
            self.malformed += 1
            self._malformed_log.warn(subject=msg.subject, seq=d.stream_seq, reason=str(exc))
            return []
        if self.verify_identity:
            for event in held:  # one subject vouches for all of a batch or none
                problem = identity_problem(msg.subject, event)
                if problem is not None:
                    self.rejected += 1
                    self._rejected_log.warn(subject=msg.subject, seq=d.stream_seq, reason=problem,
                                            rejected_total=self.rejected)
                    return []
        time_ms = d.time_ns // 1_000_000
        return [Recorded(seq=d.stream_seq, time_ms=time_ms, event=event, subject=msg.subject) for event in held]

    async def record_ready(self) -> bool:
        """True when the next record comes without waiting on the server: a consumer can fold a
        burst of records before acting on all of them at once. Delivered messages are checked
        here (junk skipped), so a burst that ends in junk answers False: "already delivered" is
        not "a record is ready", and acting must not wait for the next record."""
        while not self._ready and self._buf and not self._done:
            self._ready.extend(await self._accept(self._buf.popleft()))
        return bool(self._ready)

    async def next_burst(self, limit: int = 256) -> list[Recorded]:
        """The next record (waiting for it as iteration does) and every record already delivered
        after it, up to `limit`, in order; [] when the reader has ended.

        For a consumer that folds: decoding a burst and then folding it costs about half the CPU
        per record of alternating the two (measured by `benchmarks.reader_cost`): each loop keeps
        its own code and data hot instead of evicting the other's at every record."""
        try:
            burst = [await self.__anext__()]
        except StopAsyncIteration:
            return []
        ready = self._ready
        while len(burst) < limit and (ready or await self.record_ready()):
            burst.append(ready.popleft())
        return burst

    # -- iteration -------------------------------------------------------------------------------

    def __aiter__(self) -> "EventReader":
        return self

    async def __anext__(self) -> Recorded:
        if self._closed:
            raise StopAsyncIteration
        if not self._started:
            await self._start()
        if self._ready:
            self._skipped_in_a_row = 0
            return self._ready.popleft()
        while True:
            while self._buf and not self._done:
                records = await self._accept(self._buf.popleft())
                if records:
                    self._skipped_in_a_row = 0
                    self._ready.extend(records[1:])
                    return records[0]
                self._skipped_in_a_row += 1
                if self._skipped_in_a_row % 64 == 0:
                    # A run of junk must not hold the event loop: heartbeats share it.
                    await asyncio.sleep(0)
            if self._done:
                await self.aclose()
                raise StopAsyncIteration
            if self._closed:
                raise StopAsyncIteration
            await self._fill()

    async def aclose(self) -> None:
        """Stop reading and delete the server-side consumer. Safe twice."""
        if self._closed:
            return
        self._closed = True
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        self._wake()
        await self._drop_consumer()

    async def __aenter__(self) -> "EventReader":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


async def read_all(conn: BusConnection, *, verify_identity: bool = True) -> list[Recorded]:
    """Every record of the job's stream, events and decisions, up to its end as of now.

    `verify_identity=False` keeps records whose subject does not vouch for their payload (an
    export keeps the evidence; `rolectl replay --check` then names them).
    """
    async with read_events(conn, from_seq=1, include_decisions=True, stop_at_end=True,
                           verify_identity=verify_identity) as reader:
        return [rec async for rec in reader]


def read_events(
    conn: BusConnection,
    *,
    from_seq: int | None = None,
    from_time: _dt.datetime | int | float | None = None,
    include_decisions: bool = True,
    stop_at_end: bool = False,
    verify_identity: bool = True,
    known: Callable[[int], bool] | None = None,
) -> EventReader:
    """Read the job's event stream as `Recorded(seq, time_ms, event)`, in order.

    Starts at stream sequence `from_seq`, or at the first message stored at or after `from_time`
    (a datetime, or epoch milliseconds as in `Recorded.time_ms`), or at the beginning. With
    `include_decisions=False` only input events are read. With `stop_at_end=True` iteration ends
    after the last message that existed when reading began; otherwise it follows the stream live.
    Malformed messages are counted in `reader.malformed` and skipped; records whose subject does
    not vouch for their payload (`identity_problem`) are counted in `reader.rejected` and skipped
    unless `verify_identity=False`. Both are logged at a bounded rate (`bus.logging.LogBudget`).
    Every record carries the subject it was recorded on. `known(seq)` true passes a message over
    undecoded: the caller has it already (the synchronizer, the decisions it published).

    Use as `async with read_events(conn, ...) as reader: async for rec in reader: ...` so the
    server-side consumer is deleted when you stop early.
    """
    return EventReader(conn, from_seq=from_seq, from_time=from_time, include_decisions=include_decisions,
                       stop_at_end=stop_at_end, verify_identity=verify_identity, known=known)


async def last_sequence(conn: BusConnection) -> int:
    """Sequence of the last message in the job's event stream (0 when empty)."""
    try:
        info = await conn.js.stream_info(conn.names.event_stream)
    except nats.js.errors.NotFoundError as exc:
        raise BusError(
            f"stream {conn.names.event_stream} does not exist on {conn.url}: no member of job "
            f"{conn.names.job!r} has started on this server yet; check the job name and --nats"
        ) from exc
    return info.state.last_seq
