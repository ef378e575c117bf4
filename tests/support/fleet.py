"""A recorded fleet: a trainer and a thousand explorers' records in a real job stream, some of them
stragglers, for what operators read at scale (`rolectl status`, the dashboard).

No synchronizer runs: the records are what one would have folded (joins, steps, versions, an
expiry it published); readers fold them as they fold any job. Who straggles is fixed, so a test
names them: `EXPIRED`, `STOPPED` and `BEHIND` explorers, the rest at the trainer's step and version.
"""

from __future__ import annotations

import asyncio

from rolectl.bus.connection import connect
from rolectl.bus.events import EventPublisher
from rolectl.bus.streams import ensure_event_stream
from rolectl.sync_protocol import (
    JobConfigured,
    MemberExpired,
    MemberJoined,
    MemberRef,
    Role,
    RunningStatus,
    StatusChanged,
    StepFinished,
    SyncConfig,
    SyncMethod,
    VersionPublished,
)

__all__ = ["record_fleet", "explorer_id", "STEP", "EXPIRED", "STOPPED", "BEHIND"]

STEP = 12  # where the trainer and the explorers that keep up are (step and version)
EXPIRED = (17, 503)  # explorer indexes the synchronizer expired
STOPPED = (42,)  # stopped without finishing (Ctrl-C): it may come back
BEHIND = {900: 3, 7: 5, 250: 9}  # explorer index -> the version (and step) it is stuck at

TRAINER = MemberRef(role=Role.TRAINER, id="trainer", incarnation=1)
SYNC = MemberRef(role=Role.SYNCHRONIZER, id="sync-0", incarnation=1)


def explorer_id(index: int) -> str:
    return f"explorer-{index:04d}"


async def _publish_all(publishers: dict[str, EventPublisher], events: list, at_once: int = 64) -> None:
    for i in range(0, len(events), at_once):
        await asyncio.gather(*(publishers[e.member.key].publish(e) for e in events[i:i + at_once]))


async def record_fleet(nats_url: str, job: str, explorers: int = 1000) -> list[MemberRef]:
    """Record a job of a trainer, a synchronizer and `explorers` explorers; returns the explorers."""
    fleet = [MemberRef(role=Role.EXPLORER, id=explorer_id(i), incarnation=1) for i in range(explorers)]
    config = SyncConfig(sync_method=SyncMethod.MEMORY, heartbeat_expiry=600, sync_timeout=600)
    async with connect(nats_url, job=job, role="trainer", member="fleet-recorder") as conn:
        await ensure_event_stream(conn.js, conn.names)
        members = (TRAINER, SYNC, *fleet)
        publishers = {m.key: EventPublisher(conn, m) for m in members}
        await _publish_all(publishers, [JobConfigured(member=m, config=config) for m in members])
        await _publish_all(publishers, [MemberJoined(member=m, host=f"host-{m.id}", pid=1, step=0, version=0)
                                        for m in members])
        trainer = publishers[TRAINER.key]
        await trainer.publish(VersionPublished(member=TRAINER, version=STEP, step=STEP, method=SyncMethod.MEMORY,
                                               location=f"weights/v{STEP}", nbytes=1, digest="sha256:0"))
        await trainer.publish(StepFinished(member=TRAINER, step=STEP, version=STEP, metrics={"total_steps": 20}))
        steps = [StepFinished(member=e, step=BEHIND.get(i, STEP), version=BEHIND.get(i, STEP),
                              metrics={"total_steps": 20}) for i, e in enumerate(fleet)]
        await _publish_all(publishers, steps)
        await _publish_all(publishers, [StatusChanged(member=fleet[i], status=RunningStatus.STOPPED, step=STEP,
                                                      version=STEP) for i in STOPPED])
        await _publish_all(publishers, [MemberExpired(member=SYNC, expired=fleet[i], silent_for=700.0)
                                        for i in EXPIRED])
    return fleet
