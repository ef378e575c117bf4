"""How a synchronizer process ends, with real processes: Ctrl-C records its final STOPPED (so
`rolectl status` does not list a ghost), and it exits 0 by itself once every member finished,
unless started with --keep-running."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import MemberJoined, MemberReleased, Role, RunningStatus, StatusChanged
from tests.support.e2e import LiveJob, assert_decisions_replay, job_config, of_kind

pytestmark = pytest.mark.e2e


def _final_stops(records, member: str):
    return [r for r in of_kind(records, StatusChanged, role=Role.SYNCHRONIZER, member=member)
            if r.event.status is RunningStatus.STOPPED and r.event.final]


async def test_ctrl_c_records_the_synchronizers_final_stopped(tmp_path):
    config = job_config(tmp_path, job="e2e-sync-sigint")
    async with LiveJob(tmp_path, config) as job:
        job.start("sync", "sync-0")
        await job.wait_for(lambda recs: of_kind(recs, MemberJoined, role=Role.SYNCHRONIZER, member="sync-0"),
                           timeout=120, what="the synchronizer to join")
        assert not _final_stops(job.records, "sync-0")
        job.interrupt("sync-0")
        assert await job.wait_exit("sync-0", 60) == 0
        stops = await job.wait_for(lambda recs: _final_stops(recs, "sync-0"), timeout=30,
                                   what="the synchronizer's final STOPPED")
        assert len(stops) == 1, stops
        joined = of_kind(job.records, MemberJoined, role=Role.SYNCHRONIZER, member="sync-0")[-1]
        assert stops[0].event.member == joined.event.member  # the same incarnation that joined


async def test_synchronizer_exits_by_itself_once_the_job_is_done(tmp_path):
    total = 3
    config = job_config(
        tmp_path, job="e2e-sync-done",
        synchronizer={"sync_method": "memory", "sync_style": "fixed"},
        trainer={"total_steps": total, "save_interval": 0, "train_batch_tasks": 8},
        explorers={"total_steps": total},
    )
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.all_exit_zero(["trainer", "explorer-0", "explorer-1"], timeout=240)
        # nobody stops it: it sees every member finish, records what is left and its STOPPED
        assert await job.wait_exit("sync-0", 60) == 0
        await job.wait_for(lambda recs: _final_stops(recs, "sync-0"), timeout=30,
                           what="the synchronizer's final STOPPED")
        await job.stream_caught_up()
        assert_decisions_replay(job.records)
        assert "job_done_exiting" in job.log_tail("sync-0", lines=200)


async def test_keep_running_synchronizer_stays_after_the_job(tmp_path):
    """With --keep-running it is still there after every member finished (until Ctrl-C)."""
    import asyncio
    import signal
    import subprocess
    import sys

    from rolectl.bus.events import EventPublisher
    from rolectl.sync_protocol import JobConfigured, MemberRef
    from tests.support.e2e import ROOT

    config = job_config(tmp_path, job="e2e-sync-keep", synchronizer={"sync_method": "memory"})
    async with LiveJob(tmp_path, config) as job:
        log = tmp_path / "sync-keep.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rolectl", "start", "sync", "--config", str(config),
                 "--nats", job.url, "--id", "sync-keep", "--keep-running"],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            await job.wait_for(lambda recs: of_kind(recs, MemberJoined, role=Role.SYNCHRONIZER, member="sync-keep"),
                               timeout=120, what="the synchronizer to join")
            # a whole (tiny) job: a trainer and an explorer join and stop for good
            for role, member_id in ((Role.TRAINER, "trainer"), (Role.EXPLORER, "explorer-0")):
                ref = MemberRef(role=role, id=member_id, incarnation=1)
                pub = EventPublisher(job.conn, ref)
                await pub.publish(JobConfigured(member=ref, config=job.cfg.synchronizer))
                await pub.publish(MemberJoined(member=ref, host="test", pid=1, step=0, version=0))
                await pub.publish(StatusChanged(member=ref, status=RunningStatus.STOPPED, step=0, version=0,
                                                final=True))
            # A synchronizer without --keep-running exits here (test above). This one still
            # answers: a newcomer asking for weights afterwards gets its release recorded.
            late = MemberRef(role=Role.EXPLORER, id="explorer-late", incarnation=1)
            pub = EventPublisher(job.conn, late)
            await pub.publish(MemberJoined(member=late, host="test", pid=2, step=0, version=-1))
            asked = await pub.publish(StatusChanged(member=late, status=RunningStatus.REQUIRE_SYNC, step=0,
                                                    version=-1))
            await job.wait_for(lambda recs: [r for r in of_kind(recs, MemberReleased)
                                             if r.event.released == late and r.seq > asked],
                               timeout=60, what="the kept synchronizer to release a later request")
            assert proc.poll() is None, log.read_text()[-3000:]
            assert "job_done_exiting" not in log.read_text()
            proc.send_signal(signal.SIGINT)
            assert await asyncio.to_thread(proc.wait, 60) == 0
            await job.wait_for(lambda recs: _final_stops(recs, "sync-keep"), timeout=30,
                               what="its final STOPPED after Ctrl-C")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
