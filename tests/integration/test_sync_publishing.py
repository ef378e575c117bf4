"""How the synchronizer records decisions when the round's subject is not what it expected: another
replica recorded part of the round (batched differently), or junk sits there. What it finds counts as
recorded; only what is missing is sent, after the last message found. Real nats-server, real
`Synchronizer` and `DecisionPublisher`."""

from __future__ import annotations

from bus.connection import connect
from bus.events import DecisionPublisher, read_events
from bus.streams import ensure_event_stream
from roles.config import parse_config
from roles.synchronizer import Synchronizer
from sync_protocol import (
    MemberRef,
    MemberReleased,
    ReleaseReason,
    Role,
    RoundClosed,
    RoundOpened,
    RoundOutcome,
    SyncMethod,
    decision_identity,
)

EXPLORER = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1)
OPENED = RoundOpened(round=1, cause_seq=5, method=SyncMethod.MEMORY, opened_by=EXPLORER, version=-1, opened_at_ms=1)
RELEASED = MemberReleased(round=1, cause_seq=5, released=EXPLORER, reason=ReleaseReason.NEW_VERSION, version=0,
                          reload=False)
CLOSED = RoundClosed(round=1, cause_seq=5, outcome=RoundOutcome.COMPLETED)


async def test_what_another_replica_recorded_is_not_sent_again_and_junk_is_published_after(nats_url, job_name):
    cfg = parse_config({"job": job_name, "nats_url": nats_url, "synchronizer": {"sync_method": "memory"}})
    sync = Synchronizer(cfg, "sync-a")
    async with connect(nats_url, job=job_name, role="synchronizer", member="sync-a") as conn, \
            connect(nats_url, job=job_name, role="synchronizer", member="sync-b") as other:
        await ensure_event_stream(conn.js, conn.names)
        sync.conn, sync.decisions = conn, DecisionPublisher(conn)
        # replica b recorded the round's first two decisions, one message each (we batch all three)
        replica_b = DecisionPublisher(other)
        first = await replica_b.publish(OPENED, expected_last_subject_seq=0)
        second = await replica_b.publish(RELEASED, expected_last_subject_seq=first)
        await other.nc.publish(other.names.decision(1), b"junk after them")
        await other.nc.flush()
        run = [OPENED, RELEASED, CLOSED]
        for d in run:
            sync.pending[decision_identity(d)] = d

        await sync._catch_up_on_round(1, 0, run)

        assert list(sync.pending.values()) == [CLOSED]
        assert sync.recorded[decision_identity(OPENED)] == first
        assert sync.recorded[decision_identity(RELEASED)] == second
        junk = sync.round_subject_seq[1]
        assert junk > second and sync._foreign == {1: 1}
        # what is missing goes after the junk, guarded by it
        assert await sync.decisions.publish([CLOSED], expected_last_subject_seq=junk) is not None
        async with read_events(conn, from_seq=1, stop_at_end=True) as reader:
            recorded = [rec.event async for rec in reader]
    assert recorded == [OPENED, RELEASED, CLOSED]  # each once, in the round's order; junk skipped
