"""The dashboard in a real headless Chromium reads a job's archive and its live tail as one history.

A scripted job runs on a real nats-server with snapshots every 10 records, so its synchronizer
archives and trims the stream: the first trainer steps are in the archive only. `rolectl dashboard
--archive DIR`, or `rolectl dashboard --config JOB.yaml` (a real process), must plot every trainer
step's reward, and say on the page how far the archive reaches. Chromium comes from the system
(/usr/bin/chromium), never downloaded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from rolectl.bus.archive import archived_upto
from rolectl.bus.connection import connect
from rolectl.bus.server import NatsServer, free_port
from rolectl.roles.observe.export import read_history
from rolectl.sync_protocol import Role, StepFinished
from tests.support.scripted_job import run_scripted_job
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
STEPS = 6


async def _trimmed_job(nats_url: str, job: str, run_dir: Path) -> tuple[list, int]:
    """Run the scripted job; returns its whole history and the stream's first sequence."""
    await run_scripted_job(nats_url, job, steps=STEPS, snapshot_every=10, run_dir=str(run_dir))
    async with connect(nats_url, job=job, role="observer", member="archive-browser") as conn:
        first = (await conn.js.stream_info(conn.names.event_stream)).state.first_seq
        return await read_history(conn, run_dir / job / "archive"), first


def _api_state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/state", timeout=2.0) as resp:
        return json.load(resp)


@pytest.fixture(params=["--archive", "--config", "--run"])
def dashboard_of_trimmed_job(request, nats_url, job_name, tmp_path):
    """`rolectl dashboard` told where the archive is by `--archive DIR`, or by the job's config; or
    a finished run opened offline (`--run RUN_DIR`: its own store, no server to start)."""
    import asyncio

    run = tmp_path / "run"
    if request.param == "--run":  # a run directory as `rolectl up` leaves it: its server is gone
        with NatsServer(store_dir=str(run / "nats")) as server:
            history, first = asyncio.run(_trimmed_job(server.url, job_name, tmp_path))
        (run / "job.yaml").write_text(f"job: {job_name}\nrun_dir: {tmp_path}\nmodel: {{engine: tiny}}\n")
    else:
        history, first = asyncio.run(_trimmed_job(nats_url, job_name, tmp_path))
    archive = tmp_path / job_name / "archive"
    trainer_steps = [r for r in history if isinstance(r.event, StepFinished) and r.event.member.role is Role.TRAINER]
    assert len(trainer_steps) == STEPS
    # the premise: the stream alone no longer holds the first steps (a dashboard without the archive
    # starts at the newest snapshot and cannot plot them)
    assert trainer_steps[0].seq < first <= archived_upto(archive) + 1
    port = free_port()
    log = tmp_path / "dashboard.log"
    if request.param == "--archive":
        where = ["--job", job_name, "--nats", nats_url, "--archive", str(archive)]
    else:  # the job's config names the job, its NATS and its run_dir (the archive is RUN_DIR/JOB/archive)
        config = tmp_path / "job.yaml"
        config.write_text(f"job: {job_name}\nnats_url: {nats_url}\nrun_dir: {tmp_path}\n"
                          "model: {engine: tiny}\n")
        where = ["--config", str(config)]
    if request.param == "--run":
        where = ["--run", str(run)]  # the private server's monitoring URL too
    else:
        where.extend(["--monitor-url", "http://127.0.0.1:1"])
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rolectl", "dashboard", *where, "--port", str(port)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}/"

    def caught_up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"rolectl dashboard exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            return _api_state(url)["stream"]["last_seq"] >= history[-1].seq
        except OSError:
            return False  # not listening yet

    try:
        wait_until_sync(caught_up, timeout=90.0, what=f"the dashboard at {url} to fold the job's history",
                        details=lambda: log.read_text(errors="replace")[-2000:])
        yield url, history, archive
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_dashboard_shows_archive_and_live_tail_as_one_history(dashboard_of_trimmed_job, tmp_path):
    url, history, archive = dashboard_of_trimmed_job
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: install it with `apt-get install -y chromium`"
    state = _api_state(url)
    assert [step for step, _ in state["series"]["reward"]] == list(range(1, STEPS + 1)), state["series"]["reward"]
    assert state["archive"]["upto_seq"] == archived_upto(archive) and state["archive"]["error"] is None
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            # every trainer step's reward is plotted: the archived ones too
            page.wait_for_function(
                "(n) => document.querySelectorAll('#plot-reward svg circle').length >= n", arg=STEPS, timeout=60_000)
            page.wait_for_function("() => !document.getElementById('history').hidden", timeout=30_000)
            assert int(page.get_attribute("#history", "data-archived-upto")) == archived_upto(archive)
            assert "archive to seq" in page.locator("#history").inner_text()
            assert int(page.locator("#stream-seq").inner_text()) == history[-1].seq
            page.screenshot(path=str(tmp_path / "dashboard-archive.png"), full_page=True)
        finally:
            browser.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
