"""The bound on how far explorers run ahead of the trainer (`max_ahead`): who is paused, when every
paused explorer resumes, and what is recorded, fed one input at a time."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import (
    ExplorerPaused,
    ExplorersResumed,
    IllegalEvent,
    JobConfigured,
    MemberRef,
    Recorded,
    ResumeReason,
    Role,
    State,
    StepFinished,
    SyncConfig,
    SyncMethod,
    SyncStyle,
    TasksTaken,
    decode,
    encode,
    fold,
    reduce,
)
from rolectl.sync_protocol.reducer import PACE_TRANSITIONS, Pace, PaceTrigger
from rolectl.sync_protocol.snapshot import decode_state, encode_state
from tests.support.reducer_scenario import E1, E1_AGAIN, E2, T_AGAIN, T, expired, finish, join, stop

BOUNDED = SyncConfig(sync_method=SyncMethod.MEMORY, sync_style=SyncStyle.FULLY_ASYNC, max_ahead=1)


class _Job:
    """A fold fed one input at a time, keeping every decision."""

    def __init__(self) -> None:
        self.state = State.initial()
        self.seq = 0
        self.decisions: list = []

    def feed(self, event) -> tuple:
        self.seq += 1
        self.state, caused = reduce(self.state, Recorded(seq=self.seq, time_ms=1000 * self.seq, event=event))
        for d in caused:
            assert d.cause_seq == self.seq and decode(encode(d)) == d
        self.decisions.extend(caused)
        return caused


def _started(config: SyncConfig = BOUNDED, unit: int | None = 4) -> _Job:
    job = _Job()
    job.feed(JobConfigured(member=T, config=config, train_batch_tasks=unit))
    for ref in (T, E1, E2):
        job.feed(join(ref))
    return job


def _step(ref, step: int, tasks: int) -> StepFinished:
    return StepFinished(member=ref, step=step, version=0, tasks=tasks)


def test_an_explorer_whose_step_reaches_the_bound_is_paused():
    job = _started()  # bound: (1 + 1) x 4 = 8 tasks past the trainer's
    assert job.feed(_step(E1, 1, 4)) == ()
    (paused,) = job.feed(_step(E1, 2, 8))
    assert paused == ExplorerPaused(round=0, cause_seq=job.seq, explorer=E1, step=2, produced=8, consumed=0,
                                    limit=8)
    assert job.state.paused == ("explorer/e1",) and job.state.explorer_pauses == 1


def test_the_bound_counts_every_explorers_tasks():
    job = _started()
    assert job.feed(_step(E1, 1, 4)) == ()
    (paused,) = job.feed(_step(E2, 1, 4))  # 4 + 4: the fleet, not one explorer, is 8 ahead
    assert paused.explorer == E2 and paused.produced == 8
    # e1 is not paused until its own next step says so: it may be mid-step now
    assert job.state.paused == ("explorer/e2",)
    (again,) = job.feed(_step(E1, 2, 8))
    assert again.explorer == E1 and again.produced == 12
    assert job.state.paused == ("explorer/e2", "explorer/e1")


def test_the_trainer_catching_up_resumes_every_paused_explorer_in_one_decision():
    job = _started()
    job.feed(_step(E1, 1, 4))
    job.feed(_step(E2, 1, 4))
    job.feed(_step(E1, 2, 8))
    assert job.feed(_step(T, 1, 4)) == ()  # 12 - 4 = 8: still at the bound
    (resumed,) = job.feed(_step(T, 2, 8))
    assert resumed == ExplorersResumed(round=0, cause_seq=job.seq, reason=ResumeReason.CAUGHT_UP, paused=2,
                                       produced=12, consumed=8)
    assert job.state.paused == ()


def test_filtered_and_dropped_tasks_count_as_taken():
    # the trainer reports what it took off the stream, trained or not: 12 taken for one step
    job = _started()
    job.feed(_step(E1, 1, 8))
    assert job.state.paused == ("explorer/e1",)
    (resumed,) = job.feed(_step(T, 1, 12))
    assert resumed.consumed == 12 and job.state.paused == ()


def test_a_trainer_dropping_while_it_fills_a_step_resumes_the_paused():
    # its next step needs 4 fresh tasks; the 8 it took were stale: without TasksTaken the explorers
    # would wait for its step and its step for them
    job = _started()
    job.feed(_step(E1, 1, 8))
    (resumed,) = job.feed(TasksTaken(member=T, tasks=8))
    assert resumed.reason is ResumeReason.CAUGHT_UP and resumed.consumed == 8 and job.state.tasks_consumed == 8
    with pytest.raises(IllegalEvent, match="trainer"):
        job.feed(TasksTaken(member=E1, tasks=8))
    with pytest.raises(IllegalEvent, match="never negative"):
        job.feed(TasksTaken(member=T, tasks=-1))


def test_the_trainer_finishing_resumes_the_paused_and_pauses_nobody_after():
    job = _started()
    job.feed(_step(E1, 1, 8))
    (resumed,) = job.feed(finish(T, 0, 0))
    assert resumed.reason is ResumeReason.TRAINER_FINISHED and resumed.paused == 1
    assert job.feed(_step(E2, 1, 40)) == ()


def test_a_trainer_that_stops_early_is_waited_for():
    job = _started()
    job.feed(_step(E1, 1, 8))
    assert job.feed(stop(T, 0, 0)) == ()
    assert job.state.paused == ("explorer/e1",)
    job.feed(join(T_AGAIN))
    (resumed,) = job.feed(_step(T_AGAIN, 1, 4))
    assert resumed.reason is ResumeReason.CAUGHT_UP


def test_a_paused_explorer_that_leaves_is_no_longer_paused():
    job = _started()
    job.feed(_step(E1, 1, 8))
    assert job.feed(expired(E1)) == () and job.state.paused == ()
    assert job.state.tasks_produced == 8  # what it produced stays produced


def test_an_explorer_that_joins_while_the_explorers_are_ahead_is_paused_and_keeps_its_tasks():
    job = _started()
    job.feed(_step(E1, 1, 8))
    # a restart: the old incarnation leaves (its pause with it), the new one is paused at once, so a
    # crashing explorer cannot run one step further each time it comes back
    (paused,) = job.feed(join(E1_AGAIN, step=1))
    assert paused.explorer == E1_AGAIN and paused.step == 1 and paused.produced == 8
    assert job.state.paused == ("explorer/e1",) and job.state.member(E1_AGAIN).tasks == 8
    job.feed(_step(T, 1, 4))
    assert job.state.paused == ()
    assert job.feed(join(MemberRef(role=Role.EXPLORER, id="e9", incarnation=0))) == ()  # below the bound


def test_a_reported_step_again_counts_its_tasks_once():
    job = _started()
    job.feed(_step(E1, 1, 4))
    job.feed(_step(E1, 1, 4))  # the same step reported again after a restart: a total, not an increment
    assert job.state.tasks_produced == 4 and job.state.paused == ()


def test_without_a_bound_or_its_unit_nothing_is_decided_but_tasks_are_counted():
    unbounded = _started(config=SyncConfig(sync_method=SyncMethod.MEMORY, sync_style=SyncStyle.FULLY_ASYNC))
    no_unit = _started(unit=None)
    for job in (unbounded, no_unit):
        assert job.feed(_step(E1, 1, 100)) == ()
        assert job.state.tasks_produced == 100 and job.state.ahead_limit() is None


def test_steps_before_the_config_decide_nothing():
    job = _Job()
    for ref in (T, E1):
        job.feed(join(ref))
    assert job.feed(_step(E1, 1, 100)) == ()
    job.feed(JobConfigured(member=T, config=BOUNDED, train_batch_tasks=4))
    assert job.decisions == [] and job.state.tasks_produced == 100


def test_a_steps_report_without_tasks_paces_nothing():
    job = _started()
    assert job.feed(StepFinished(member=E1, step=9, version=0)) == ()
    assert job.state.tasks_produced == 0


@pytest.mark.parametrize("event, why", [
    (JobConfigured(member=E1, config=BOUNDED, train_batch_tasks=5), "the job trains 4 tasks a step"),
    (JobConfigured(member=E1, config=BOUNDED, train_batch_tasks=0), "train_batch_tasks must be at least 1"),
    (StepFinished(member=E1, step=1, version=0, tasks=-1), "a count of tasks is never negative"),
])
def test_inputs_that_break_the_count_are_illegal(event, why):
    job = _started()
    with pytest.raises(IllegalEvent, match=why):
        job.feed(event)


def test_every_pace_row_is_reached_and_the_table_says_so():
    assert set(PACE_TRANSITIONS) == {(Pace.EXPLORING, PaceTrigger.AHEAD), (Pace.PAUSED, PaceTrigger.CAUGHT_UP),
                                     (Pace.PAUSED, PaceTrigger.TRAINER_FINISHED), (Pace.PAUSED, PaceTrigger.LEFT)}


def test_a_snapshot_keeps_the_pace():
    job = _started()
    job.feed(_step(E1, 1, 4))
    job.feed(_step(E2, 1, 4))
    restored, _ = decode_state(encode_state(job.state))
    assert restored == job.state and restored.paused == ("explorer/e2",) and restored.train_batch_tasks == 4
    # the tail folds the same from the restored state as from the original
    tail = [Recorded(seq=job.seq + 1, time_ms=0, event=_step(T, 1, 8))]
    assert fold(tail, restored) == fold(tail, job.state)
