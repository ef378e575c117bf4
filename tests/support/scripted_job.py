"""A realistic small job for the inspection tests: one trainer and two explorers publish their inputs
to a real nats-server while the real `Synchronizer` runs in-process and records its decisions.

Members here are scripted (no engines, no weights), so every test that needs "a job that ran" gets
one in about a second. Every step waits for the decision it needs (with a timeout), never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from dataclasses import dataclass, field

from rolectl.bus.connection import BusConnection, connect
from rolectl.bus.events import EventPublisher, read_events
from rolectl.bus.streams import ensure_event_stream
from rolectl.roles.config import parse_config
from rolectl.roles.synchronizer import Synchronizer
from rolectl.sync_protocol import (
    Decision,
    JobConfigured,
    MemberJoined,
    MemberRef,
    MemberReleased,
    Recorded,
    Role,
    RoundClosed,
    RunningStatus,
    StatusChanged,
    StepFinished,
    SyncMethod,
    VersionPublished,
    WeightsLoaded,
)
from tests.support.wait import wait_until

__all__ = ["ScriptedJob", "run_scripted_job", "stop_task", "TRAINER", "EXPLORERS"]

TRAINER = MemberRef(role=Role.TRAINER, id="trainer", incarnation=1)
EXPLORERS = (MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1),
             MemberRef(role=Role.EXPLORER, id="explorer-1", incarnation=1))
NBYTES = 4_000_000


@dataclass
class ScriptedJob:
    """A job under way: its connection, one publisher per member, and the decisions recorded so far."""

    conn: BusConnection
    cfg: object
    publishers: dict[str, EventPublisher] = field(default_factory=dict)
    decisions: list[Recorded] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def publish(self, event) -> int:
        return await self.publishers[event.member.key].publish(event)

    async def follow(self) -> None:
        async with read_events(self.conn, from_seq=1, include_decisions=True) as reader:
            async for rec in reader:
                if isinstance(rec.event, Decision):
                    async with self.changed:
                        self.decisions.append(rec)
                        self.changed.notify_all()

    async def wait_released(self, member: MemberRef, after_seq: int, timeout: float = 15.0) -> MemberReleased:
        """The synchronizer's release of `member` caused by an input after `after_seq`."""
        return await self._wait(lambda d: isinstance(d, MemberReleased) and d.released.key == member.key
                                and d.cause_seq >= after_seq, f"release of {member.key} after seq {after_seq}",
                                timeout)

    async def wait_closed(self, round_id: int, timeout: float = 15.0) -> RoundClosed:
        return await self._wait(lambda d: isinstance(d, RoundClosed) and d.round == round_id,
                                f"round {round_id} closed", timeout)

    async def _wait(self, match, what: str, timeout: float):
        return await wait_until(lambda: next((rec.event for rec in self.decisions if match(rec.event)), None),
                                timeout=timeout, what=what, changed=self.changed,
                                details=lambda: f"decisions so far: {[r.event for r in self.decisions]}")


