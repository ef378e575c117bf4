"""Partial rollouts: a generation paused for new weights goes on from the tokens it has, each token
recorded with the version that sampled it (tiny and hf engines alike), and the record survives the
wire; the configs that cannot pause a generation are refused with the reason."""

from __future__ import annotations

import pytest
import torch

from rolectl.bus.experiences import decode_batch, encode_batch, validate_batch
from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_rollout_engine, make_taskset, make_train_engine
from rolectl.roles.engines.base import PausePoint
from rolectl.sync_protocol import ConfigError
from rolectl.sync_protocol.experience import ExperienceBatch, Segment
from tests.support.pause import PauseAfter, changed_weights
from tests.support.tiny_llm import built_model, data_section, model_section

PAUSE_AT = 2
"""The pause comes after this many tokens of the first generation."""


def _tiny_job(**explorers):
    return parse_config({"job": "partial", "model": {"engine": "tiny", "group_size": 4},
                         "synchronizer": {"sync_method": "memory", "sync_style": "fully_async"},
                         "explorers": {"partial_rollout": True, **explorers}})


def test_tiny_pause_keeps_the_prefix_and_samples_the_rest_with_the_new_version():
    cfg = _tiny_job()
    tasks = make_taskset(cfg, seed=0, batch_size=3).next_batch()
    unpaused = make_rollout_engine(cfg, "explorer-0").rollout(tasks, explore_step=5)
    engine = make_rollout_engine(cfg, "explorer-0")
    new_weights = changed_weights(engine)
    pause = PauseAfter(engine, new_weights, 3, after=PAUSE_AT)
    assert isinstance(pause, PausePoint)
    paused = engine.rollout(tasks, explore_step=5, pause_point=pause)

    assert pause.loads == 1 and engine.version == 3
    assert [e.id for e in paused] == [e.id for e in unpaused]
    two_versions = 0
    for before, after in zip(unpaused, paused):
        # the tokens sampled before the pause are the old weights' own, the same as without a pause
        assert after.response[:PAUSE_AT] == before.response[:PAUSE_AT]
        assert after.logprobs[:PAUSE_AT] == pytest.approx(before.logprobs[:PAUSE_AT])
        assert after.model_version == 0  # the oldest version of its tokens: staleness counts from it
        n = len(after.response)
        if n <= PAUSE_AT:
            assert after.token_versions is None and after.versions() == (0,) * n
            continue
        two_versions += 1
        assert after.token_versions == ((PAUSE_AT, 0), (n - PAUSE_AT, 3))
        assert after.segments() == (Segment(start=0, end=PAUSE_AT, sampled=True, version=0),
                                    Segment(start=PAUSE_AT, end=n, sampled=True, version=3))
    assert two_versions, "no generation was in flight at the pause"
    _logprobs_are_the_samplers(cfg, new_weights, [e for e in paused if e.token_versions])
    batch = ExperienceBatch(member="explorer-0", explore_step=5, model_version=3, experiences=tuple(paused))
    validate_batch(batch, make_train_engine(cfg).experience_limits)
    assert decode_batch(encode_batch(batch)) == batch


