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
