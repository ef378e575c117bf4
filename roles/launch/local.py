"""`rolectl up`: a whole job on one machine — an embedded nats-server plus every role as its own
OS process, live progress, per-role logs in a run directory, an export and a JSON summary at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import nats.errors
from rich.console import Console
from rich.live import Live

from rolectl.bus.archive import ArchiveError
from rolectl.bus.auth import AuthDir
from rolectl.bus.connection import BusConnection, connect
from rolectl.bus.errors import BusError
from rolectl.bus.events import read_events
from rolectl.bus.logging import setup_logging
from rolectl.bus.security import redact
from rolectl.bus.server import NatsServer, NatsServerError
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import EnvSettings, JobConfig
from rolectl.roles.exit_codes import ExitCode
from rolectl.roles.launch.base import Launcher, RoleHandle
from rolectl.roles.launch.run_dir import RUN_CONFIG, new_run_path, resume_command, write_config
from rolectl.roles.launch.up_view import PIPE_LINE_S, ConsoleLog, Progress, progress_view, summary_table
from rolectl.roles.observe.dashboard import start_dashboard
from rolectl.roles.observe.export import read_history
from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.observe.replay import summarize, write_export
from rolectl.roles.observe.run_store import server_running, server_stopped
from rolectl.roles.observe.trackers import Trackers
from rolectl.roles.provision import provision_job
from rolectl.roles.runner import EXIT_ERROR, EXIT_INCOMPLETE, EXIT_INTERRUPTED
from rolectl.roles.stopping import stop_task

__all__ = ["run_up", "supervise", "summarize", "write_config", "auth_mismatch", "LocalLauncher", "RoleProcess"]

console = Console(stderr=True)


@dataclasses.dataclass
class RoleProcess:
    """One role running as a child process of `up`, its output going to a log file."""

    role: str
    member_id: str
    log_path: Path
    proc: subprocess.Popen
    told: bool = False  # sent its stop signal: never a second one, which would cut its cleanup short

    @property
    def name(self) -> str:
        return self.member_id

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    @property
    def restarts(self) -> int:
        return 0  # a local role that crashes fails the job (`--launcher ray` restarts it)

    def tail(self, lines: int = 15) -> str:
        return tail_file(self.log_path, lines)


def tail_file(path: Path, lines: int = 15) -> str:
    try:
        with open(path, "rb") as fh:
            return b"".join(deque(fh, maxlen=lines)).decode(errors="replace")
    except OSError:
        return "(no log)"


@dataclasses.dataclass
class LocalLauncher:
    """Every role as an OS process on this machine, logs under `<run dir>/logs`."""

    config_path: Path
    nats_url: str
    logs: Path
    auth: AuthDir | None = None
    name: str = "local"

    def start(self, role: str, member_id: str) -> RoleProcess:
        log_path = self.logs / f"{member_id}.log"
        out = open(log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", EnvSettings.variable("advertise_host"): "127.0.0.1"}
        if self.auth is not None:  # its own identity, by file path in the environment (never argv)
            env.update(self.auth.security(member_id).as_env())
        proc = subprocess.Popen(
            [sys.executable, "-m", "rolectl", "start", role, "--config", str(self.config_path),
             "--nats", self.nats_url, "--id", member_id, "--log-format", "json"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # Ctrl-C in the terminal reaches `up`, which stops children in order
        )
        out.close()
        return RoleProcess(role=role, member_id=member_id, log_path=log_path, proc=proc)

    async def stop_all(self, handles: list[RoleProcess], grace_s: float = 15.0) -> None:
        """SIGINT each running role once (it records its STOPPED), then SIGKILL what is left after
        `grace_s`. A role told already is not told again: a second stop request cancels its cleanup."""
        for p in handles:
            if p.proc.poll() is None and not p.told:
                p.proc.send_signal(signal.SIGINT)
                p.told = True
        deadline = time.monotonic() + grace_s
        for p in handles:
            while p.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()


def run_up(cfg: JobConfig, *, explorers: int | None = None, summary_path: str | None = None,
           dashboard: bool = True, dashboard_port: int = 0, run_dir: str | None = None,
           timeout_s: float | None = None, auth: AuthDir | None = None, resume: Path | None = None) -> int:
    """Run the job to its end; the exit code follows `roles.runner`: 0 the job completed, 3 it ended
    short of its last step (every process may have exited 0), 1 a role failed, 130 interrupted.

    With `auth` (what `rolectl auth init` wrote) the server runs from its nats-server.conf (TLS, one
    identity per member), admin provisions the streams and each role connects as itself. With
    `resume` (a run directory, `cfg` its recorded config) the run goes on there: the same store,
    checkpoints and directory; a run that already finished is said so, and that is all (exit 0)."""
    setup_logging("warning", json=False, stream=ConsoleLog(console))  # above the live table, for people
    if explorers is not None:
        cfg, note = cfg.with_explorer_count(explorers)
        if note:
            console.print(f"[yellow]--explorers {explorers}:[/] {note}", highlight=False)
    if auth is not None:
        problem = auth_mismatch(cfg, auth)
        if problem:
            console.print(f"[red]rolectl up --auth-dir {auth.path}:[/] {problem}", highlight=False)
            return ExitCode.USAGE
    run_path = resume if resume is not None else new_run_path(cfg, run_dir)
    server = _embedded_server(cfg, run_path, auth)
    try:
        server.start()
    except NatsServerError as exc:
        console.print(f"[red]cannot start the embedded nats-server:[/] {exc}")
        return ExitCode.ERROR
    url = server.url if auth is None else auth.url
    server_running(run_path, server, url)  # `--run` readers use it, and never open the store beside it
    cfg = cfg.with_overrides(nats_url=url, run_dir=str(run_path))
    config_path = run_path / RUN_CONFIG
    write_config(cfg, config_path)
    secured = "" if auth is None else f" (TLS, identities from {auth.path})"
    console.print(f"[bold]rolectl up[/] job [cyan]{cfg.job}[/]{' resumed' if resume else ''}: nats {url}{secured} "
                  f"(monitoring {server.monitor_url}), run dir {run_path}")
    code: int = EXIT_INTERRUPTED
    try:
        if resume is not None and asyncio.run(_finished_already(cfg, run_path, auth)):
            code = ExitCode.OK
            return code
        launcher = LocalLauncher(config_path=config_path, nats_url=url, logs=run_path / "logs", auth=auth)
        code = asyncio.run(supervise(cfg, launcher, run_path, monitor_url=server.monitor_url,
                                     summary_path=summary_path, dashboard=dashboard,
                                     dashboard_port=dashboard_port, timeout_s=timeout_s, auth=auth))
        return code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        server.stop()
        server_stopped(run_path)
        if code in (EXIT_ERROR, EXIT_INCOMPLETE, EXIT_INTERRUPTED):  # ended short: how to go on
            console.print(f"resume:  {resume_command(run_path)}", highlight=False, soft_wrap=True)


def _embedded_server(cfg: JobConfig, run_path: Path, auth: AuthDir | None) -> NatsServer:
    """The job's own nats-server, its store in the run directory; out of the terminal's process
    group (`up` stops it last, after the roles and the export)."""
    log_file = str(run_path / "logs" / "nats-server.log")
    if auth is None:
        return NatsServer(store_dir=str(run_path / "nats"), log_file=log_file, go_gc=cfg.server_go_gc,
                          own_session=True)
    # the store stays per run, so a second run of the same job starts from an empty stream
    conf = run_path / "nats-server.conf"
    conf.write_text(auth.server_conf_with_store(run_path / "nats"))
    return NatsServer(config_file=str(conf), host="127.0.0.1", port=auth.port, http_port=auth.http_port,
                      log_file=log_file, go_gc=cfg.server_go_gc, own_session=True)


async def _finished_already(cfg: JobConfig, run_path: Path, auth: AuthDir | None) -> bool:
    """True (and said) when the record in the run's store shows the job finished: nothing to resume."""
    security = auth.security("observer") if auth is not None else None
    try:
        async with connect(cfg.nats_url, job=cfg.job, role="observer", member="up", security=security) as conn:
            records = await asyncio.wait_for(read_history(conn, cfg.event_archive_dir), timeout=30.0)
    except (asyncio.TimeoutError, BusError, ArchiveError, nats.errors.Error):
        return False  # no record to read (the run stopped before its streams were made): the roles make it
    outcome = JobObserver().extend(records).outcome()
    if outcome.complete:
        console.print(f"job {cfg.job} in {run_path} already finished ({outcome.reason}): nothing to resume. "
                      f"Its summary: {run_path / 'summary.json'}; to train again, start a new run with --config",
                      highlight=False, soft_wrap=True)
    return outcome.complete


