"""Run one role in the foreground: logging, the event loop, Ctrl-C → clean stop, exit codes."""

from __future__ import annotations

import asyncio
import os

import structlog

from bus.errors import BusError
from bus.logging import setup_logging
from roles.session import JobIncomplete, install_stop_signals
from roles.config import JobConfig

__all__ = ["run_role", "default_member_id", "EXIT_OK", "EXIT_ERROR", "EXIT_INCOMPLETE", "EXIT_INTERRUPTED"]

# One table of exit codes for every role (and `rolectl up`):
EXIT_OK = 0  # the role's work is done (the trainer trained total_steps; a synchronizer saw every
#             member finish, or was stopped)
EXIT_ERROR = 1  # it failed: a bug, an unreachable server, bad data it could not get past
EXIT_INCOMPLETE = 3  # it ended before the job's work was done (e.g. gave up on a peer that never came back)
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM before its work was done (a restart may resume it)


def default_member_id(role: str) -> str:
    return {"trainer": "trainer", "explorer": "explorer-0"}.get(role, f"sync-{os.getpid()}")


def run_role(role: str, cfg: JobConfig, member_id: str | None = None, *, keep_running: bool = False) -> int:
    """Run `role` until it finishes; return the process exit code (0 finished or stopped, 1 error).
    A synchronizer finishes once every member of the job did, unless `keep_running`."""
    setup_logging(cfg.log_level)
    # Each role process gets a share of a machine that also runs its peers: one intra-op thread
    # avoids oversubscription (the torch default is one thread per core, per process).
    import torch

    torch.set_num_threads(int(os.environ.get("ROLECTL_TORCH_THREADS", "1")))
    member_id = member_id or default_member_id(role)
    log = structlog.get_logger().bind(job=cfg.job, role=role, member=member_id)
    if role == "trainer":
        from roles.trainer import Trainer

        runner = Trainer(cfg, member_id)
    elif role == "explorer":
        from roles.explorer import Explorer

        runner = Explorer(cfg, member_id)
    elif role == "sync":
        from roles.synchronizer import Synchronizer

        runner = Synchronizer(cfg, member_id, keep_running=keep_running)
    else:
        raise ValueError(f"unknown role {role!r}; use trainer, explorer or sync")

    async def main() -> None:
        task = asyncio.current_task()
        install_stop_signals(task)
        await runner.run()

    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        # A synchronizer has no end of its own: stopping it is how it ends. A trainer or explorer
        # stopped before its work was done leaves the job unfinished, and says so.
        code = EXIT_OK if role == "sync" else EXIT_INTERRUPTED
        log.info("stopped_by_signal", exit_code=code)
        return code
    except JobIncomplete as exc:
        log.error("job_incomplete", reason=str(exc), exit_code=EXIT_INCOMPLETE)
        return EXIT_INCOMPLETE
    except BusError as exc:
        log.error("bus_error", error=str(exc))
        return EXIT_ERROR
    except Exception as exc:
        log.exception("role_failed", error=str(exc))
        return EXIT_ERROR
    log.info("role_exited")
    return EXIT_OK
