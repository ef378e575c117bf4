"""The dashboard in a real headless Chromium, watching a real job started with `rolectl up`.

`rolectl up` runs an embedded nats-server, the synchronizer, a trainer and two explorers as
processes, and serves the dashboard on the port we give it. The page must list the members and show
the latest version moving while the job runs. A screenshot goes to the test's tmp dir and to
`runs/dashboard.png` for humans. Chromium comes from the system (/usr/bin/chromium): this test never
downloads a browser and never skips.
"""

from __future__ import annotations

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
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # up stops every role, then itself
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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

            rows = page.locator("#members tbody tr[data-member]")
            keys = [rows.nth(i).get_attribute("data-member") for i in range(rows.count())]
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