async def supervise(cfg: JobConfig, launcher: Launcher, run_path: Path, *, monitor_url: str | None,
                    summary_path, dashboard, dashboard_port, timeout_s, auth: AuthDir | None = None,
                    extra_summary: dict | None = None) -> int:
    """Start every role through `launcher`, show progress until the job ends (every worker exited
    0, one role failed, Ctrl-C or `timeout_s`), stop everyone, export the stream and write the summary.
    The same for every launcher: only how roles are started, watched and stopped differs."""
    run = _Supervision(cfg, launcher, run_path, auth=auth)
    if not await run.provision():
        return ExitCode.ERROR
    run.start()
    dashboard_handle = None
    exit_code = 0
    try:
        async with connect(cfg.nats_url, job=cfg.job, role="observer", member="up", security=run.observer) as conn:
            await ensure_event_stream(conn.js, conn.names, replicas=cfg.nats.replicas)
            await ensure_experience_stream(conn.js, conn.names, replicas=cfg.nats.replicas)
            following = await _Following.start(conn, cfg, run_path.name)
            if dashboard:
                dashboard_handle = await _open_dashboard(cfg, run.observer, monitor_url, dashboard_port)
            exit_code = run.exit_code(await run.watch(following.view, timeout_s))
            exit_code = await run.conclude(conn, following, exit_code, summary_path=summary_path,
                                           extra_summary=extra_summary)
    except (BusError, nats.errors.Error, asyncio.TimeoutError) as exc:
        # the embedded server or the connection failed under us: say so, never a traceback
        console.print(f"[red]lost the job's NATS server:[/] {exc or type(exc).__name__}")
        exit_code = EXIT_INTERRUPTED if run.stop.is_set() else EXIT_ERROR
    finally:
        await run.stop_roles()
        if dashboard_handle is not None:
            await dashboard_handle.aclose()
    return exit_code


