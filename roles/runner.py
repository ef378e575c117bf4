"""Run one role in the foreground: logging, the event loop, Ctrl-C → clean stop, exit codes."""

from __future__ import annotations

import asyncio
import os
import signal

import structlog

from rolectl.bus.errors import BusError, describe
from rolectl.bus.logging import setup_logging
from rolectl.roles.config import JobConfig, env_settings
from rolectl.roles.resume import StartMode, StartRefused
from rolectl.roles.session import JobIncomplete, install_stop_signals

__all__ = ["run_role", "default_member_id", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_INCOMPLETE",
           "EXIT_INTERRUPTED", "EXIT_CODES"]

# One table of exit codes for every rolectl command (roles, `up`, `server`, `replay`, ...); the
# README's "Exit codes" table is checked against it by tests/unit/test_cli_errors.py.
EXIT_OK = 0  # the work is done (the trainer trained total_steps; a synchronizer saw every member
#             finish, or it or a server was stopped)
EXIT_ERROR = 1  # it failed: a bug, an unreachable server, bad data it could not get past, a failed --check
EXIT_USAGE = 2  # it did not start: a bad flag, config or input file, or a start that would not do what was meant
EXIT_INCOMPLETE = 3  # it ended before the job's work was done (e.g. gave up on a peer that never came back)
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM before its work was done (a restart may resume it)
EXIT_CODES = {
    EXIT_OK: "done: the job (or the command) finished its work; a synchronizer that saw every member finish; a stopped synchronizer or server",
    EXIT_ERROR: "failed: a role crashed, the server could not be reached, `replay --check` found a difference",
    EXIT_USAGE: "did not start: bad flag, config or input file, a busy port, saved state of another run",
    EXIT_INCOMPLETE: "ended short: the job stopped before its last step (a peer never came back)",
    EXIT_INTERRUPTED: "interrupted: Ctrl-C / SIGTERM before the work was done (a restart resumes)",
}


def default_member_id(role: str) -> str:
    return {"trainer": "trainer", "explorer": "explorer-0"}.get(role, f"sync-{os.getpid()}")


def run_role(role: str, cfg: JobConfig, member_id: str | None = None, *, start_mode: StartMode = StartMode.AUTO,
             log_json: bool = True, keep_running: bool = False) -> int:
    """Run `role` until it finishes; return the process exit code (see EXIT_CODES).

    `start_mode` says what a trainer or explorer does with saved state (see roles.resume);
    `log_json` picks one JSON object per line (files, log shippers) over aligned console text; a
    synchronizer finishes once every member of the job did, unless `keep_running`."""
    setup_logging(cfg.log_level, json=log_json)
    if role != "sync":  # a synchronizer runs no engine: it (re)starts without importing torch
        # Each role process gets a share of a machine that also runs its peers: one intra-op
        # thread avoids oversubscription (the torch default is one thread per core, per process).
        import torch

        torch.set_num_threads(env_settings().torch_threads)
    member_id = member_id or default_member_id(role)
    log = structlog.get_logger().bind(job=cfg.job, role=role, member=member_id)
    if role == "trainer":
        from rolectl.roles.trainer import Trainer

        runner = Trainer(cfg, member_id, start_mode=start_mode)
    elif role == "explorer":
        from rolectl.roles.explorer import Explorer

        runner = Explorer(cfg, member_id, start_mode=start_mode)
    elif role == "sync":
        from rolectl.roles.synchronizer import Synchronizer

        runner = Synchronizer(cfg, member_id, keep_running=keep_running)
    else:
        raise ValueError(f"unknown role {role!r}; use trainer, explorer or sync")

    async def main() -> None:
        task = asyncio.current_task()
        install_stop_signals(task)
        await runner.run()

    try:
        try:
            asyncio.run(main())
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
