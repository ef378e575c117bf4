"""A trainer that finds saved state, against real nats-servers: a re-run of a job name on a fresh
stream is refused (it used to "finish" at once from the old checkpoint), `--fresh` trains from step
0, a finished member is not started again; and `rolectl start` says so readably on a console and as
JSON lines in a file (exit 2). Restarts that must resume are the e2e fault tests' part."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

# same folder (on sys.path); `tests` may be another package's (vllm ships one)
from test_trainer_guard import _config, _publish_rollouts

from rolectl.bus.connection import connect
from rolectl.bus.events import read_all
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.resume import StartMode, StartRefused
from rolectl.roles.runner import EXIT_USAGE
from rolectl.roles.trainer import Trainer
from rolectl.sync_protocol import Role, StepFinished

ROOT = Path(__file__).resolve().parents[2]


async def _train(cfg, *, start_mode: StartMode = StartMode.AUTO) -> list[int]:
    """Publish three steps of rollouts to `cfg`'s server, run a trainer there; the steps it reported."""
    async with connect(cfg.nats_url, job=cfg.job, role="observer", member="test") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await ensure_experience_stream(conn.js, conn.names)
        await _publish_rollouts(conn, cfg, steps=3)
        trainer = Trainer(cfg, start_mode=start_mode)
        await asyncio.wait_for(trainer.run(), 120)  # no explorer is alive: it trains what there is
        return [r.event.step for r in await read_all(conn)
                if isinstance(r.event, StepFinished) and r.event.member.role is Role.TRAINER]


async def test_a_rerun_on_a_fresh_stream_is_refused_and_fresh_trains_from_step_0(tmp_path, nats_server, own_server,
                                                                                 job_name):
    first = _config(tmp_path, job_name, nats_server.url)
    assert await _train(first) == [1, 2, 3]
    state_file = first.trainer_checkpoint_dir / "trainer_state.json"
    assert json.loads(state_file.read_text())["step"] == 3

    rerun = first.with_overrides(nats_url=own_server.url)  # same job name and run_dir, a new server
    with pytest.raises(StartRefused, match="holds step 3 of an earlier run.*not a restart. Pass --fresh"):
        await asyncio.wait_for(Trainer(rerun).run(), 120)
    assert json.loads(state_file.read_text())["step"] == 3  # refused: nothing discarded

    assert await _train(rerun, start_mode=StartMode.FRESH) == [1, 2, 3]  # from step 0, not "finished" at once

    # The stream now records the trainer as finished: starting it again is refused, not a no-op "success".
    with pytest.raises(StartRefused, match="its work is done"):
        await asyncio.wait_for(Trainer(rerun).run(), 120)


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_start_refusal_is_readable_on_a_console_and_json_in_a_file(tmp_path, own_server, job_name, log_format):
    cfg = _config(tmp_path, job_name, own_server.url)
    state = cfg.trainer_checkpoint_dir / "trainer_state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"checkpoint": "step-7", "step": 7}))  # left by an earlier run
    result = subprocess.run(
        [sys.executable, "-m", "rolectl", "start", "trainer", "--config", str(tmp_path / "job.yaml"),
         "--nats", own_server.url, "--log-format", log_format],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    refusal = [line for line in lines if "start_refused" in line]
    assert refusal, result.stderr
    if log_format == "json":
        event = json.loads(refusal[-1])
        assert event["event"] == "start_refused" and event["exit_code"] == EXIT_USAGE
        assert "--fresh" in event["reason"] and str(state) in event["reason"]
    else:
        assert not any(line.lstrip().startswith("{") for line in lines), result.stderr
        assert "--fresh" in refusal[-1] and str(state) in refusal[-1]
