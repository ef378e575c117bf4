"""`rolectl`: run a role, a whole job, a dev server; inspect, replay and watch a job."""

from __future__ import annotations

import asyncio
import sys
from contextlib import contextmanager
from pathlib import Path

import click

__all__ = ["main"]

ROLE_NAMES = ("trainer", "explorer", "sync")


class InputError(click.ClickException):
    """The command did not start: a bad config, input file or port (exit 2, as click's usage errors)."""

    exit_code = 2


def _port_taken(host: str, port: int) -> bool:
    """True when `port` on `host` cannot be bound now (another process listens there)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _check_nats_url(_ctx, param, value: str | None) -> str | None:
    """--nats: one or more comma-separated server URLs; a malformed one is a usage error (exit 2),
    said before anything starts."""
    if value is None:
        return None
    from rolectl.bus.connection import parse_server_urls

    try:
        parse_server_urls(value)
    except ValueError as exc:
        raise click.BadParameter(f"{exc}; several servers are separated by commas", param=param) from None
    return value


def nats_option(default: str | None, help: str):
    return click.option("--nats", default=default, show_default=default is not None, callback=_check_nats_url,
                        help=help)


def client_options(command):
    """--creds / --tls-ca / --tls-cert / --tls-key: files, never secrets on the command line; each read
    from its ROLECTL_NATS_* variable when not given (click's `envvar`, shown in --help)."""
    from rolectl.bus.security import ENV_VARS

    file = click.Path(exists=True, dir_okay=False)
    for field, text in reversed([
        ("creds", "Credential file of this identity: nkey seed (.nk), NATS JWT creds (.creds) or client "
                  "certificate (.crt, key in .key)."),
        ("tls_ca", "CA file that signed the server's certificate."),
        ("tls_cert", "Client certificate (mTLS), with --tls-key."),
        ("tls_key", "Client certificate's key."),
    ]):
        command = click.option(f"--{field.replace('_', '-')}", type=file, default=None, envvar=ENV_VARS[field],
                               show_envvar=True, help=text)(command)
    return command


def _security(creds=None, tls_ca=None, tls_cert=None, tls_key=None, *, config=None):
    """Flags over ROLECTL_NATS_* variables over the config's `nats:` section; checked now. (Under
    click the flags already hold the variables; a caller outside click gets them here.)"""
    from rolectl.bus.security import ClientSecurity, SecurityError
    from rolectl.roles.config import env_settings
    from rolectl.sync_protocol import ConfigError

    try:
        environment = env_settings().nats_security
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    resolved = ClientSecurity(creds=creds, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key).over(
        environment.over(config)
    )
    try:
        resolved.check()
    except SecurityError as exc:
        raise InputError(str(exc)) from None
    return resolved


def _load(config_path: str, nats: str | None, security_flags: dict | None = None, *, check_engines: bool = True):
    import dataclasses

    from rolectl.roles.config import load_config
    from rolectl.sync_protocol import ConfigError

    try:
        cfg = load_config(config_path, check_engines=check_engines)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    if nats:
        cfg = cfg.with_overrides(nats_url=nats)
    if security_flags is not None:
        security = _security(**security_flags, config=cfg.nats.security)
        # only the credential paths: the rest of the nats section (replicas) stays as configured
        cfg = cfg.with_overrides(nats=cfg.nats.replace(**dataclasses.asdict(security)))
    return cfg


def _exit_codes_epilog() -> str:
    from rolectl.roles.exit_codes import exit_code_table

    # \b keeps click from rewrapping the table
    return "\b\nExit codes (every command):\n" + exit_code_table()


class _Commands(click.Group):
    """rolectl's commands. Output whose reader went away (`rolectl status | head`) ends quietly with
    0: the reader had what it wanted (click would say nothing and exit 1). `replay --check` keeps
    its verdict (roles.observe.replay)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            from rolectl.roles.observe.render import quiet_closed_stdout

            quiet_closed_stdout()
            ctx.exit(0)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]}, epilog=_exit_codes_epilog())
@click.version_option(package_name="rolectl")
def main() -> None:
    """rolectl: RL fine-tuning roles coordinated over NATS.

    A trainer and explorers publish status and version events; a stateless synchronizer folds them
    and decides when weights move; weights travel out of band.
    """


@main.command()
@click.argument("role", type=click.Choice(ROLE_NAMES))
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Job YAML (see examples/).")
@click.option("--id", "member_id", default=None,
              help="Member id (default: trainer / explorer-0 / sync-<pid>); an explorer is explorer-N, "
                   "N < explorers.count.")
@click.option("--job", default=None, help="Job name; overrides the config's `job` (run the same file as another job).")
@nats_option(None, "NATS URL(s), comma-separated; overrides the config's nats_url.")
@click.option("--resume", is_flag=True,
              help="Continue from the saved state in the run dir even if the job's stream does not know this member.")
@click.option("--fresh", is_flag=True,
              help="Discard this member's saved state in the run dir and start from step 0.")
@click.option("--log-format", type=click.Choice(["auto", "console", "json"]), default="auto", show_default=True,
              help="console: aligned text for people; json: one object per line for files and log shippers; "
                   "auto: console on a terminal, json otherwise.")
@click.option("--keep-running", is_flag=True, default=False,
              help="sync only: keep following the job after every member finished (default: exit 0 once "
                   "the trainer and every explorer that joined stopped for good).")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="trainer of trainer.world_size ranks: hosts they are spread over (each runs world_size/nnodes).")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="trainer ranks: this host's index, 0..nnodes-1 (host 0 runs rank 0, which speaks on NATS).")
@click.option("--master-addr", default=None, help="trainer ranks: rank 0's host, reachable from every host "
                                                  "(default 127.0.0.1; required with --nnodes > 1).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=None,
              help="trainer ranks: a free port on --master-addr (default: any free port; required with --nnodes > 1).")
@click.option("--serve", "serve", is_flag=True, default=False,
              help="explorer only: serve an OpenAI-compatible endpoint instead of exploring (as `serve.enabled`).")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="With --serve: the endpoint's port (overrides serve.port; 0 = a free one).")
@client_options
def start(role: str, config_path: str, member_id: str | None, job: str | None, nats: str | None, resume: bool,
          fresh: bool, log_format: str, keep_running: bool, nnodes: int, node_rank: int, master_addr: str | None,
          master_port: int | None, serve: bool, port: int | None, **security) -> None:
    """Run one ROLE (trainer, explorer or sync) in the foreground. Ctrl-C stops it cleanly.

    A trainer or explorer that finds saved state resumes from it when the job's stream records its
    previous incarnation (a restart); otherwise it refuses (exit 2) until told --resume or --fresh.
    """
    from rolectl.bus.subjects import check_name
    from rolectl.roles.resume import StartMode
    from rolectl.roles.runner import run_role

    if resume and fresh:
        raise click.UsageError("--resume continues from the saved state, --fresh discards it: give one")
    if keep_running and role != "sync":
        raise click.UsageError(f"--keep-running is for `rolectl start sync` (a {role} ends with its work)")
    start_mode = "resume" if resume else "fresh" if fresh else None
    if start_mode and role == "sync":
        raise click.UsageError(f"--{start_mode} applies to a trainer or an explorer; a synchronizer saves no state")
    # a synchronizer runs no engine: it starts (and restarts) without importing one
    cfg = _load(config_path, nats, security, check_engines=role != "sync")
    if job is not None:
        try:
            check_name(job, "job name")
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--job") from None
        cfg = cfg.with_overrides(job=job)
    # With a credential the member is its identity (the server allows nothing else).
    member_id = member_id or cfg.nats.security.identity
    if member_id is not None:
        try:
            check_name(member_id, "member id")
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--id") from None
    if role == "explorer":
        _check_explorer_id(member_id or "explorer-0", cfg)
    make_runner = _serving(role, cfg, serve, port)
    if make_runner is not None:
        cfg = cfg.with_overrides(serve=cfg.serve.replace(enabled=True, port=cfg.serve.port if port is None else port))
    log_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    rank_flags = nnodes != 1 or node_rank != 0 or master_addr is not None or master_port is not None
    if role == "trainer" and cfg.trainer.world_size > 1:
        from rolectl.roles.launch.ranks import RankLayout, run_trainer

        try:
            RankLayout(cfg.trainer.world_size, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                       master_port=master_port)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        sys.exit(run_trainer(cfg, member_id, start_mode=StartMode(start_mode or "auto"), log_json=log_json,
                             argv=sys.argv[1:], nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                             master_port=master_port))
    if rank_flags:
        raise click.UsageError("--nnodes/--node-rank/--master-addr/--master-port place the ranks of a trainer "
                               "with trainer.world_size > 1 (model.engine: fsdp)")
    sys.exit(run_role(role, cfg, member_id, start_mode=StartMode(start_mode or "auto"), log_json=log_json,
                      keep_running=keep_running, make_runner=make_runner))


def _serving(role: str, cfg, serve: bool, port: int | None):
    """What builds the serving explorer when this start serves (--serve or serve.enabled), else None."""
    if (serve or port is not None) and role != "explorer":
        raise click.UsageError(f"--serve and --port are for `rolectl start explorer` (not {role})")
    if port is not None and not (serve or cfg.serve.enabled):
        raise click.UsageError("--port is the served endpoint's port: give --serve too (or serve.enabled: true)")
    if role != "explorer" or not (serve or cfg.serve.enabled):
        return None
    from rolectl.roles.serve import serve_problems, serving_explorer
    from rolectl.sync_protocol import ConfigError

    problems = serve_problems(cfg)
    if problems:
        raise InputError(str(ConfigError(problems, where=cfg.source or "config")))
    return serving_explorer


def _check_explorer_id(member_id: str, cfg) -> None:
    """An explorer is `explorer-N` with N below the job's `explorers.count`: its index picks its
    share of the task set and its speed, and the trainer waits for exactly that many."""
    import re

    count = cfg.explorers.count
    ids = f"explorer-0..explorer-{count - 1}" if count > 1 else "explorer-0"
    found = re.fullmatch(r"explorer-(0|[1-9][0-9]*)", member_id)
    if found is None:
        raise click.BadParameter(f"{member_id!r} is not an explorer id: explorers are explorer-N; this job's "
                                 f"are {ids} (explorers.count = {count} in {cfg.source})", param_hint="--id")
    if int(found.group(1)) >= count:
        raise click.BadParameter(f"{member_id!r} is outside this job's {count} explorer(s) ({ids}, explorers.count "
                                 f"in {cfg.source}); raise explorers.count to run more", param_hint="--id")


@main.command(epilog=_exit_codes_epilog())
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Job YAML (see examples/); required unless --resume.")
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Continue the run in this run directory (what `up` printed as its run dir) after Ctrl-C or a "
                   "crash: the same job, server store, checkpoints and directory, with the config it was "
                   "recorded with (a --config must agree with it). A run that finished is said so (exit 0).")
@click.option("--explorers", type=click.IntRange(min=1), default=None,
              help="Number of explorers (overrides the config). A train_batch_tasks of one round "
                   "(count x buffer.batch_size) is scaled with it; otherwise it is kept, with a note.")
@click.option("--summary", type=click.Path(dir_okay=False), default=None, help="Write a JSON summary here.")
@click.option("--dashboard/--no-dashboard", default=True, help="Serve the live dashboard (default on).")
@click.option("--dashboard-port", type=int, default=0, help="Dashboard port (default: a free one).")
@click.option("--run-dir", default=None, help="Where role logs and checkpoints go (default: config run_dir).")
@click.option("--auth-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Run secured with what `rolectl auth init` wrote there: its nats-server.conf (TLS, "
                   "identities), admin provisions the streams, each role connects as its own identity.")
@click.option("--launcher", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: every role a process on this machine. ray: every role a Ray actor in one "
                   "placement group (needs `pip install 'rolectl[ray]'`).")
@click.option("--ray-address", default=None,
              help="With --launcher ray: the cluster (auto, HOST:PORT or ray://HOST:10001; default $RAY_ADDRESS, "
                   "else a local Ray sized for the job).")
@nats_option(None, "With --launcher ray: use this NATS (URLs reachable from every node) instead of a "
                   "nats-server started as an actor on the head node.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True,
              help="With --launcher ray: how often Ray restarts a role that crashed before the job fails.")
def up(config_path, resume_dir, explorers, summary, dashboard, dashboard_port, run_dir, auth_dir, launcher,
       ray_address, nats, max_restarts) -> None:
    """Run a whole job: a nats-server and every role as its own process, on this machine
    (--launcher local) or as actors on a Ray cluster (--launcher ray). Prints a summary at the end;
    exits 0 when the job completed, 3 when it ended short of its last step, 1 when a role failed,
    130 when interrupted (Ctrl-C, SIGTERM); then `rolectl up --resume RUN_DIR` continues it."""
    if config_path is None and resume_dir is None:
        raise click.UsageError("give --config FILE (a new run) or --resume RUN_DIR (continue one)")
    cfg = _load(config_path, None) if config_path is not None else None
    resume = None
    if resume_dir is not None:
        resume, cfg = _open_run_for_resume(resume_dir, cfg, explorers=explorers, run_dir=run_dir, launcher=launcher)
    if launcher == "ray":
        given = [flag for flag, value in (("--auth-dir", auth_dir),) if value]
        if given:
            raise click.UsageError(f"{given[0]} is not supported with --launcher ray yet; run secured jobs "
                                   "with the local launcher or start the roles yourself (docs/security.md)")
        from rolectl.roles.launch.ray import RayLaunchError, RayUnavailable, run_up_ray

        try:
            code = run_up_ray(cfg, ray_address=ray_address, nats=nats, explorers=explorers, summary_path=summary,
                              dashboard=dashboard, dashboard_port=dashboard_port, run_dir=run_dir,
                              max_restarts=max_restarts)
        except (RayUnavailable, RayLaunchError) as exc:
            raise click.ClickException(str(exc)) from None
        sys.exit(code)
    given = [flag for flag, value in (("--ray-address", ray_address), ("--nats", nats)) if value]
    if given:
        raise click.UsageError(f"{' and '.join(given)} apply to --launcher ray only")
    from rolectl.roles.launch.local import run_up

    auth = None
    if auth_dir:
        from rolectl.bus.auth import read_auth_dir

        try:
            auth = read_auth_dir(auth_dir)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    sys.exit(
        run_up(cfg, explorers=explorers, summary_path=summary, dashboard=dashboard,
               dashboard_port=dashboard_port, run_dir=run_dir, auth=auth, resume=resume)
    )


def _open_run_for_resume(resume_dir: str, given, **changes):
    """`up --resume`: the run directory and its recorded config (a bad one is a usage error, exit 2)."""
    from rolectl.roles.launch.run_dir import ResumeError, open_for_resume
    from rolectl.sync_protocol import ConfigError

    flags = [f"--{k.replace('_', '-')}" for k, v in changes.items() if v not in (None, "local")]
    if flags:
        raise click.UsageError(f"{' and '.join(flags)} cannot change a run being resumed: --resume continues "
                               "the run in its directory with the config it was recorded with")
    try:
        return open_for_resume(resume_dir, given)
    except (ResumeError, ConfigError) as exc:
        raise InputError(f"--resume {resume_dir}: {exc}") from None


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Job YAML: the job's name, sync method and storage decide which streams to make.")
@nats_option(None, "NATS URL(s), comma-separated; overrides the config's nats_url.")
@client_options
def provision(config_path: str, nats: str | None, **security) -> None:
    """Create (or check) the job's streams; run it as the admin identity before the roles start."""
    from rolectl.bus.errors import BusError
    from rolectl.bus.logging import setup_logging
    from rolectl.roles.provision import provision_job

    setup_logging("warning")
    cfg = _load(config_path, nats, security)
    try:
        streams = asyncio.run(provision_job(cfg))
    except BusError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"job {cfg.job}: streams ready: {', '.join(streams)}")


