"""What the dashboard shows of one fold: its /metrics samples and its snapshot, for unit tests."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rolectl.roles.observe.dashboard import Dashboard
from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.observe.prometheus import JobCollector

JOB = (("job", "demo"),)
"""The labels of a job-wide sample of `exported`'s dashboard."""


def exported(observer: JobObserver) -> tuple[Dashboard, dict]:
    """A dashboard of job "demo" over `observer`, and what /metrics serves: (name, labels) -> value."""
    dashboard = Dashboard(job="demo", nats_url="nats://127.0.0.1:4222", monitor_url=None)
    dashboard.observer = observer
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(dashboard))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
               for s in family.samples}
    return dashboard, samples
