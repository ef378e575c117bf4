"""Every long-lived fold is bounded: a member's `JobView` and a `JobObserver` (dashboard, `up`'s
progress) driven through 10^6 records of a job hold no more after them than after 3 x 10^5 (once
their windows are full), and their counts still cover every record.
Also the summary's experience counts: a step reported again counts once, and drops after the
trainer's last step are counted from its final STOPPED."""

from __future__ import annotations

from collections.abc import Iterator

from rolectl.roles.job_view import DECISIONS_KEPT, JobView
from rolectl.roles.observe.observer import JobObserver, StepCounts
from rolectl.sync_protocol import (
    MemberReleased,
    Recorded,
    RunningStatus,
    State,
    StatusChanged,
    SyncConfig,
    SyncMethod,
    SyncStyle,
)
from rolectl.sync_protocol.reducer import reduce_lenient
from tests.support.reducer_scenario import E1, E2, T, configured, join, loaded, publish, req, run, step_done

RECORDS = 1_000_000


def _job_records() -> Iterator[Recorded]:
    """A two-explorer memory/fixed job for ever: each step the trainer trains and publishes, each
    explorer explores, asks, is released with the new version and loads it (with the decisions
    the reducer takes, recorded as the synchronizer records them)."""
    cfg = SyncConfig(sync_method=SyncMethod.MEMORY, sync_style=SyncStyle.FIXED)
    state, seq, time_ms = State.initial(), 0, 1_000_000

    def record(event) -> list[Recorded]:
        nonlocal state, seq, time_ms
        seq += 1
        time_ms += 10
        rec = Recorded(seq=seq, time_ms=time_ms, event=event)
        state, computed, error = reduce_lenient(state, rec)
        assert error is None, error
        out = [rec]
        if computed:
            seq += 1
            out += [Recorded(seq=seq, time_ms=time_ms, event=d) for d in computed]
        return out

    for member in (T, E1, E2):
        yield from record(configured(cfg, member))
        yield from record(join(member))
    step = 0
    while True:
        step += 1
        yield from record(step_done(T, step, step - 1, num_experiences=8.0, reward_mean=0.5))
        yield from record(publish(step))
        for explorer in (E1, E2):
            yield from record(step_done(explorer, step, step - 1, experiences=4.0))
            yield from record(req(explorer, step, step - 1))
            yield from record(loaded(explorer, step))
            yield from record(run(explorer, step, step))


def test_a_view_and_an_observer_stay_bounded_over_a_million_records():
    view = JobView(conn=None)
    observer = JobObserver()
    # a member that waits for the decision about its request all along: what it has not looked
    # at yet is kept, then forgotten once it has
    waiting = view.first_decision(0, lambda d: d if isinstance(d, MemberReleased) and d.released == E1
                                  and d.version == 3 else None)
    sizes = {}
    answer = None
    for n, rec in enumerate(_job_records(), start=1):
        view.fold(rec)
        observer.apply(rec)
        if answer is None and n % 1000 == 0:
            answer = waiting(view)
            if answer is None:
                assert view._decisions_base == 0  # nothing it has yet to see was dropped
            else:
                del waiting  # answered: the wait is over, its predicate goes
        if n in (300_000, RECORDS):
            sizes[n] = (len(view.decisions) + len(view.joins), observer.size())
        if n == RECORDS:
            break
    assert answer is not None and answer.version == 3
    assert sizes[RECORDS][0] <= 2 * DECISIONS_KEPT + 3, sizes  # decisions kept + one join per member
    assert sizes[RECORDS][1] <= sizes[300_000][1] + 10, sizes  # flat once its windows are full
    # ... and the totals still cover every record
    summary = observer.summary(job="soak")
    steps = summary["trainer_steps"]
    assert steps > 30_000 and observer.records == RECORDS
    assert summary["experiences_trained"] == 8 * steps
    assert summary["experiences_produced"] in range(8 * steps, 8 * (steps + 1) + 1)
    assert summary["sync_wait_ms"]["count"] >= 2 * steps - 2
    assert view.last_seq == observer.state.last_seq


def test_a_step_reported_again_counts_once_with_its_latest_figure():
    counts = StepCounts(window=4)
    for step in range(1, 11):
        counts.add("explorer-0", step, 4)
    counts.add("explorer-0", 10, 4)  # a restart explores its last unsaved step again
    counts.add("explorer-0", 9, 3)  # ... or reports a smaller batch for it
    counts.add("explorer-0", 2, 4)  # older than the window: counted long ago
    counts.add("explorer-1", 1, 4)
    assert counts.total == 10 * 4 - 1 + 4
    assert counts.size() == 4 + 1


def _stopped(step: int, **metrics: float) -> Recorded:
    return Recorded(seq=100, time_ms=1, event=StatusChanged(member=T, status=RunningStatus.STOPPED, step=step,
                                                            version=step, metrics=metrics))


def test_drops_after_the_trainers_last_step_are_counted_from_its_final_stop():
    records = _job_records()
    observer = JobObserver()
    for rec in records:
        observer.apply(rec)
        if rec.seq >= 60:
            break
    before = observer.summary(job="j")["experiences_dropped_stale"]
    stop = _stopped(observer.trainer_steps, dropped_stale_total=float(before + 5))
    observer.apply(Recorded(seq=observer.state.last_seq + 1, time_ms=1, event=stop.event))
    summary = observer.summary(job="j")
    assert summary["experiences_dropped_stale"] == before + 5
    assert summary["experiences_produced"] == (summary["experiences_trained"] + summary["experiences_dropped_stale"]
                                               + summary["experiences_left_untrained"])
