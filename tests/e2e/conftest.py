"""Fixtures of the end-to-end tests that several of them start from, built once per session."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from tests.support.e2e import sft_example_base

# The base only has to exist and load, not to know the skill yet: the SFT example's first steps.
SFT_BASE_STEPS = 4


@pytest.fixture(scope="session")
def sft_base(tmp_path_factory, worker_id) -> Path:
    """The SFT example's base (examples/sft_base.yaml, shortened, run by `rolectl up`), built once per
    test run for the tests that start from it: the LoRA and DPO quickstarts. They only read it (it
    is their model.path and the DPO reference). Under xdist every worker has this fixture, so the
    first one builds the base in the run's shared temp directory under a file lock and the others
    wait for it and read it (pytest-xdist's recipe for a session fixture shared by workers):
    `--dist loadgroup` would keep them on one worker, but with pytest 9.2 it no longer groups
    (pytest-dev/pytest-xdist#1386)."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent  # the directory every worker's basetemp is in
    home = root / "sft-base"
    with FileLock(str(root / "sft-base.lock")):
        done = home / "built"  # names the export directory once the base is complete
        if not done.exists():
            shutil.rmtree(home, ignore_errors=True)  # a worker that failed here left a partial one
            home.mkdir()
            done.write_text(str(sft_example_base(home, steps=SFT_BASE_STEPS)))
        return Path(done.read_text())