class _Supervision:
    """One `supervise` call in three steps: start (streams provisioned, roles started, Ctrl-C
    caught), watch (the progress table until the job ends), conclude (everyone stopped, the
    history exported, the summary written)."""

    def __init__(self, cfg: JobConfig, launcher: Launcher, run_path: Path, *, auth: AuthDir | None):
        self.cfg = cfg
        self.launcher = launcher
        self.run_path = run_path
        self.auth = auth
        self.observer = auth.security("observer") if auth is not None else None
        self.started = time.monotonic()
        self.everyone: list[RoleHandle] = []  # the synchronizer, the trainer, the explorers (a stage: its trainer)
        self.stop = asyncio.Event()  # the first Ctrl-C / SIGTERM: stop the roles in order
        self.hurry = asyncio.Event()  # the second: kill them now
        self.progress = Progress(cfg.trainer.total_steps)

    @property
    def workers(self) -> list[RoleHandle]:
        """The trainer and the explorers: the job is done when each of them exited 0."""
        return [handle for handle in self.everyone if handle.role != "sync"]

    # -- start -------------------------------------------------------------------------------------
    async def provision(self) -> bool:
        """With identities, only admin may create streams: make them before any role needs them."""
        if self.auth is None:
            return True
        try:
            streams = await provision_job(self.cfg, security=self.auth.security("admin"))
        except BusError as exc:
            console.print(f"[red]provisioning the job's streams as admin failed:[/] {exc}", highlight=False)
            return False
        console.print(f"provisioned as admin: {', '.join(streams)}", highlight=False)
        return True

    def start(self) -> None:
        """Every role in `ROLE_ORDER` (a trainer-only stage: its trainer alone, nothing to sync), then
        Ctrl-C / SIGTERM caught: once to stop, twice to kill."""
        sync = [] if self.cfg.trainer_only else [self.launcher.start("sync", "sync-0")]
        self.everyone = [*sync, self.launcher.start("trainer", "trainer"),
                         *(self.launcher.start("explorer", e) for e in self.cfg.explorer_ids())]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            self.hurry.set()
            console.print(f"[yellow]stopping faster: roles still running in {_HURRY_GRACE_S:.0f} s are killed; "
                          "the job's record is still exported[/]")
        else:
            console.print(f"[yellow]interrupted ({sig.name}): stopping the roles, then the server "
                          "(Ctrl-C again to stop faster)[/]")
        self.stop.set()

    # -- watch -------------------------------------------------------------------------------------
    async def watch(self, view: JobObserver, timeout_s: float | None) -> RoleHandle | str | None:
        """Show progress until the job ends; return why: the role that failed, "stopped" (Ctrl-C),
        "timeout", or None when every worker exited 0."""
        cfg, everyone = self.cfg, self.everyone
        served: set[str] = set()
        next_line = time.monotonic() + PIPE_LINE_S
        with Live(progress_view(cfg, view, everyone, self.progress), console=console, refresh_per_second=2,
                  transient=not console.is_terminal) as live:
            while True:
                trainer = view.state.trainer_state
                if trainer is not None and trainer.metrics.get("total_steps"):  # a stage counts its own
                    self.progress.total = int(trainer.metrics["total_steps"])
                self.progress.update(view.trainer_steps, time.monotonic())
                if cfg.serve.enabled:
                    _print_serve_urls(cfg, served, everyone)
                live.update(progress_view(cfg, view, everyone, self.progress))
                if not console.is_terminal and time.monotonic() >= next_line:
                    # in a pipe the live table shows nothing until the end: a plain line now and then
                    console.print(self.progress.line(), highlight=False)
                    next_line = time.monotonic() + PIPE_LINE_S
                failed = next((p for p in everyone if p.poll() not in (None, 0)), None)
                if failed or all(p.poll() == 0 for p in self.workers):
                    return failed
                if self.stop.is_set():
                    return "stopped"
                if timeout_s and time.monotonic() - self.started > timeout_s:
                    return "timeout"
                await asyncio.sleep(0.5)  # refresh cadence of the progress table

    def exit_code(self, ended: RoleHandle | str | None) -> int:
        """The exit code for how `watch` ended, said on the console (a failed role's own words too)."""
        if ended is None:
            return 0
        if ended == "stopped":
            return EXIT_INTERRUPTED
        if isinstance(ended, str):
            console.print(f"[red]job {ended}[/]")
            return EXIT_ERROR
        console.print(f"[red]{ended.name} exited with code {ended.returncode}[/]; last log lines:")
        console.print(ended.tail(), markup=False, highlight=False)
        reason = why_it_stopped(ended.tail(200))
        if reason:  # the role's own words, not buried in the tail
            console.print(f"[red]{ended.name}:[/] {reason}", highlight=False)
        return ended.returncode if ended.returncode > 0 else EXIT_ERROR

    async def stop_roles(self) -> None:
        await _stop_roles(self.launcher, self.everyone, self.hurry)

    # -- conclude ----------------------------------------------------------------------------------
    async def conclude(self, conn: BusConnection, following: _Following, exit_code: int, *,
                       summary_path: str | None, extra_summary: dict | None) -> int:
        """Stop everyone, export the history, write and show the summary. Returns the exit code:
        `exit_code`, or EXIT_INCOMPLETE when every process exited 0 and still the job fell short."""
        from rolectl.roles.engines import engine_summary  # here: it loads torch, which only `up` needs

        cfg = self.cfg
        # Let the synchronizer see the last events, then stop it and record the run.
        await self.stop_roles()
        records = await _read_history(conn, cfg)
        events_file = self.run_path / "events.jsonl"
        write_export(records, events_file, job=cfg.job)
        summary = summarize(records, job=cfg.job)
        if not console.is_terminal:
            # where it ended, in a pipe too: from the whole history, which the live view may trail
            self.progress.update(max(following.view.trainer_steps, summary["trainer_steps"]), time.monotonic())
            console.print(self.progress.line(), highlight=False)
        if exit_code == 0 and not summary["complete"]:
            exit_code = EXIT_INCOMPLETE  # every process exited 0 and still the job fell short
            console.print(f"[red]job incomplete:[/] {summary['end_reason']}")
        everyone = self.everyone
        summary.update(nats_url=redact(cfg.nats_url), secured=self.auth is not None,
                       wall_s=round(time.monotonic() - self.started, 2), run_dir=str(self.run_path),
                       events_file=str(events_file), launcher=self.launcher.name,
                       exit_codes={p.name: p.returncode for p in everyone},
                       restarts={p.name: p.restarts for p in everyone if p.restarts})
        trackers = await following.close(records)
        if cfg.monitor.backends:
            summary.update(trackers=list(cfg.monitor.backends), tracker_failures=dict(trackers.failures),
                           monitor_dir=str(cfg.monitor_dir))
        summary.update(extra_summary or {})
        summary.update(engine_summary(cfg.model, records))
        if cfg.final_export_dir.is_dir():
            summary["hf_model_dir"] = str(cfg.final_export_dir.resolve())
        self._write_summary(summary, summary_path, events_file)
        return exit_code

    def _write_summary(self, summary: dict, summary_path: str | None, events_file: Path) -> None:
        text = json.dumps(summary, indent=2)
        (self.run_path / "summary.json").write_text(text)
        if summary_path:
            Path(summary_path).write_text(text)
        console.print(summary_table(summary))
        # where to look now that the server and the dashboard are gone with the job
        written = [str(self.run_path / "summary.json"), *([str(summary_path)] if summary_path else [])]
        own_store = self.launcher.name == "local"  # the run directory holds the server's store
        replay = (f"rolectl replay --file {events_file}" if summary.get("events") or not own_store else
                  f"rolectl replay --run {self.run_path}")  # no export: the run's own store
        later = f"\nlater:   rolectl status|replay|dashboard|export --run {self.run_path}" if own_store else ""
        console.print(f"summary: {' and '.join(written)}\nevents:  {events_file}\n"
                      f"replay:  {replay}   (add --check to verify every decision){later}",
                      highlight=False, soft_wrap=True)


