"""The live dashboard of a job: one page (server-sent events, no build step), a JSON snapshot at
`/api/state`, and the same figures for Prometheus at `/metrics`.

Theory of operation
-------------------
The dashboard is a read-only observer. It folds the job's archived history first (when it knows the
archive directory: `--archive`, the job's config, or `rolectl up`), then follows the stream with
`read_events` from where the archive ends (a stretch trimmed meanwhile is read back from the
archive), so archive and live tail are one history. It folds it
with `roles.observe.observer.JobObserver` (the pure reducer, skipping illegal inputs like the synchronizer),
listens to heartbeats for "last seen", and polls the nats-server monitoring endpoint (`/varz`,
`/jsz`) for server health. Every change bumps a counter; each open page gets a fresh snapshot over
server-sent events at most a few times a second. It never publishes anything.

`start_dashboard()` runs inside the caller's event loop (`rolectl up` uses it);
`serve_dashboard()` is the foreground `rolectl dashboard` command.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from rich.console import Console

from rolectl.bus.archive import ArchiveError, archived_upto, read_range, read_segment, segments
from rolectl.bus.connection import connect
from rolectl.bus.errors import BusError, describe
from rolectl.bus.events import last_sequence, read_events, subscribe_heartbeats
from rolectl.bus.logging import setup_logging
from rolectl.bus.security import redact
from rolectl.bus.snapshots import SnapshotStore
from rolectl.bus.subjects import JobNames
from rolectl.roles.exit_codes import ExitCode
from rolectl.roles.observe.observer import JobObserver, mismatch_view, pace_view
from rolectl.roles.observe.prometheus import JobCollector
from rolectl.roles.observe.views import member_counts
from rolectl.roles.stopping import stop_task
from rolectl.sync_protocol import Role

__all__ = ["Dashboard", "DashboardHandle", "start_dashboard", "serve_dashboard", "default_monitor_url"]

STATIC_DIR = Path(__file__).with_name("dashboard_static")
_SSE_MIN_INTERVAL_S = 0.25  # at most 4 snapshots a second per page: enough to look live
_SSE_KEEPALIVE_S = 15.0
_MONITOR_PERIOD_S = 1.0
_STREAM_RETRY_S = 0.5
_ROUNDS_SHOWN = 60
_LOG_SHOWN = 120
_POINTS_SHOWN = 1500


def default_monitor_url(nats_url: str) -> str:
    """The monitoring URL a nats-server usually has: same host, port 8222."""
    first = nats_url.split(",")[0].strip()
    host = urlparse(first if "://" in first else f"nats://{first}").hostname or "127.0.0.1"
    return f"http://{host}:8222"


async def _preflight(job: str, nats_url: str, monitor_url: str, *, monitor_given: bool, security=None) -> list[str]:
    """What is wrong with where the dashboard looks, each with what to do (empty: both answer).

    The page keeps retrying either way; this is for the person at the console, who otherwise saw
    only the URLs and an empty page."""
    from rolectl.bus.connection import connect
    from rolectl.bus.errors import BusError

    problems = []
    try:
        async with connect(nats_url, job=job, role="observer", member=f"dashboard-{os.getpid()}",
                           connect_timeout=3.0, security=security):
            pass
    except BusError as exc:  # its message says where, why and what to run
        problems.append(f"{exc} The dashboard keeps trying meanwhile.")
    except Exception as exc:
        problems.append(f"NATS at {redact(nats_url)} does not answer ({describe(exc)}). Start one "
                        "(`rolectl server`, or `rolectl up` prints its URL) or pass --nats URL; the dashboard "
                        "keeps trying meanwhile")
    try:
        timeout = aiohttp.ClientTimeout(total=3.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(f"{monitor_url.rstrip('/')}/varz") as resp:
                resp.raise_for_status()
    except Exception as exc:
        why = describe(exc)
        guess = "" if monitor_given else " (the default guess: the --nats host, port 8222)"
        problems.append(f"no nats-server monitoring at {monitor_url}{guess}: {why}. Pass --monitor-url "
                        "http://HOST:PORT: `rolectl server` prints it (its --http-port), `rolectl up` prints it "
                        "on its first line; the NATS health panel stays empty until then")
    return problems


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _thin(points: list, limit: int = _POINTS_SHOWN) -> list:
    """At most `limit` points, evenly spaced, always keeping the last one."""
    if len(points) <= limit:
        return points
    step = len(points) / limit
    out = [points[int(i * step)] for i in range(limit - 1)]
    out.append(points[-1])
    return out


class Dashboard:
    """The dashboard's model and background work: follow the stream, heartbeats, server health."""

    def __init__(self, *, job: str, nats_url: str, monitor_url: str | None, security=None,
                 archive_dir: Path | None = None):
        self.job = job
        self.archive_dir = Path(archive_dir) if archive_dir is not None else None
        # what was folded from the archive: records, the last sequence, why it stopped short (if so)
        self.archived: dict[str, Any] = {"dir": str(self.archive_dir) if self.archive_dir else None,
                                         "records": 0, "upto_seq": 0, "error": None}
        self.names = JobNames(job)  # a bad job name fails here, before anything starts
        self._connect_url = nats_url
        self.nats_url = redact(nats_url)  # what the page and /api/state show
        self.security = security
        self.monitor_url = monitor_url.rstrip("/") if monitor_url else None
        self.observer = JobObserver(log_tail=_LOG_SHOWN)
        self.connection = "connecting"
        self.error: str | None = None
        self.nats: dict[str, Any] = {"ok": None, "error": None if monitor_url else "no monitoring URL given"}
        self.started_ms = _now_ms()
        self.changes = 0
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._follow(), name="dashboard-follow"))
        if self.monitor_url:
            self._tasks.append(asyncio.create_task(self._poll_monitor(), name="dashboard-monitor"))

    async def aclose(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            await stop_task(task)

    async def _bump(self) -> None:
        async with self._changed:
            self.changes += 1
            self._changed.notify_all()

    async def wait_change(self, seen: int, timeout: float) -> int:
        """Wait until the model changed after `seen` (or `timeout`); returns the current counter."""

        async def changed() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: self.changes != seen)

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed(), timeout)
        return self.changes

    # -- following the job -----------------------------------------------------------------------

    async def _follow(self) -> None:
        while True:
            try:
                async with connect(self._connect_url, job=self.job, role="observer",
                                   member=f"dashboard-{os.getpid()}", security=self.security) as conn:
                    hb = await subscribe_heartbeats(conn, self._on_heartbeat)
                    try:
                        while True:  # the dashboard may start before any member created the stream
                            try:
                                await last_sequence(conn)
                                break
                            except BusError as exc:
                                await self._set_connection("waiting for the job's stream", str(exc))
                                await asyncio.sleep(_STREAM_RETRY_S)
                        await self._set_connection("live", None)
                        if self.archive_dir is not None and not self.observer.records:
                            await self._fold_archive()
                        start = self.observer.state.last_seq + 1
                        first = (await conn.js.stream_info(conn.names.event_stream)).state.first_seq
                        backfill = None
                        if self.archive_dir is not None and not self.archived["error"]:
                            archive = self.archive_dir
                            held = archived_upto(archive)
                            if first > start and held < first - 1:
                                self.archived["error"] = (
                                    f"the archive in {archive} holds records up to seq {held} and the stream "
                                    f"starts at {first}: the history shown starts at the newest snapshot")
                            else:
                                backfill = functools.partial(read_range, archive)
                        if backfill is None and first > start:
                            # trimmed below what we hold, no archive to read it from: the newest snapshot
                            snapshot = await SnapshotStore(conn).latest()
                            if snapshot is not None and snapshot.state.last_seq >= start:
                                self.observer = JobObserver(log_tail=_LOG_SHOWN, start=snapshot.state)
                                start = snapshot.state.last_seq + 1
                        async with read_events(conn, from_seq=start, include_decisions=True,
                                               backfill=backfill) as reader:
                            async for rec in reader:
                                self.observer.apply(rec)
                                await self._bump()
                    finally:
                        await hb.aclose()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away or the reader failed: show it, try again
                await self._set_connection("reconnecting", describe(exc))
                await asyncio.sleep(1.0)

    async def _fold_archive(self) -> None:
        """Fold the archived segments, oldest first, one at a time (a long job's archive is never
        held whole). A damaged segment stops it there, and the page says so: the history shown
        then starts at the newest snapshot, as without an archive."""
        assert self.archive_dir is not None
        for segment in segments(self.archive_dir):
            try:
                records = await asyncio.to_thread(read_segment, segment)
            except ArchiveError as exc:
                self.archived["error"] = str(exc)
                self.observer = JobObserver(log_tail=_LOG_SHOWN)
                self.archived.update(records=0, upto_seq=0)
                break
            for rec in records:
                self.observer.apply(rec)  # a sequence already folded (segments overlap) is passed over
            self.archived.update(records=self.observer.records, upto_seq=self.observer.state.last_seq)
            await self._bump()

    async def _set_connection(self, state: str, error: str | None) -> None:
        if (self.connection, self.error) != (state, error):
            self.connection, self.error = state, redact(error) if error else error
            await self._bump()

    async def _on_heartbeat(self, hb) -> None:
        self.observer.heartbeat(hb.member.key, _now_ms())
        await self._bump()

    async def _poll_monitor(self) -> None:
        timeout = aiohttp.ClientTimeout(total=_MONITOR_PERIOD_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    varz = await self._get(session, "/varz")
                    jsz = await self._get(session, "/jsz?streams=true")
                    self.nats = self._health(varz, jsz)
                except Exception as exc:  # the server is away: say so on the page
                    self.nats = {**self.nats, "ok": False,
                                 "error": f"{self.monitor_url} unreachable ({describe(exc)})"}
                await self._bump()
                await asyncio.sleep(_MONITOR_PERIOD_S)  # polling period of the monitoring endpoint

    async def _get(self, session: aiohttp.ClientSession, path: str) -> dict[str, Any]:
        async with session.get(f"{self.monitor_url}{path}") as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    def _health(self, varz: dict[str, Any], jsz: dict[str, Any]) -> dict[str, Any]:
        ours = {self.names.event_stream, self.names.experience_stream, self.names.weights_stream}
        streams = []
        for account in jsz.get("account_details") or []:
            for s in account.get("stream_detail") or []:
                state = s.get("state") or {}
                streams.append({"name": s.get("name"), "messages": state.get("messages", 0),
                                "bytes": state.get("bytes", 0), "consumers": state.get("consumer_count", 0),
                                "last_seq": state.get("last_seq", 0), "ours": s.get("name") in ours})
        streams.sort(key=lambda s: (not s["ours"], s["name"] or ""))
        keys = ("version", "uptime", "connections", "total_connections", "in_msgs", "out_msgs", "in_bytes",
                "out_bytes", "slow_consumers", "mem", "cpu", "subscriptions")
        return {
            "ok": True,
            "error": None,
            "polled_ms": _now_ms(),
            "server": {k: varz.get(k) for k in keys},
            "jetstream": {k: jsz.get(k) for k in ("streams", "consumers", "messages", "bytes", "memory", "storage")},
            "streams": streams,
        }

    # -- views -----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything the page renders, as plain JSON."""
        obs = self.observer
        now = _now_ms()
        state = obs.state
        rounds = [r.to_json() for r in list(obs.rounds.values())[-_ROUNDS_SHOWN:]]
        # every round closed since the start (the kept `rounds` are only the newest few thousand)
        outcomes = dict(sorted(obs.round_outcomes.items()))
        closed = [r for r in obs.rounds.values() if r.outcome is not None]  # the kept ones, for the chart
        moved = [r for r in obs.rounds.values() if r.gbps]
        last_rate = next((r.gbps for r in reversed(moved)), None)
        stale = obs.staleness[-1] if obs.staleness else None
        latest = obs.latest()
        published = obs.versions[-1] if obs.versions else None
        latest["published_ms"] = published.time_ms if published and published.version == latest["version"] else None
        trainer = state.trainer_state
        return {
            "job": self.job,
            "now_ms": now,
            "connection": {"state": self.connection, "error": self.error, "nats_url": self.nats_url},
            "archive": dict(self.archived),
            "job_state": _job_state(obs),
            "stream": {"last_seq": state.last_seq, "records": obs.records, "decisions": obs.decisions_recorded,
                       "illegal": obs.illegal_total, "first_ms": obs.first_time_ms, "last_ms": obs.last_time_ms},
            "config": state.config.to_mapping() if state.config else None,
            "latest": latest,
            "trainer": {"step": trainer.step, "version": trainer.version, "status": trainer.status.value,
                        "total_steps": int(trainer.metrics.get("total_steps", 0)) or None,
                        "metrics": dict(trainer.metrics)} if trainer else None,
            # stragglers first within each role (the page lists them a page at a time), and the counts
            "members": (members := obs.members(now)),
            "member_counts": member_counts(members),
            "rounds": rounds,
            "rounds_summary": {"closed": sum(outcomes.values()), "open": len(state.rounds), "outcomes": outcomes,
                               "total": len(obs.rounds)},
            "versions": [vars(v) for v in list(obs.versions)[-30:]],
            "throughput": {"bytes_loaded_total": obs.bytes_loaded_total, "last_gbps": last_rate,
                           # every load with bytes since the start, as the summary's weight_loads
                           "transfers": obs.weight_loads},
            "served": obs.served_view(),  # serve mode's traffic (None when no explorer serves)
            "agent": obs.agent.summary(),  # an agent job's episodes, turns, tool calls, errors (else None)
            "staleness": {"mean": stale[1] if stale else None, "dropped_total": stale[2] if stale else None,
                          "corrected_total": obs.corrected_stale,  # kept past the bound (staleness_policy)
                          "series": _thin([[s, m, d] for s, m, d in obs.staleness])},
            "pace": pace_view(obs),  # explorers paused for running ahead of the trainer (max_ahead)
            "mismatch": mismatch_view(obs),  # the rollout/trainer logprob gap and its alarm
            # algorithm.dynamic_sampling: groups of equal rewards explorers filtered, and their experiences
            "filtered": {"groups": obs.groups_filtered.total, "experiences": obs.experiences_filtered.total},
            "series": {
                "reward": _thin([[step, reward] for step, reward, _ in obs.reward]),
                # eval means by version, on the reward's axis: version N is the weights after train step N
                "eval": {name: _thin([[e["version"], e["rewards"][name]] for e in obs.evals if name in e["rewards"]])
                         for name in dict.fromkeys(k for e in obs.evals for k in e["rewards"])},
                "sync_time": _thin([[r.id, r.duration_ms / 1000 if r.duration_ms is not None else None,
                                     r.transfer_seconds] for r in closed]),
            },
            "log": [vars(line) for line in list(obs.log)[-_LOG_SHOWN:]],
            "nats": self.nats,
        }


def _job_state(obs: JobObserver) -> dict:
    """Whether the job is still going: `ended` once the trainer finished, or once every trainer and
    explorer that joined is gone (stopped or expired) — the page then stops saying "live"."""
    outcome = obs.outcome()
    workers = [m for m in obs.state.members.values() if m.ref.role in (Role.TRAINER, Role.EXPLORER)]
    trainer = obs.state.trainer_state
    ended = trainer is not None and (trainer.finished or not any(m.alive for m in workers))
    return {"ended": ended, "outcome": outcome.status, "reason": outcome.reason}


def _app(dashboard: Dashboard) -> web.Application:
    registry = CollectorRegistry(auto_describe=False)  # per app: several dashboards per process
    registry.register(JobCollector(dashboard))
    app = web.Application()

    async def index(_request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def state(_request: web.Request) -> web.Response:
        return web.json_response(dashboard.snapshot(), dumps=_dumps)

    async def metrics(_request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "connection": dashboard.connection})

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        seen = -1
        try:
            while True:
                if dashboard.changes != seen:
                    seen = dashboard.changes
                    await resp.write(f"data: {_dumps(dashboard.snapshot())}\n\n".encode())
                    await asyncio.sleep(_SSE_MIN_INTERVAL_S)  # rate limit, not synchronisation
                    continue
                before = seen
                now = await dashboard.wait_change(seen, _SSE_KEEPALIVE_S)
                if now == before:
                    await resp.write(b": keep-alive\n\n")
        except ConnectionResetError:
            pass  # the page went away
        return resp

    app.router.add_get("/", index)
    app.router.add_get("/api/state", state)
    app.router.add_get("/api/events", events)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_static("/static/", STATIC_DIR, append_version=False)
    return app


def _dumps(value: Any) -> str:
    return json.dumps(_finite(value), separators=(",", ":"), default=str)


def _finite(value: Any) -> Any:
    """NaN and infinities become null: JSON has no spelling for them (a diverged loss has)."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


@dataclass
class DashboardHandle:
    """A running dashboard: `url`, the model (`dashboard`), and `aclose()` (safe twice)."""

    url: str
    dashboard: Dashboard
    _runner: web.AppRunner

    async def aclose(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        await self.dashboard.aclose()
        await runner.cleanup()


async def start_dashboard(*, job: str, nats_url: str, monitor_url: str | None, host: str = "127.0.0.1",
                          port: int = 0, security=None, archive_dir: Path | None = None) -> DashboardHandle:
    """Serve the dashboard of `job` on `host:port` (0: a free port) inside the running event loop;
    with `archive_dir`, the job's archived history comes first (see the module's docstring)."""
    dashboard = Dashboard(job=job, nats_url=nats_url, monitor_url=monitor_url, security=security,
                          archive_dir=archive_dir)
    runner = web.AppRunner(_app(dashboard), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot serve the dashboard on {host}:{port}: {exc.strerror or exc} "
                      "(pick another --port / --dashboard-port, or 0 for a free one)") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    dashboard.start()
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return DashboardHandle(url=f"http://{shown}:{bound}/", dashboard=dashboard, _runner=runner)


def serve_dashboard(*, job: str, nats: str, host: str, port: int, monitor_url: str | None,
                    security=None, archive_dir: Path | None = None) -> int:
    """`rolectl dashboard`: serve until Ctrl-C. 0 on a clean stop, 1 when it cannot start."""
    setup_logging("warning")
    console = Console(stderr=True)
    monitor = monitor_url or default_monitor_url(nats)

    async def main() -> int:
        try:
            handle = await start_dashboard(job=job, nats_url=nats, monitor_url=monitor, host=host, port=port,
                                           security=security, archive_dir=archive_dir)
        except OSError as exc:  # the port is taken (or the host cannot be bound): as `rolectl server`, exit 2
            console.print(f"rolectl dashboard: --port {port}: {host}:{port} cannot be used ({exc.strerror or exc}); "
                          "pass a free --port, or stop what listens there", style="red", markup=False,
                          highlight=False, soft_wrap=True)
            return ExitCode.USAGE
        except ValueError as exc:
            console.print(f"rolectl dashboard: {exc}", style="red", markup=False, highlight=False, soft_wrap=True)
            return ExitCode.ERROR
        console.print(f"dashboard of job {job} at {handle.url} (NATS {redact(nats)}, monitoring {monitor}); "
                      "Ctrl-C stops it", markup=False, highlight=False, soft_wrap=True)
        for problem in await _preflight(job, nats, monitor, monitor_given=monitor_url is not None, security=security):
            console.print(f"warning: {problem}", style="yellow", markup=False, highlight=False, soft_wrap=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await handle.aclose()
        return ExitCode.OK

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return ExitCode.OK
