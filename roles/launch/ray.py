"""`rolectl up --launcher ray`: the same job as local `up`, its roles placed on a Ray cluster.

Ray only places and supervises processes. One placement group per job holds a bundle per role
(from the config: the trainer's num_cpus/num_gpus, each explorer's num_cpus and, with use_gpus,
engine_num x tensor_parallel_size GPUs); in each bundle a named actor (`<job>/<member>` in namespace
`rolectl`) runs its role exactly as `rolectl start` does, as a child process, with the
CUDA_VISIBLE_DEVICES Ray gave the actor. Events still go through NATS and weights out of band.

A role that crashes (killed, or exits with an error) takes its actor down with it, so Ray restarts
the actor (`max_restarts`) and the new incarnation starts the role again; the role's own resume
logic (checkpoint, rejoin) does the rest. The NATS server is given (`--nats`) or run by the job's
own actor on the head node, its store on that node's disk.

Secured (`--auth-dir`, what `rolectl auth init` wrote on the driver's machine): the server runs
from the auth dir's nats-server.conf (TLS, one nkey identity per member), the driver provisions the
streams as admin and follows the job as observer, and each role actor is handed the files of its
own identity only — its nkey seed and the CA certificate, as constructor arguments — which it
writes with mode 0600 into a private 0700 directory on its node and names to its role process in
the ROLECTL_NATS_* variables, as the local launcher does. No actor holds another member's seed,
nothing is written to a shared disk, and no seed is in an environment or a command line Ray shows
(a runtime_env's variables are listed by Ray's dashboard and state API; constructor arguments are
not). The directory is removed when the role ends. See docs/security.md.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rolectl.bus.auth import AuthDir, with_tls_files
from rolectl.bus.security import ClientSecurity
from rolectl.roles.config import EnvSettings, JobConfig
from rolectl.roles.runner import EXIT_ERROR, EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE

__all__ = ["RayUnavailable", "RayLaunchError", "import_ray", "role_bundles", "actor_name", "run_up_ray",
           "NAMESPACE", "INSTALL_HINT"]

NAMESPACE = "rolectl"
INSTALL_HINT = "pip install 'rolectl[ray]'"


class RayUnavailable(RuntimeError):
    """Ray is not installed where `up --launcher ray` runs."""


class RayLaunchError(RuntimeError):
    """The job cannot be placed on this Ray cluster (already running, not enough resources...)."""


def import_ray():
    """The `ray` module, or RayUnavailable saying which extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(
            f"--launcher ray needs Ray, which cannot be imported here ({exc}); install it with "
            f"`{INSTALL_HINT}` (ray[default], which also brings `ray job submit`)") from None
    return ray


def actor_name(job: str, member: str) -> str:
    """Names are per job, so a second `up` of a job still running on the cluster is refused."""
    return f"{job}/{member}"


def role_bundles(cfg: JobConfig) -> list[tuple[str, str, dict[str, float]]]:
    """(role, member id, bundle) in start order: the synchronizer, the trainer, every explorer."""
    explorer_gpus = cfg.explorers.engine_num * cfg.explorers.tensor_parallel_size if cfg.explorers.use_gpus else 0
    out = [("sync", "sync-0", {"CPU": 1.0}),
           ("trainer", "trainer", _bundle(cfg.trainer.num_cpus, cfg.trainer.num_gpus))]
    out += [("explorer", member, _bundle(cfg.explorers.num_cpus, explorer_gpus)) for member in cfg.explorer_ids()]
    return out


def _bundle(cpus: int, gpus: int) -> dict[str, float]:
    return {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}


# -- what runs inside the actors -------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
try:  # resolved before any fork: a child must not load libraries between fork and exec
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _write_private(directory: Path, files: dict[str, bytes]) -> dict[str, Path]:
    """Write `files` (name -> content) into `directory` with mode 0600 from the start; their paths."""
    paths = {}
    for name, content in files.items():
        path = directory / Path(name).name  # a name, never a path out of the directory
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(content)
        paths[name] = path
    return paths


