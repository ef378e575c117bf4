"""A run of `rolectl up` opened from its run directory (`--run runs/<job>-<time>-<pid>`): its job's
name, its record and its archive, with no server for the user to start.

While `up` runs, its server is the one to read (`up` writes where it listens in `server.json` and
removes the file when the server stops). After the run, a private nats-server is started on the
run's own store (`nats/`), on free loopback ports, for as long as the command reads it: the record
is read, never written (a second server must never open a store a live one holds, hence the file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolectl.bus.errors import NatsServerError
from rolectl.bus.files import write_json_atomic
from rolectl.bus.server import NatsServer
from rolectl.roles.config import load_config
from rolectl.sync_protocol import ConfigError

__all__ = ["SERVER_FILE", "RUN_CONFIG", "RunError", "OpenedRun", "open_run", "job_source", "server_running",
           "server_stopped"]

SERVER_FILE = "server.json"
"""In a run directory while `up`'s server runs: its pid, client URL and monitoring URL."""
RUN_CONFIG = "job.yaml"
"""The effective config of a run (`rolectl up` writes it; every role of the run reads it)."""


class RunError(ValueError):
    """A run directory cannot be read as asked; the message says why and what to do instead."""


@dataclass(frozen=True)
class OpenedRun:
    """Where a run's record is read from now."""

    path: Path
    job: str
    nats_url: str
    monitor_url: str | None
    archive_dir: Path
    live: bool  # `up` still runs it (its own server), or a private server reads the store


def server_running(run_path: Path, server: NatsServer, url: str) -> None:
    """`up`: its server listens at `url` now (what `open_run` reads while the run is live)."""
    write_json_atomic(run_path / SERVER_FILE, {"pid": server.pid, "url": url, "monitor_url": server.monitor_url})


def server_stopped(run_path: Path) -> None:
    """`up`: its server is gone; the store may be opened by a private server."""
    (run_path / SERVER_FILE).unlink(missing_ok=True)


@contextmanager
def open_run(run_dir: str | Path) -> Iterator[OpenedRun]:
    """The run in `run_dir`, readable for the duration of the `with` block."""
    path = Path(run_dir).resolve()
    config = path / RUN_CONFIG
    if not config.is_file():
        raise RunError(f"{path} is not a run directory of `rolectl up` (it has no {RUN_CONFIG}): give the "
                       "directory `up` printed as its run dir")
    try:
        cfg = load_config(config, check_engines=False)
    except ConfigError as exc:
        raise RunError(f"{config}: {exc}") from None
    live = _live_server(path)
    if live is not None:
        yield OpenedRun(path, cfg.job, live["url"], live.get("monitor_url"), cfg.event_archive_dir, live=True)
        return
    if (path / "nats-server.conf").is_file():
        raise RunError(f"{path} is a secured run (its server ran from {path / 'nats-server.conf'}): start that "
                       f"server with `rolectl server --config {path / 'nats-server.conf'}` and pass --job "
                       f"{cfg.job}, --nats and the observer's credential; or read {path / 'events.jsonl'} with "
                       "`rolectl replay --file`")
    if not (path / "nats").is_dir():
        raise RunError(f"{path} has no nats/ store to read; its export is `rolectl replay --file "
                       f"{path / 'events.jsonl'}`")
    server = NatsServer(store_dir=str(path / "nats"))
    try:
        server.start()
    except NatsServerError as exc:
        raise RunError(f"cannot open the store of {path}: {exc}") from None
    try:
        yield OpenedRun(path, cfg.job, server.url, server.monitor_url, cfg.event_archive_dir, live=False)
    finally:
        server.stop()


@contextmanager
def job_source(job: str | None, nats: str | None, archive: str | None,
               run_dir: str | None) -> Iterator[tuple[str, str | None, Path | None, str | None]]:
    """What a reading command reads, for the duration of the block: (job, NATS URL, archive dir,
    monitoring URL or None), from the run in `run_dir`, else from the job, URL and archive given."""
    if run_dir is None:
        if job is None:
            raise RunError("give --job JOB (with --nats URL), or --run RUN_DIR (a run of `rolectl up`)")
        yield job, nats, Path(archive) if archive else None, None
        return
    try:
        with open_run(run_dir) as run:
            yield run.job, run.nats_url, run.archive_dir, run.monitor_url
    except RunError as exc:  # raised on opening: what the block raises is never one
        raise RunError(f"--run {run_dir}: {exc}") from None


def _live_server(path: Path) -> dict[str, Any] | None:
    """What `server.json` says when the nats-server it names still runs; None otherwise."""
    try:
        said = json.loads((path / SERVER_FILE).read_text())
        pid = int(said["pid"])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if Path("/proc").is_dir() else b"nats-server"
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no file, a damaged one, or its server is gone (up killed): the store is free
    return said if b"nats-server" in cmdline else None
