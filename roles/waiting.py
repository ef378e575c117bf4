"""Waits that say so: a wait that lasts logs once what it waits for and since when, then at a
slowing interval, and how long it took once it is over (no role waits in silence)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime, timezone

__all__ = ["WaitNotice", "notice_delays"]

FIRST_S = 5.0  # a wait shorter than this is not worth a line
FACTOR = 2.0  # each further line comes this many times later than the one before
CAP_S = 300.0  # ... but at least every 5 minutes


def notice_delays(first_s: float = FIRST_S, factor: float = FACTOR, cap_s: float = CAP_S):
    """The delays between the lines of one wait: first_s, then growing by `factor` up to `cap_s`."""
    delay = first_s
    while True:
        yield delay
        delay = min(delay * factor, cap_s)


class WaitNotice:
    """`with WaitNotice(log, "a sync decision"):` around a wait (inside a running event loop).

    `detail()` (optional) is asked at each line for what is known now (who is missing...)."""

    def __init__(self, log, what: str, *, detail: Callable[[], str | None] | None = None,
                 first_s: float = FIRST_S, factor: float = FACTOR, cap_s: float = CAP_S, **fields):
        self._log = log
        self.what = what
        self._detail = detail
        self._fields = fields
        self._delays = notice_delays(first_s, factor, cap_s)
        self._handle: asyncio.TimerHandle | None = None
        self._started = 0.0
        self._since = ""
        self.lines = 0  # how many "still_waiting" lines it logged

    def __enter__(self) -> WaitNotice:
        self._started = time.monotonic()
        self._since = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._handle = asyncio.get_running_loop().call_later(next(self._delays), self._say)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self.lines:
            self._log.info("wait_over", waiting_for=self.what, waited_s=round(time.monotonic() - self._started, 1),
                           **self._fields)

    def _say(self) -> None:
        extra = {}
        if self._detail is not None:
            try:
                detail = self._detail()
            except Exception as exc:  # a detail must never break the wait it describes
                detail = f"(detail unavailable: {exc})"
            if detail:
                extra["detail"] = detail
        self._log.info("still_waiting", waiting_for=self.what, since=self._since,
                       waited_s=round(time.monotonic() - self._started, 1), **self._fields, **extra)
        self.lines += 1
        self._handle = asyncio.get_running_loop().call_later(next(self._delays), self._say)
