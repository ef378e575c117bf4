"""A run of `rolectl up` opens from its run directory with no server to start: `status`, `replay`
and `export --run RUN_DIR` read its own store through a private nats-server (and, while `up` still
runs it, its live server, never a second one on the same store). The dashboard's `--run` is in
tests/browser/test_dashboard_archive.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rolectl.bus.server import NatsServer
from rolectl.roles.cli import main
from rolectl.roles.exit_codes import ExitCode
from rolectl.roles.observe.replay import load_export
from rolectl.roles.observe.run_store import open_run, server_running, server_stopped
from tests.support.scripted_job import run_scripted_job

STEPS = 3


def _run_dir(tmp_path: Path, job: str) -> Path:
    """A run directory as `rolectl up` leaves it: job.yaml, and the job's store in nats/."""
    run = tmp_path / f"{job}-20260101-000000-1"
    with NatsServer(store_dir=str(run / "nats")) as server:
        asyncio.run(run_scripted_job(server.url, job, steps=STEPS, run_dir=str(run)))
    (run / "job.yaml").write_text(f"job: {job}\nrun_dir: {run}\nnats_url: nats://127.0.0.1:1\n")
    return run


@pytest.fixture
def finished_run(tmp_path, job_name) -> Path:
    return _run_dir(tmp_path, job_name)


def test_status_of_a_finished_run_reads_its_store(finished_run, job_name):
    result = CliRunner().invoke(main, ["status", "--run", str(finished_run), "--json"])
    assert result.exit_code == ExitCode.OK, result.output
    shown = json.loads(result.output)
    rows = {m["key"]: m for m in shown["members"]}
    assert rows["trainer/trainer"]["status"] == "finished" and rows["trainer/trainer"]["step"] == STEPS


def test_replay_and_export_of_a_finished_run(finished_run, tmp_path):
    result = CliRunner().invoke(main, ["replay", "--run", str(finished_run), "--check"])
    assert result.exit_code == ExitCode.OK, result.output
    assert "check OK" in result.output
    out = tmp_path / "export.jsonl"
    result = CliRunner().invoke(main, ["export", "--run", str(finished_run), "-o", str(out)])
    assert result.exit_code == ExitCode.OK, result.output
    assert len(load_export(out)) > STEPS


def test_a_live_run_is_read_from_its_own_server(finished_run):
    # while `up` runs, its server holds the store: readers use it, never a second server beside it
    with NatsServer(store_dir=str(finished_run / "nats")) as live:
        server_running(finished_run, live, live.url)
        try:
            with open_run(finished_run) as run:
                assert run.live and run.nats_url == live.url
            result = CliRunner().invoke(main, ["status", "--run", str(finished_run), "--json"])
            assert result.exit_code == ExitCode.OK, result.output
        finally:
            server_stopped(finished_run)
    with open_run(finished_run) as run:  # its server gone: a private one opens the store
        assert not run.live and run.nats_url != live.url


@pytest.mark.parametrize("args,said", [
    (["status", "--run", "{tmp}"], "is not a run directory of `rolectl up`"),
    (["status", "--run", "{run}", "--job", "x"], "drop --job"),
    (["replay", "--run", "{run}", "--file", "{run}/job.yaml"], "exactly one of --job, --file or --run"),
    (["status"], "give --job JOB (with --nats URL), or --run RUN_DIR"),
])
def test_a_run_directory_given_wrong_is_a_usage_error(finished_run, tmp_path, args, said):
    args = [a.format(tmp=tmp_path, run=finished_run) for a in args]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert said in " ".join(result.output.split()), result.output
