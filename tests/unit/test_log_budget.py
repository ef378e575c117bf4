"""bus.logging.LogBudget: the first warnings in full, then one summary line per interval."""

from __future__ import annotations

from rolectl.bus.logging import LogBudget


class _Recorder:
    def __init__(self):
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **fields):
        self.lines.append((event, fields))


def test_first_burst_in_full_then_one_summary_per_interval():
    now = [0.0]
    log = _Recorder()
    budget = LogBudget(log, "bus.thing_rejected", burst=3, interval_s=10.0, clock=lambda: now[0])

    for i in range(1000):
        budget.warn(n=i)
    assert [e for e, _ in log.lines] == ["bus.thing_rejected"] * 3
    now[0] = 10.0
    budget.warn(n=1000)
    now[0] = 15.0
    budget.warn(n=1001)  # within the interval: counted, not logged

    assert budget.count == 1002
    assert len(log.lines) == 4
    event, fields = log.lines[3]
    assert event == "bus.thing_rejected_suppressed"
    assert fields["suppressed"] == 998 and fields["total"] == 1001 and fields["latest"] == {"n": 1000}
    assert budget.suppressed == 1
