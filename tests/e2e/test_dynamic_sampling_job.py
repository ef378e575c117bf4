"""DAPO's dynamic sampling end to end with the tiny engine (`algorithm.dynamic_sampling`): explorers
leave out the groups whose rewards are all equal, generate more of their task sets to fill each
step, and the job completes with the filtered groups counted and every experience accounted for."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import Role, StepFinished
from tests.support.e2e import LiveJob, accounted_summary, assert_decisions_replay, job_config, of_kind

pytestmark = pytest.mark.e2e


async def test_filtered_groups_are_counted_and_the_job_completes(tmp_path):
    config = job_config(tmp_path, job="e2e-dynamic-sampling",
                        synchronizer={"sync_method": "memory", "sync_style": "fixed"},
                        trainer={"total_steps": 3, "save_interval": 3, "train_batch_tasks": 8},
                        explorers={"total_steps": 3, "step_delay_s": [0.0, 0.0]},
                        algorithm={"dynamic_sampling": True, "max_num_gen_batches": 4})
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.all_exit_zero(["trainer", "explorer-0", "explorer-1", "sync-0"], timeout=300)
        summary = await accounted_summary(job)  # produced = trained + stale + filtered + left, left in the stream
        explored = [r.event.metrics for r in of_kind(job.records, StepFinished, role=Role.EXPLORER)]
        records = job.records
    assert summary["complete"] and summary["trainer_steps"] == 3, summary
    # the base model gives some groups equal rewards (seeded: explorer-0's first batch has one)
    assert summary["groups_filtered"] > 0 and summary["experiences_filtered"] == 4 * summary["groups_filtered"]
    # the steps that filtered a group generated more to fill themselves
    assert any(m["gen_batches"] > 1 for m in explored if m["groups_filtered"]), explored
    assert all(m["experiences"] - m["experiences_filtered"] >= 16 or m["dynamic_sampling_short"] for m in explored)
    assert_decisions_replay(records)