def _private_dir(prefix: str) -> Path:
    """A new directory only this user can enter (mkdtemp makes it 0700), on this node's own disk."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def _prepare_role_process() -> None:
    """In the role process, between fork and exec: take no blocked signals along (a Ray worker
    thread blocks SIGINT, and a role that never sees it cannot publish STOPPED), and be SIGKILLed
    when the thread that started it (the actor's watcher, alive as long as the actor) dies, so a
    killed actor leaves no orphan."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RoleActor:
    """One role as `rolectl start ROLE` in a child process of this actor. Restarted by Ray after a
    crash of its role (the actor exits with it); a role that finished, gave up (exit 3) or was
    stopped through `stop` ends for good."""

    def __init__(self, role: str, member_id: str, config_text: str, config_path: str, nats_url: str,
                 logs_dir: str, identity: dict[str, bytes] | None = None) -> None:
        """`identity` (secured jobs): this member's credential and the CA, {file name: content}."""
        import ray

        self.role, self.member_id, self.nats_url = role, member_id, nats_url
        self._identity_dir: Path | None = None
        self._security_env: dict[str, str] = {}
        if identity is not None:
            self._identity_dir = _private_dir(f"rolectl-{member_id}-")
            written = _write_private(self._identity_dir, identity)
            ca = written.pop("ca.pem")
            (creds,) = written.values()
            self._security_env = ClientSecurity(creds=str(creds), tls_ca=str(ca)).as_env()
        self.config_path = Path(config_path)
        self.log_path = Path(logs_dir) / f"{member_id}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if not self.config_path.exists() or self.config_path.read_text() != config_text:
            tmp = self.config_path.with_name(f".{self.config_path.name}.{os.getpid()}")
            tmp.write_text(config_text)  # this node may not share the driver's disk
            tmp.replace(self.config_path)
        counter = self.log_path.with_suffix(".incarnations")
        self.incarnation = int(counter.read_text()) + 1 if counter.exists() else 0
        counter.write_text(str(self.incarnation))
        self.node_ip = ray.util.get_node_ip_address()
        self._stopping = threading.Event()
        self._exited = threading.Event()
        self._started = threading.Event()
        self._code: int | None = None
        self._proc: subprocess.Popen | None = None
        self._spawn_error: BaseException | None = None
        threading.Thread(target=self._watch, name=f"role-{member_id}", daemon=True).start()
        self._started.wait()
        if self._spawn_error is not None:
            raise self._spawn_error

    def _watch(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", EnvSettings.variable("advertise_host"): self.node_ip,
               **self._security_env}  # its own identity, by file path (never argv)
        try:
            with open(self.log_path, "ab") as out:
                out.write((f"--- rolectl up --launcher ray: {self.member_id} incarnation {self.incarnation} "
                           f"on {self.node_ip}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}\n"
                           ).encode())
                out.flush()
                # A restart by Ray continues this run's saved state, whatever the stream says of it
                # (a role killed just after it finished its work rejoins and exits 0 instead of
                # refusing with "nothing to resume" until the restarts run out).
                resume = ["--resume"] if self.incarnation > 0 and self.role != "sync" else []
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "rolectl", "start", self.role, "--config", str(self.config_path),
                     "--nats", self.nats_url, "--id", self.member_id, *resume],
                    stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_prepare_role_process)
        except BaseException as exc:
            self._spawn_error = exc
            return
        finally:
            self._started.set()
        code = self._proc.wait()
        self._forget_identity()  # the role is over either way; a restarted actor writes its own
        # done, ended short, or refused to start (bad config or flags: a restart cannot fix it)
        if code in (EXIT_OK, EXIT_INCOMPLETE, EXIT_USAGE) or self._stopping.is_set():
            self._code = code
            self._exited.set()
            return
        # A crash: this actor goes down with its role, so Ray restarts it (max_restarts) and the
        # next incarnation starts the role again. os._exit: an unexpected death is what Ray restarts.
        with open(self.log_path, "ab") as out:
            out.write(f"--- {self.member_id} exited with code {code}: its actor exits so Ray restarts it\n".encode())
        os._exit(1)

    def _forget_identity(self) -> None:
        if self._identity_dir is not None:
            shutil.rmtree(self._identity_dir, ignore_errors=True)

    def read_serve_url(self, path: str) -> str | None:
        """The serving explorer's URL, read on this node (the driver may not share its disk)."""
        from rolectl.roles.launch.local import read_serve_url

        return read_serve_url(Path(path))

    def pid(self) -> int:
        """The role process's PID (on this actor's node)."""
        return self._proc.pid

    def incarnations(self) -> int:
        return self.incarnation

    def wait_exit(self) -> int:
        """The role's final exit code (a crash is not final: this call is retried on the restarted actor)."""
        self._exited.wait()
        return self._code

    def stop(self, grace_s: float) -> int:
        """SIGINT (the role publishes STOPPED), SIGKILL after `grace_s`; its exit code."""
        self._stopping.set()
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._exited.wait(10)
        return self._code if self._code is not None else self._proc.returncode

    def tail(self, lines: int) -> str:
        from rolectl.roles.launch.local import tail_file

        return tail_file(self.log_path, lines)


