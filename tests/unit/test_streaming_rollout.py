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


def test_streaming_steps_keep_a_step_of_lookahead_in_flight_and_publish_each_group_once():
    """The first step also admits the next batch (an engine that collects all it holds waits for its
    slowest): from then on each step takes a step's worth of whole groups out of two, long ones
    published by later steps, and one step's worth stays in flight until the stop drops it."""
    from rolectl.roles.engines import make_rollout_engine, make_taskset
    from rolectl.roles.rollout_step import StreamingSteps

    cfg = parse_config(_job(model={"engine": "tiny", "group_size": 4, "task_length": 2, "long_task_length": 12,
                                   "long_task_fraction": 0.3}))
    taskset = make_taskset(cfg, seed=0, batch_size=4)
    steps = StreamingSteps([make_rollout_engine(cfg, "explorer-0")])
    published, carried, lookaheads = [], 0, []

    def more():
        lookaheads.append(step)
        return taskset.next_batch()

    for step in range(1, 7):
        experiences = steps.rollout(taskset.next_batch(), step, more=more)
        assert len(experiences) == 4 * 4 and len({e.group for e in experiences}) == 4, step
        assert steps.in_flight() == 4 == steps.metrics()["streaming_in_flight_groups"], step
        published += sorted({e.group for e in experiences})
        carried += steps.metrics()["streaming_carried_groups"]
    assert len(published) == len(set(published)) == 6 * 4  # every group once
    assert lookaheads == [1] and carried > 0, (lookaheads, "no step published a group an earlier step admitted")
    assert any(g.split("-")[2] != "1" and int(g.split("-")[2]) > 10**8 for g in published)  # the lookahead's
    assert steps.drop() == 4 and steps.in_flight() == 0
