"""The `rolectl` console script and `python -m rolectl` are the same command: a reward module in the
working directory resolves under both (the script's `sys.path` starts with its `bin/`, not the
working directory), and is called with the data row it declares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "rolectl"


def _project(tmp_path: Path) -> Path:
    """A job beside its own reward module and eval rows, as a user keeps them."""
    (tmp_path / "my_reward.py").write_text("def weighted(response, answer, *, row):\n    return row['weight']\n")
    rows = [json.loads(line) for line in (ROOT / "examples/data/reverse_digits_eval.jsonl").read_text().splitlines()]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({**r, "weight": i / 4}) + "\n"
                                                 for i, r in enumerate(rows[:4])))
    (tmp_path / "job.yaml").write_text("job: script-reward\nrun_dir: runs\nmodel: {engine: tiny}\n"
                                       "eval: {path: eval.jsonl, rewards: ['my_reward:weighted']}\n")
    (tmp_path / "runs" / "script-reward" / "trainer").mkdir(parents=True)  # a job with only version 0 kept
    return tmp_path


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", [[str(SCRIPT)], [sys.executable, "-m", "rolectl"]], ids=["script", "module"])
def test_a_reward_module_in_the_working_directory_resolves_under_both(tmp_path, command):
    project = _project(tmp_path)
    done = subprocess.run([*command, "bench", "--config", "job.yaml", "--versions", "0", "--json"], cwd=project,
                          capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    [row] = json.loads(done.stdout)
    assert row["rewards"] == {"my_reward:weighted": pytest.approx((0 + 1 + 2 + 3) / 4 / 4)}
