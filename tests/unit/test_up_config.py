"""`rolectl up` hands its roles one effective config file: it loads as the same job, every example."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolectl.roles.config import load_config
from rolectl.roles.launch.local import write_config
from tests.support.examples import LATER_STAGES

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_effective_config_loads_as_the_same_engine_sections(path, tmp_path):
    check = path.name not in LATER_STAGES  # their files are made by earlier commands
    cfg = load_config(path, check_engines=check)
    write_config(cfg, tmp_path / "job.yaml")
    again = load_config(tmp_path / "job.yaml", check_engines=check)
    assert (again.model, again.data, again.algorithm) == (cfg.model, cfg.data, cfg.algorithm)
    assert (again.trainer, again.explorers, again.synchronizer) == (cfg.trainer, cfg.explorers, cfg.synchronizer)