@main.group()
def auth() -> None:
    """Secure deployments: TLS, one identity per member, least privilege."""


@auth.command("init")
@click.option("--dir", "directory", required=True, type=click.Path(file_okay=False),
              help="Where to write the CA, server certificate, nats-server.conf and one credential per identity.")
@click.option("--job", required=True, help="The job these identities may reach (and no other).")
@click.option("--explorers", type=click.IntRange(min=1), required=True, help="Explorer identities: explorer-0..N-1.")
@click.option("--synchronizers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Synchronizer identities: sync-0..K-1.")
@click.option("--host", "hosts", multiple=True, help="Name or IP the server certificate is valid for "
              "(repeat; default 127.0.0.1 and localhost). Non-loopback hosts make the server listen on 0.0.0.0.")
@click.option("--port", type=click.IntRange(1, 65535), default=4222, show_default=True)
@click.option("--http-port", type=click.IntRange(1, 65535), default=8222, show_default=True,
              help="Monitoring port (loopback only: it has no authentication).")
@click.option("--store-dir", default=None, help="JetStream store (default: DIR/jetstream).")
def auth_init(directory, job, explorers, synchronizers, hosts, port, http_port, store_dir) -> None:
    """Write everything a secure deployment of one job needs (see DIR/README afterwards)."""
    import shlex

    from rolectl.bus.auth import init_auth_dir

    command = "rolectl auth init " + " ".join(shlex.quote(a) for a in sys.argv[3:])
    try:
        made = init_auth_dir(directory, job=job, explorers=explorers, synchronizers=synchronizers,
                             hosts=list(hosts) or ["127.0.0.1", "localhost"], port=port,
                             http_port=http_port, store_dir=store_dir, command=command)
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {made.path}: nats-server.conf, ca.pem, server.pem/.key, one .nk per identity "
               f"(trainer, explorer-0..{explorers - 1}, sync-0..{synchronizers - 1}, observer, admin); "
               f"see {made.path / 'README'}")


