"""The `rolectl` commands that run something: a role, a whole job, a dev server; provision and auth."""

from __future__ import annotations

import asyncio
import sys

import click

from .options import (
    InputError,
    client_options,
    exit_codes_epilog,
    load_job_config,
    nats_option,
    port_taken,
)

ROLE_NAMES = ("trainer", "explorer", "sync")


@click.command()
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
    # an explorer checks its engines, not the trainer's losses (verl: seconds of imports per start)
    cfg = load_job_config(config_path, nats, security, check_engines=role != "sync", rollout_only=role == "explorer")
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


@click.command(epilog=exit_codes_epilog())
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
                   "identities), admin provisions the streams, each role connects as its own identity "
                   "(with --launcher ray, each actor is handed its own identity's files only).")
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
    cfg = load_job_config(config_path, None) if config_path is not None else None
    resume = None
    if resume_dir is not None:
        resume, cfg = _open_run_for_resume(resume_dir, cfg, explorers=explorers, run_dir=run_dir, launcher=launcher)
    auth = None
    if auth_dir:
        from rolectl.bus.auth import read_auth_dir

        try:
            auth = read_auth_dir(auth_dir)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    if launcher == "ray":
        from rolectl.roles.launch.ray import RayLaunchError, RayUnavailable, run_up_ray

        try:
            code = run_up_ray(cfg, ray_address=ray_address, nats=nats, explorers=explorers, summary_path=summary,
                              dashboard=dashboard, dashboard_port=dashboard_port, run_dir=run_dir,
                              max_restarts=max_restarts, auth=auth)
        except (RayUnavailable, RayLaunchError) as exc:
            raise click.ClickException(str(exc)) from None
        sys.exit(code)
    given = [flag for flag, value in (("--ray-address", ray_address), ("--nats", nats)) if value]
    if given:
        raise click.UsageError(f"{' and '.join(given)} apply to --launcher ray only")
    from rolectl.roles.launch.local import run_up

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


@click.command()
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
    cfg = load_job_config(config_path, nats, security)
    try:
        streams = asyncio.run(provision_job(cfg))
    except BusError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"job {cfg.job}: streams ready: {', '.join(streams)}")


@click.group()
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


@click.command()
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
            if port_taken(host, value):
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
