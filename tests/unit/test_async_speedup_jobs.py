"""The async benchmark's jobs: every mode a valid job that differs from sync only in how weights move."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import async_speedup
from rolectl.roles.config import parse_config


def _args(**overrides) -> argparse.Namespace:
    defaults = dict(steps=3, batch_size=4, group_size=4, task_length=2, long_task_length=20, long_task_fraction=0.1,
                    max_ahead=1)
    return argparse.Namespace(**{**defaults, **overrides})


def test_every_mode_is_a_job_that_samples_and_trains_the_same_tasks(tmp_path: Path):
    jobs = {mode: async_speedup.job_config(tmp_path, mode, _args()) for mode in async_speedup.MODES}
    parsed = {mode: parse_config(data) for mode, data in jobs.items()}
    for mode, job in parsed.items():
        assert (job.trainer.total_steps, job.trainer.train_batch_tasks) == (3, 8), mode
        assert (job.explorers.count, job.explorers.total_steps, job.buffer.batch_size) == (2, 3, 4), mode
        assert job.synchronizer.max_staleness is None, mode  # nothing dropped: equal samples trained
        assert jobs[mode]["model"] == jobs["sync"]["model"], mode
    assert parsed["sync"].synchronizer.sync_offset == 0 and parsed["one_step_off"].synchronizer.sync_offset == 1
    bounded = parsed[async_speedup.BOUNDED]
    assert bounded.synchronizer.max_ahead == 1 and bounded.explorers.partial_rollout and bounded.explorers.streaming
    assert jobs[async_speedup.BOUNDED]["algorithm"]["rollout_correction"]["rollout_is"] == "token"
    assert all(parsed[mode].synchronizer.max_ahead is None for mode in ("sync", "one_step_off", "fully_async"))


def test_a_mode_reports_its_median_round_and_every_round():
    rounds = [{"samples_per_s": 30.0, "round": 0}, {"samples_per_s": 10.0, "round": 1}, {"samples_per_s": 20.0,
                                                                                         "round": 2}]
    assert async_speedup._median_round(rounds) == {"samples_per_s": 20.0, "round": 2,
                                                   "samples_per_s_rounds": [30.0, 10.0, 20.0]}