@main.command()
@click.option("--port", type=click.IntRange(1, 65535), default=4222, show_default=True,
              help="Client port (single server).")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8222, show_default=True,
              help="Monitoring port (single server); give it to `rolectl dashboard --monitor-url`.")
@click.option("--store-dir", default=None, type=click.Path(file_okay=False),
              help="JetStream store (default: a temporary directory); a cluster keeps one per node under it "
                   "and writes cluster.json there.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--cluster", "cluster_size", type=click.IntRange(min=1), default=None,
              help="Run a local JetStream cluster of N nodes on free ports (with routes between them) "
                   "instead of one server.")
@click.option("--config", "config_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Run nats-server with this config as is (e.g. DIR/nats-server.conf from `rolectl auth init`).")
def server(port: int, http_port: int, store_dir: str | None, host: str, cluster_size: int | None,
           config_file: str | None) -> None:
    """Run an embedded nats-server with JetStream (or a local cluster) in the foreground (development).

    With --cluster N the first line printed is the comma-separated client URL list to pass as
    --nats; STORE_DIR/cluster.json lists each node's name, client URL, monitoring URL and pid.
    """
    import os
    import signal
    import threading

    from click.core import ParameterSource

    from rolectl.bus.server import NatsCluster, NatsServer, NatsServerError, find_nats_server

    if config_file:
        if cluster_size is not None:
            raise click.UsageError("--config runs one server from its own config; drop --cluster")
        try:
            binary = find_nats_server()
        except NatsServerError as exc:
            raise click.ClickException(str(exc)) from None
        os.execv(binary, [binary, "-c", config_file])

    ctx = click.get_current_context()
    if cluster_size is not None:
        given = [f"--{name.replace('_', '-')}" for name in ("port", "http_port")
                 if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"{' and '.join(given)} apply to a single server; --cluster picks free ports "
                                   "for every node (see cluster.json)")
        srv = NatsCluster(size=cluster_size, host=host, store_dir=store_dir, own_session=True)
    else:
        for flag, value in (("--port", port), ("--http-port", http_port)):
            if _port_taken(host, value):
                raise InputError(f"{flag} {value}: {host}:{value} is already in use (another nats-server? "
                                 f"`rolectl server` twice?); pass a free {flag}, or stop what listens there")
        srv = NatsServer(host=host, port=port, http_port=http_port, store_dir=store_dir, own_session=True)
    stop = threading.Event()
    # Both set explicitly: a SIGINT ignored by the parent (a non-interactive shell's `&`, some
    # libraries in a test process) is inherited, and Python then raises no KeyboardInterrupt, so
    # Ctrl-C / SIGINT would leave the server (and a cluster's nodes) running.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        srv.start()
    except NatsServerError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # the store directory cannot be made or written
        raise InputError(f"--store-dir {store_dir}: {exc.strerror or exc} ({exc.filename or store_dir})") from None
    try:
        if isinstance(srv, NatsCluster):
            described = srv.write_description()
            click.echo(srv.url)
            click.echo(f"nats-server cluster {srv.name} of {cluster_size} node(s) ready; nodes in {described} "
                       f"(monitoring {', '.join(n.monitor_url for n in srv.nodes)}); Ctrl-C stops every node")
        else:
            click.echo(f"nats-server ready at {srv.url} (monitoring {srv.monitor_url}, store {srv.store_dir}); "
                       "Ctrl-C stops it")
        # A cluster goes on while any node runs: a node killed on purpose (a fault test) may come back.
        while srv.running and not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()


