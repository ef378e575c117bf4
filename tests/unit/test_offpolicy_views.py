"""What the one fold shows of async RL's off-policy side: explorers paced by the trainer
(`synchronizer.max_ahead`: paused members, pauses counted) and the rollout/trainer logprob gap
(`algorithm.rollout_correction`: the mismatch alarm counted, flagged), in the summary, `rolectl
status`'s views and the dashboard's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rolectl.roles.observe.dashboard import Dashboard
from rolectl.roles.observe.observer import MISMATCH_ALARM, JobObserver, mismatch_view, pace_view
from rolectl.roles.observe.prometheus import JobCollector
from rolectl.sync_protocol import JobConfigured, Recorded, StepFinished, StepsRolledBack, SyncConfig, SyncMethod
from tests.support.reducer_scenario import E1, E2, Job, T, join

PACED = SyncConfig(sync_method=SyncMethod.MEMORY, max_ahead=0)
CONFIG = SyncConfig(sync_method=SyncMethod.MEMORY)


def _exported(dashboard: Dashboard, observer: JobObserver) -> dict:
    """What /metrics serves for `observer`'s fold: (name, sorted labels) -> value."""
    dashboard.observer = observer
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(dashboard))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect() for s in family.samples}

def _records(*events) -> list[Recorded]:
    """The events as the synchronizer records them: each input, then the decisions it caused."""
    job, records = Job(), []
    for event in events:
        decisions = job.feed(event)
        records.append(job.history[-1])
        for d in decisions:
            job.seq += 1
            records.append(Recorded(seq=job.seq, time_ms=job.time_ms, event=d))
    return records


def _records_after(observer: JobObserver, *events) -> list[Recorded]:
    seq = observer.state.last_seq
    return [Recorded(seq=seq + i + 1, time_ms=0, event=e) for i, e in enumerate(events)]


def _explorer_step(ref, step: int, tasks: int) -> StepFinished:
    return StepFinished(member=ref, step=step, version=0, metrics={"experiences": 8.0}, tasks=tasks)


def test_paused_explorers_show_as_paused_and_their_pauses_are_counted():
    events = (JobConfigured(member=T, config=PACED, train_batch_tasks=2), join(T), join(E1), join(E2),
              _explorer_step(E1, 1, tasks=2), _explorer_step(E2, 1, tasks=2))
    observer = JobObserver().extend(_records(*events))
    rows = {row["id"]: row["status"] for row in observer.members()}
    assert rows == {"t": "running", "e1": "paused", "e2": "paused"}
    assert observer.summary(job="j")["explorer_pauses"] == 2
    assert pace_view(observer) == {"paused": ["explorer/e1", "explorer/e2"], "pauses": 2, "produced": 4,
                                   "consumed": 0, "limit": 2}
    # the trainer took them: both explore again, in one decision
    observer.extend(_records_after(observer, StepFinished(member=T, step=1, version=0, tasks=4)))
    assert {row["status"] for row in observer.members()} == {"running"}
    assert pace_view(observer)["paused"] == [] and observer.summary(job="j")["explorer_pauses"] == 2


def test_an_unbounded_job_pauses_nobody():
    observer = JobObserver().extend(_records(
        JobConfigured(member=T, config=SyncConfig(sync_method=SyncMethod.MEMORY)), join(T), join(E1),
        StepFinished(member=E1, step=1, version=0, metrics={"experiences": 8.0})))
    assert pace_view(observer) == {"paused": [], "pauses": 0, "produced": 0, "consumed": 0, "limit": None}
    assert {row["status"] for row in observer.members()} == {"running"}


def test_metrics_export_the_paused_explorers_and_the_pauses():
    dashboard = Dashboard(job="demo", nats_url="nats://127.0.0.1:4222", monitor_url=None)
    samples = _exported(dashboard, JobObserver().extend(_records(
        JobConfigured(member=T, config=PACED, train_batch_tasks=2), join(T), join(E1), _explorer_step(E1, 1, tasks=2))))
    job = (("job", "demo"),)
    assert samples[("rolectl_explorers_paused", job)] == 1
    assert samples[("rolectl_explorer_pauses_total", job)] == 1
    assert samples[("rolectl_member_status", (("job", "demo"), ("member", "e1"), ("role", "explorer"),
                                              ("status", "paused")))] == 1
    assert dashboard.snapshot()["pace"]["paused"] == ["explorer/e1"]


