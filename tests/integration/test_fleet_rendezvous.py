"""A rendezvous of 1,024 explorers on a real nats-server with the event stream's default limits: the
real `Synchronizer` records one small `RendezvousReady`, and every member's `JobView` finds its rank
in the group its own fold holds (schema 5: the decision names the group instead of listing it). An
explorer's `MemberView`, which reads only its own scope, binds it with the group record the
synchronizer stored before deciding, having folded none of the other explorers' records."""

from __future__ import annotations

import asyncio
import tempfile

from rolectl.bus.connection import connect
from rolectl.bus.events import EventPublisher, read_events
from rolectl.bus.streams import DEFAULT_EVENT_MAX_MSG_SIZE, ensure_event_stream
from rolectl.roles.config import parse_config
from rolectl.roles.session import JobView, MemberView
from rolectl.roles.synchronizer import Synchronizer
from rolectl.sync_protocol import (
    JobConfigured,
    MemberJoined,
    MemberRef,
    RendezvousReady,
    Role,
    RunningStatus,
    StatusChanged,
)
from tests.support.scripted_job import stop_task

FLEET = 1024
TRAINER = MemberRef(role=Role.TRAINER, id="trainer", incarnation=1)


async def _publish_all(publishers: dict[str, EventPublisher], events: list, at_once: int = 64) -> list[int]:
    seqs: list[int] = []
    for i in range(0, len(events), at_once):
        chunk = events[i:i + at_once]
        seqs += await asyncio.gather(*(publishers[e.member.key].publish(e) for e in chunk))
    return seqs


async def _rendezvous_of_a_fleet(nats_url: str, job: str) -> None:
    cfg = parse_config({"job": job, "nats_url": nats_url, "run_dir": tempfile.mkdtemp(prefix="rolectl-fleet-"),
                        "synchronizer": {"sync_method": "nccl", "sync_style": "fixed", "heartbeat_expiry": 600,
                                         "sync_timeout": 600}})
    explorers = [MemberRef(role=Role.EXPLORER, id=f"explorer-{i:04d}", incarnation=1) for i in range(FLEET)]
    async with connect(nats_url, job=job, role="trainer", member="fleet") as conn:
        await ensure_event_stream(conn.js, conn.names)  # the defaults: 64 KiB a message
        limit = (await conn.js.stream_info(conn.names.event_stream)).config.max_msg_size
        assert limit == DEFAULT_EVENT_MAX_MSG_SIZE == 64 * 1024
        publishers = {m.key: EventPublisher(conn, m) for m in (TRAINER, *explorers)}
        sync_task = asyncio.create_task(Synchronizer(cfg, "sync-0").run(), name="synchronizer")
        view = JobView(conn)
        mine = explorers[500]
        scoped = MemberView(conn, [mine.id])  # what explorer-0500's own process reads
        try:
            await view.start()
            await scoped.start()
            members = (TRAINER, *explorers)
            await _publish_all(publishers, [JobConfigured(member=m, config=cfg.synchronizer) for m in members])
            await _publish_all(publishers, [
                MemberJoined(member=m, host="h", pid=1, step=0, version=0, ranks=1 + (m in explorers[::3]))
                for m in members])
            await _publish_all(publishers, [
                StatusChanged(member=e, status=RunningStatus.REQUIRE_SYNC, step=1, version=0) for e in explorers])
            asked = await publishers[TRAINER.key].publish(StatusChanged(
                member=TRAINER, status=RunningStatus.REQUIRE_SYNC, step=1, version=1, rendezvous="10.0.0.1:29500"))

            def ready(d):
                return d if isinstance(d, RendezvousReady) else None

            decision = await view.wait_for(view.first_decision(asked - 1, ready), timeout=120,
                                           what="the rendezvous of 1,024 explorers")
            seen_by_mine = await scoped.wait_for(scoped.first_decision(asked - 1, ready, about=mine.key),
                                                 timeout=120, what="the rendezvous, in explorer-0500's view")
        finally:
            await scoped.aclose()
            await view.aclose()
            await stop_task(sync_task)
        async with read_events(conn, from_seq=asked, stop_at_end=True) as reader:
            recorded = [rec async for rec in reader if isinstance(rec.event, RendezvousReady)]
        message = await conn.js.get_msg(conn.names.event_stream, recorded[0].seq)
    assert decision.explorers == FLEET and decision.world_size == 1 + FLEET + len(explorers[::3])
    assert len(message.data) < 1024 < limit  # one small message, whatever the fleet
    # the scoped view folded the trainer's, the synchronizer's and its own inputs only, and binds
    # the same decision to the same group (read from the record, digest checked)
    assert scoped.inputs_seen <= 8 < 3 * FLEET <= view.inputs_seen
    assert seen_by_mine.is_bound and seen_by_mine.assignment_of(mine) == decision.assignment_of(mine)
    assert seen_by_mine.participants == decision.participants
    # every explorer's view binds it to the group it folded and finds its own ranks, in id order
    offset = 1
    for e in explorers:
        place = decision.assignment_of(e)
        assert (place.rank_offset, place.ranks) == (offset, 1 + (e in explorers[::3]))
        offset += place.ranks


def test_a_rendezvous_of_1024_explorers_is_recorded_within_the_default_limits(nats_url, job_name):
    asyncio.run(_rendezvous_of_a_fleet(nats_url, job_name))
