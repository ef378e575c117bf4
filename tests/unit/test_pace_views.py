"""What the one fold shows of explorers paced by the trainer (`synchronizer.max_ahead`): members
paused, pauses counted in the summary, `rolectl status`'s view and the dashboard's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rolectl.roles.observe.dashboard import Dashboard, _Collector
from rolectl.roles.observe.observer import JobObserver, pace_view
from rolectl.sync_protocol import JobConfigured, Recorded, StepFinished, SyncConfig, SyncMethod
from tests.support.reducer_scenario import E1, E2, Job, T, join

PACED = SyncConfig(sync_method=SyncMethod.MEMORY, max_ahead=0)


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
    dashboard.observer = JobObserver().extend(_records(
        JobConfigured(member=T, config=PACED, train_batch_tasks=2), join(T), join(E1), _explorer_step(E1, 1, tasks=2)))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(dashboard))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in registry.collect() for s in family.samples}
    job = (("job", "demo"),)
    assert samples[("rolectl_explorers_paused", job)] == 1
    assert samples[("rolectl_explorer_pauses_total", job)] == 1
    assert samples[("rolectl_member_status", (("job", "demo"), ("member", "e1"), ("role", "explorer"),
                                              ("status", "paused")))] == 1
    assert dashboard.snapshot()["pace"]["paused"] == ["explorer/e1"]
