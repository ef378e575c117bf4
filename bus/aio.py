"""asyncio helpers the bus needs on every supported Python."""

from __future__ import annotations

import asyncio
import sys

__all__ = ["raise_if_cancelling"]


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that `asyncio.wait_for` (inside nats-py's fetch) swallowed.

    On Python 3.11, wait_for drops a cancel that lands while its inner future completes
    (gh-86296, fixed in 3.12); the task would then keep reading and never stop. The task still
    counts the cancel request, so honour it here.
    """
    if sys.version_info < (3, 11):
        return  # Task.cancelling() is new in 3.11: nothing to read before it
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
