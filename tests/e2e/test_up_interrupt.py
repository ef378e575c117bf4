"""Ctrl-C or SIGTERM on `rolectl up` (a real process): it stops its roles, writes what it can and
exits 130 (the table's "interrupted") without a traceback; a second Ctrl-C kills the roles at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rolectl.roles.runner import EXIT_INTERRUPTED
from tests.support.e2e import ROOT, _kill_tree, job_config
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.e2e


def _wait_for_text(path, text, proc, timeout):
    def written() -> bool:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        assert proc.poll() is None, f"exited {proc.returncode}\n{path.read_text(errors='replace')[-3000:]}"
        return False  # polling a file another process writes

    wait_until_sync(written, timeout=timeout, poll=0.2, what=f"{text!r} in {path}")


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGINT, signal.SIGINT), (signal.SIGTERM,)],
                         ids=["ctrl-c", "ctrl-c-twice", "sigterm"])
def test_up_interrupted_exits_130_without_a_traceback(tmp_path, signals):
    config = job_config(tmp_path, job="e2e-up-interrupt", synchronizer={"sync_method": "memory"},
                        trainer={"total_steps": 500}, explorers={"total_steps": 500})
    out_path = tmp_path / "up.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rolectl", "up", "--config", str(config), "--no-dashboard",
             "--run-dir", str(tmp_path / "runs")],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        _wait_for_text(out_path, "run dir", proc, 120)
        logs = next((tmp_path / "runs").glob("e2e-up-interrupt-*")) / "logs"
        _wait_for_text(logs / "trainer.log", '"train_step"', proc, 240)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.2) if len(signals) > 1 else None  # two distinct presses, not one signal
        rc = proc.wait(timeout=60)  # a bound on "hung"
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    output = out_path.read_text(errors="replace")
    assert rc == EXIT_INTERRUPTED, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "interrupted" in output, output[-3000:]
