"""No silent waits, with real processes: an explorer whose trainer never started says, within
seconds, what it waits for and what is missing."""

from __future__ import annotations

import pytest

from tests.support.e2e import LiveJob, job_config

pytestmark = pytest.mark.e2e


async def test_an_explorer_without_a_trainer_says_what_it_waits_for(tmp_path):
    config = job_config(tmp_path, job="e2e-no-trainer", synchronizer={"sync_method": "memory"})
    async with LiveJob(tmp_path, config) as job:
        job.start("sync", "sync-0")
        job.start("explorer", "explorer-0")
        await job.wait_until(lambda: "still_waiting" in job.log_tail("explorer-0", lines=200), timeout=120,
                             what="the explorer to say it is still waiting")
        log = job.log_tail("explorer-0", lines=200)
        assert "\"waiting_for\": \"a sync decision (" in log, log
        assert "no trainer has joined the job yet" in log, log
        assert '"since"' in log, log
