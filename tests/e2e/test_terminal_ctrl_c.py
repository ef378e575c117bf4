"""Ctrl-C as a terminal sends it: `rolectl up` (and `rolectl server`, `rolectl start`) run as the
foreground job of a pseudo-terminal, and Ctrl-C pressed there, which sends SIGINT to the whole
foreground process group (tests/e2e/test_up_interrupt.py signals `up`'s pid alone).

`up` stops what it started in order (the roles, then the export, then the server): it exits 130
quickly, every role records its STOPPED and its exit code (none killed), `events.jsonl` holds the
whole record and replays, the summary says "interrupted" and how far the trainer got, and the last
lines say how to resume. Then `up --resume` continues the run to its end, every step trained once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rolectl.roles.exit_codes import ExitCode
from rolectl.roles.observe.replay import load_export
from rolectl.sync_protocol import MemberJoined, Role, StatusChanged, StepsRolledBack
from tests.support.e2e import ROOT, job_config, of_kind, trainer_steps
from tests.support.terminal import TerminalJob
from tests.support.wait import wait_until_sync

pytestmark = pytest.mark.e2e

STOPPED_WITHIN_S = 5.0
"""From the Ctrl-C to `up`'s exit: the roles stop cleanly in about a second each; the old failure
waited out a 15 s grace and killed them."""


def _config(tmp_path: Path, *, steps: int, job: str) -> Path:
    return job_config(tmp_path, job=job, synchronizer={"sync_method": "memory"},
                      trainer={"total_steps": steps, "save_interval": 2},
                      # a step of exploration takes a while: the job is mid-way when Ctrl-C lands
                      explorers={"total_steps": steps, "step_delay_s": [0.3, 0.3]})


def _up(config: Path, tmp_path: Path, name: str = "up") -> TerminalJob:
    return TerminalJob(["up", "--config", str(config), "--no-dashboard", "--run-dir", str(tmp_path / "runs")],
                       tmp_path / f"{name}.out")


def _run_dir(tmp_path: Path, job: str) -> Path:
    return next((tmp_path / "runs").glob(f"{job}-*"))


def _wait_for_trainer_step(tmp_path: Path, job: str, up: TerminalJob, step: int) -> None:
    def trained() -> bool:
        assert up.poll() is None, f"up exited {up.returncode}\n{up.output()[-4000:]}"
        logs = list((tmp_path / "runs").glob(f"{job}-*/logs/trainer.log"))
        return bool(logs) and logs[0].read_text(errors="replace").count('"train_step"') >= step

    wait_until_sync(trained, timeout=300, poll=0.1, what=f"trainer step {step}",
                    details=lambda: up.output()[-4000:])


def _replays(events: Path, *, complete: bool) -> None:
    """`rolectl replay --file EVENTS --check`: every recorded decision is recomputed; a job that
    ended short exits 1 all the same (as it should), so the check's own verdict is read too."""
    check = subprocess.run([sys.executable, "-m", "rolectl", "replay", "--file", str(events), "--check"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "check OK: all" in check.stdout, check.stdout[-3000:] + check.stderr[-3000:]
    assert check.returncode == (0 if complete else 1), check.stdout[-3000:] + check.stderr[-3000:]


def _assert_stopped_in_order(up: TerminalJob, run_dir: Path, rc: int, took: float) -> dict:
    output = up.output()
    assert rc == ExitCode.INTERRUPTED, output[-4000:]
    assert took < STOPPED_WITHIN_S, f"up took {took:.1f} s to stop\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    assert '"event": "' not in output, "a raw JSON log line on the console:\n" + output[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    codes = summary["exit_codes"]
    assert set(codes) == {"sync-0", "trainer", "explorer-0", "explorer-1"}, codes
    assert codes["sync-0"] == 0 and all(codes[m] == 130 for m in ("trainer", "explorer-0", "explorer-1")), codes
    done = summary["trainer_steps"]
    assert done >= 1 and summary["end_reason"].startswith("interrupted"), summary
    assert f"after step {done}" in summary["end_reason"], summary
    assert "trainer_steps" in output and "interrupted" in output
    # the whole record: every role's STOPPED (the synchronizer's too), steps 1..done; and it replays
    events = Path(summary["events_file"])
    records = load_export(events)
    stopped = {r.event.member.id for r in of_kind(records, StatusChanged) if r.event.status.value == "stopped"}
    assert stopped == set(codes), stopped
    assert trainer_steps(records) == list(range(1, done + 1))
    _replays(events, complete=False)
    assert f"rolectl up --resume {run_dir}" in output, output[-2000:]
    return summary


@pytest.mark.parametrize("presses", ["ctrl-c", "ctrl-c twice", "sigterm"])
def test_ctrl_c_in_a_terminal_stops_up_in_order_and_keeps_the_record(tmp_path, presses):
    job = f"e2e-tty-{presses.replace(' ', '-')}"
    config = _config(tmp_path, steps=500, job=job)
    with _up(config, tmp_path) as up:
        _wait_for_trainer_step(tmp_path, job, up, 2)
        started = time.monotonic()
        if presses == "sigterm":
            up.signal(15)
        else:
            up.ctrl_c()
            if presses == "ctrl-c twice":
                up.wait_for_output("Ctrl-C again", timeout=30)
                up.ctrl_c()
        rc = up.wait(timeout=120)  # a bound on "hung"; the figure is asserted below
        took = time.monotonic() - started
        summary = _assert_stopped_in_order(up, _run_dir(tmp_path, job), rc, took)
    if presses == "ctrl-c twice":
        assert "stopping faster" in up.output()
    assert summary["complete"] is False


def test_up_resume_continues_an_interrupted_run_to_its_end(tmp_path):
    """Ctrl-C mid-job, then `up --resume RUN_DIR`: the same job, store and checkpoints; the run
    ends complete with every step 1..N trained once, and its whole record replays."""
    steps, job = 10, "e2e-tty-resume"
    config = _config(tmp_path, steps=steps, job=job)
    with _up(config, tmp_path) as up:
        _wait_for_trainer_step(tmp_path, job, up, 3)
        up.ctrl_c()
        assert up.wait(timeout=120) == ExitCode.INTERRUPTED, up.output()[-4000:]
    run_dir = _run_dir(tmp_path, job)
    first = json.loads((run_dir / "summary.json").read_text())
    assert 3 <= first["trainer_steps"] < steps, first

    with TerminalJob(["up", "--resume", str(run_dir), "--no-dashboard"], tmp_path / "resume.out") as again:
        rc = again.wait(timeout=300)
        assert rc == ExitCode.OK, again.output()[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["complete"] is True and summary["trainer_steps"] == steps, summary
    assert summary["run_dir"] == str(run_dir)
    records = load_export(summary["events_file"])
    # the first run's record and the resumed one's, in one stream: two trainer incarnations
    assert len(of_kind(records, MemberJoined, role=Role.TRAINER)) == 2
    assert trainer_steps(records) == list(range(1, steps + 1)), trainer_steps(records)
    assert not of_kind(records, StepsRolledBack)  # a clean stop saved: nothing trained twice
    _replays(Path(summary["events_file"]), complete=True)

    # a finished run: said, and nothing else (exit 0)
    done = subprocess.run([sys.executable, "-m", "rolectl", "up", "--resume", str(run_dir), "--no-dashboard"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == ExitCode.OK, done.stdout[-3000:] + done.stderr[-3000:]
    assert "already finished" in done.stderr, done.stderr[-3000:]


def test_ctrl_c_stops_rolectl_server_and_its_node_processes(tmp_path):
    store = tmp_path / "store"
    with TerminalJob(["server", "--cluster", "3", "--store-dir", str(store)], tmp_path / "server.out") as server:
        server.wait_for_output("Ctrl-C stops every node", timeout=120)
        nodes = [node["pid"] for node in json.loads((store / "cluster.json").read_text())["nodes"]]
        server.ctrl_c()
        assert server.wait(timeout=60) == ExitCode.OK, server.output()[-3000:]
    assert not [pid for pid in nodes if Path(f"/proc/{pid}").exists()], "nodes left running"