@dataclasses.dataclass
class _Following:
    """The job's stream as `up` follows it: folded into `view` (the progress table reads it) and
    fed to the experiment trackers."""

    view: JobObserver
    trackers: Trackers
    task: asyncio.Task

    @classmethod
    async def start(cls, conn: BusConnection, cfg: JobConfig, run_name: str) -> _Following:
        view = JobObserver(log_tail=0)
        trackers = await asyncio.to_thread(
            Trackers.start, cfg, run_name,
            warn=lambda message: console.print(f"[yellow]{message}[/]", highlight=False, markup=False))
        return cls(view, trackers, asyncio.create_task(_follow(conn, view, trackers), name="up-follow"))

    async def close(self, records: list) -> Trackers:
        """Stop following; the trackers get what the live reader had not reached yet (seen records
        are skipped), then close."""
        await stop_task(self.task)
        for rec in records:
            self.trackers.apply(rec)
        await asyncio.to_thread(self.trackers.close)
        return self.trackers


async def _open_dashboard(cfg: JobConfig, security, monitor_url: str | None, port: int):
    """The job's dashboard, its URL printed; None when it cannot start (the job matters more)."""
    try:
        handle = await start_dashboard(job=cfg.job, nats_url=cfg.nats_url, security=security,
                                       monitor_url=monitor_url, port=port, archive_dir=cfg.event_archive_dir)
    except Exception as exc:  # the job matters more than its window
        console.print(f"[yellow]dashboard not started:[/] {exc}")
        return None
    console.print(f"dashboard: [link={handle.url}]{handle.url}[/link]")
    return handle


