"""How a role's asyncio work stops: a task cancelled for sure, a unit finished before the stop,
and Ctrl-C / SIGTERM turned into a cancel of the role's main task."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["stop_task", "finish_before_stopping", "install_stop_signals"]


async def stop_task(task: asyncio.Task, *, log=None, poll_s: float = 0.5) -> None:
    """Cancel `task` and wait until it has ended, cancelling again if a cancellation was lost.

    Before Python 3.12, `asyncio.wait_for` returns the result instead of raising CancelledError
    when the awaited future completes in the same loop iteration as the cancellation (nats-py's
    `next_msg` awaits `wait_for(queue.get())`); the task then goes on as if never cancelled, and a
    plain `task.cancel(); await task` waits for ever (a role that finished but never exits).
    """
    attempts = 0
    while not task.done():
        task.cancel()
        attempts += 1
        await asyncio.wait({task}, timeout=poll_s)
    if attempts > 1 and log is not None:
        log.info("task_cancel_repeated", task=task.get_name(), attempts=attempts)
    if not task.cancelled() and task.exception() is not None and log is not None:
        log.debug("task_ended_with_error", task=task.get_name(), error=str(task.exception()))


async def finish_before_stopping(work: Awaitable[T], *, log, what: str,
                                 unless: Callable[[], bool] | None = None) -> T:
    """Await `work` to its end even when the role is told to stop meanwhile (Ctrl-C, SIGTERM: a
    cancel), then stop: for a unit that must not be cut in two (a batch published whose step is
    never reported; a step trained but never saved nor reported). Bounded by the unit itself.
    When `unless()` holds at the stop (the member was replaced: its successor owns the work), the
    unit is cancelled instead, as any other await would be."""
    task = asyncio.ensure_future(work)
    stop_requested = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise  # the unit itself was cancelled: nothing is left to finish
            if unless is not None and unless():
                task.cancel()
                raise
            if not stop_requested:
                log.info("stopping_after_unit_in_flight", unit=what)
            stop_requested = True
    if stop_requested:
        raise asyncio.CancelledError
    return result


def install_stop_signals(task: asyncio.Task) -> None:
    """SIGINT/SIGTERM cancel the role's main task, so its cleanup publishes STOPPED."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, task.cancel)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
