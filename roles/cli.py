"""`rolectl`: run a role, a whole job, a dev server; inspect, replay and watch a job."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

__all__ = ["main"]

ROLE_NAMES = ("trainer", "explorer", "sync")


def _load(config_path: str, nats: str | None):
    from roles.config import load_config
    from sync_protocol import ConfigError

    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if nats:
        cfg = cfg.with_overrides(nats_url=nats)
    return cfg


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
@click.option("--id", "member_id", default=None, help="Member id (default: trainer / explorer-0 / sync-<pid>).")
@click.option("--nats", default=None, help="NATS URL(s), comma-separated; overrides the config's nats_url.")
def start(role: str, config_path: str, member_id: str | None, nats: str | None) -> None:
    """Run one ROLE (trainer, explorer or sync) in the foreground. Ctrl-C stops it cleanly."""
    from roles.runner import run_role

    cfg = _load(config_path, nats)
    sys.exit(run_role(role, cfg, member_id))


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--explorers", type=int, default=None, help="Number of explorers (overrides the config).")
@click.option("--summary", type=click.Path(dir_okay=False), default=None, help="Write a JSON summary here.")
@click.option("--dashboard/--no-dashboard", default=True, help="Serve the live dashboard (default on).")
@click.option("--dashboard-port", type=int, default=0, help="Dashboard port (default: a free one).")
@click.option("--run-dir", default=None, help="Where role logs and checkpoints go (default: config run_dir).")
def up(config_path, explorers, summary, dashboard, dashboard_port, run_dir) -> None:
    """Run a whole job on this machine: an embedded nats-server and every role as its own process."""
    from roles.up import run_up

    cfg = _load(config_path, None)
    sys.exit(
        run_up(cfg, explorers=explorers, summary_path=summary, dashboard=dashboard,
               dashboard_port=dashboard_port, run_dir=run_dir)
    )


@main.command()
@click.option("--port", type=int, default=4222, show_default=True, help="Client port (single server).")
@click.option("--http-port", type=int, default=8222, show_default=True, help="Monitoring port (single server).")
@click.option("--store-dir", default=None,
              help="JetStream store (default: a temporary directory); a cluster keeps one per node under it "
                   "and writes cluster.json there.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--cluster", "cluster_size", type=click.IntRange(min=1), default=None,
              help="Run a local JetStream cluster of N nodes on free ports (with routes between them) "
                   "instead of one server.")
def server(port: int, http_port: int, store_dir: str | None, host: str, cluster_size: int | None) -> None:
    """Run an embedded nats-server with JetStream (or a local cluster) in the foreground (development).

    With --cluster N the first line printed is the comma-separated client URL list to pass as
    --nats; STORE_DIR/cluster.json lists each node's name, client URL, monitoring URL and pid.
    """
    import signal
    import threading

    from click.core import ParameterSource

    from bus.server import NatsCluster, NatsServer, NatsServerError

    ctx = click.get_current_context()
    if cluster_size is not None:
        given = [f"--{name.replace('_', '-')}" for name in ("port", "http_port")
                 if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"{' and '.join(given)} apply to a single server; --cluster picks free ports "
                                   "for every node (see cluster.json)")
        srv = NatsCluster(size=cluster_size, host=host, store_dir=store_dir)
    else:
        srv = NatsServer(host=host, port=port, http_port=http_port, store_dir=store_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        srv.start()
    except NatsServerError as exc:
        raise click.ClickException(str(exc)) from None
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


@main.command()
@click.option("--job", required=True)
@click.option("--nats", default="nats://127.0.0.1:4222", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def status(job: str, nats: str, as_json: bool) -> None:
    """Members of a job (role, id, status, step, version, last seen), read from its stream."""
    from roles.inspect import print_status

    sys.exit(asyncio.run(print_status(job, nats, as_json=as_json)))


@main.command()
@click.option("--job", required=True)
@click.option("--nats", default="nats://127.0.0.1:4222", show_default=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="File to write (.jsonl for JSON lines, .msgpack for msgpack).")
def export(job: str, nats: str, output: str) -> None:
    """Write a job's recorded events and decisions, with sequences and server timestamps."""
    from bus.errors import BusError
    from bus.logging import setup_logging
    from roles.replay import ExportError, export_job

    setup_logging("warning")
    try:
        n = asyncio.run(export_job(job, nats, Path(output)))
    except (ExportError, BusError, ValueError) as exc:  # bad path, NATS away, no such job
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {n} records to {output}")


@main.command()
@click.option("--job", default=None)
@click.option("--nats", default="nats://127.0.0.1:4222", show_default=True)
@click.option("--file", "file_", type=click.Path(exists=True, dir_okay=False), default=None,
              help="An export written by `rolectl export` (or by `rolectl up`).")
@click.option("--until", default=None, help="Stop at this stream sequence (int) or time (ISO 8601).")
@click.option("--check", is_flag=True, help="Recompute every decision and compare with the recorded one.")
@click.option("--json", "as_json", is_flag=True, help="Print the timeline as JSON.")
def replay(job, nats, file_, until, check, as_json) -> None:
    """Fold a job's events into a readable timeline; with --check, verify every decision."""
    from roles.replay import run_replay

    if (job is None) == (file_ is None):
        raise click.UsageError("give exactly one of --job or --file")
    sys.exit(run_replay(job=job, nats=nats, file=file_, until=until, check=check, as_json=as_json))


@main.command()
@click.option("--job", required=True)
@click.option("--nats", default="nats://127.0.0.1:4222", show_default=True)
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--monitor-url", default=None, help="nats-server monitoring URL (default: same host, port 8222).")
def dashboard(job, nats, port, host, monitor_url) -> None:
    """Serve the live dashboard of a job (members, versions, rounds, NATS health, /metrics)."""
    from roles.dashboard import serve_dashboard

    sys.exit(serve_dashboard(job=job, nats=nats, host=host, port=port, monitor_url=monitor_url))


if __name__ == "__main__":
    main()