async def stop_task(task: asyncio.Task) -> None:
    """Cancel `task` and wait for it to end.

    Cancelling again until it ends: on Python < 3.12 `asyncio.wait_for` (used inside nats-py's
    fetch) swallows a cancellation that lands just as a message arrives.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()


async def run_scripted_job(nats_url: str, job: str, *, steps: int = 4, stop: bool = True,
                           snapshot_every: int | None = None, run_dir: str | None = None) -> int:
    """Run the scripted job to its end; returns the stream's last sequence number.

    Each trainer step publishes a version; explorer-0 syncs every step (usually finding the new
    version at once), explorer-1 asks for a version before the trainer has it and so waits.
    """
    # the synchronizer archives the stream's history under run_dir once it snapshots
    cfg = parse_config({
        "job": job, "nats_url": nats_url, "run_dir": run_dir or tempfile.mkdtemp(prefix="rolectl-scripted-"),
        "synchronizer": {"sync_method": "memory", "sync_style": "fixed", "sync_interval": 1,
                         "heartbeat_expiry": 600, "sync_timeout": 600,
                         **({"snapshot_every": snapshot_every} if snapshot_every is not None else {})},
    })
    sync = Synchronizer(cfg, "sync-0")
    async with connect(nats_url, job=job, role="trainer", member="script") as conn:
        await ensure_event_stream(conn.js, conn.names)
        sync_task = asyncio.create_task(sync.run(), name="synchronizer")
        job_ = ScriptedJob(conn=conn, cfg=cfg)
        follower = asyncio.create_task(job_.follow(), name="follow")
        try:
            await _script(job_, cfg, steps=steps, stop=stop)
        finally:
            await stop_task(follower)
            await stop_task(sync_task)
        from rolectl.bus.events import last_sequence

        return await last_sequence(conn)


async def _script(job: ScriptedJob, cfg, *, steps: int, stop: bool) -> None:
    for ref in (TRAINER, *EXPLORERS):
        job.publishers[ref.key] = EventPublisher(job.conn, ref)
    versions = {e.key: -1 for e in EXPLORERS}
    for ref in (TRAINER, *EXPLORERS):
        await job.publish(JobConfigured(member=ref, config=cfg.synchronizer))
        await job.publish(MemberJoined(member=ref, host=f"host-{ref.id}", pid=100, step=0,
                                       version=0 if ref.role is Role.TRAINER else -1))
    # explorers pull the base model before exploring
    for e in EXPLORERS:
        seq = await job.publish(StatusChanged(member=e, status=RunningStatus.REQUIRE_SYNC, step=0, version=-1))
        released = await job.wait_released(e, seq)
        versions[e.key] = max(0, released.version)
        await job.publish(WeightsLoaded(member=e, version=versions[e.key], round=released.round))
    for step in range(1, steps + 1):
        for e in EXPLORERS:
            await job.publish(StepFinished(member=e, step=step, version=versions[e.key],
                                           metrics={"reward_mean": 0.1 * step}))
        # explorer-1 asks before the trainer has published this step's version: it waits
        slow = EXPLORERS[1]
        wait_seq = await job.publish(StatusChanged(member=slow, status=RunningStatus.REQUIRE_SYNC, step=step,
                                                   version=versions[slow.key]))
        await job.publish(StepFinished(member=TRAINER, step=step, version=step - 1,
                                       metrics={"reward_mean": 0.2 * step, "loss": 1.0 / step,
                                                "mean_staleness": 0.5, "dropped_stale_total": float(step // 2),
                                                "total_steps": float(2 * steps)}))  # as a trainer reports it
        await job.publish(VersionPublished(member=TRAINER, version=step, step=step, method=SyncMethod.MEMORY,
                                           location=f"v{step}", nbytes=NBYTES, digest=f"sha256:{step:064x}"))
        released = await job.wait_released(slow, wait_seq)
        await job.publish(WeightsLoaded(member=slow, version=released.version, round=released.round,
                                        nbytes=NBYTES, seconds=0.02))
        versions[slow.key] = released.version
        # explorer-0 asks after the version exists: released at once
        fast = EXPLORERS[0]
        seq = await job.publish(StatusChanged(member=fast, status=RunningStatus.REQUIRE_SYNC, step=step,
                                              version=versions[fast.key]))
        released = await job.wait_released(fast, seq)
        await job.publish(WeightsLoaded(member=fast, version=released.version, round=released.round,
                                        nbytes=NBYTES, seconds=0.01))
        versions[fast.key] = released.version
        await job.wait_closed(released.round)
    if stop:
        # the trainer trained its last step: the job is complete
        await job.publish(StatusChanged(member=TRAINER, status=RunningStatus.STOPPED, step=steps, version=steps,
                                        final=True))
        for e in EXPLORERS:
            await job.publish(StatusChanged(member=e, status=RunningStatus.STOPPED, step=steps,
                                            version=versions[e.key], final=True))