class JobActor:
    """The job's anchor on the cluster (its name refuses a second `up` of the job) and, unless a
    server was given, the job's nats-server, on the node this actor runs on (the head)."""

    def __init__(self) -> None:
        self.server = None
        self._private: Path | None = None  # a secured server's certificate, key and config

    def start_nats(self, store_dir: str, log_file: str, go_gc: int | None = None) -> tuple[str, str]:
        import ray

        from rolectl.bus.server import NatsServer

        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        self.server = NatsServer(host="0.0.0.0", store_dir=store_dir, log_file=log_file, go_gc=go_gc)
        self.server.start()
        ip = ray.util.get_node_ip_address()
        return f"nats://{ip}:{self.server.port}", f"http://{ip}:{self.server.http_port}"

    def start_secured_nats(self, conf_text: str, files: dict[str, bytes], port: int, http_port: int,
                           log_file: str, go_gc: int | None = None) -> None:
        """The job's nats-server from the config `rolectl auth init` wrote (its store moved to this
        run), with the server's certificate and key, written into a private directory on this node."""
        from rolectl.bus.server import NatsServer

        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        self._private = _private_dir("rolectl-nats-")
        written = _write_private(self._private, files)
        conf_text = with_tls_files(conf_text, cert_file=written["server.pem"], key_file=written["server.key"])
        conf = _write_private(self._private, {"nats-server.conf": conf_text.encode()})["nats-server.conf"]
        self.server = NatsServer(config_file=str(conf), host="127.0.0.1", port=port, http_port=http_port,
                                 log_file=log_file, go_gc=go_gc)
        self.server.start()

    def stop_nats(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None


# -- the driver side ---------------------------------------------------------------------------------

@dataclasses.dataclass
class RayRole:
    """A `RoleHandle` for a role run by a RoleActor."""

    role: str
    member_id: str
    actor: Any
    log_path: Path
    _exit_ref: Any = None
    _code: int | None = None
    _incarnations: int = 0
    died: bool = False
    _url_ref: Any = None

    @property
    def name(self) -> str:
        return self.member_id

    def poll(self) -> int | None:
        if self._code is None:
            import ray

            ready, _ = ray.wait([self._exit_ref], timeout=0)
            if ready:
                try:
                    self._code = ray.get(ready[0])
                except ray.exceptions.RayError:  # the actor is gone for good: restarts spent
                    self._code, self.died = EXIT_ERROR, True
        return self._code

    @property
    def returncode(self) -> int | None:
        return self._code

    @property
    def restarts(self) -> int:
        return self._incarnations

    def serve_url(self, path: str) -> str | None:
        """The URL its serving explorer wrote on its node, once it has; never blocks (one read in flight)."""
        import ray

        if self._url_ref is None:
            self._url_ref = self.actor.read_serve_url.remote(path)
        ready, _ = ray.wait([self._url_ref], timeout=0)
        if not ready:
            return None
        ref, self._url_ref = self._url_ref, None
        try:
            return ray.get(ref)
        except ray.exceptions.RayError:  # restarting: ask again next time
            return None

    def tail(self, lines: int = 15) -> str:
        import ray

        prefix = "(its actor died after its last restart)\n" if self.died else ""
        try:
            return prefix + ray.get(self.actor.tail.remote(lines), timeout=10)
        except ray.exceptions.RayError:
            from rolectl.roles.launch.local import tail_file

            return prefix + tail_file(self.log_path, lines)  # this node's copy, where it runs here


@dataclasses.dataclass
class RayLauncher:
    """Role actors in one placement group, one bundle each (`role_bundles` order)."""

    cfg: JobConfig
    placement_group: Any
    config_path: Path
    logs: Path
    max_restarts: int
    auth: AuthDir | None = None
    name: str = "ray"
    started: list[RayRole] = dataclasses.field(default_factory=list)

    def _identity(self, member_id: str) -> dict[str, bytes] | None:
        """The files of `member_id`'s identity (its nkey seed, the CA): what its actor, and it alone, gets."""
        if self.auth is None:
            return None
        security = self.auth.security(member_id)  # FileNotFoundError naming what auth init lacks
        return {Path(security.creds).name: Path(security.creds).read_bytes(), "ca.pem": self.auth.ca.read_bytes()}

    def start(self, role: str, member_id: str) -> RayRole:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index, bundle = next((i, b) for i, (_, m, b) in enumerate(role_bundles(self.cfg)) if m == member_id)
        actor = ray.remote(RoleActor).options(
            name=actor_name(self.cfg.job, member_id), namespace=NAMESPACE,
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            max_restarts=self.max_restarts, max_task_retries=-1,
            max_concurrency=4,  # wait_exit blocks; stop and tail must still get through
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=index),
        ).remote(role, member_id, self.config_path.read_text(), str(self.config_path), self.cfg.nats_url,
                 str(self.logs), self._identity(member_id))
        handle = RayRole(role=role, member_id=member_id, actor=actor, log_path=self.logs / f"{member_id}.log")
        handle._exit_ref = actor.wait_exit.remote()
        self.started.append(handle)
        return handle

    async def stop_all(self, handles: list[RayRole], grace_s: float = 15.0) -> None:
        import ray

        running = [h for h in handles if h.poll() is None]
        if running:
            stops = [h.actor.stop.remote(grace_s) for h in running]
            await asyncio.to_thread(ray.wait, stops, num_returns=len(stops), timeout=grace_s + 20)
            await asyncio.to_thread(ray.wait, [h._exit_ref for h in running], num_returns=len(running),
                                    timeout=10)
        for h in handles:
            h.poll()
            try:  # the count the summary reports: how often Ray started this role's actor again
                h._incarnations = await asyncio.to_thread(ray.get, h.actor.incarnations.remote(), timeout=10)
            except ray.exceptions.RayError:
                pass

    def close(self) -> None:
        import ray

        for h in self.started:
            try:
                ray.kill(h.actor, no_restart=True)
            except Exception:  # already gone
                pass


