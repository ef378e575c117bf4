"""Partial rollouts in a real job: fully_async explorers pause their generations for each new version
and go on from their tokens; every experience produced is still counted once (trained, dropped as
stale, or left untrained in the stream), and the versions each loaded mid-step are recorded."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import Role, StepFinished, WeightsLoaded
from tests.support.e2e import LiveJob, accounted_summary, job_config, of_kind

pytestmark = pytest.mark.e2e


async def test_nothing_is_lost_or_duplicated_across_pauses(tmp_path):
    # Explorers that never wait and keep exploring until the trainer is done: new versions land while
    # their (longer, heavier than the default) generations are in flight.
    config = job_config(tmp_path, job="e2e-partial",
                        synchronizer={"sync_method": "memory", "sync_style": "fully_async", "max_staleness": 2},
                        trainer={"total_steps": 6, "save_interval": 0, "train_batch_tasks": 8},
                        explorers={"total_steps": 40, "partial_rollout": True, "step_delay_s": [0.0, 0.0]},
                        buffer={"batch_size": 8},
                        model={"task_length": 8, "d_model": 128, "d_ff": 512, "group_size": 4})
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.all_exit_zero(["trainer", "explorer-0", "explorer-1", "sync-0"], timeout=300)
        summary = await accounted_summary(job)  # produced = trained + dropped + left, left in the stream
        steps = of_kind(job.records, StepFinished, role=Role.EXPLORER)
        loads = of_kind(job.records, WeightsLoaded, role=Role.EXPLORER)

    pauses = sum(r.event.metrics.get("partial_rollout_pauses", 0) for r in steps)
    resumed = sum(r.event.metrics.get("partial_rollout_experiences", 0) for r in steps)
    assert pauses >= 1 and resumed >= 1, f"no generation was paused for new weights: {summary}"
    # every load inside a rollout is on the record, each version at most once per explorer
    for member in ("explorer-0", "explorer-1"):
        versions = [r.event.version for r in loads if r.event.member.id == member]
        assert versions == sorted(set(versions)), f"{member} loaded {versions}"
