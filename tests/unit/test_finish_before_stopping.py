"""A role's unit that must not be cut in two (publish then report; train then save then report):
a stop request waits for it, then stops the role; a replaced member's stop cuts it at once."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from rolectl.roles.stopping import finish_before_stopping
from tests.support.wait import wait_until

log = structlog.get_logger()


async def _unit(steps: list[str], gate: asyncio.Event) -> str:
    steps.append("published")
    await gate.wait()
    steps.append("reported")
    return "done"


async def test_a_stop_during_the_unit_waits_for_its_end_then_stops():
    steps: list[str] = []
    gate = asyncio.Event()
    role = asyncio.create_task(finish_before_stopping(_unit(steps, gate), log=log, what="a step"))
    await wait_until(lambda: steps == ["published"], timeout=5, poll=0, what="the unit's first half")
    role.cancel()  # Ctrl-C
    role.cancel()  # and again, impatiently
    await asyncio.sleep(0)  # one turn of the loop: the role task takes both cancels
    assert not role.done(), "the unit is half done: the stop must wait"
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(role, timeout=5)
    assert steps == ["published", "reported"]


async def test_without_a_stop_the_result_comes_back():
    gate = asyncio.Event()
    gate.set()
    assert await finish_before_stopping(_unit([], gate), log=log, what="a step") == "done"


async def test_the_units_own_error_is_raised_not_hidden_by_the_stop():
    gate, started = asyncio.Event(), asyncio.Event()

    async def failing():
        started.set()
        await gate.wait()
        raise RuntimeError("the publish failed")

    role = asyncio.create_task(finish_before_stopping(failing(), log=log, what="a step"))
    await asyncio.wait_for(started.wait(), timeout=5)
    role.cancel()
    gate.set()
    with pytest.raises(RuntimeError, match="the publish failed"):
        await asyncio.wait_for(role, timeout=5)


async def test_a_stop_of_a_replaced_member_cancels_the_unit_at_once():
    steps: list[str] = []
    gate = asyncio.Event()
    replaced = True
    role = asyncio.create_task(finish_before_stopping(_unit(steps, gate), log=log, what="a step",
                                                      unless=lambda: replaced))
    await wait_until(lambda: steps == ["published"], timeout=5, poll=0, what="the unit's first half")
    role.cancel()  # the session's fence: a newer incarnation took over
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(role, timeout=5)
    gate.set()
    await asyncio.sleep(0)  # one turn: a unit still running would report now
    assert steps == ["published"], "the successor owns the step: nothing more is reported"