def _available_resources(ray) -> dict[str, float]:
    return {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}


def run_up_ray(cfg: JobConfig, *, ray_address: str | None, nats: str | None = None,
               explorers: int | None = None, summary_path: str | None = None, dashboard: bool = True,
               dashboard_port: int = 0, run_dir: str | None = None, timeout_s: float | None = None,
               max_restarts: int = 3, placement_timeout_s: float = 120.0, auth: AuthDir | None = None) -> int:
    """`rolectl up --launcher ray`: place the job on a Ray cluster, supervise it as local `up` does
    (same exit codes, same summary plus `launcher`), tear everything down at its end or on Ctrl-C.
    With `auth` the job runs secured (see the module docstring). Raises RayUnavailable (no Ray) or
    RayLaunchError (cannot place the job, or identities that do not fit it) before anything starts."""
    ray = import_ray()
    from rolectl.bus.logging import setup_logging
    from rolectl.roles.launch.local import auth_mismatch, console, supervise, write_config

    setup_logging("warning")
    if explorers is not None:
        cfg = cfg.with_overrides(explorers=cfg.explorers.replace(count=explorers))
    if auth is not None and (problem := auth_mismatch(cfg, auth)):
        raise RayLaunchError(f"--auth-dir {auth.path}: {problem}")
    bundles = role_bundles(cfg)
    _init_ray(ray, ray_address, needed_cpus=sum(b["CPU"] for _, _, b in bundles))
    job_actor = pg = launcher = None
    try:
        job_actor = _start_job_actor(ray, cfg)
        pg = _place(ray, cfg, bundles, placement_timeout_s)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_path = Path(run_dir or cfg.run_dir).resolve() / f"{cfg.job}-{stamp}-{os.getpid()}"
        (run_path / "logs").mkdir(parents=True, exist_ok=True)
        url, monitor_url = (nats, None) if nats else _start_nats(ray, job_actor, cfg, run_path, auth)
        cfg = cfg.with_overrides(nats_url=url, run_dir=str(run_path))
        config_path = run_path / "job.yaml"
        write_config(cfg, config_path)
        console.print(f"[bold]rolectl up --launcher ray[/] job [cyan]{cfg.job}[/]: nats {url}, Ray "
                      f"{ray.get_runtime_context().gcs_address}, placement group of {len(bundles)} bundles, "
                      f"run dir {run_path}", highlight=False)
        launcher = RayLauncher(cfg=cfg, placement_group=pg, config_path=config_path, logs=run_path / "logs",
                               max_restarts=max_restarts, auth=auth)
        try:
            return asyncio.run(supervise(cfg, launcher, run_path, monitor_url=monitor_url, summary_path=summary_path,
                                         dashboard=dashboard, dashboard_port=dashboard_port, timeout_s=timeout_s,
                                         auth=auth,
                                         extra_summary={"ray_address": ray.get_runtime_context().gcs_address}))
        except KeyboardInterrupt:
            return 130
    finally:
        _tear_down(ray, launcher, job_actor, pg)


