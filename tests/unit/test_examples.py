"""Every shipped example job file loads and validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolectl.roles.config import JobConfig, load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples():
    names = {p.name for p in EXAMPLES}
    assert "quickstart.yaml" in names and len(names) >= 5, names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads(path):
    cfg = load_config(path)
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
