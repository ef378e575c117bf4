"""structlog setup for every rolectl process: one JSON event per line (or console text), with bound
job/role/member context.

Call `setup_logging()` once at process start (the CLI does); library code only calls `get_logger()`
and binds what it knows (job, role, member, version, round). Until `setup_logging()` runs, structlog's
defaults apply, so importing `bus` never reconfigures a host application's logging.
"""

from __future__ import annotations

import enum
import logging as _stdlib_logging
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import Any, TextIO

import structlog

from .security import redact

__all__ = ["setup_logging", "get_logger", "bind_context", "clear_context", "LogBudget"]

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "critical": 50}


def setup_logging(level: str | int = "info", *, json: bool = True, stream: TextIO | None = None) -> None:
    """Configure structlog: events at or above `level` go to `stream` (stderr by default), one per line.

    `json=True` renders each event as one JSON object (for files and log shippers); `json=False`
    renders aligned key=value text for a terminal. Context bound with `bind_context()` (per task,
    via contextvars) and with `logger.bind()` appears in every event.
    """
    if isinstance(level, str):
        try:
            level_no = _LEVELS[level.lower()]
        except KeyError:
            raise ValueError(f"unknown log level {level!r}; use one of {sorted(_LEVELS)}") from None
    else:
        level_no = int(level)
    renderer: Any = (
        structlog.processors.JSONRenderer(sort_keys=False, default=str)
        if json
        else structlog.dev.ConsoleRenderer(colors=False, sort_keys=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            _redact_urls,
            _plain_enums,
            *([] if json else [_lead_with_progress]),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        # Not cached: a later setup_logging() (tests, the CLI re-reading flags) takes effect at once.
        cache_logger_on_first_use=False,
    )
    # Libraries that log through the stdlib (nats-py, aiohttp) stay quiet below warnings.
    _stdlib_logging.basicConfig(level=max(level_no, _stdlib_logging.WARNING), stream=stream or sys.stderr)
    # asyncio warns on every TLS connection nats-py closes (its protocol's eof_received returns
    # True, which TLS ignores): noise, not a problem.
    asyncio_log = _stdlib_logging.getLogger("asyncio")
    if _ignore_tls_eof not in asyncio_log.filters:
        asyncio_log.addFilter(_ignore_tls_eof)


_LEADING = ("step", "total_steps", "reward", "version", "waiting_for")
_TRAILING = ("job", "role", "member", "ts")


def _lead_with_progress(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    """Console lines: what happened, then step and reward, then the rest; who says it last."""
    first = {k: event[k] for k in ("level", "event", *_LEADING) if k in event}
    last = {k: event[k] for k in _TRAILING if k in event}
    return {**first, **{k: v for k, v in event.items() if k not in first and k not in last}, **last}


def _ignore_tls_eof(record: _stdlib_logging.LogRecord) -> bool:
    return "eof_received() has no effect when using ssl" not in record.getMessage()


def _redact_urls(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    """Mask URL passwords in every string of the event (messages, bound URLs, tracebacks)."""
    return {k: (redact(v) if isinstance(v, str) and "@" in v else v) for k, v in event.items()}


def _plain_enums(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """An enum field as its plain value (`exit_code=2`, not `<ExitCode.USAGE: 2>` on a console)."""
    for key, value in event.items():
        if isinstance(value, enum.Enum):
            event[key] = int(value) if isinstance(value, int) else value.value
    return event


def get_logger(name: str = "rolectl", **context: Any) -> Any:
    """A structlog logger named `name` with `context` bound (job=..., role=..., member=...)."""
    return structlog.get_logger(name).bind(logger=name, **context)


def bind_context(**context: Any) -> None:
    """Bind `context` for every event logged from this task (and tasks it starts) from now on."""
    structlog.contextvars.bind_contextvars(**context)


def clear_context() -> None:
    """Forget everything `bind_context()` bound in this task."""
    structlog.contextvars.clear_contextvars()


class LogBudget:
    """Log the first `burst` occurrences of a warning in full, then at most one summary line per
    `interval_s` (how many were left out, and the latest one's fields).

    For warnings that a sender controls (malformed or forged records): a flood of junk must cost a
    few log lines, not a log line per message (10,000 junk events once wrote a 10 MB log).
    `clock` is injectable for tests (seconds, monotonic).
    """

    def __init__(self, log: Any, event: str, *, burst: int = 10, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.log = log
        self.event = event
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self.count = 0  # every occurrence, logged or not
        self.suppressed = 0  # left out since the last line
        self._last_line = float("-inf")

    def warn(self, **fields: Any) -> None:
        self.count += 1
        now = self.clock()
        if self.count <= self.burst:
            self._last_line = now
            self.log.warning(self.event, **fields)
            return
        self.suppressed += 1
        if now - self._last_line >= self.interval_s:
            self.log.warning(f"{self.event}_suppressed", suppressed=self.suppressed, total=self.count,
                             interval_s=self.interval_s, latest=fields)
            self.suppressed = 0
            self._last_line = now
