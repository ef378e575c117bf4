"""The quickstart as shipped: `rolectl up --config examples/quickstart.yaml` learns, end to end."""

from __future__ import annotations

import pytest

from tests.support.e2e import ROOT, assert_decisions_replay, run_up

pytestmark = pytest.mark.e2e


def test_quickstart_learns(tmp_path, record_property):
    # A bound on "hung", not on speed: a run took 358 s on the shared 2-core machine (load 12-17).
    run = run_up(ROOT / "examples" / "quickstart.yaml", tmp_path, timeout=900,
                 extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    figures = {k: s.get(k) for k in ("wall_s", "trainer_steps", "explorer_steps", "final_version",
                                      "reward_first", "reward_last", "sync_wait_ms")}
    for key, value in figures.items():
        record_property(key, value)
    print(f"quickstart: {figures}")
    assert run.rc == 0, f"exit {run.rc}: {s.get('exit_codes')}\n{run.role_logs()}"
    assert s["trainer_steps"] == 50 and s["final_version"] == 50, figures
    assert s["explorer_steps"] == {"explorer-0": 50, "explorer-1": 50}, figures
    assert s["reward_last"] >= s["reward_first"] + 0.3, figures
    assert_decisions_replay(run.records)
