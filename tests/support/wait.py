"""One bounded wait for a condition: check it until it holds, or fail naming what was awaited.

Tests never sleep to synchronise: they wait for a condition with a bound. Between checks the wait
either sleeps `poll` seconds (a condition nobody signals: a process's exit, an HTTP endpoint, the
kernel's view of a process) or waits for a signal that something changed (`changed`: an
`asyncio.Condition` notified on every change, or a coroutine function that returns after the next
change), so a condition that is signalled is re-checked at once and never polled.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["wait_until", "wait_until_sync"]

T = TypeVar("T")


def _failure(what: str, timeout: float, details: Callable[[], str] | None) -> AssertionError:
    extra = details() if details is not None else ""
    return AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"\n{extra}" if extra else ""))


async def wait_until(condition: Callable[[], T | Awaitable[T]], *, timeout: float, what: str,
                     poll: float = 0.1,
                     changed: asyncio.Condition | Callable[[], Awaitable[Any]] | None = None,
                     details: Callable[[], str] | None = None) -> T:
    """Return `condition()`'s first truthy value (a coroutine function is awaited), re-checked after
    every `changed` signal, or every `poll` seconds without one. After `timeout` seconds raise
    AssertionError("timed out after ... waiting for `what`") with `details()` appended (logs, state).
    An exception the condition raises (an assertion that fails at once) ends the wait."""

    async def check() -> T:
        value = condition()
        return await value if inspect.isawaitable(value) else value

    async def checked_under(cond: asyncio.Condition) -> T:
        async with cond:  # checked under the lock: a change cannot slip between a check and the wait
            while not (value := await check()):
                await cond.wait()
            return value

    async def checked() -> T:
        while not (value := await check()):
            if changed is None:
                await asyncio.sleep(poll)  # a poll interval bounded by the timeout, not a synchronisation
            else:
                await changed()
        return value

    try:
        if isinstance(changed, asyncio.Condition):
            return await asyncio.wait_for(checked_under(changed), timeout)
        return await asyncio.wait_for(checked(), timeout)
    except asyncio.TimeoutError:
        raise _failure(what, timeout, details) from None


def wait_until_sync(condition: Callable[[], T], *, timeout: float, what: str, poll: float = 0.1,
                    details: Callable[[], str] | None = None) -> T:
    """`wait_until` for code outside an event loop (fixtures that start processes): polls every
    `poll` seconds, checks once more at the deadline, then raises the same AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise _failure(what, timeout, details)
        time.sleep(min(poll, left))  # a poll interval bounded by the deadline, not a synchronisation
