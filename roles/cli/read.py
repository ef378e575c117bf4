"""The `rolectl` commands that read a job: status, export, replay, the dashboard, trackers, bench."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from .options import (
    InputError,
    client_options,
    client_security,
    job_source_of_flags,
    load_job_config,
    nats_option,
    run_option,
)


@click.command()
@click.option("--job", default=None, help="The job to read (or --run).")
@nats_option("nats://127.0.0.1:4222", "NATS URL(s), comma-separated.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--archive", "archive", type=click.Path(file_okay=False), default=None,
              help="The job's archived history (default place: RUN_DIR/JOB/archive), read before the stream.")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="List this many explorers, the furthest behind first (default: 40 in the table, all in JSON).")
@click.option("--all", "list_all", is_flag=True, help="List every explorer.")
@run_option
@client_options
def status(job: str | None, nats: str, as_json: bool, archive: str | None, limit: int | None, list_all: bool,
           run_dir: str | None, **security) -> None:
    """Members of a job, read from its stream: counts by role and status, then the trainer, the
    explorers (stragglers first) and the synchronizers (role, id, status, step, version, last seen)."""
    from rolectl.roles.observe.status import DEFAULT_LIMIT, print_status

    if list_all and limit is not None:
        raise click.UsageError("give --limit N or --all, not both")
    shown = None if list_all else limit if limit is not None else None if as_json else DEFAULT_LIMIT
    client = client_security(**security)
    with job_source_of_flags(job, nats, archive, run_dir) as (job, nats, archive_dir, _):
        code = asyncio.run(print_status(job, nats, as_json=as_json, security=client, archive_dir=archive_dir,
                                        limit=shown))
    sys.exit(code)


@click.command()
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
    client = client_security(**security)
    try:
        with job_source_of_flags(job, nats, archive, run_dir) as (job, nats, archive_dir, _):
            n = asyncio.run(export_job(job, nats, Path(output), security=client, archive_dir=archive_dir))
    except ArchiveError as exc:  # a damaged segment: named, nothing written
        raise InputError(str(exc)) from None
    except BusError as exc:  # NATS away, no such job: exit 1 as every command
        raise click.ClickException(str(exc)) from None
    except (ExportError, ValueError) as exc:  # a bad output path or job name: exit 2
        raise InputError(str(exc)) from None
    click.echo(f"wrote {n} records to {output}")


@click.command()
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
    client = client_security(**security)
    if file_ is not None:
        sys.exit(run_replay(job=None, nats=nats, file=file_, until=until, check=check, as_json=as_json,
                            security=client, archive=archive))
    with job_source_of_flags(job, nats, archive, run_dir) as (job, nats, archive_dir, _):
        code = run_replay(job=job, nats=nats, file=None, until=until, check=check, as_json=as_json,
                          security=client, archive=archive_dir)
    sys.exit(code)


@click.command()
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
        with job_source_of_flags(job, nats, archive, run_dir, others=("config_path", "monitor_url")) as (
                job, nats, archive_dir, monitor_url):
            code = serve_dashboard(job=job, nats=nats, host=host, port=port, monitor_url=monitor_url,
                                   security=client_security(**security), archive_dir=archive_dir)
        sys.exit(code)
    if config_path is not None:
        cfg = load_job_config(config_path, nats, security, check_engines=False)
        if job is not None and job != cfg.job:
            raise click.UsageError(f"--job {job} is not the job of {config_path} ({cfg.job}); give one of them")
        job, nats, client = cfg.job, cfg.nats_url, cfg.nats.security
        archive_dir = Path(archive) if archive else cfg.event_archive_dir
    elif job is None:
        raise click.UsageError("give --job (with --nats), or --config with the job's config file")
    else:
        nats = nats or "nats://127.0.0.1:4222"
        client = client_security(**security)
        archive_dir = Path(archive) if archive else None
    sys.exit(serve_dashboard(job=job, nats=nats, host=host, port=port, monitor_url=monitor_url,
                             security=client, archive_dir=archive_dir))


@click.command()
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

    cfg = load_job_config(config_path, nats, check_engines=False)  # the engines run elsewhere: not checked here
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


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--versions", default=None,
              help="Comma-separated versions to evaluate (default every kept one: 0, the base model, and the "
                   "trainer's checkpoints).")
@click.option("--run-dir", default=None,
              help="The run directory `rolectl up` printed (default: the config's run_dir, or the newest "
                   "`up` run of the job under it).")
@click.option("--eval", "eval_file", default=None, type=click.Path(exists=True),
              help="Eval task file, or a directory saved with save_to_disk; overrides the config's eval source.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def bench(config_path, versions, run_dir, eval_file, as_json) -> None:
    """Evaluate a job's saved versions on its eval set: one row per version, each reward's mean."""
    from rolectl.bus.logging import setup_logging
    from rolectl.roles.engines.evaluation import eval_config_problems
    from rolectl.roles.observe.bench import BenchError, print_bench, run_bench

    setup_logging("warning")
    cfg = load_job_config(config_path, None)
    if eval_file:
        cfg = cfg.with_overrides(eval=cfg.eval.replace(path=eval_file, dataset=None, config=None))
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