run_option = click.option(
    "--run", "run_dir", type=click.Path(exists=True, file_okay=False), default=None,
    help="A run directory of `rolectl up` (runs/JOB-TIME-PID): its job, record and archive, read with no server to "
         "start (a private one opens the run's store), instead of --job/--nats/--archive.")


@contextmanager
def _job_source(job: str | None, nats: str | None, archive: str | None, run_dir: str | None,
                others: tuple[str, ...] = ()):
    """(job, NATS URL, archive dir, monitoring URL or None) to read, from --job/--nats/--archive or --run."""
    from click.core import ParameterSource

    from rolectl.roles.observe.run_store import RunError, job_source

    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in ("job", "nats", "archive", *others) if run_dir
             and ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]
    if given:
        raise click.UsageError(f"--run reads the job, its record and archive from the run: drop {' and '.join(given)}")
    try:
        with job_source(job, nats, archive, run_dir) as source:
            yield source
    except RunError as exc:  # raised on opening: the commands' own errors are not RunErrors
        raise InputError(str(exc)) from None


@main.command()
@click.option("--job", default=None, help="The job to read (or --run).")
@nats_option("nats://127.0.0.1:4222", "NATS URL(s), comma-separated.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--archive", "archive", type=click.Path(file_okay=False), default=None,
              help="The job's archived history (default place: RUN_DIR/JOB/archive), read before the stream.")
