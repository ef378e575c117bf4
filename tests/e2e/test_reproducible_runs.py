"""A synchronous job is reproducible: `rolectl up` run twice with the same config and seed trains the
same model, step by step, whichever of its explorers' batches reaches the trainer first."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import Role, StepFinished, VersionPublished
from tests.support.e2e import job_config, of_kind, run_up

pytestmark = pytest.mark.e2e

STEPS = 4
# what a step trained and what it measured; not its timings
TRAINED = ("loss", "grad_norm", "reward_mean", "reward_std", "entropy", "approx_kl", "clip_fraction",
           "ratio_mean", "num_experiences", "trained_tokens")


def _run(tmp_path, delays: list[float]):
    tmp_path.mkdir()
    config = job_config(
        tmp_path, job="e2e-repro",
        synchronizer={"sync_method": "memory", "sync_style": "fixed", "sync_interval": 1, "sync_offset": 0},
        # 3 tasks an explorer, 4 minibatches: a step's minibatches mix both explorers' groups
        buffer={"batch_size": 3},
        trainer={"total_steps": STEPS, "save_interval": 0, "train_batch_tasks": 6},
        explorers={"total_steps": STEPS, "step_delay_s": delays},
        model={"seed": 3},
    )
    run = run_up(config, tmp_path, timeout=300)
    assert run.rc == 0, f"exit {run.rc}: {run.summary.get('exit_codes')}\n{run.role_logs()}"
    trained = {r.event.step: {k: r.event.metrics[k] for k in TRAINED}
               for r in of_kind(run.records, StepFinished, role=Role.TRAINER)}
    explored = {(r.event.member.id, r.event.step): r.event.metrics["reward_mean"]
                for r in of_kind(run.records, StepFinished, role=Role.EXPLORER)}
    versions = {r.event.version: r.event.digest for r in of_kind(run.records, VersionPublished)}
    first: dict[int, str] = {}  # which explorer finished each explore step first
    for r in of_kind(run.records, StepFinished, role=Role.EXPLORER):
        first.setdefault(r.event.step, r.event.member.id)
    return trained, explored, versions, first


def test_a_synchronous_job_run_twice_trains_the_same_model(tmp_path):
    """The second run is the first with its explorers' speeds swapped: the run-to-run variation of
    which explorer's batch lands first, made certain. Losses, rewards and every published version's
    weights digest are equal, to the bit."""
    one = _run(tmp_path / "one", [0.0, 0.5])
    two = _run(tmp_path / "two", [0.5, 0.0])
    assert one[3] != two[3], (one[3], two[3])  # the batches did arrive in other orders
    assert sorted(one[0]) == list(range(1, STEPS + 1)) and sorted(one[2]) == list(range(1, STEPS + 1))
    assert one[0] == two[0], "the trainer's per-step metrics differ"
    assert one[1] == two[1], "the explorers' per-step rewards differ"
    assert one[2] == two[2], "the published weights differ"
