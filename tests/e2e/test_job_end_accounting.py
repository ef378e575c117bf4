"""How a job's end is seen by those who come late or count: an explorer started after the trainer's
final stop exits at once (no synchronizer needed), and the run summary accounts for every experience
produced (trained, dropped as stale, or left untrained in the experience stream)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from rolectl.roles.exit_codes import ExitCode
from rolectl.sync_protocol import MemberJoined, Role
from tests.support.e2e import ROOT, LiveJob, accounted_summary, job_config, of_kind

pytestmark = pytest.mark.e2e

LATE_EXIT_BOUND_S = 90.0
"""A bound on "at once" on the loaded 2-core machine (start-up imports torch); the wait it replaces
is sync_timeout + 30 s (630 s by default)."""


def _start_late(job: LiveJob, member_id: str, config_path) -> subprocess.Popen:
    # not LiveJob.start: the late explorer runs with a config of its own
    log = open(job.logs / f"{member_id}.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolectl", "start", "explorer", "--config", str(config_path),
         "--nats", job.url, "--id", member_id],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True)
    log.close()
    return proc


async def _run_late(job: LiveJob, member_id: str, config_path) -> tuple[int, float, str]:
    started = time.monotonic()
    proc = _start_late(job, member_id, config_path)
    try:
        await job.wait_until(lambda: proc.poll() is not None, timeout=LATE_EXIT_BOUND_S,
                             what=f"the late explorer {member_id} to exit")
    finally:
        if proc.poll() is None:
            proc.kill()  # by PID: the process this test started
            proc.wait()
    return proc.returncode, time.monotonic() - started, (job.logs / f"{member_id}.log").read_text()


async def test_explorer_started_after_the_job_ended_exits_at_once(tmp_path):
    config = job_config(tmp_path, job="e2e-late-explorer",
                        synchronizer={"sync_method": "memory", "sync_style": "fixed", "sync_timeout": 600},
                        trainer={"total_steps": 3, "save_interval": 0, "train_batch_tasks": 8},
                        explorers={"total_steps": 3})
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.all_exit_zero(["trainer", "explorer-0", "explorer-1"], timeout=240)
        assert await job.wait_exit("sync-0", 60) == 0  # no live synchronizer from here on

        # a third explorer of the job (count raised), started after the job ended
        data = yaml.safe_load(config.read_text())
        data["explorers"]["count"] = 4
        more = tmp_path / "more_explorers.yaml"
        more.write_text(yaml.safe_dump(data))
        rc, wall, log = await _run_late(job, "explorer-2", more)
        assert rc == ExitCode.OK, f"exit {rc} after {wall:.0f} s\n{log[-3000:]}"
        assert "trainer_already_finished" in log, log[-3000:]

        # an explorer whose own id finished, started again: its work is done, not an error
        job.start("explorer", "explorer-0")
        rc = await job.wait_exit("explorer-0", LATE_EXIT_BOUND_S)
        log = job.log_tail("explorer-0", 200)
        assert rc == ExitCode.OK, f"exit {rc}\n{log[-3000:]}"
        assert "explorer_already_finished" in log, log[-3000:]

        # the same late start, but with steps of its own left and explorers that do not stop with
        # the trainer: its work is incomplete, and it says why
        data["explorers"]["stop_with_trainer"] = False
        keep_going = tmp_path / "keep_going.yaml"
        keep_going.write_text(yaml.safe_dump(data))
        rc, wall, log = await _run_late(job, "explorer-3", keep_going)
        assert rc == ExitCode.INCOMPLETE, f"exit {rc} after {wall:.0f} s\n{log[-3000:]}"
        assert "the trainer finished the job at step 3 before explorer 'explorer-3' joined" in log, log[-3000:]

        await job.stream_caught_up()
        late = [r for r in of_kind(job.records, MemberJoined, role=Role.EXPLORER)
                if r.event.member.id in ("explorer-2", "explorer-3")]
        assert not late, "a late explorer joined a finished job"


async def test_summary_counts_experiences_left_untrained(tmp_path):
    """Explorers that never wait (fully_async) produce more than the trainer trains; with a tight
    staleness bound some are dropped. Every experience produced is counted once, and the count left
    untrained is what the experience stream really holds at the end."""
    config = job_config(tmp_path, job="e2e-overproduce",
                        synchronizer={"sync_method": "memory", "sync_style": "fully_async", "max_staleness": 1},
                        trainer={"total_steps": 3, "save_interval": 1, "train_batch_tasks": 4},
                        explorers={"total_steps": 6, "stop_with_trainer": False, "step_delay_s": [0.0, 0.0]})
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.all_exit_zero(["trainer", "explorer-0", "explorer-1", "sync-0"], timeout=300)
        summary = await accounted_summary(job)  # produced = trained + dropped + left, left in the stream
    assert summary["experiences_produced"] > summary["experiences_trained"], summary  # the explorers over-produced