@run_option
@client_options
def status(job: str | None, nats: str, as_json: bool, archive: str | None, run_dir: str | None, **security) -> None:
    """Members of a job (role, id, status, step, version, last seen), read from its stream."""
    from rolectl.roles.observe.status import print_status

    client = _security(**security)
    with _job_source(job, nats, archive, run_dir) as (job, nats, archive_dir, _):
        code = asyncio.run(print_status(job, nats, as_json=as_json, security=client, archive_dir=archive_dir))
    sys.exit(code)


@main.command()
@click.option("--job", default=None, help="The job to read (or --run).")
@nats_option("nats://127.0.0.1:4222", "NATS URL(s), comma-separated.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="File to write (.jsonl for JSON lines, .msgpack for msgpack).")
@click.option("--archive", "archive", type=click.Path(file_okay=False), default=None,
              help="The job's archived history (default place: RUN_DIR/JOB/archive), read before the stream.")
@run_option
@client_options
def export(job: str | None, nats: str, output: str, archive: str | None, run_dir: str | None, **security) -> None:
    """Write a job's recorded events and decisions, with sequences and server timestamps."""
    from rolectl.bus.archive import ArchiveError
    from rolectl.bus.errors import BusError
    from rolectl.bus.logging import setup_logging
    from rolectl.roles.observe.replay import ExportError, export_job

    setup_logging("warning")
    client = _security(**security)
    try:
        with _job_source(job, nats, archive, run_dir) as (job, nats, archive_dir, _):
            n = asyncio.run(export_job(job, nats, Path(output), security=client, archive_dir=archive_dir))
    except ArchiveError as exc:  # a damaged segment: named, nothing written
        raise InputError(str(exc)) from None
    except BusError as exc:  # NATS away, no such job: exit 1 as every command
        raise click.ClickException(str(exc)) from None
    except (ExportError, ValueError) as exc:  # a bad output path or job name: exit 2
        raise InputError(str(exc)) from None
    click.echo(f"wrote {n} records to {output}")


@main.command()
@click.option("--job", default=None)
@nats_option("nats://127.0.0.1:4222", "NATS URL(s), comma-separated.")
@click.option("--file", "file_", type=click.Path(exists=True, dir_okay=False), default=None,
              help="An export written by `rolectl export` (or by `rolectl up`).")
@click.option("--until", default=None, help="Stop at this stream sequence (int) or time (ISO 8601).")
@click.option("--check", is_flag=True, help="Recompute every decision and compare with the recorded one.")
@click.option("--json", "as_json", is_flag=True, help="Print the timeline as JSON.")
@click.option("--archive", "archive", type=click.Path(file_okay=False), default=None,
              help="The job's archived history (default place: RUN_DIR/JOB/archive), read before the stream.")
@run_option
@client_options
def replay(job, nats, file_, until, check, as_json, archive, run_dir, **security) -> None:
    """Fold a job's events into a readable timeline; with --check, verify every decision."""
    from rolectl.roles.observe.replay import run_replay

    if sum(given is not None for given in (job, file_, run_dir)) != 1:
        raise click.UsageError("give exactly one of --job, --file or --run")
    client = _security(**security)
    if file_ is not None:
        sys.exit(run_replay(job=None, nats=nats, file=file_, until=until, check=check, as_json=as_json,
                            security=client, archive=archive))
    with _job_source(job, nats, archive, run_dir) as (job, nats, archive_dir, _):
        code = run_replay(job=job, nats=nats, file=None, until=until, check=check, as_json=as_json,
                          security=client, archive=archive_dir)
    sys.exit(code)


@main.command()
@click.option("--job", default=None, help="The job to watch (required without --config).")
@nats_option(None, "NATS URL(s), comma-separated [default: the config's nats_url, else nats://127.0.0.1:4222].")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The job's config: its job name, NATS URL, credentials and archive directory.")
@click.option("--archive", "archive", type=click.Path(file_okay=False), default=None,
              help="The job's archived history (default with --config: RUN_DIR/JOB/archive), read before the stream.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--monitor-url", default=None, help="nats-server monitoring URL (default: same host, port 8222).")
@run_option
@client_options
def dashboard(job, nats, config_path, archive, port, host, monitor_url, run_dir, **security) -> None:
    """Serve the live dashboard of a job (members, versions, rounds, NATS health, /metrics): its archived
    history, then its stream live, as one history."""
    from rolectl.roles.observe.dashboard import serve_dashboard

    if run_dir is not None:
        with _job_source(job, nats, archive, run_dir, others=("config_path", "monitor_url")) as (
                job, nats, archive_dir, monitor_url):
            code = serve_dashboard(job=job, nats=nats, host=host, port=port, monitor_url=monitor_url,
                                   security=_security(**security), archive_dir=archive_dir)
        sys.exit(code)
    if config_path is not None:
        cfg = _load(config_path, nats, security, check_engines=False)
        if job is not None and job != cfg.job:
            raise click.UsageError(f"--job {job} is not the job of {config_path} ({cfg.job}); give one of them")
        job, nats, client = cfg.job, cfg.nats_url, cfg.nats.security
        archive_dir = Path(archive) if archive else cfg.event_archive_dir
    elif job is None:
        raise click.UsageError("give --job (with --nats), or --config with the job's config file")
    else:
        nats = nats or "nats://127.0.0.1:4222"
        client = _security(**security)
        archive_dir = Path(archive) if archive else None
    sys.exit(serve_dashboard(job=job, nats=nats, host=host, port=port, monitor_url=monitor_url,
                             security=client, archive_dir=archive_dir))


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The job's config: its trackers (monitor.backends), NATS URL, credentials and archive.")
@nats_option(None, "NATS URL(s), comma-separated [default: the config's nats_url].")
@click.option("--run", "run_name", default=None,
              help="The trackers' run name [default: JOB-track-<UTC time>].")
@click.option("--once", is_flag=True, help="Log the record as it is now and stop, instead of following the job "
                                           "to its end.")
def track(config_path, nats, run_name, once) -> None:
    """Log a job to its experiment trackers (monitor.backends) from its record: for jobs whose roles
    were started one by one (`rolectl up` feeds them itself). Follows the job to its end."""
    from rolectl.bus.archive import ArchiveError
    from rolectl.bus.errors import BusError
    from rolectl.bus.logging import setup_logging
    from rolectl.roles.config import tracker_problems
    from rolectl.roles.exit_codes import ExitCode
    from rolectl.roles.observe.track import default_run_name, track_job

    cfg = _load(config_path, nats, check_engines=False)  # the engines run elsewhere: not checked here
    if not cfg.monitor.backends:
        raise InputError(f"{config_path}: monitor.backends is empty, so there is nothing to log to; "
                         "name one or more of tensorboard, mlflow, wandb")
    problems = tracker_problems(cfg.monitor.backends)
    if problems:
        raise InputError("; ".join(f"{config_path}: {path}: {why}" for path, why in problems))
    setup_logging("warning")
    run = run_name or default_run_name(cfg)
    click.echo(f"logging job {cfg.job} to {', '.join(cfg.monitor.backends)} (run {run}) in {cfg.monitor_dir}")
    try:
        code = asyncio.run(track_job(cfg, run=run, once=once, say=click.echo))
    except KeyboardInterrupt:
        click.echo("interrupted: what was read so far is logged", err=True)
        sys.exit(ExitCode.INTERRUPTED)
    except (BusError, ArchiveError) as exc:  # NATS away, no such job, a damaged archive segment
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--versions", default=None,
              help="Comma-separated versions to evaluate (default every kept one: 0, the base model, and the "
                   "trainer's checkpoints).")
