"""Explorers paced by the trainer (`synchronizer.max_ahead`), end to end with the tiny engine: the
explorer that runs ahead is paused and released, never more than the bound ahead, each decision
recomputed from the job's record (`replay --check`)."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import ExplorerPaused, ExplorersResumed, Recorded, Role, StepFinished, TasksTaken
from tests.support.e2e import assert_decisions_replay, job_config, of_kind, run_up

pytestmark = pytest.mark.e2e


def _explore_steps_ahead(records: list[Recorded]) -> list[int]:
    """At each explorer step report: how many train steps' worth of tasks the explorers had
    produced beyond what the trainer had reported taking (one explorer, one step = one train step)."""
    trained, ahead = 0, []
    for rec in records:
        event = rec.event
        if isinstance(event, StepFinished) and event.member.role is Role.TRAINER:
            trained = event.step
        elif isinstance(event, StepFinished) and event.member.role is Role.EXPLORER:
            ahead.append(event.step - trained)
    return ahead


def _paced_run(tmp_path, job: str, *, trainer_steps: int, **synchronizer):
    """One explorer that explores until the trainer finishes (fully_async, no wait for weights),
    bound to max_ahead 0, each explore step one train step's worth (4 tasks); the run, ended well."""
    config = job_config(tmp_path, job=job,
                        synchronizer={"sync_method": "memory", "sync_style": "fully_async", "max_ahead": 0,
                                      **synchronizer},
                        trainer={"total_steps": trainer_steps, "train_batch_tasks": 4},
                        explorers={"count": 1, "total_steps": 100_000, "stop_with_trainer": True,
                                   "step_delay_s": [0.0]})
    run = run_up(config, tmp_path, timeout=300)  # a bound on "hung", not on speed
    assert run.rc == 0, run.role_logs()
    return run


def test_an_explorer_ahead_of_the_trainer_is_paused_and_released(tmp_path):
    # one explorer whose step is one train step's worth, never waiting for weights (fully_async),
    # bound to max_ahead 0: after each step it has produced the trainer's next batch, and waits
    # until the trainer took it. It explores until the trainer finishes, so it is ahead in every
    # interleaving.
    run = _paced_run(tmp_path, "e2e-paced", trainer_steps=4)
    paused = [r.event for r in of_kind(run.records, ExplorerPaused)]
    resumed = [r.event for r in of_kind(run.records, ExplorersResumed)]
    assert paused and resumed, run.role_logs()
    assert all(p.limit == 4 and p.produced - p.consumed >= 4 for p in paused)
    # paused at most one step past the bound: the batch of the trainer's next step, never two
    assert max(_explore_steps_ahead(run.records)) <= 1, _explore_steps_ahead(run.records)
    assert run.summary["explorer_pauses"] == len(paused)
    assert_decisions_replay(run.records)  # every pause and release recomputed from the inputs


def test_a_trainer_that_drops_stale_experiences_releases_the_paused_explorer(tmp_path):
    # max_staleness 0: whatever the explorer sampled before it loaded the trainer's newest weights is
    # dropped while the trainer fills its next step, which then needs what the paused explorer would
    # produce: the trainer's TasksTaken releases it (without it, each waits for the other)
    run = _paced_run(tmp_path, "e2e-paced-drops", trainer_steps=3, max_staleness=0)
    taken = [r.event for r in of_kind(run.records, TasksTaken)]
    assert run.summary["experiences_dropped_stale"] > 0 and taken, run.role_logs()
    assert all(t.member.role is Role.TRAINER for t in taken)
    assert_decisions_replay(run.records)
