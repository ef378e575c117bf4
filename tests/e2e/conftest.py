"""Fixtures of the end-to-end tests that several of them start from, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.e2e import sft_example_base

# The base only has to exist and load, not to know the skill yet: the SFT example's first steps.
SFT_BASE_STEPS = 4


@pytest.fixture(scope="session")
def sft_base(tmp_path_factory) -> Path:
    """The SFT example's base (examples/sft_base.yaml, shortened, run by `rolectl up`), built once for
    the tests that start from it: the LoRA and DPO quickstarts. They only read it (it is their
    model.path and the DPO reference); with `-n 3 --dist loadgroup` they share the "sft-base" group,
    so one worker builds it once."""
    return sft_example_base(tmp_path_factory.mktemp("sft-base"), steps=SFT_BASE_STEPS)
