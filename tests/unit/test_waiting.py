"""`WaitNotice`: a wait that lasts says what it waits for and since when, then less and less often."""

from __future__ import annotations

import asyncio
import itertools

from rolectl.roles.waiting import WaitNotice, notice_delays


def test_delays_grow_to_a_cap():
    assert list(itertools.islice(notice_delays(5.0, 2.0, 30.0), 6)) == [5.0, 10.0, 20.0, 30.0, 30.0, 30.0]


class _Log:
    """Records log calls; wakes the test at the n-th line (no sleeping to synchronise)."""

    def __init__(self, wake_at: int):
        self.lines: list[tuple[str, dict]] = []
        self.enough = asyncio.Event()
        self.wake_at = wake_at

    def info(self, event, **fields):
        self.lines.append((event, fields))
        if len(self.lines) >= self.wake_at:
            self.enough.set()


async def test_a_long_wait_logs_what_since_when_and_slows_down():
    log = _Log(wake_at=3)
    loop = asyncio.get_running_loop()
    with WaitNotice(log, "a sync decision", detail=lambda: "no trainer has joined", first_s=0.02, factor=3.0,
                    cap_s=10.0) as notice:
        started = loop.time()
        await asyncio.wait_for(log.enough.wait(), timeout=10)
        elapsed = loop.time() - started
    events = [e for e, _ in log.lines]
    assert events[:3] == ["still_waiting"] * 3 and events[-1] == "wait_over", events
    first = log.lines[0][1]
    assert first["waiting_for"] == "a sync decision" and first["detail"] == "no trainer has joined"
    assert first["since"].endswith("+00:00")  # a UTC time stamp
    assert elapsed >= 0.02 + 0.06 + 0.18  # the third line came after the slowed-down delays
    assert notice.lines == 3


async def test_a_short_wait_says_nothing():
    log = _Log(wake_at=1)
    with WaitNotice(log, "anything", first_s=5.0):
        await asyncio.sleep(0)  # a wait that is over at once
    assert log.lines == []
