"""`tests.support.wait`: the one bounded wait the tests share returns the first truthy value, wakes on a
signalled change, ends at once on a failing check, and fails naming what it waited for."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.wait import wait_until, wait_until_sync


async def test_the_wait_returns_the_first_truthy_value():
    values = iter([0, None, "", [], 7, 8])
    assert await wait_until(lambda: next(values), timeout=30, what="a value", poll=0.001) == 7


async def test_a_coroutine_condition_is_awaited():
    async def ready() -> str:
        return "yes"

    assert await wait_until(ready, timeout=30, what="ready") == "yes"


async def test_a_wait_that_times_out_names_what_it_waited_for_and_the_details():
    with pytest.raises(AssertionError, match=r"^timed out after 0.05 s waiting for the moon\nsky: dark$"):
        await wait_until(lambda: False, timeout=0.05, what="the moon", poll=0.01, details=lambda: "sky: dark")


async def test_a_failing_check_ends_the_wait_at_once():
    def exited() -> bool:
        raise AssertionError("the process exited with 3")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="the process exited with 3"):
        await wait_until(exited, timeout=60, what="a process")
    assert time.monotonic() - started < 30


async def test_a_notified_condition_is_checked_again_at_once_without_polling():
    changed = asyncio.Condition()
    box: list[int] = []
    waiter = asyncio.create_task(wait_until(lambda: box, timeout=30, what="the box", changed=changed))
    await asyncio.sleep(0)  # let the waiter check once and wait on the condition
    assert not waiter.done()
    async with changed:
        box.append(1)
        changed.notify_all()
    assert await waiter == [1]


async def test_a_change_callback_is_awaited_between_checks():
    seen = []

    async def next_change() -> None:
        seen.append(len(seen))

    assert await wait_until(lambda: len(seen) >= 3 and seen, timeout=30, what="3 changes",
                            changed=next_change) == [0, 1, 2]


def test_the_sync_wait_polls_until_the_deadline_then_fails():
    calls: list[int] = []
    with pytest.raises(AssertionError, match=r"^timed out after 0.05 s waiting for never$"):
        wait_until_sync(lambda: calls.append(1), timeout=0.05, what="never", poll=0.01)
    assert len(calls) >= 2  # checked more than once, the last time at the deadline
    assert wait_until_sync(lambda: "up", timeout=30, what="up") == "up"
