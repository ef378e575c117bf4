"""The multi-turn agent example (`examples/agent_multiturn.yaml`) runs shortened as real processes
(`rolectl up`: a server, a synchronizer, a trainer, two explorers): the job completes; its
explorers played episodes (more than one turn each on average: the model asks, then answers), with
no environment error; its trainer trained on the tokens the policy sampled and not on the ones the
environment said (both counted, every step's loss finite although the environment's tokens are
ones the policy never samples); the summary's `agent` block and up's table show it; and `rolectl
replay --check` of its recording passes (no sync decision depends on what a trajectory holds). The
full run's learning curve is the example's own command (docs/agents.md), not a test."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rolectl.sync_protocol import Role, StepFinished
from tests.support.e2e import ROOT, of_kind, run_up, shortened

pytestmark = pytest.mark.e2e

STEPS = 3


def _summary_rows(output: str) -> dict[str, str]:
    """Each figure of up's printed summary table and its value, the value's folded lines joined."""
    rows: dict[str, str] = {}
    figure = None
    for line in output[output.index("run summary"):].splitlines():
        cells = [cell.strip() for cell in line.split("│")]
        if len(cells) < 4:
            continue
        figure = cells[1] or figure
        rows[figure] = rows.get(figure, "") + cells[2]
    return rows


def test_agent_example_plays_episodes_trains_on_sampled_tokens_and_replays(tmp_path):
    run = run_up(shortened("agent_multiturn.yaml", tmp_path, steps=STEPS), tmp_path, timeout=240,
                 extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0, f"exit {run.rc}: {s.get('exit_codes')}\n{run.output[-2000:]}\n{run.role_logs()}"
    assert s["complete"] is True and s["trainer_steps"] == STEPS and s["final_version"] == STEPS, s
    agent = s["agent"]
    # every experience is one episode; some asked (a turn of its own) before answering
    assert agent["episodes"] == s["experiences_produced"] > 0, s
    assert 1.0 < agent["turns_mean"] <= 3.0, agent
    assert agent["tool_calls"]["reveal"]["ok"] > 0 and agent["env_errors"] == {}, agent
    explored = [r.event.metrics for r in of_kind(run.records, StepFinished, role=Role.EXPLORER)]
    assert explored and all(m["agent/episodes"] == m["experiences"] for m in explored)
    # the trainer: each step trained sampled tokens and left the environment's out, its loss finite
    trained = [r.event.metrics for r in of_kind(run.records, StepFinished, role=Role.TRAINER)]
    assert len(trained) == STEPS
    assert all(m["trained_tokens"] > 0 and m["masked_tokens"] > 0 and math.isfinite(m["loss"]) for m in trained)
    assert agent["trained_tokens"] == sum(m["trained_tokens"] for m in trained) > 0, agent
    assert agent["masked_tokens"] == sum(m["masked_tokens"] for m in trained) > 0, agent
    assert json.loads(_summary_rows(run.output)["agent"]) == agent  # up's table shows the block
    check = subprocess.run([sys.executable, "-m", "rolectl", "replay", "--file", s["events_file"], "--check"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and "check OK" in check.stdout, check.stdout + check.stderr
