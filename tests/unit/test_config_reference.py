"""The configuration reference is generated from the config models and committed in step with them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from rolectl.roles.config import EnvSettings, JobConfig
from rolectl.roles.config_reference import _SECTIONS, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_reference_is_the_generated_one():
    assert DOC.read_text() == render(), (
        "docs/configuration.md is out of date: python -m rolectl.roles.config_reference > docs/configuration.md")


@pytest.mark.parametrize("model", [JobConfig, EnvSettings, *(model for _, model, _ in _SECTIONS)],
                         ids=lambda m: m.__name__)
def test_every_field_is_described(model: type[BaseModel]):
    assert [name for name, info in model.model_fields.items()
            if not info.description and not isinstance(info.default, BaseModel)] == []


def test_every_section_and_variable_is_in_the_reference():
    text = render()
    sections = [name for name, info in JobConfig.model_fields.items() if isinstance(info.default, BaseModel)]
    assert all(f"\n## {name}\n" in text for name in [*sections, "synchronizer", "data", "algorithm"])
    assert all(f"`ROLECTL_{name.upper()}`" in text for name in EnvSettings.model_fields)
