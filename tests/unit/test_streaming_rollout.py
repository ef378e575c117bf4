"""Streaming rollouts (`explorers.streaming`): generations run on across explore steps; a step
publishes the groups that finish first and the rest go on with the weights loaded in between. The
configs that cannot stream are refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolectl.roles.config import parse_config
from rolectl.sync_protocol import ConfigError
from tests.support.tiny_llm import data_section, model_section


def _job(**sections):
    data = {"job": "streaming", "model": {"engine": "tiny", "group_size": 4},
            "synchronizer": {"sync_method": "memory", "sync_style": "fully_async"},
            "explorers": {"partial_rollout": True, "streaming": True}}
    for name, section in sections.items():
        data[name] = {**data.get(name, {}), **section} if name != "model" else section
    return data


def test_a_streaming_job_parses():
    assert parse_config(_job()).explorers.streaming


@pytest.mark.parametrize(("sections", "says"), [
    ({"explorers": {"partial_rollout": False}}, "needs explorers.partial_rollout: true"),
    ({"algorithm": {"dynamic_sampling": True}}, "does not combine with algorithm.dynamic_sampling"),
    ({"model": model_section(Path("never-built")), "data": data_section()}, "cannot carry generations across steps"),
])
def test_configs_that_cannot_stream_are_refused(sections, says):
    with pytest.raises(ConfigError) as caught:
        parse_config(_job(**sections))
    assert "explorers.streaming" in str(caught.value) and says in str(caught.value), str(caught.value)
