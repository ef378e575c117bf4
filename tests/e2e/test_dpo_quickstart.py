"""The DPO quickstart ("dpo_quickstart.yaml"), shortened, as its header runs it: the SFT example makes
the base ("sft_base.yaml", shortened), examples/data/make_dpo_pairs.py writes pairs from the base's
own samples, and `rolectl up` runs the DPO stage from the base: the trainer alone, every step
reporting the loss, the reward margin, the chosen and rejected rewards and the accuracy; the first
step starts at the reference (the base), the job ends complete and its export loads."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
import yaml

from rolectl.sync_protocol import Role, StepFinished
from tests.support.e2e import ROOT, of_kind, run_up

# the SFT base is tests/e2e/conftest.py's `sft_base`, built once per test run
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("sft-base")]

STEPS = 4
FIGURES = ("dpo/loss", "dpo/reward_margin", "dpo/reward_chosen", "dpo/reward_rejected", "dpo/accuracy")


def pairs_from_the_base(tmp_path: Path, base: Path) -> Path:
    out = tmp_path / "data" / "digits-dpo"
    done = subprocess.run([sys.executable, "examples/data/make_dpo_pairs.py", "--model", str(base), "--out", str(out),
                           "--prompts", "48", "--eval-prompts", "8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pairs from 48 prompts" in done.stdout and "the base's greedy positional_match" in done.stdout, done.stdout
    return out


def shortened(tmp_path: Path, base: Path, data: Path) -> Path:
    config = yaml.safe_load((ROOT / "examples" / "dpo_quickstart.yaml").read_text())
    config["run_dir"] = str(tmp_path / "runs")
    config["trainer"].update(export_dir=str(tmp_path / "bases" / "digits-dpo"), save_interval=2)
    config["model"]["path"] = str(base)
    config["dpo"].update(path=str(data / "pairs.jsonl"), eval_path=str(data / "eval.jsonl"), max_steps=STEPS,
                         eval_interval=0)
    path = tmp_path / "dpo_quickstart.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.timeout(900)
def test_the_dpo_quickstart_runs_from_the_sft_base_on_its_own_scored_samples(tmp_path, sft_base):
    base = sft_base
    data = pairs_from_the_base(tmp_path, base)
    run = run_up(shortened(tmp_path, base, data), tmp_path, timeout=300, extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0 and s["complete"] is True, f"exit {run.rc}\n{run.output[-2000:]}\n{run.role_logs()}"
    assert s["trainer_steps"] == STEPS and s["explorer_steps"] == {} and s["syncs"] == 0, s
    steps = {r.event.step: dict(r.event.metrics) for r in of_kind(run.records, StepFinished, role=Role.TRAINER)}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step in steps.values():
        assert set(FIGURES) <= set(step), sorted(step)
        assert step["dpo/reward_margin"] == pytest.approx(step["dpo/reward_chosen"] - step["dpo/reward_rejected"],
                                                          abs=1e-6)
    # the first step's policy is the reference (the base): no margin yet, the sigmoid loss is log 2
    assert steps[1]["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert steps[1]["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert steps[STEPS]["dpo/reward_margin"] > 0  # the policy moved toward the chosen responses
    last = steps[STEPS]
    assert {"dpo/eval_loss", "dpo/eval_accuracy", "dpo/eval/positional_match"} <= set(last), sorted(last)
    stage = s["stage"]
    assert stage["name"] == "dpo" and stage["last"]["reward_margin"] == round(last["dpo/reward_margin"], 4)
    assert stage["eval"][-1]["figures"]["accuracy"] == round(last["dpo/eval_accuracy"], 4)
    export = tmp_path / "bases" / "digits-dpo"  # the next stage's model.path
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert loaded.config.model_type == "gpt2" and (export / "tokenizer.json").is_file()