def _trainer_step(step: int, k3_kl: float, gap: float, alarm: bool) -> StepFinished:
    return StepFinished(member=T, step=step, version=step - 1, metrics={
        "num_experiences": 8.0, "rollout_corr/k3_kl": k3_kl, "rollout_corr/log_gap_max": gap,
        MISMATCH_ALARM: 1.0 if alarm else 0.0})


def test_steps_past_the_alarm_are_counted_and_flagged():
    observer = JobObserver().extend(_records(
        JobConfigured(member=T, config=CONFIG), join(T), join(E1),
        _trainer_step(1, 2.5, 7.0, True), _trainer_step(2, 0.001, 0.1, False), _trainer_step(3, 3.0, 9.0, True)))
    assert observer.summary(job="j")["mismatch_alarms"] == 2
    assert mismatch_view(observer) == {"step": 3, "alarm": True, "alarms": 2, "k3_kl": 3.0, "log_gap_max": 9.0}
    # a step trained again after a restart counts by its training that stands
    seq = observer.state.last_seq
    observer.extend([Recorded(seq=seq + 1, time_ms=0, event=StepsRolledBack(member=T, from_step=3, to_step=2)),
                     Recorded(seq=seq + 2, time_ms=0, event=_trainer_step(3, 0.002, 0.2, False))])
    assert observer.summary(job="j")["mismatch_alarms"] == 1 and not mismatch_view(observer)["alarm"]


def test_a_job_without_the_correction_shows_no_gap_and_no_alarm():
    observer = JobObserver().extend(_records(
        JobConfigured(member=T, config=CONFIG), join(T),
        StepFinished(member=T, step=1, version=0, metrics={"num_experiences": 8.0})))
    assert observer.summary(job="j")["mismatch_alarms"] == 0
    assert mismatch_view(observer) == {"step": 1, "alarm": False, "alarms": 0, "k3_kl": None, "log_gap_max": None}


def test_metrics_export_the_gap_and_its_alarm():
    dashboard = Dashboard(job="demo", nats_url="nats://127.0.0.1:4222", monitor_url=None)
    samples = _exported(dashboard, JobObserver().extend(_records(
        JobConfigured(member=T, config=CONFIG), join(T), _trainer_step(1, 2.5, 7.0, True))))
    job = (("job", "demo"),)
    assert samples[("rolectl_trainer_rollout_k3_kl", job)] == 2.5
    assert samples[("rolectl_trainer_rollout_log_gap_max", job)] == 7.0
    assert samples[("rolectl_trainer_mismatch_alarm", job)] == 1
    assert samples[("rolectl_trainer_mismatch_alarms_total", job)] == 1
    assert dashboard.snapshot()["mismatch"]["alarm"] is True


def test_partial_rollout_pauses_are_summed_once_per_explorer_step():
    """Each explorer step's weight loads inside its rollout add up in the summary; a step reported
    again (an explorer restarted after reporting, before saving) counts once, by its new figure."""
    def step(ref, n: int, pauses: int, resumed: int) -> StepFinished:
        return StepFinished(member=ref, step=n, version=0,
                            metrics={"experiences": 8.0, "partial_rollout_pauses": float(pauses),
                                     "partial_rollout_experiences": float(resumed)})

    events = (JobConfigured(member=T, config=CONFIG, train_batch_tasks=2), join(T), join(E1), join(E2),
              step(E1, 1, pauses=2, resumed=5), step(E2, 1, pauses=1, resumed=3), step(E1, 1, pauses=1, resumed=4))
    summary = JobObserver().extend(_records(*events)).summary(job="j")
    assert (summary["partial_rollout_pauses"], summary["partial_rollout_experiences"]) == (2, 7), summary
    assert JobObserver().extend(_records(*events[:4])).summary(job="j")["partial_rollout_pauses"] == 0
