"""The dashboard in a real headless Chromium, watching a real job started with `rolectl up`.

`rolectl up` runs an embedded nats-server, the synchronizer, a trainer and two explorers as
processes, and serves the dashboard on the port we give it. The page must list the members and show
the latest version moving while the job runs. A screenshot goes to the test's tmp dir and to
`runs/dashboard.png` for humans. Chromium comes from the system (/usr/bin/chromium): this test never
downloads a browser and never skips. A recorded fleet of 1,000 explorers is counted and paged.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from rolectl.bus.server import free_port
from tests.support.fleet import BEHIND, EXPIRED, STOPPED, explorer_id, record_fleet
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("dashboard_job.yaml")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
MEMBERS = ("trainer/trainer", "explorer/explorer-0", "explorer/explorer-1")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Wait until `url` answers 200, failing at once if `rolectl up` exits first."""

    def answers() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"rolectl up exited with {proc.returncode} before serving the dashboard:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return resp.status == 200
        except OSError:
            return False  # not listening yet

    wait_until_sync(answers, timeout=timeout, what=f"the dashboard at {url} to answer", details=lambda: _tail(log))


def _interrupt(proc: subprocess.Popen, timeout: float) -> None:
    """Ctrl-C, as a person would; killed if it has not exited after `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def running_job(tmp_path):
    """`rolectl up` with the test config; yields the dashboard URL; stops the job afterwards."""
    port = free_port()
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rolectl", "up", "--config", str(CONFIG), "--dashboard-port", str(port),
             "--run-dir", str(tmp_path / "runs")],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_http(url + "healthz", proc, log, timeout=60.0)
        yield url
    finally:
        _interrupt(proc, timeout=60)  # up stops every role, then itself


def test_dashboard_shows_members_and_a_moving_version(running_job, tmp_path):
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: install it with `apt-get install -y chromium`"
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(running_job)

            # every member shows up in the members table
            page.wait_for_function(
                "(keys) => keys.every(k => document.querySelector(`#members tr[data-member='${k}']`))",
                arg=list(MEMBERS), timeout=60_000)

            # the version shown now, then a newer one while the job runs
            first = page.wait_for_function(
                "() => { const v = document.getElementById('latest-version').dataset.version;"
                "        return v === undefined ? null : {v: Number(v)}; }", timeout=60_000).json_value()["v"]
            page.wait_for_function(
                "(first) => Number(document.getElementById('latest-version').dataset.version) > first",
                arg=first, timeout=90_000)
            shown = int(page.get_attribute("#latest-version", "data-version"))
            assert shown > first

            # enough history for a readable picture: trainer steps plotted, a few rounds closed
            page.wait_for_function(
                "() => document.querySelectorAll('#plot-reward svg circle').length >= 6"
                " && document.querySelectorAll('#rounds tbody tr[data-round]').length >= 8", timeout=90_000)
            # the eval curve beside it, in the legend, once explorer-0 evaluated a trained version
            page.wait_for_function(
                "() => (document.querySelector('#plot-reward .legend') || {}).textContent?.includes("
                "'eval positional_match')", timeout=90_000)

            # read in one go: the rows are ordered stragglers first, and move as the job runs
            keys = page.eval_on_selector_all("#members tbody tr[data-member]",
                                             "rows => rows.map(r => r.dataset.member)")
            assert set(MEMBERS) <= set(keys)
            trainer = page.locator("#members tr[data-member='trainer/trainer']")
            assert trainer.locator("td").nth(0).inner_text().strip() == "trainer"
            # "finished" once it trained its last step (a stopped one may come back)
            assert trainer.get_attribute("data-status") in ("running", "require_sync", "stopped", "finished")
            assert page.locator("#job").inner_text() == "dashboard-browser"

            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    (ROOT / "runs").mkdir(exist_ok=True)
    shutil.copyfile(shot, ROOT / "runs" / "dashboard.png")
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture
def fleet_dashboard(tmp_path, nats_url, job_name):
    """`rolectl dashboard` watching a recorded job of a trainer and 1,000 explorers; yields its URL."""
    asyncio.run(record_fleet(nats_url, job_name, explorers=1000))
    port = free_port()
    log = tmp_path / "dashboard.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rolectl", "dashboard", "--job", job_name, "--nats", nats_url,
             "--port", str(port)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_http(url + "healthz", proc, log, timeout=60.0)
        yield url
    finally:
        _interrupt(proc, timeout=30)


def test_a_fleet_of_a_thousand_is_counted_and_paged_stragglers_first(fleet_dashboard, tmp_path):
    """1,000 explorers: the counts by status on top, one page of 50 rows under them (the expired, the
    stopped and those furthest behind first), and the next page on a click."""
    errors: list[str] = []
    stragglers = [explorer_id(i) for i in (*EXPIRED, *STOPPED, *sorted(BEHIND, key=BEHIND.get))]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(fleet_dashboard)
            page.wait_for_function(
                "() => document.querySelector(\"#member-counts [data-role='explorer'] [data-status='running'] .n\")"
                "?.textContent === '997'", timeout=60_000)
            counts = page.locator("#member-counts [data-role='explorer']")
            assert counts.locator("[data-status='expired'] .n").inner_text() == "2"
            assert counts.locator("[data-status='stopped'] .n").inner_text() == "1"
            rows = page.locator("#members tbody tr[data-member]")
            assert rows.count() == 50
            keys = [rows.nth(i).get_attribute("data-member") for i in range(rows.count())]
            # the trainer, then the stragglers (the synchronizer's row is on the last page)
            assert keys[:1 + len(stragglers)] == ["trainer/trainer", *(f"explorer/{s}" for s in stragglers)]
            assert page.locator("#members-page").inner_text() == "1–50 of 1002"
            assert page.locator("#members-prev").is_disabled()
            page.click("#members-next")
            page.wait_for_function("() => document.getElementById('members-page').textContent === '51–100 of 1002'")
            second = page.locator("#members tbody tr[data-member]")
            assert second.count() == 50 and second.nth(0).get_attribute("data-member") not in keys
            # the version chips: those behind first, then a count, not a thousand chips
            assert page.locator("#versions .chip").count() <= 25
            assert "hold v12" in page.locator("#versions .chip.more").inner_text()
            page.screenshot(path=str(tmp_path / "fleet.png"), full_page=True)
        finally:
            browser.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
