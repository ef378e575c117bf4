"""bus.events against a real nats-server: publish, dedup, read back by sequence and time, decisions, heartbeats."""

from __future__ import annotations

import asyncio

import pytest

from rolectl.bus.connection import connect
from rolectl.bus.errors import DecisionSuperseded
from rolectl.bus.events import (
    DecisionPublisher,
    EventPublisher,
    EventReader,
    decision_msg_id,
    last_sequence,
    publish_heartbeat,
    read_events,
    subscribe_heartbeats,
)
from rolectl.bus.streams import ensure_event_stream
from rolectl.sync_protocol import (
    MemberJoined,
    MemberRef,
    MemberReleased,
    ReleaseReason,
    Role,
    RoundClosed,
    RoundOpened,
    RoundOutcome,
    RoundTimedOut,
    RunningStatus,
    StatusChanged,
    StepFinished,
    SyncMethod,
    VersionPublished,
    encode,
)
from tests.support.wait import wait_until

TRAINER = MemberRef(role=Role.TRAINER, id="t0", incarnation=1)
EXPLORER = MemberRef(role=Role.EXPLORER, id="e0", incarnation=3)
SYNC = MemberRef(role=Role.SYNCHRONIZER, id="s0", incarnation=0)


@pytest.fixture
async def conn(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="trainer", member="t0") as c:
        await ensure_event_stream(c.js, c.names)
        yield c


def _some_events() -> list:
    return [
        MemberJoined(member=TRAINER, host="h", pid=1, step=0, version=0),
        StatusChanged(member=TRAINER, status=RunningStatus.RUNNING, step=0, version=0),
        StepFinished(member=TRAINER, step=1, version=0, metrics={"loss": 0.5}),
        VersionPublished(member=TRAINER, version=1, step=1, method=SyncMethod.MEMORY, location="v1",
                         nbytes=10, digest="abc"),
        StatusChanged(member=TRAINER, status=RunningStatus.REQUIRE_SYNC, step=1, version=1, rendezvous="h:1"),
    ]


def _opened(round_id: int = 1, cause: int = 5) -> RoundOpened:
    return RoundOpened(round=round_id, cause_seq=cause, method=SyncMethod.MEMORY, opened_by=EXPLORER,
                       version=0, opened_at_ms=123)


async def _collect(reader) -> list:
    async with reader:
        return [rec async for rec in reader]


