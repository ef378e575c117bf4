"""How the synchronizer records decisions when the decision log is not what it expected: another
replica recorded part of a batch (batched differently), or junk sits there. What it finds counts as
recorded; only what is missing is sent, after the last message found. Real nats-server, real
`Synchronizer` and `DecisionPublisher`."""

from __future__ import annotations

import asyncio

import pytest

from rolectl.bus.connection import connect
from rolectl.bus.errors import PayloadTooLarge
from rolectl.bus.events import DecisionPublisher, read_events
from rolectl.bus.lease import Lease
from rolectl.bus.streams import ensure_event_stream
from rolectl.roles.config import parse_config
from rolectl.roles.synchronizer import Synchronizer
from rolectl.sync_protocol import (
    MemberRef,
    MemberReleased,
    ReleaseReason,
    Role,
    RoundClosed,
    RoundOpened,
    RoundOutcome,
    SyncMethod,
    decision_identity,
    encode_decisions,
)

EXPLORER = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1)
OPENED = RoundOpened(round=1, cause_seq=5, method=SyncMethod.MEMORY, opened_by=EXPLORER, version=-1, opened_at_ms=1)
RELEASED = MemberReleased(round=1, cause_seq=5, released=EXPLORER, reason=ReleaseReason.NEW_VERSION, version=0,
                          reload=False)
CLOSED = RoundClosed(round=1, cause_seq=5, outcome=RoundOutcome.COMPLETED)


async def _make_active(sync: Synchronizer, conn) -> None:
    """`sync` as the active, caught-up replica on `conn`: it holds the job's lease, so it sends."""
    sync.conn, sync.decisions = conn, DecisionPublisher(conn)
    sync.lease = Lease(conn, bucket=conn.names.lease_bucket, key="synchronizer", holder="sync-a#1", ttl_s=5)
    await sync.lease.open()
    assert await sync.lease.acquire_or_renew()
    sync.active = sync.caught_up = True


async def test_what_another_replica_recorded_is_not_sent_again_and_junk_is_published_after(nats_url, job_name):
    cfg = parse_config({"job": job_name, "nats_url": nats_url, "synchronizer": {"sync_method": "memory"}})
    sync = Synchronizer(cfg, "sync-a")
    async with connect(nats_url, job=job_name, role="synchronizer", member="sync-a") as conn, \
            connect(nats_url, job=job_name, role="synchronizer", member="sync-b") as other:
        await ensure_event_stream(conn.js, conn.names)
        sync.conn, sync.decisions = conn, DecisionPublisher(conn)
        # replica b recorded the first two decisions, one message each (we batch all three)
        replica_b = DecisionPublisher(other)
        first = await replica_b.publish(OPENED, expected_last_subject_seq=0)
        second = await replica_b.publish(RELEASED, expected_last_subject_seq=first)
        await other.nc.publish(other.names.decision_log, b"junk after them")
        await other.nc.flush()
        run = [OPENED, RELEASED, CLOSED]
        for d in run:
            sync.pending[decision_identity(d)] = d

        await sync._catch_up_on_log(0, run)

        assert list(sync.pending.values()) == [CLOSED]
        assert sync.recorded[decision_identity(OPENED)] == first
        assert sync.recorded[decision_identity(RELEASED)] == second
        junk = sync.log_seq
        assert junk > second and sync._foreign == 1
        # what is missing goes after the junk, guarded by it
        assert await sync.decisions.publish([CLOSED], expected_last_subject_seq=junk) is not None
        async with read_events(conn, from_seq=1, stop_at_end=True) as reader:
            recorded = [rec.event async for rec in reader]
    assert recorded == [OPENED, RELEASED, CLOSED]  # each once, in computed order; junk skipped


async def test_decisions_of_several_rounds_decided_together_are_one_message_in_computed_order(nats_url, job_name):
    """Group commit: what is unsent when nothing is in flight goes as one batch, rounds mixed; while
    it is in flight nothing else leaves; the next batch is guarded by its ack's sequence."""
    cfg = parse_config({"job": job_name, "nats_url": nats_url, "synchronizer": {"sync_method": "memory"}})
    sync = Synchronizer(cfg, "sync-a")
    other_round = RoundClosed(round=2, cause_seq=6, outcome=RoundOutcome.COMPLETED)
    async with connect(nats_url, job=job_name, role="synchronizer", member="sync-a") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await _make_active(sync, conn)
        first, later = [OPENED, other_round, RELEASED], [CLOSED]
        for d in first:
            sync.pending[decision_identity(d)] = sync._unsent[decision_identity(d)] = d

        assert sync._send_ready() == 3
        sync.pending[decision_identity(CLOSED)] = sync._unsent[decision_identity(CLOSED)] = CLOSED
        assert sync._send_ready() == 0  # one batch in flight at a time: CLOSED waits for its ack
        in_flight = sync._in_flight
        await in_flight  # its ack sends CLOSED, guarded by the first batch's sequence
        assert sync._in_flight is not None and sync._in_flight is not in_flight
        await sync._in_flight
        assert not sync.pending and sync._in_flight is None

        async with read_events(conn, from_seq=1, stop_at_end=True) as reader:
            records = [rec async for rec in reader]
    assert [r.event for r in records] == [*first, *later]
    assert len({r.seq for r in records}) == 2  # two messages: the three decided together, then CLOSED
    assert {r.subject for r in records} == {conn.names.decision_log}
    assert sync.log_seq == records[-1].seq


