"""`rolectl track` for a job whose roles were started one by one: started before the job, it logs
every trainer step to TensorBoard (read back with TensorBoard's own reader) and exits 0 once the
job has ended; a second `track --once` after the job logs the same from the record alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.e2e import ROOT, LiveJob, job_config, trainer_steps

pytestmark = pytest.mark.e2e


def _scalars(logdir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir)).Reload()
    return [(s.step, s.value) for s in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def _track(config, url: str, *extra: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rolectl", "track", "--config", str(config),
                             "--nats", url, *extra], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


async def test_track_logs_a_job_started_role_by_role_and_exits_at_its_end(tmp_path):
    config = job_config(tmp_path, job="e2e-track", synchronizer={"sync_method": "memory"},
                        monitor={"backends": ["tensorboard"]})
    async with LiveJob(tmp_path, config) as job:
        with open(tmp_path / "track-live.log", "wb") as log:
            live = _track(config, job.url, "--run", "live", log=log)
            try:
                job.start_all()
                await job.all_exit_zero(["trainer", *job.cfg.explorer_ids(), "sync-0"], timeout=180)
                await job.wait_until(lambda: live.poll() is not None, timeout=60, what="track to exit at the job's end",
                                     poll=0.2)
            finally:
                if live.poll() is None:
                    live.kill()
        output = (tmp_path / "track-live.log").read_text()
        assert live.returncode == 0, output
        steps = sorted(set(trainer_steps(job.records)))
        assert steps == list(range(1, job.cfg.trainer.total_steps + 1))

        once = subprocess.run([sys.executable, "-m", "rolectl", "track", "--config", str(config),
                               "--nats", job.url, "--run", "after", "--once"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert once.returncode == 0, once.stdout + once.stderr

    tensorboard = job.cfg.monitor_dir / "tensorboard"
    for run in ("live", "after"):
        loss = _scalars(tensorboard / run, "trainer/loss")
        assert [step for step, _ in loss] == steps, (run, loss, output)
        assert all(v == v for _, v in loss)  # finite values, as the trainer reported them
    assert _scalars(tensorboard / "live", "trainer/loss") == _scalars(tensorboard / "after", "trainer/loss")
    assert _scalars(tensorboard / "live", "sync/bytes"), "no sync was logged"
    assert "complete" in output


async def test_track_refuses_a_config_without_trackers(tmp_path):
    config = job_config(tmp_path, job="e2e-track-none")
    proc = subprocess.run([sys.executable, "-m", "rolectl", "track", "--config", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "monitor.backends is empty" in proc.stderr
