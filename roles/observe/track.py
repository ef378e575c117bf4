"""`rolectl track`: a job's history (archive, then the live stream) into its experiment trackers.

`rolectl up` feeds the trackers of `monitor.backends` itself. A job whose roles were started one by
one (`rolectl start ...`, on several machines) has no `up`: this command is its tracker feed. It
reads the job's record from the first event (the archived part from `event_archive_dir`), logs what
each record says (`Trackers.apply`: trainer and explorer steps, evals, syncs), and, following the
stream live, ends once the trainer's final STOPPED is recorded and the record is read to its end.
With `--once` it stops at the record's current end instead. A restarted `track` writes a new run.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os
from collections.abc import Callable

from rolectl.bus.archive import read_range
from rolectl.bus.connection import connect
from rolectl.bus.events import last_sequence, read_events
from rolectl.roles.config import JobConfig
from rolectl.roles.exit_codes import ExitCode
from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.observe.trackers import Trackers

__all__ = ["default_run_name", "track_job"]


def default_run_name(cfg: JobConfig, now: _dt.datetime | None = None) -> str:
    """`<job>-track-<UTC time>`: a restarted `track` writes a run of its own, beside `up`'s."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return f"{cfg.job}-track-{now:%Y%m%d-%H%M%S}"


async def track_job(cfg: JobConfig, *, run: str, once: bool = False,
                    say: Callable[[str], None] = print) -> ExitCode:
    """Feed `cfg`'s trackers from the job's record; OK once the job's end (or, with `once`, the
    record's current end) is logged. Raises `BusError` when the server or the job is missing."""
    observer = JobObserver(log_tail=0)
    logged, end = 0, None  # end: the record's last sequence once the job is over (following it live)
    async with connect(cfg.nats_url, job=cfg.job, role="observer", member=f"track-{os.getpid()}",
                       security=cfg.nats.security) as conn:
        await last_sequence(conn)  # a clear error when the server has no such job, before any run is made
        trackers = await asyncio.to_thread(Trackers.start, cfg, run, warn=say)
        try:
            archive = cfg.event_archive_dir
            async with read_events(conn, from_seq=1, include_decisions=True, stop_at_end=once,
                                   backfill=lambda first, last: read_range(archive, first, last)) as reader:
                async for rec in reader:
                    observer.apply(rec)
                    trackers.apply(rec)
                    logged = rec.seq
                    if not once and end is None and observer.outcome().complete:
                        end = await last_sequence(conn)  # what the others said after the trainer's end
                    if end is not None and rec.seq >= end:
                        break
        finally:
            await asyncio.to_thread(trackers.close)
    outcome = observer.outcome()
    failed = ", ".join(f"{name} ({n} failures)" for name, n in sorted(trackers.failures.items()))
    say(f"logged job {cfg.job} to run {run} up to seq {logged} ({outcome.status}: {outcome.reason})"
        + (f"; trackers that failed: {failed}" if failed else ""))
    if not once and end is None:  # the stream ended before the job did: the feed is not whole
        say(f"the record of job {cfg.job} ended before the job did")
        return ExitCode.ERROR
    return ExitCode.ERROR if failed else ExitCode.OK
