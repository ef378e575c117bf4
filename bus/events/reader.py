"""The ordered reader of the job's event stream: `read_events()` yields `Recorded` in stream order.

An "ordered consumer" on an ephemeral pull consumer with one pull request kept outstanding; any
gap in delivery re-creates the consumer just after the last sequence seen (see the package
docstring and `EventReader`).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header, StatusCode

from rolectl.sync_protocol import Decision, DecodeError, Event, Recorded, decode_all

from .._natspy_compat import api_prefix, unique_name
from ..aio import raise_if_cancelling
from ..connection import BusConnection
from ..errors import BusClosed, BusError, HistoryGap, describe
from ..logging import LogBudget
from ..retry import backoff_delay
from ..subjects import identity_problem, subject_matches

__all__ = [
    "EventReader",
    "last_sequence",
    "read_all",
    "read_events",
]

# How long past its expiry a pull request may stay silent before the reader asks whether its
# consumer still exists (the server answers an expired request with a 408 at once).
_REQUEST_GRACE_S = 0.5


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
        backfill: Callable[[int, int], list[Recorded]] | None = None,
        subjects: Sequence[str] | None = None,
    ):
        if from_seq is not None and from_time is not None:
            raise ValueError("give from_seq or from_time, not both")
        if backfill is not None and not include_decisions:
            raise ValueError("backfill needs include_decisions=True: a filtered reader skips sequences by design")
        if subjects is not None and (not subjects or not include_decisions):
            raise ValueError("subjects names the subjects to read (decisions too, if wanted): give at least one, "
                             "and leave include_decisions at True")
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
        # backfill(first, last): the records a trim removed from the stream while we lagged
        # behind it (bus.archive.read_range); without it such a stretch is skipped unseen
        self.backfill = backfill
        self.backfilled = 0
        # only these subjects (a member's scope): sequences are skipped by design, so a trim that
        # passed the reader is found by asking where the stream starts (see _trimmed_in_scope)
        self.subjects = tuple(subjects) if subjects is not None else None
        self._first_seq_unchecked = True  # a new consumer: where the stream starts is asked once
        self._first_seq_checked_at = 0.0
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
        self._sub: Subscription | None = None
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
        self._waiter: asyncio.Future[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
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
            filter_subjects=list(self.subjects) if self.subjects is not None else None,
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
                self.conn.log.debug("bus.reader_create_retry", stream=self._stream, attempt=attempt,
                                    error=describe(exc))
                await asyncio.sleep(backoff_delay(attempt, base=0.05, cap=2.0))  # jittered: a fleet's readers spread
        self._consumer = info.name
        self._sub = sub
        self._next_subject = f"{api_prefix(self.conn.js)}.CONSUMER.MSG.NEXT.{self._stream}.{info.name}"
        self._dseq = 0
        self._credit = 0
        self._consumer_lost = False
        self._first_seq_unchecked = True
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
        elif status == StatusCode.CONFLICT and "deleted" in ((msg.headers or {}).get(Header.DESCRIPTION) or "").lower():
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
            # awaited here, before `seen` changes (B023 is about closures called later)
            await self.conn.wait_for(lambda: self.conn.reconnects > seen or self.conn.is_closed)  # noqa: B023
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
                await asyncio.sleep(backoff_delay(self._lost_in_a_row, base=0.05, cap=2.0))
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
        sub = self._sub
        assert sub is not None  # requests go out only while our consumer is set up
        try:
            await self.conn.nc.publish(self._next_subject, request, reply=sub.subject)
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
        # the sequence due next (unknown for a reader started at a time, until its first record)
        expected = self.last_seq + 1 if self.last_seq else None if self.from_time else (self.from_seq or 1)
        trimmed: list[Recorded] = []
        if self.backfill and expected is not None and d.stream_seq > expected:
            trimmed = (await self._trimmed_in_scope(expected, d) if self.subjects is not None
                       else self._backfill(expected, d.stream_seq - 1))
        self.last_seq = d.stream_seq
        if self.end_seq is not None and (d.stream_seq >= self.end_seq or d.pending == 0):
            self._done = True
        if self.known is not None and self.known(d.stream_seq):
            return trimmed
        try:
            held = decode_all(msg.data)
        except DecodeError as exc:
            self.malformed += 1
            self._malformed_log.warn(subject=msg.subject, seq=d.stream_seq, reason=str(exc))
            return trimmed
        if not self._vouched(msg.subject, held, d.stream_seq):
            return trimmed
        time_ms = d.time_ns // 1_000_000
        return trimmed + [Recorded(seq=d.stream_seq, time_ms=time_ms, event=event, subject=msg.subject)
                          for event in held]

    def _vouched(self, subject: str | None, held: Sequence[Event | Decision], seq: int) -> bool:
        """Does the subject vouch for every record of the message (one for all of a batch or none)?"""
        if self.verify_identity and subject is not None:  # an archived row of an older build has none
            for event in held:
                problem = identity_problem(subject, event)
                if problem is not None:
                    self.rejected += 1
                    self._rejected_log.warn(subject=subject, seq=seq, reason=problem, rejected_total=self.rejected)
                    return False
        return True

    def _backfill(self, first: int, last: int, keep: Callable[[Recorded], bool] | None = None) -> list[Recorded]:
        """Records `first`..`last` (those `keep` keeps: a filtered reader's subjects), trimmed from the
        stream while we lagged, read back from the archive and passed through the same checks as
        live ones; `HistoryGap` when it lacks them."""
        assert self.backfill is not None
        try:
            found = self.backfill(first, last)
        except Exception as exc:
            raise HistoryGap(f"records {first}..{last} of stream {self._stream} were trimmed while this reader "
                             f"lagged behind, and cannot be read back: {exc}") from exc
        self.conn.log.info("bus.reader_backfilled", stream=self._stream, first=first, last=last, records=len(found))
        out: list[Recorded] = []
        by_seq: dict[int, list[Recorded]] = {}
        for rec in found:
            if keep is None or keep(rec):
                by_seq.setdefault(rec.seq, []).append(rec)
        for seq, held in by_seq.items():
            if self.known is not None and self.known(seq):
                continue
            if self._vouched(held[0].subject, [r.event for r in held], seq):
                out.extend(held)
        self.backfilled += len(out)
        return out

    async def _trimmed_in_scope(self, expected: int, d: _Delivery) -> list[Recorded]:
        """A filtered reader skips sequences by design, so a jump says nothing by itself. Records of
        its subjects that a trim purged before they were delivered are found by asking where the
        stream starts now: before the first delivery of each consumer (a reader that was away) and,
        while it lags (the delivery says more wait for it), at most once every `poll_s`. A reader
        at the stream's tail is handed each record as it is stored, long before a trim (which
        stops at the synchronizer's last snapshot) can reach it."""
        now = asyncio.get_running_loop().time()
        if not self._first_seq_unchecked and (d.pending == 0 or now - self._first_seq_checked_at < self.poll_s):
            return []
        self._first_seq_unchecked = False
        self._first_seq_checked_at = now
        try:
            info = await asyncio.wait_for(self.conn.js.stream_info(self._stream), self.poll_s)
        except Exception as exc:  # the server busy or away: asked again at the next chance
            self._first_seq_unchecked = True
            self.conn.log.debug("bus.reader_first_seq_unknown", stream=self._stream, error=describe(exc))
            return []
        first = info.state.first_seq
        if first <= expected:
            return []
        names, subjects = self.conn.names, self.subjects or ()
        return self._backfill(expected, min(first, d.stream_seq) - 1, keep=lambda rec: any(
            subject_matches(pattern, rec.subject or names.recorded_subject(rec.event)) for pattern in subjects))

    async def at_end(self) -> bool | None:
        """Whether every record of this reader's subjects stored so far has been handed out (the
        server's count for its consumer, and what is buffered here); None while it has no consumer
        or the server cannot say. For a filtered reader, whose last record read says nothing of
        where the stream ends."""
        consumer = self._consumer
        if consumer is None or self.conn.nc.is_closed:
            return None
        try:
            info = await asyncio.wait_for(self.conn.js.consumer_info(self._stream, consumer), self.poll_s)
        except Exception:
            return None
        if consumer != self._consumer:
            return None  # re-created meanwhile
        # delivered by the server but not read off the socket yet: not handed out
        in_transit = info.delivered is not None and info.delivered.consumer_seq > self._dseq + len(self._buf)
        return not info.num_pending and not in_transit and not self._buf and not self._ready

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

        For a consumer that folds: decoding a burst and then folding it is cheaper per record than
        alternating the two (`benchmarks.reader_cost`): each loop keeps its own code and data hot."""
        try:
            burst = [await self.__anext__()]
        except StopAsyncIteration:
            return []
        ready = self._ready
        while len(burst) < limit and (ready or await self.record_ready()):
            burst.append(ready.popleft())
        return burst

    # -- iteration -------------------------------------------------------------------------------

    def __aiter__(self) -> EventReader:
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

    async def __aenter__(self) -> EventReader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
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
    backfill: Callable[[int, int], list[Recorded]] | None = None,
    subjects: Sequence[str] | None = None,
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
    `backfill(first, last)` returns the records a trim purged while the reader lagged behind it
    (`bus.archive.read_range`): a reader that folds must see every record, and one that cannot
    get them raises `HistoryGap` instead of folding past a hole. `subjects` reads only those
    subjects (NATS wildcards; a member's scope): a JetStream consumer with several filter subjects.

    Use as `async with read_events(conn, ...) as reader: async for rec in reader: ...` so the
    server-side consumer is deleted when you stop early.
    """
    return EventReader(conn, from_seq=from_seq, from_time=from_time, include_decisions=include_decisions,
                       stop_at_end=stop_at_end, verify_identity=verify_identity, known=known,
                       backfill=backfill, subjects=subjects)


async def last_sequence(conn: BusConnection, *, patience_s: float = 0.0) -> int:
    """Sequence of the last message in the job's event stream (0 when empty).

    With `patience_s`, for a role that starts or catches up: a server restarting, or a cluster
    electing a stream leader after losing a node, answers nothing for seconds, and is asked again
    for up to that long. Without it the first failure is raised (a command says so at once)."""
    if patience_s > 0:
        return await conn.retry(lambda: last_sequence(conn), what="the job's last sequence", retry_for=patience_s)
    try:
        info = await conn.js.stream_info(conn.names.event_stream)
    except nats.js.errors.NotFoundError as exc:
        raise BusError(
            f"stream {conn.names.event_stream} does not exist on {conn.url}: no member of job "
            f"{conn.names.job!r} has started on this server yet; check the job name and --nats"
        ) from exc
    return info.state.last_seq