def _released_at(round_id: int, location_bytes: int) -> MemberReleased:
    """A release whose weights live at a long location: a decision of about that many bytes."""
    return MemberReleased(round=round_id, cause_seq=round_id, released=EXPLORER, reason=ReleaseReason.NEW_VERSION,
                          version=round_id, reload=True, location="w" * location_bytes, digest="sha256:00", nbytes=1)


async def test_a_batch_over_the_servers_max_payload_goes_in_smaller_messages(nats_url, job_name):
    """Decisions that together exceed the event stream's max_msg_size (no decision grows with the
    fleet since schema 5; long locations still may) are recorded, in order, in messages it takes;
    nothing is lost or doubled."""
    cfg = parse_config({"job": job_name, "nats_url": nats_url, "synchronizer": {"sync_method": "memory"}})
    sync = Synchronizer(cfg, "sync-a")
    async with connect(nats_url, job=job_name, role="synchronizer", member="sync-a") as conn:
        await ensure_event_stream(conn.js, conn.names)
        limit = (await conn.js.stream_info(conn.names.event_stream)).config.max_msg_size
        decisions = [_released_at(r, int(0.4 * limit)) for r in (1, 2, 3)]  # 0.4 of the limit each
        assert len(encode_decisions(decisions)) > limit
        await _make_active(sync, conn)
        for d in decisions:
            sync.pending[decision_identity(d)] = sync._unsent[decision_identity(d)] = d

        sync._send_ready()
        while sync._in_flight is not None:  # each batch's end sends the next (bounded: 3 decisions)
            await asyncio.wait_for(sync._in_flight, 30)
        assert not sync.pending and sync._batch_max < 3

        async with read_events(conn, from_seq=1, stop_at_end=True) as reader:
            records = [rec async for rec in reader]
    assert [r.event for r in records] == decisions
    assert len({r.seq for r in records}) > 1


async def test_one_decision_over_the_streams_limit_is_a_clear_error(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="synchronizer", member="sync-a") as conn:
        await ensure_event_stream(conn.js, conn.names)
        limit = (await conn.js.stream_info(conn.names.event_stream)).config.max_msg_size
        huge = _released_at(1, limit)
        with pytest.raises(PayloadTooLarge, match="max_msg_size") as err:
            await DecisionPublisher(conn).publish(huge, expected_last_subject_seq=0)
    assert err.value.size > limit and "nats stream edit" in str(err.value)


async def test_a_decision_log_shorter_than_the_guard_knew_is_guarded_on_what_it_holds(nats_url, job_name):
    """The log's messages aged out (max_age) or were purged: the guard names a sequence the log no
    longer holds. The synchronizer guards on what is there and records what it decided."""
    cfg = parse_config({"job": job_name, "nats_url": nats_url, "synchronizer": {"sync_method": "memory"}})
    sync = Synchronizer(cfg, "sync-a")
    async with connect(nats_url, job=job_name, role="synchronizer", member="sync-a") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await _make_active(sync, conn)
        sync.log_seq = await sync.decisions.publish(OPENED, expected_last_subject_seq=0)
        await conn.js.purge_stream(conn.names.event_stream, subject=conn.names.decision_log)
        assert await sync.decisions.last_on_log() == 0
        for d in (RELEASED, CLOSED):
            sync.pending[decision_identity(d)] = sync._unsent[decision_identity(d)] = d

        sync._send_ready()
        while sync._in_flight is not None:  # the guard fails once, then the batch goes (bounded)
            await asyncio.wait_for(sync._in_flight, 30)
        assert not sync.pending and sync._foreign == 0
        async with read_events(conn, from_seq=1, stop_at_end=True) as reader:
            records = [rec async for rec in reader]
    assert [r.event for r in records] == [RELEASED, CLOSED]
    assert sync.log_seq == records[-1].seq