def _logprobs_are_the_samplers(cfg, new_weights, resumed) -> None:
    """After the pause, each token's logprob is the new weights' on the whole prefix (kept tokens
    included): the generation continued from its tokens, not from scratch."""
    from rolectl.roles.engines.model import scored_tokens

    scorer = make_rollout_engine(cfg, "scorer")
    scorer.load_weights(new_weights, 3)
    for e in resumed:
        tokens = torch.tensor([[*e.prompt, *e.response]])
        logprobs, _ = scored_tokens(scorer.policy, tokens, torch.tensor([len(e.prompt)]), width=len(e.response),
                                    allowed_tokens=scorer.allowed_tokens, temperature=cfg.model.temperature,
                                    entropy=False)
        assert logprobs[0, PAUSE_AT:].tolist() == pytest.approx(e.logprobs[PAUSE_AT:], abs=1e-4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return built_model(tmp_path_factory.mktemp("hf"))


def test_hf_pause_keeps_the_prefix_and_records_both_versions(model_dir):
    cfg = parse_config({"job": "partial-hf", "model": model_section(model_dir, rollout_engine="hf"),
                        "data": data_section(), "explorers": {"count": 2, "partial_rollout": True},
                        "synchronizer": {"sync_method": "memory", "sync_style": "fully_async"}})
    tasks = make_taskset(cfg, seed=0, batch_size=2).next_batch()
    unpaused = make_rollout_engine(cfg, "explorer-0").rollout(tasks, explore_step=4)
    engine = make_rollout_engine(cfg, "explorer-0")
    # a generate's stopping check runs after each token: the pause comes after PAUSE_AT tokens
    pause = PauseAfter(engine, changed_weights(engine), 2, after=PAUSE_AT - 1)
    paused = engine.rollout(tasks, explore_step=4, pause_point=pause)

    assert pause.loads == 1 and engine.version == 2
    first_group = [e for e in paused if e.group.endswith("-0")]
    for before, after in zip(unpaused, first_group):
        assert after.response[:PAUSE_AT] == before.response[:PAUSE_AT]
        assert after.model_version == 0
        n = len(after.response)
        expected = ((PAUSE_AT, 0), (n - PAUSE_AT, 2)) if n > PAUSE_AT else None
        assert after.token_versions == expected, (after.response, after.token_versions)
    # the next task's group starts after the load: all of it the new version's
    assert all(e.model_version == 2 and e.token_versions is None for e in paused if e.group.endswith("-1"))
    assert any(e.token_versions for e in first_group), "no generation was in flight at the pause"
    batch = ExperienceBatch(member="explorer-0", explore_step=4, model_version=2, experiences=tuple(paused))
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.parametrize(("sections", "says"), [
    ({"synchronizer": {"sync_method": "memory", "sync_style": "fixed"}}, "needs synchronizer.sync_style: fully_async"),
    ({"synchronizer": {"sync_method": "nccl", "sync_style": "fully_async"}}, "with a pull sync_method"),
    ({"explorers": {"over_rollout_ratio": 0.25}}, "does not combine with explorers.over_rollout_ratio"),
])
def test_configs_that_cannot_pause_a_generation_are_refused(sections, says):
    data = {"job": "partial", "model": {"engine": "tiny"},
            "synchronizer": {"sync_method": "memory", "sync_style": "fully_async"},
            "explorers": {"partial_rollout": True}}
    for name, section in sections.items():
        data[name] = {**data[name], **section}
    with pytest.raises(ConfigError) as caught:
        parse_config(data)
    assert "explorers.partial_rollout" in str(caught.value) and says in str(caught.value)


def test_the_explorer_says_a_pause_as_it_happens_and_loads_every_engine(tmp_path):
    """`PauseForWeights` on the rollout's thread: the version the background fetch got is loaded
    into the explorer's engines between its two log lines (`generations_paused`, then
    `generations_resumed`), and kept for the records published once the rollout is back; a
    version no newer than the one held loads nothing and says nothing."""
    import structlog
    from structlog.testing import capture_logs

    from rolectl.roles.explorer import Explorer

    cfg = parse_config({"job": "partial", "run_dir": str(tmp_path), "model": {"engine": "tiny", "group_size": 4},
                        "synchronizer": {"sync_method": "memory", "sync_style": "fully_async"},
                        "explorers": {"partial_rollout": True}})
    explorer = Explorer(cfg, "explorer-0")
    explorer.log, explorer.version, explorer.explore_step = structlog.get_logger(), 2, 6
    pause = explorer.pause_point
    explorer._pending_weights = (3, changed_weights(explorer.engine), 1234, 0.5)
    assert pause.pending()
    with capture_logs() as logged:
        pause.load()
        explorer._pending_weights = (3, changed_weights(explorer.engine, seed=2), 1234, 0.5)
        pause.load()  # the same version again: nothing to load
    assert [(e["event"], e["version"], e["step"]) for e in logged] == [("generations_paused", 3, 7),
                                                                       ("generations_resumed", 3, 7)]
    assert logged[0]["held"] == 2 and explorer.version == 3 and explorer.engine.version == 3
    assert pause.take_loaded() == [(3, 1234, 0.5)] and pause.take_loaded() == []