async def test_events_round_trip_in_order_with_sequence_and_server_time(conn):
    pub = EventPublisher(conn, TRAINER)
    events = _some_events()
    seqs = [await pub.publish(e) for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    records = await _collect(read_events(conn, stop_at_end=True))

    assert [r.event for r in records] == events
    assert [r.seq for r in records] == seqs
    times = [r.time_ms for r in records]
    assert times == sorted(times) and all(t > 1_600_000_000_000 for t in times)
    assert await last_sequence(conn) == seqs[-1]


async def test_events_go_to_the_member_and_kind_subject(conn):
    pub = EventPublisher(conn, EXPLORER)
    with pytest.raises(ValueError, match="only its own events"):
        await pub.publish(MemberJoined(member=TRAINER, host="h", pid=1, step=0, version=0))
    seq = await pub.publish(StepFinished(member=EXPLORER, step=1, version=0))
    msg = await conn.js.get_msg(conn.names.event_stream, seq)
    assert msg.subject == conn.names.event("explorer", "e0", "step_finished")
    assert msg.headers["Nats-Msg-Id"] == "explorer/e0#3/1"


async def test_same_msg_id_twice_is_stored_once(conn):
    pub = EventPublisher(conn, SYNC)
    event = RoundTimedOut(member=SYNC, round=7)
    first = await pub.publish(event, msg_id="timeout/7")
    again = await pub.publish(event, msg_id="timeout/7")

    assert again == first
    records = await _collect(read_events(conn, stop_at_end=True))
    assert [r.seq for r in records] == [first]


async def test_read_from_sequence_starts_there(conn):
    pub = EventPublisher(conn, TRAINER)
    seqs = [await pub.publish(e) for e in _some_events()]

    records = await _collect(read_events(conn, from_seq=seqs[2], stop_at_end=True))

    assert [r.seq for r in records] == seqs[2:]


async def test_read_from_time_starts_at_first_message_stored_then(conn):
    pub = EventPublisher(conn, TRAINER)
    for e in _some_events()[:2]:
        await pub.publish(e)
    everything = await _collect(read_events(conn, stop_at_end=True))
    later = [await pub.publish(e) for e in _some_events()[2:]]
    # Start strictly after the last early message's server time (ms resolution): the server may
    # stamp several messages within one millisecond, so expect "no early message" rather than
    # an exact first sequence when they share it.
    cut_ms = everything[-1].time_ms + 1

    records = await _collect(read_events(conn, from_time=cut_ms, stop_at_end=True))

    assert records, "messages stored after the cut must be read"
    assert all(r.time_ms >= cut_ms for r in records)
    assert {r.seq for r in records} <= set(later)
    assert records[-1].seq == later[-1]


async def test_read_without_decisions_skips_the_sync_subjects(conn):
    seq = await EventPublisher(conn, TRAINER).publish(_some_events()[0])
    await DecisionPublisher(conn).publish(_opened(cause=seq), expected_last_subject_seq=0)

    with_decisions = await _collect(read_events(conn, stop_at_end=True))
    inputs_only = await _collect(read_events(conn, include_decisions=False, stop_at_end=True))

    assert len(with_decisions) == 2 and isinstance(with_decisions[1].event, RoundOpened)
    assert [r.seq for r in inputs_only] == [seq]


async def test_stop_at_end_on_an_empty_stream_yields_nothing(conn):
    assert await _collect(read_events(conn, stop_at_end=True)) == []


async def test_live_reader_sees_events_published_after_it_started(conn):
    pub = EventPublisher(conn, TRAINER)
    events = _some_events()
    await pub.publish(events[0])

    async with read_events(conn) as reader:
        first = await asyncio.wait_for(reader.__anext__(), 5)
        await pub.publish(events[1])
        second = await asyncio.wait_for(reader.__anext__(), 5)

    assert [first.event, second.event] == events[:2]


async def test_garbage_on_an_event_subject_is_skipped_and_counted(conn):
    pub = EventPublisher(conn, TRAINER)
    good = _some_events()[:2]
    await pub.publish(good[0])
    subject = conn.names.event("trainer", "t0", "status_changed")
    await conn.js.publish(subject, b"\xc1 definitely not msgpack")
    await conn.js.publish(subject, encode(good[1])[:-3])  # truncated
    await conn.js.publish(conn.names.decision(9), b"\x81\xa4kind\xa7unknown")  # a map, unknown kind
    await pub.publish(good[1])

    reader = read_events(conn, stop_at_end=True)
    records = await _collect(reader)

    assert [r.event for r in records] == good
    assert reader.malformed == 3


async def test_decision_second_replica_is_told_what_the_subject_holds(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="synchronizer", member="s0") as a, \
            connect(nats_url, job=job_name, role="synchronizer", member="s1") as b:
        await ensure_event_stream(a.js, a.names)
        replica_a, replica_b = DecisionPublisher(a), DecisionPublisher(b)
        opened = _opened(round_id=1, cause=4)

        seq = await replica_a.publish(opened, expected_last_subject_seq=0)
        assert seq is not None
        # The same decision again, and a racing different one: the expected subject sequence is
        # stale for both; reading the subject after it tells the replica which case it is.
        for again in (opened, RoundClosed(round=1, cause_seq=4, outcome=RoundOutcome.TIMED_OUT)):
            with pytest.raises(DecisionSuperseded):
                await replica_b.publish(again, expected_last_subject_seq=0)
            assert await replica_b.on_subject_after(0) == [(seq, (opened,))]
        # Without the subject check the msg id dedups the same decision
        assert await replica_b.publish(opened, expected_last_subject_seq=None) is None
        # The round's next decisions as one batch, chained on the first: accepted once.
        released = MemberReleased(round=1, cause_seq=6, released=EXPLORER, reason=ReleaseReason.NEW_VERSION,
                                  version=1, reload=True, location="v1")
        closed = RoundClosed(round=1, cause_seq=6, outcome=RoundOutcome.COMPLETED)
        seq2 = await replica_b.publish([released, closed], expected_last_subject_seq=seq)
        assert seq2 is not None and seq2 > seq
        with pytest.raises(DecisionSuperseded):  # replica a did not know b recorded it
            await replica_a.publish([released, closed], expected_last_subject_seq=seq)
        assert await replica_a.on_subject_after(seq) == [(seq2, (released, closed))]
        assert await replica_a.publish([released, closed], expected_last_subject_seq=None) is None  # same id
        # junk on the log: it is no decision, so the replica publishes after it
        await a.nc.publish(a.names.decision_log, b"junk")
        await a.nc.flush()
        late = MemberReleased(round=1, cause_seq=9, released=TRAINER, reason=ReleaseReason.NO_NEW_VERSION,
                              version=1, reload=False)
        with pytest.raises(DecisionSuperseded):
            await replica_a.publish(late, expected_last_subject_seq=seq2)
        [(junk_seq, held)] = await replica_a.on_subject_after(seq2)
        assert junk_seq > seq2 and held == ()
        assert await replica_a.publish(late, expected_last_subject_seq=junk_seq) is not None
        assert await replica_a.on_subject_after(0, limit=2) == [(seq, (opened,)), (seq2, (released, closed))]

        records = await _collect(read_events(a, stop_at_end=True))
    # a batch is read as its decisions, in order, each with the batch's sequence
    assert [r.event for r in records] == [opened, released, closed, late]
    assert [r.seq for r in records[:3]] == [seq, seq2, seq2]


def test_decision_msg_id_names_round_kind_cause_and_released_member():
    released = MemberReleased(round=3, cause_seq=9, released=EXPLORER, reason=ReleaseReason.NEW_VERSION,
                              version=1, reload=False)
    closed = RoundClosed(round=3, cause_seq=9, outcome=RoundOutcome.COMPLETED)
    assert decision_msg_id(released) == "d/3/member_released/9/explorer/e0"
    assert decision_msg_id(_opened(round_id=3, cause=9)) == "d/3/round_opened/9/"
    # a batch: its first and last decision and its length, so runs that differ never share an id
    assert decision_msg_id([released, closed]) == "d/3/member_released/9/explorer/e0..2/3/round_closed/9/"
    # rounds mixed: the last decision's round is in the name too
    other = RoundClosed(round=4, cause_seq=9, outcome=RoundOutcome.COMPLETED)
    assert decision_msg_id([released, other]) == "d/3/member_released/9/explorer/e0..2/4/round_closed/9/"
    assert decision_msg_id([_opened(round_id=3, cause=9), released, closed]) != decision_msg_id([released, closed])


async def test_heartbeats_reach_subscribers_and_stay_out_of_the_stream(conn):
    got: asyncio.Queue = asyncio.Queue()
    sub = await subscribe_heartbeats(conn, got.put)
    async with sub:
        await conn.nc.publish(conn.names.heartbeat("explorer", "e0"), b"garbage")
        await publish_heartbeat(conn, EXPLORER, step=4, version=2, status="require_sync", host="box")
        hb = await asyncio.wait_for(got.get(), 5)

    assert (hb.member, hb.step, hb.version, hb.status, hb.host) == (
        EXPLORER, 4, 2, RunningStatus.REQUIRE_SYNC, "box")
    assert sub.malformed == 1
    assert await last_sequence(conn) == 0


async def test_a_lost_delivery_is_detected_and_read_again(conn):
    pub = EventPublisher(conn, TRAINER)
    events = [StepFinished(member=TRAINER, step=s, version=0) for s in range(5)]
    for e in events:
        await pub.publish(e)
    reader = read_events(conn, stop_at_end=True)
    deliveries = 0
    deliver = reader._on_delivery

    async def lose_the_second(msg):
        # As a dropped pull response would: the consumer (AckNone) never redelivers it by itself.
        nonlocal deliveries
        deliveries += 1
        if deliveries != 2:
            await deliver(msg)

    reader._on_delivery = lose_the_second
    async with reader:
        records = [rec async for rec in reader]

    assert [r.event for r in records] == events
    assert deliveries > len(events)  # the lost one and those after it came again, from a new consumer


async def test_record_ready_is_false_when_what_is_delivered_is_only_junk(conn):
    """A consumer folds a burst (`record_ready`) before acting on it: junk at the end of a burst
    must not make it wait for the next real record before acting (the synchronizer held its
    decisions 150 s that way, until an explorer's retry arrived)."""
    pub = EventPublisher(conn, TRAINER)
    good = _some_events()[:3]
    await pub.publish(good[0])
    await pub.publish(good[1])
    subject = conn.names.event("trainer", "t0", "status_changed")
    for _ in range(3):
        await conn.js.publish(subject, b"\xc1 junk")
    async with read_events(conn) as reader:
        first = await asyncio.wait_for(reader.__anext__(), 5)
        # everything was stored before the reader started: one fetch delivered the whole burst
        assert len(reader._buf) == 4
        assert await asyncio.wait_for(reader.record_ready(), 5)  # good[1]: no waiting
        second = await asyncio.wait_for(reader.__anext__(), 5)
        assert not await asyncio.wait_for(reader.record_ready(), 5)  # only junk is left: act now
        assert reader.malformed == 3
        await pub.publish(good[2])
        third = await asyncio.wait_for(reader.__anext__(), 5)
    assert [first.event, second.event, third.event] == good


async def test_next_burst_returns_what_is_delivered_in_order_up_to_its_limit(conn):
    """A burst is the next record plus every record already delivered (junk skipped), at most
    `limit`; the rest waits for the next burst; a live reader's next burst waits for a record."""
    pub = EventPublisher(conn, TRAINER)
    events = [StepFinished(member=TRAINER, step=s, version=0) for s in range(5)]
    for event in events[:4]:
        await pub.publish(event)
    await conn.js.publish(conn.names.event("trainer", "t0", "step_finished"), b"\xc1 junk")
    async with read_events(conn) as reader:
        first = await asyncio.wait_for(reader.next_burst(limit=3), 5)
        assert 1 <= len(first) <= 3 and [r.event for r in first] == events[:len(first)]
        # the rest of what was stored (events and the junk) reaches the reader's buffer
        await wait_until(lambda: len(reader._buf) >= 5 - len(first), timeout=5, poll=0.01,
                         what=f"{5 - len(first)} messages delivered",
                         details=lambda: f"only {len(reader._buf)} messages delivered")
        second = await asyncio.wait_for(reader.next_burst(limit=3), 5)
        # everything delivered, up to the limit; the junk at the end is no record
        assert [r.event for r in second] == events[len(first):min(len(first) + 3, 4)]
        if len(first) + len(second) < 4:
            second += await asyncio.wait_for(reader.next_burst(limit=3), 5)
        assert [r.event for r in first + second] == events[:4]
        assert not await asyncio.wait_for(reader.record_ready(), 5)  # only the junk was left
        assert reader.malformed == 1
        waiting = asyncio.ensure_future(reader.next_burst(limit=3))
        await pub.publish(events[4])
        third = await asyncio.wait_for(waiting, 5)
    assert [r.event for r in third] == events[4:]
    assert [r.seq for r in first + second + third] == sorted(r.seq for r in first + second + third)


async def test_next_burst_is_empty_when_the_reader_ends(conn):
    pub = EventPublisher(conn, TRAINER)
    events = _some_events()[:3]
    for event in events:
        await pub.publish(event)
    async with read_events(conn, stop_at_end=True) as reader:
        bursts = []
        while burst := await asyncio.wait_for(reader.next_burst(), 5):
            bursts.append(burst)
    assert [r.event for burst in bursts for r in burst] == events
    assert await reader.next_burst() == []  # closed: stays ended


async def test_a_live_reader_whose_consumer_is_deleted_goes_on_after_the_last_record(conn):
    """The server answers the outstanding pull request with 409 "consumer deleted": the reader
    makes a new consumer just after what it has and keeps following, nothing skipped or repeated."""
    pub = EventPublisher(conn, TRAINER)
    events = [StepFinished(member=TRAINER, step=s, version=0) for s in range(4)]
    await pub.publish(events[0])
    async with read_events(conn) as reader:
        first = await asyncio.wait_for(reader.__anext__(), 5)
        lost = reader._consumer
        await conn.js.delete_consumer(conn.names.event_stream, lost)
        for e in events[1:]:
            await pub.publish(e)
        rest = [await asyncio.wait_for(reader.__anext__(), 10) for _ in events[1:]]
        assert reader._consumer != lost

    assert [r.event for r in [first, *rest]] == events
    assert [r.seq for r in [first, *rest]] == sorted({r.seq for r in [first, *rest]})


async def test_a_live_reader_gets_each_record_from_one_outstanding_request(conn):
    """Following the stream live costs no request per record: one pull request stays outstanding
    and records arrive on it as the server stores them."""
    pub = EventPublisher(conn, TRAINER)
    events = [StepFinished(member=TRAINER, step=s, version=0) for s in range(5)]
    async with EventReader(conn, poll_s=300.0) as reader:  # no request expires during the test
        sent = 0
        request = reader._request_next

        async def counted():
            nonlocal sent
            sent += 1
            await request()

        reader._request_next = counted
        got = []
        for e in events:
            await pub.publish(e)
            got.append(await asyncio.wait_for(reader.__anext__(), 5))

    assert [r.event for r in got] == events
    assert sent == 1
