"""`rolectl up` end to end: every sync style x weight method finishes, with two explorers of
different speeds, and every run's recorded decisions are exactly a fold of its recorded inputs."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import (
    MemberReleased,
    RendezvousReady,
    Role,
    RoundOpened,
    StepFinished,
    VersionPublished,
    WeightsBroadcast,
)
from tests.support.e2e import assert_decisions_replay, job_config, of_kind, run_up, trainer_steps

pytestmark = pytest.mark.e2e

TOTAL_STEPS = 6


def _check_run(run, *, method: str, style: str, engine_num: int) -> None:
    s = run.summary
    assert run.rc == 0, f"rolectl up exited {run.rc}: {s.get('exit_codes')}\n{run.role_logs()}"
    assert s["exit_codes"] and all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]
    assert s["trainer_steps"] == TOTAL_STEPS, (s, run.role_logs())
    steps = trainer_steps(run.records)
    assert steps == list(range(1, TOTAL_STEPS + 1)), f"trainer steps {steps}"
    assert set(s["explorer_steps"]) == {"explorer-0", "explorer-1"}, s["explorer_steps"]
    assert all(n >= 1 for n in s["explorer_steps"].values()), s["explorer_steps"]
    # Every explorer-step's tasks were produced before the trainer could consume them.
    explorer_finished = of_kind(run.records, StepFinished, role=Role.EXPLORER)
    produced = sum(int(r.event.metrics["experiences"]) for r in explorer_finished)
    steps = of_kind(run.records, StepFinished, role=Role.TRAINER)
    trained = sum(int(r.event.metrics["num_experiences"]) for r in steps)
    assert 0 < trained <= produced, (trained, produced)
    assert s["final_version"] > 0, s
    assert_decisions_replay(run.records)

    opened = [r.event for r in of_kind(run.records, RoundOpened)]
    if method == "nccl":
        readies = [r.event for r in of_kind(run.records, RendezvousReady)]  # bound to their group
        assert all(d.is_bound for d in readies)
        broadcasts = [r.event for r in of_kind(run.records, WeightsBroadcast)]
        assert readies and broadcasts, "no rendezvous happened"
        # every explorer rank in one group behind the trainer's rank 0
        for d in readies:
            assert all(p.ranks == engine_num for p in d.participants), d
            assert d.world_size == 1 + engine_num * len(d.participants), d
            offsets = [1 + engine_num * i for i in range(len(d.participants))]
            assert [p.rank_offset for p in d.participants] == offsets, d
        # fixed / explorer_driven: every explorer waits at its boundaries; trainer_driven: both
        # explore until the trainer has finished. Either way both meet the trainer.
        full = [d for d in readies if {p.member.id for p in d.participants} == {"explorer-0", "explorer-1"}]
        assert full, [d.participants for d in readies]
        versions = [b.version for b in broadcasts]
        assert versions == sorted(set(versions)) and versions[-1] == s["final_version"], versions
    else:
        published = [r.event.version for r in of_kind(run.records, VersionPublished)]
        assert published and published == sorted(set(published)), published
        assert published[-1] == s["final_version"]
    if style == "explorer_driven":
        # the explorers drive: every round is an explorer's request
        assert opened and all(d.opened_by.role is Role.EXPLORER for d in opened), opened
    if style == "fixed" and method != "nccl":
        # pull + fixed: an explorer at its boundary waits for a version newer than its own
        released = [r.event for r in of_kind(run.records, MemberReleased)]
        assert any(d.reason.value == "new_version" and d.reload for d in released), released


NCCL_ROWS = ["fixed", "explorer_driven", "trainer_driven"]
PULL_ROWS = [(style, method) for method in ("memory", "checkpoint")
             for style in ("fixed", "trainer_driven", "explorer_driven", "fully_async")]


@pytest.mark.parametrize("style", NCCL_ROWS)
def test_nccl_gloo_two_explorers_two_ranks(tmp_path, style):
    explorers = {"engine_num": 2}
    if style == "trainer_driven":
        # An explorer joins only a round the trainer opened, so explorers with a fixed number of
        # steps may all finish before a trainer that is slow to start ever waits (then no version
        # moves). Explorers that explore until the trainer has finished cannot miss its rounds,
        # whatever the relative speed of the processes.
        # They pause between steps (a sleep, not a synchronisation: it only keeps explorers that
        # explore for as long as the trainer trains from starving it of CPU on a loaded machine).
        explorers.update(total_steps=100_000, stop_with_trainer=True, step_delay_s=[0.3, 0.4])
    config = job_config(
        tmp_path, job=f"e2e-nccl-{style.replace('_', '-')}",
        synchronizer={"sync_method": "nccl", "sync_style": style},
        explorers=explorers,
        trainer={"total_steps": TOTAL_STEPS},
    )
    run = run_up(config, tmp_path, timeout=300)  # a bound on "hung", not on speed
    _check_run(run, method="nccl", style=style, engine_num=2)


@pytest.mark.parametrize(("style", "method"), PULL_ROWS)
def test_pull_methods(tmp_path, style, method):
    config = job_config(
        tmp_path, job=f"e2e-{method}-{style.replace('_', '-')}",
        synchronizer={"sync_method": method, "sync_style": style},
        trainer={"total_steps": TOTAL_STEPS},
    )
    run = run_up(config, tmp_path, timeout=300)  # a bound on "hung", not on speed
    _check_run(run, method=method, style=style, engine_num=1)
