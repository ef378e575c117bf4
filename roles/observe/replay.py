"""`rolectl replay`: load a recorded job (its stream, or an export file), print its timeline or JSON,
and with `--check` recompute every decision from the recorded inputs.

The parts live by idea: `export` (files and reading a stream), `timeline` (folding records),
`check` (recorded against recomputed decisions), `render` (terminal output). Their public names are
re-exported here, where callers have always imported them.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from rich.console import Console

from rolectl.bus.archive import ArchiveError
from rolectl.bus.errors import BusError
from rolectl.bus.logging import setup_logging
from rolectl.bus.security import redact
from rolectl.roles.observe.check import Mismatch, check_decisions, decision_identity
from rolectl.roles.observe.export import (
    EXPORT_SUFFIXES,
    ExportError,
    export_job,
    load_export,
    read_job,
    read_job_from_snapshot,
    write_export,
)
from rolectl.roles.observe.render import print_check, print_timeline, quiet_closed_stdout
from rolectl.roles.observe.timeline import (
    build_timeline,
    cut,
    job_outcome,
    observe,
    parse_until,
    summarize,
    verify_subjects,
)
from rolectl.sync_protocol import Recorded
from rolectl.sync_protocol.state import State

__all__ = [
    "EXPORT_SUFFIXES",
    "ExportError",
    "Mismatch",
    "build_timeline",
    "check_decisions",
    "cut",
    "decision_identity",
    "export_job",
    "job_outcome",
    "load_export",
    "observe",
    "parse_until",
    "read_job",
    "run_replay",
    "summarize",
    "write_export",
]


def _load(job: str | None, nats: str, file: str | Path | None,
          security=None, archive: str | Path | None = None) -> tuple[list[Recorded], State | None]:
    """The records, and the reducer snapshot to fold them from when the job's stream no longer
    starts at its first record (trimmed by age or size): None when the records are complete."""
    if file is not None:
        records = load_export(file)
        if not records:  # nothing to replay is not a replay that passed
            raise ExportError(f"{file} holds no records: write one with `rolectl export --job JOB -o FILE` "
                              "(or use the events.jsonl in a `rolectl up` run directory)")
        return records, None
    return asyncio.run(read_job_from_snapshot(job, nats, security=security,
                                              archive_dir=Path(archive) if archive else None))


def run_replay(*, job: str | None, nats: str, file: str | Path | None, until: str | None, check: bool,
               as_json: bool, security=None, archive: str | Path | None = None) -> int:
    """`rolectl replay`: 0 when fine (and, with `check`, every decision matches and the job did not
    end short of its last step), 1 on a mismatch or an incomplete job or when NATS or the job cannot
    be reached (as every command: roles.runner.EXIT_CODES), 2 when the input is wrong (a bad or empty
    file, a bad --until, a job name that cannot be one)."""
    setup_logging("warning")  # stdout is for the timeline (and JSON); logs go to stderr
    err = Console(stderr=True)
    try:
        moment = parse_until(until)
        records, start = _load(job, nats, file, security, archive)
    except ArchiveError as exc:  # a damaged segment: named, and the replay stops there
        err.print(f"rolectl replay: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        return 2
    except BusError as exc:
        err.print(f"rolectl replay: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        return 1
    except (ExportError, ValueError) as exc:
        err.print(f"rolectl replay: {exc}", style="red", highlight=False, markup=False, soft_wrap=True)
        return 2
    records = cut(records, moment)
    timeline = build_timeline(verify_subjects(records)[0])  # the state members saw: forged records left out
    timeline["until"] = until
    timeline["source"] = str(file) if file is not None else f"job {job} on {redact(nats)}"
    mismatches = check_decisions(records, start) if check else []
    errors = [m for m in mismatches if not m.warning]
    outcome = job_outcome(records, start)
    # a job that ended short of its last step is a failed job, even when every decision matches
    failed = bool(errors) or (check and moment is None and outcome.status == "incomplete")
    try:
        _print(timeline, records, mismatches, outcome, failed, check=check, as_json=as_json, err=err)
    except BrokenPipeError:  # `| head` had what it wanted; the verdict stands all the same
        quiet_closed_stdout()
    return 1 if failed else 0


def _print(timeline, records, mismatches, outcome, failed: bool, *, check: bool, as_json: bool, err) -> None:
    if as_json:
        timeline["outcome"] = {"status": outcome.status, "reason": outcome.reason}
        if check:
            timeline["check"] = {
                "ok": not failed,
                "mismatches": [{**vars(m), "identity": list(m.identity), "message": m.describe()}
                               for m in mismatches],
            }
        json.dump(timeline, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print_timeline(timeline)
        if check:
            print_check(records, mismatches)
        style = {"complete": "green", "running": "yellow"}.get(outcome.status, "bold red")
        err.print(f"job {outcome.status}: {outcome.reason}", style=style, highlight=False, markup=False)