def _start_nats(ray, job_actor, cfg: JobConfig, run_path: Path, auth: AuthDir | None) -> tuple[str, str]:
    """The job's nats-server on the head node (its URL and monitoring URL): plain, or secured from
    the auth dir's config, whose URL (its certificate's first host) every node dials."""
    store, log = str(run_path / "nats"), str(run_path / "logs" / "nats-server.log")
    if auth is None:
        return ray.get(job_actor.start_nats.remote(store, log, cfg.server_go_gc), timeout=120)
    files = {name: (auth.path / name).read_bytes() for name in ("server.pem", "server.key")}
    ray.get(job_actor.start_secured_nats.remote(auth.server_conf_with_store(store), files, auth.port,
                                                auth.http_port, log, cfg.server_go_gc), timeout=120)
    return auth.url, auth.monitor_url


def _init_ray(ray, address: str | None, *, needed_cpus: float) -> None:
    """Join the given cluster (or RAY_ADDRESS's), else start a Ray of our own sized for the job."""
    address = address or os.environ.get("RAY_ADDRESS")
    init: dict[str, Any] = dict(namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    if address:
        ray.init(address=address, **init)
    else:  # a Ray of our own on this machine, sized for the job's bundles
        ray.init(num_cpus=max(os.cpu_count() or 1, int(needed_cpus)), include_dashboard=False, **init)


def _start_job_actor(ray, cfg: JobConfig):
    """The job's own actor (it runs the NATS server); its name refuses a second `up` of the job."""
    try:
        return ray.remote(JobActor).options(
            name=actor_name(cfg.job, "job"), namespace=NAMESPACE, num_cpus=0,
            # on the head node: its disk keeps the NATS store, and it is there for the cluster's life
            resources={"node:__internal_head__": 0.001},
        ).remote()
    except ValueError as exc:
        raise RayLaunchError(
            f"job {cfg.job!r} is already running on this Ray cluster (actor {actor_name(cfg.job, 'job')!r} "
            f"in namespace {NAMESPACE!r} exists: {exc}); stop that `rolectl up` first, or give this run "
            "another job name") from None


def _place(ray, cfg: JobConfig, bundles: list, timeout_s: float):
    """The job's placement group, ready; RayLaunchError when the cluster is too small or busy."""
    from ray.util.placement_group import placement_group

    have = _available_resources(ray)
    asks = {"CPU": sum(b["CPU"] for _, _, b in bundles), "GPU": sum(b.get("GPU", 0) for _, _, b in bundles)}
    short = {k: v for k, v in asks.items() if v > have.get(k, 0)}
    if short:
        raise RayLaunchError(
            f"job {cfg.job!r} needs {asks} (bundles {[(m, b) for _, m, b in bundles]}) but the Ray cluster has "
            f"{have} in all: add nodes, or lower trainer.num_cpus/num_gpus, explorers.num_cpus/use_gpus "
            "or the number of explorers")
    pg = placement_group([b for _, _, b in bundles], strategy="PACK", name=f"rolectl-{cfg.job}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise RayLaunchError(
            f"job {cfg.job!r}: its placement group {[b for _, _, b in bundles]} was not ready after "
            f"{timeout_s:.0f} s (free now: {ray.available_resources()}); other jobs may hold "
            "the resources")
    return pg


def _tear_down(ray, launcher: RayLauncher | None, job_actor, pg) -> None:
    """Kill the roles' actors, stop the NATS server and its actor, free the placement group, leave Ray."""
    from ray.util.placement_group import remove_placement_group

    if launcher is not None:
        launcher.close()
    if job_actor is not None:
        try:
            ray.get(job_actor.stop_nats.remote(), timeout=30)
        except Exception:  # never created, or already gone
            pass
        ray.kill(job_actor, no_restart=True)
    if pg is not None:
        remove_placement_group(pg)
    ray.shutdown()
