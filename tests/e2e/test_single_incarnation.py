"""Exactly one live incarnation per member, with real processes: a second `rolectl start` of a live
trainer or explorer is refused (exit 2) naming the live one; a trainer frozen past its expiry and
replaced by a restart learns it was replaced when thawed and exits without training again; a member
killed -9 and started again at once resumes, even when a snapshot hides its join from the new view."""

from __future__ import annotations

import signal

import pytest

from rolectl.bus.snapshots import SnapshotStore
from rolectl.roles.runner import EXIT_ERROR, EXIT_USAGE
from rolectl.sync_protocol import MemberExpired, MemberJoined, Role, StepFinished
from tests.support.e2e import LiveJob, job_config, last_trainer_step, of_kind

pytestmark = pytest.mark.e2e


async def test_a_second_start_of_a_live_member_is_refused_naming_it(tmp_path):
    config = job_config(tmp_path, job="e2e-second-start", synchronizer={"sync_method": "memory"})
    async with LiveJob(tmp_path, config) as job:
        # no synchronizer and no explorer: both wait (for experiences, for a first version)
        first = {member: job.start(role, member) for role, member in (("trainer", "trainer"),
                                                                       ("explorer", "explorer-0"))}
        for member in first:
            await job.wait_for(lambda recs, m=member: of_kind(recs, MemberJoined, member=m), timeout=120,
                               what=f"{member} to join")
        for role, member in (("trainer", "trainer"), ("explorer", "explorer-0")):
            job.start(role, member)
            assert await job.wait_exit(member, 120) == EXIT_USAGE, job.log_tail(member)
            log = job.log_tail(member, lines=200)
            assert f"{role} '{member}' of job 'e2e-second-start' is already running" in log, log
            assert f"pid {first[member].pid} on host" in log, log
            assert "start again: the new one resumes" in log, log
            assert first[member].poll() is None, f"the live {member} must keep running"
        joins = {r.event.member.key for r in of_kind(job.records, MemberJoined)}
        assert len(of_kind(job.records, MemberJoined)) == 2, joins  # the refused ones never joined


async def test_a_trainer_thawed_after_a_restart_replaced_it_exits_without_training(tmp_path):
    total, expiry = 10, 2.0
    config = job_config(
        tmp_path, job="e2e-fenced",
        synchronizer={"sync_method": "checkpoint", "sync_style": "fixed", "sync_timeout": 300,
                      "heartbeat_period": 0.4, "heartbeat_expiry": expiry},
        trainer={"total_steps": total, "save_interval": 1, "train_batch_tasks": 8},
        explorers={"total_steps": total, "step_delay_s": [0.0, 0.1], "trainer_grace_s": 120},
        buffer={"ack_wait_s": 60},
    )
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.wait_for(lambda recs: last_trainer_step(recs) >= 2, timeout=120, what="trainer step 2")
        old = job.current("trainer")
        old_log = job.procs["trainer"][-1].log_path
        old.send_signal(signal.SIGSTOP)
        try:
            await job.wait_for(lambda recs: [r for r in of_kind(recs, MemberExpired)
                                             if r.event.expired.id == "trainer"],
                               timeout=60, what="the frozen trainer to be expired")
            job.start("trainer", "trainer")  # a real restart: the old one expired
            joins = await job.wait_for(lambda recs: of_kind(recs, MemberJoined, member="trainer")[1:],
                                       timeout=120, what="the new trainer to join")
            replaced_at = joins[0].seq
            thawed_at = old_log.stat().st_size
        finally:
            old.send_signal(signal.SIGCONT)
        old.wait(timeout=60)
        assert old.returncode == EXIT_ERROR, old_log.read_text()[-3000:]
        after = old_log.read_bytes()[thawed_at:].decode(errors="replace")
        assert "replaced_by_newer_incarnation" in after, after
        assert '"train_step"' not in after and "train_step " not in after, after
        old_incarnation = of_kind(job.records, MemberJoined, member="trainer")[0].event.member.incarnation
        late = [r for r in of_kind(job.records, StepFinished, role=Role.TRAINER)
                if r.seq > replaced_at and r.event.member.incarnation == old_incarnation]
        assert not late, late
        await job.all_exit_zero(["trainer", "explorer-0", "explorer-1"], timeout=240)
        assert last_trainer_step(job.records) == total


async def test_a_trainer_killed_and_started_at_once_resumes_past_a_snapshot_of_its_join(tmp_path):
    """The restart comes long before the expiry, so only the dead pid tells the new process the old one
    is gone; the new view starts from a snapshot newer than the old join, so it reads that join (host,
    pid) from the stream instead of its own fold."""
    total = 12
    config = job_config(
        tmp_path, job="e2e-restart-at-once",
        synchronizer={"sync_method": "checkpoint", "sync_style": "fixed", "sync_timeout": 300,
                      "heartbeat_expiry": 120.0, "snapshot_every": 20},
        trainer={"total_steps": total, "save_interval": 1, "train_batch_tasks": 8},
        explorers={"total_steps": total, "trainer_grace_s": 240},
        buffer={"ack_wait_s": 60},
    )
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        join = (await job.wait_for(lambda recs: of_kind(recs, MemberJoined, member="trainer"), timeout=120,
                                   what="the trainer to join"))[0]
        snapshots = SnapshotStore(job.conn)

        async def snapshot_past_the_join():
            latest = await snapshots.latest()
            return latest is not None and latest.state.last_seq > join.seq

        await job.wait_until(snapshot_past_the_join, timeout=120, what="a snapshot newer than the trainer's join")
        job.kill9("trainer")
        job.start("trainer", "trainer")
        await job.wait_for(lambda recs: of_kind(recs, MemberJoined, member="trainer")[1:], timeout=60,
                           what="the restarted trainer to join (its predecessor is not expired yet)")
        assert "previous_process_gone" in job.log_tail("trainer", lines=400), job.log_tail("trainer")
        assert not of_kind(job.records, MemberExpired), "the restart must not have waited for an expiry"
        await job.all_exit_zero(["trainer", "explorer-0", "explorer-1"], timeout=240)
        assert last_trainer_step(job.records) == total