async def _read_history(conn: BusConnection, cfg: JobConfig) -> list:
    """The whole history: what the synchronizer archived (and trimmed), then the stream; empty,
    and said, when it cannot be read."""
    try:
        return await asyncio.wait_for(read_history(conn, cfg.event_archive_dir), timeout=30.0)
    except (asyncio.TimeoutError, BusError, ArchiveError, nats.errors.Error) as exc:
        console.print("[yellow]the job's stream could not be read for the export:[/] "
                      f"{exc or type(exc).__name__}")
        return []


_HURRY_GRACE_S = 5.0
"""After a second Ctrl-C, how long the roles still running get to record their STOPPED before they
are killed (the first Ctrl-C gives each wave of roles the launcher's full grace)."""


async def _stop_roles(launcher: Launcher, handles: list[RoleHandle], hurry: asyncio.Event) -> None:
    """Stop the roles in order: the trainer and the explorers first, each told once and given
    time to record its STOPPED, then the synchronizer, which records the decisions their stops
    cause. When `hurry` is set (a second Ctrl-C) whatever still runs gets `_HURRY_GRACE_S`, all at
    once, then is killed; the record stays whole either way (the server outlives the roles)."""
    workers = [h for h in handles if h.role != "sync"]
    synchronizers = [h for h in handles if h.role == "sync"]

    async def in_order() -> None:
        await launcher.stop_all(workers)
        await launcher.stop_all(synchronizers)

    stopping = asyncio.create_task(in_order(), name="stop-roles")
    hurried = asyncio.create_task(hurry.wait(), name="hurry")
    await asyncio.wait({stopping, hurried}, return_when=asyncio.FIRST_COMPLETED)
    hurried.cancel()
    if not stopping.done():
        await stop_task(stopping)
        await launcher.stop_all(handles, grace_s=_HURRY_GRACE_S)


