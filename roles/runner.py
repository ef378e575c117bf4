"""Run one role in the foreground: logging, the event loop, Ctrl-C → clean stop, exit codes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import structlog

from rolectl.bus.connection import connect
from rolectl.bus.errors import BusError, describe
from rolectl.bus.logging import setup_logging
from rolectl.roles.config import JobConfig, env_settings
from rolectl.roles.exit_codes import ExitCode
from rolectl.roles.resume import StartMode, StartRefused
from rolectl.roles.session import JobIncomplete, MemberReplaced, install_stop_signals

__all__ = ["run_role", "default_member_id", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_INCOMPLETE",
           "EXIT_INTERRUPTED", "EXIT_CODES"]

# The one table of exit codes lives in roles.exit_codes; these names are kept for the callers.
EXIT_OK = ExitCode.OK
EXIT_ERROR = ExitCode.ERROR
EXIT_USAGE = ExitCode.USAGE
EXIT_INCOMPLETE = ExitCode.INCOMPLETE
EXIT_INTERRUPTED = ExitCode.INTERRUPTED
EXIT_CODES = {code: code.meaning for code in ExitCode}


def _progress_bar(label: str):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class _Rate(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed:.2f} steps/s" if task.speed else "")

    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), _Rate(), TimeRemainingColumn(),
                    console=Console(stderr=True), redirect_stderr=True, redirect_stdout=False)


async def _follow_steps(progress, bar, done) -> None:
    while True:
        progress.update(bar, completed=done())
        await asyncio.sleep(0.5)  # the bar's refresh cadence


def default_member_id(role: str) -> str:
    return {"trainer": "trainer", "explorer": "explorer-0"}.get(role, f"sync-{os.getpid()}")


def run_role(role: str, cfg: JobConfig, member_id: str | None = None, *, start_mode: StartMode = StartMode.AUTO,
             log_json: bool = True, keep_running: bool = False, engine: object | None = None,
             make_runner=None) -> int:
    """Run `role` until it finishes; return the process exit code (see EXIT_CODES).

    `start_mode` says what a trainer or explorer does with saved state (see roles.resume);
    `log_json` picks one JSON object per line (files, log shippers) over aligned console text; a
    synchronizer finishes once every member of the job did, unless `keep_running`; a trainer's
    `engine` is built from `cfg` unless given (rank 0 of a trainer of several ranks). `make_runner`
    builds the explorer instead (the serving one, from a layer above this one)."""
    setup_logging(cfg.log_level, json=log_json)
    member_id = member_id or default_member_id(role)
    log = structlog.get_logger().bind(job=cfg.job, role=role, member=member_id)
    try:  # before the engine is built: a server that is not there costs its wait, not a model load too
        asyncio.run(_server_answers(role, cfg, member_id))
    except BusError as exc:
        log.error("bus_error", error=describe(exc), exit_code=EXIT_ERROR)
        return EXIT_ERROR
    if role != "sync":  # a synchronizer runs no engine: it (re)starts without importing torch
        # Each role process gets a share of a machine that also runs its peers: one intra-op
        # thread avoids oversubscription (the torch default is one thread per core, per process).
        import torch

        torch.set_num_threads(env_settings().torch_threads)
    runner = _make_runner(role, cfg, member_id, start_mode=start_mode, keep_running=keep_running, engine=engine,
                          make_runner=make_runner)
    try:
        try:
            asyncio.run(_main(role, runner, cfg, member_id, log_json=log_json))
        finally:
            # The role's work is over (done, stopped or failed): a stop request that arrives while
            # the process exits changes nothing, and must not kill it by the signal (`up` saw a
            # synchronizer that had finished by itself exit -2 for its late SIGINT).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (KeyboardInterrupt, asyncio.CancelledError):
        # A synchronizer has no end of its own: stopping it is how it ends. A trainer or explorer
        # stopped before its work was done leaves the job unfinished, and says so.
        code = EXIT_OK if role == "sync" else EXIT_INTERRUPTED
        log.info("stopped_by_signal", exit_code=code)
        return code
    except StartRefused as exc:
        log.error("start_refused", reason=str(exc), exit_code=EXIT_USAGE)
        return EXIT_USAGE
    except MemberReplaced as exc:
        log.error("member_replaced", reason=str(exc), exit_code=EXIT_ERROR)
        return EXIT_ERROR
    except JobIncomplete as exc:
        log.error("job_incomplete", reason=str(exc), exit_code=EXIT_INCOMPLETE)
        return EXIT_INCOMPLETE
    except BusError as exc:
        log.error("bus_error", error=describe(exc))
        return EXIT_ERROR
    except Exception as exc:
        log.exception("role_failed", error=describe(exc))
        return EXIT_ERROR
    log.info("role_exited")
    return EXIT_OK


async def _server_answers(role: str, cfg: JobConfig, member_id: str) -> None:
    """Connect to the job's server as the role will, and close: `BusError` when none answers."""
    async with connect(cfg.nats_url, job=cfg.job, role="synchronizer" if role == "sync" else role,
                       member=member_id, security=cfg.nats.security):
        pass


def _make_runner(role: str, cfg: JobConfig, member_id: str, *, start_mode: StartMode, keep_running: bool,
                 engine: object | None, make_runner):
    """The role's loop object: a Trainer (a StageRunner for a trainer-only stage), an Explorer (or
    what `make_runner` builds), a Synchronizer."""
    if role == "trainer" and cfg.trainer_only:
        from rolectl.roles.stage import StageRunner

        return StageRunner(cfg, member_id, start_mode=start_mode, engine=engine)
    if role == "trainer":
        from rolectl.roles.trainer import Trainer

        return Trainer(cfg, member_id, start_mode=start_mode, engine=engine)
    if role == "explorer":
        from rolectl.roles.explorer import Explorer

        return (make_runner or Explorer)(cfg, member_id, start_mode=start_mode)
    if role == "sync":
        from rolectl.roles.synchronizer import Synchronizer

        return Synchronizer(cfg, member_id, keep_running=keep_running)
    raise ValueError(f"unknown role {role!r}; use trainer, explorer or sync")


async def _main(role: str, runner, cfg: JobConfig, member_id: str, *, log_json: bool) -> None:
    """The role's loop, stopped by SIGINT/SIGTERM; a person at a terminal gets a progress bar too."""
    install_stop_signals(asyncio.current_task())
    if role == "sync" or log_json or not sys.stderr.isatty():
        await runner.run()
        return
    # a person at a terminal: a progress bar below the log lines
    done, total = ((lambda: runner.engine.step, runner.total_steps) if role == "trainer"
                   else (lambda: runner.explore_step, cfg.explorers.total_steps))
    with _progress_bar(f"{role} {member_id}") as progress:
        setup_logging(cfg.log_level, json=False)  # again: log lines now go above the bar
        bar = progress.add_task("steps", total=total, completed=done())
        follow = asyncio.create_task(_follow_steps(progress, bar, done), name="progress-bar")
        try:
            await runner.run()
        finally:
            follow.cancel()
