"""Serve mode in the job's one fold: the serving explorers' counts reach the summary and the dashboard."""

from __future__ import annotations

from rolectl.roles.observe.observer import JobObserver
from rolectl.sync_protocol import MemberJoined, MemberRef, Recorded, Role, StepFinished


def _records(counts_by_incarnation):
    records, seq = [], 0
    for inc, steps in counts_by_incarnation.items():
        ref = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=inc)
        seq += 1
        records.append(Recorded(seq=seq, time_ms=seq * 1000, event=MemberJoined(member=ref, host="h", pid=1, step=0,
                                                                                 version=0)))
        for step, (served, rewarded, expired) in enumerate(steps, start=1):
            seq += 1
            metrics = {"served_requests": float(served), "rewarded": float(rewarded), "expired": float(expired),
                       "experiences": 4.0}
            records.append(Recorded(seq=seq, time_ms=seq * 1000,
                                    event=StepFinished(member=ref, step=step, version=0, metrics=metrics)))
    return records


def test_served_counts_add_up_over_incarnations_in_the_summary_and_the_dashboard():
    observer = JobObserver()
    # a restarted explorer counts from zero again: its counts add to its predecessor's last ones
    for rec in _records({1: [(4, 2, 0), (10, 4, 1)], 2: [(6, 3, 0)]}):
        observer.apply(rec)
    summary = observer.summary(job="j")
    assert (summary["served_requests"], summary["rewarded"], summary["expired"]) == (16, 7, 1)
    view = observer.served_view()
    assert view["served_requests"] == 16 and view["per_s"] is not None and view["per_s"] > 0


def test_a_job_that_serves_nothing_has_no_serve_figures():
    observer = JobObserver()
    for rec in _records({1: []}):
        observer.apply(rec)
    assert "served_requests" not in observer.summary(job="j") and observer.served_view() is None