def why_it_stopped(log_tail: str) -> str | None:
    """The reason the role's last error line in `log_tail` (JSON lines) gives, or None."""
    for line in reversed(log_tail.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("level") == "error":
            reason = record.get("reason") or record.get("error")
            if reason:
                return str(reason)
    return None


def auth_mismatch(cfg: JobConfig, auth: AuthDir) -> str | None:
    """Why the identities in `auth` cannot run `cfg`, or None."""
    if cfg.job != auth.job:
        return (f"its identities are for job {auth.job!r} but the config's job is {cfg.job!r}: "
                f"run `rolectl auth init --dir DIR --job {cfg.job} ...` for this job")
    if cfg.explorers.count > auth.explorers:
        return (f"the job runs {cfg.explorers.count} explorers but there are identities for "
                f"{auth.explorers}: run `rolectl auth init` again with --explorers {cfg.explorers.count}")
    return None


async def _follow(conn: BusConnection, observer: JobObserver, trackers: Trackers | None = None) -> None:
    """Fold the job's stream into `observer` as it grows (the progress table reads it), and into
    the experiment trackers."""
    async with read_events(conn, from_seq=1, include_decisions=True) as reader:
        async for rec in reader:
            observer.apply(rec)
            if trackers is not None:
                trackers.apply(rec)


def read_serve_url(path: Path) -> str | None:
    """The URL a serving explorer wrote once it listens; None until then (or while it is replaced)."""
    try:
        return str(json.loads(path.read_text())["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _print_serve_urls(cfg: JobConfig, printed: set[str], handles: list) -> None:
    """Each serving explorer's endpoint, once it listens: read where it runs (a launcher whose roles
    run on other machines reads it there: `serve_url` on its handle), else from the job's directory."""
    by_member = {h.member_id: h for h in handles}
    for member in cfg.explorer_ids():
        if member in printed:
            continue
        path = cfg.job_dir / member / "serve_url"
        remote = getattr(by_member.get(member), "serve_url", None)
        url = remote(str(path)) if remote is not None else read_serve_url(path)
        if url is None:
            continue
        printed.add(member)
        console.print(f"serving: {member} [link={url}]{url}[/link] (OpenAI-compatible; "
                      f"rewards: POST {url}/rewards)", highlight=False)
