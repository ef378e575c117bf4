"""Every shipped example job file loads and validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolectl.roles.config import JobConfig, load_config
from tests.support.examples import LATER_STAGES  # loaded without the engines' check; tests below check them

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert "quickstart.yaml" in names and len(names) >= 5, names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path):
    cfg = load_config(path, check_engines=path.name not in LATER_STAGES)
    assert isinstance(cfg, JobConfig)
    assert cfg.source == str(path)
    assert cfg.job and cfg.trainer.total_steps > 0 and cfg.explorers.count > 0


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_a_header_that_counts_trainer_steps_says_what_the_file_sets(path):
    import re

    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    said = [int(n) for n in re.findall(r"(\d+) trainer steps", header)]
    total = load_config(path, check_engines=False).trainer.total_steps
    assert all(n == total for n in said), f"{path.name}: its header says {said} trainer steps, it sets {total}"


def test_the_dpo_quickstart_starts_from_what_the_base_and_the_pair_script_make():
    import importlib.util

    examples = EXAMPLES[0].parent
    spec = importlib.util.spec_from_file_location("make_dpo_pairs", examples / "data" / "make_dpo_pairs.py")
    pairs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pairs)
    base = load_config(examples / "sft_base.yaml", check_engines=False)
    dpo = load_config(examples / "dpo_quickstart.yaml", check_engines=False)
    assert dpo.stage == "dpo" and Path(dpo.model.path) == Path(base.trainer.export_dir) == pairs.MODEL
    assert (Path(dpo.dpo.path), Path(dpo.dpo.eval_path)) == (pairs.OUT / "pairs.jsonl", pairs.OUT / "eval.jsonl")
    assert dpo.model.max_new_tokens == base.model.max_new_tokens == pairs.MAX_NEW_TOKENS  # one greedy eval
    assert pairs.REWARD in dpo.dpo.eval_rewards


def test_the_lora_quickstart_starts_from_the_export_of_the_sft_example():
    import yaml

    examples = EXAMPLES[0].parent
    base = load_config(examples / "sft_base.yaml", check_engines=False)
    lora = yaml.safe_load((examples / "lora_quickstart.yaml").read_text())
    assert base.stage == "sft" and base.trainer.export_dir
    assert Path(lora["model"]["path"]) == Path(base.trainer.export_dir)
    assert "build" not in lora["model"] and lora["model"]["lora"]["rank"] > 0  # the base as exported, an adapter