@click.option("--run-dir", default=None,
              help="The run directory `rolectl up` printed (default: the config's run_dir, or the newest "
                   "`up` run of the job under it).")
@click.option("--eval", "eval_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Eval task file; overrides the config's eval.path.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench(config_path, versions, run_dir, eval_file, as_json) -> None:
    """Evaluate a job's saved versions on its eval set: one row per version, each reward's mean."""
    from rolectl.bus.logging import setup_logging
    from rolectl.roles.engines.evaluation import eval_config_problems
    from rolectl.roles.observe.bench import BenchError, print_bench, run_bench

    setup_logging("warning")
    cfg = _load(config_path, None)
    if eval_file:
        cfg = cfg.with_overrides(eval=cfg.eval.replace(path=eval_file))
        problems = eval_config_problems(cfg)
        if problems:
            raise InputError("; ".join(f"{path}: {why}" for path, why in problems))
    try:
        wanted = [int(v) for v in versions.split(",")] if versions else None
    except ValueError:
        raise InputError(f"--versions: a comma-separated list of integers, got {versions!r}") from None
    try:
        rows = run_bench(cfg, run_dir=run_dir, versions=wanted)
    except BenchError as exc:
        raise InputError(str(exc)) from None
    print_bench(rows, as_json=as_json)


if __name__ == "__main__":
    main()
