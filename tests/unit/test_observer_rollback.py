"""A trainer that resumed from a checkpoint older than the steps it had reported trains them again:
its `StepsRolledBack` record makes every fold count each step once, by the training that stands
(the reward curve, the summary's counts, `up`'s progress), and the trackers mark where it went back.
And a trainer stopped by a signal: its STOPPED says so, and the summary's end_reason says
"interrupted", not "stopped before its last step"."""

from __future__ import annotations

from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.observe.trackers import Trackers
from rolectl.sync_protocol import Recorded, RunningStatus, StatusChanged, StepsRolledBack, SyncConfig, SyncMethod
from tests.support.reducer_scenario import T_AGAIN, T, configured, join, step_done


def _records(*events) -> list[Recorded]:
    return [Recorded(seq=i, time_ms=1_000 + i, event=e) for i, e in enumerate(events, start=1)]


def _trained(ref, step: int, reward: float):
    return step_done(ref, step, step, reward_mean=reward, num_experiences=8.0)


def _killed_at_5_resumed_at_3(*retrained: int) -> list[Recorded]:
    """Steps 1..5 reported, kill -9 (last checkpoint: step 3), a restart at 3 trains `retrained`."""
    return _records(
        configured(SyncConfig(sync_method=SyncMethod.MEMORY)), join(T),
        *(_trained(T, s, 0.1 * s) for s in range(1, 6)),
        join(T_AGAIN, step=3, version=3),
        StepsRolledBack(member=T_AGAIN, from_step=5, to_step=3),
        *(_trained(T_AGAIN, s, 0.5 + 0.1 * s) for s in retrained),
    )


def test_steps_trained_again_are_counted_once_by_their_new_figures():
    view = JobObserver().extend(_killed_at_5_resumed_at_3(4, 5, 6))
    assert [(step, round(r, 2)) for step, r, _ in view.reward] == [
        (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.9), (5, 1.0), (6, 1.1)]
    summary = view.summary(job="j")
    assert summary["trainer_steps"] == 6
    assert summary["experiences_trained"] == 6 * 8
    assert summary["reward_first"] == round((0.1 + 0.2 + 0.3 + 0.9 + 1.0) / 5, 4)


def test_steps_rolled_back_and_not_trained_again_stop_counting():
    records = _killed_at_5_resumed_at_3(4)  # the restart trained step 4, then the job ended
    view = JobObserver().extend(records[:-1])
    assert view.trainer_steps == 3  # the progress goes back with the trainer
    view.apply(records[-1])
    assert view.trainer_steps == 4
    assert view.summary(job="j")["experiences_trained"] == 4 * 8
    assert [step for step, _, _ in view.reward] == [1, 2, 3, 4]


class _Kept:
    """A tracker that keeps what it is given (the Tracker protocol, no library behind it)."""

    name = "kept"

    def __init__(self) -> None:
        self.points: list[tuple[str, float, int]] = []

    def log_params(self, params) -> None:
        pass

    def log_metrics(self, metrics, *, step: int, axis: str) -> None:
        self.points.extend((key, value, step) for key, value in metrics.items())

    def close(self) -> None:
        pass


def test_trackers_mark_where_the_trainer_went_back():
    kept = _Kept()
    trackers = Trackers([kept])
    for rec in _killed_at_5_resumed_at_3(4, 5):
        trackers.apply(rec)
    assert ("trainer/rolled_back_from_step", 5.0, 3) in kept.points
    assert [step for key, _, step in kept.points if key == "trainer/reward_mean"] == [1, 2, 3, 4, 5, 4, 5]


def _stopped(interrupted: bool) -> StatusChanged:
    return StatusChanged(member=T, status=RunningStatus.STOPPED, step=2, version=2, interrupted=interrupted)


def test_a_trainer_stopped_by_a_signal_ends_the_job_interrupted():
    base = (configured(SyncConfig(sync_method=SyncMethod.MEMORY)), join(T), _trained(T, 1, 0.1),
            _trained(T, 2, 0.2))
    interrupted = JobObserver().extend(_records(*base, _stopped(True))).summary(job="j")
    assert not interrupted["complete"]
    assert interrupted["end_reason"].startswith("interrupted"), interrupted["end_reason"]
    assert "after step 2" in interrupted["end_reason"]
    stopped = JobObserver().extend(_records(*base, _stopped(False))).summary(job="j")
    assert stopped["end_reason"].startswith("the trainer stopped before its last step"), stopped["end_reason"]


def test_a_synchronizer_row_says_what_was_decided_not_step_0_version_0():
    from rolectl.roles.observe.views import progress_text, version_text
    from rolectl.sync_protocol import RoundClosed, RoundOpened, RoundOutcome
    from tests.support.reducer_scenario import E1, SYNC

    opened = RoundOpened(round=4, cause_seq=3, method=SyncMethod.MEMORY, opened_by=E1, version=0, opened_at_ms=1)
    records = _records(configured(SyncConfig(sync_method=SyncMethod.MEMORY)), join(SYNC), join(E1), opened,
                       RoundClosed(round=4, cause_seq=3, outcome=RoundOutcome.ABANDONED))
    rows = {row["id"]: row for row in JobObserver().extend(records[:3]).members()}
    assert (progress_text(rows["sync"]), version_text(rows["sync"])) == ("—", "—")
    rows = {row["id"]: row for row in JobObserver().extend(records).members()}
    assert (progress_text(rows["sync"]), version_text(rows["sync"])) == ("2 decisions, round 4", "—")
    assert (progress_text(rows["e1"]), version_text(rows["e1"])) == ("0", "-1")
