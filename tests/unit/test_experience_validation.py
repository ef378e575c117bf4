"""validate_batch: a batch from the wire reaches the engine only if it fits the engine's limits;
and the tiny engine skips (and counts) an update whose loss or gradient is not finite."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rolectl.bus.errors import MalformedExperience
from rolectl.bus.experiences import Experience, ExperienceBatch, ExperienceLimits, validate_batch
from rolectl.roles.engines import TinyConfig, TinyTrainEngine

LIMITS = ExperienceLimits(vocab_size=14, prompt_length=3, max_response_length=4, group_size=2,
                          response_tokens=frozenset(range(10)) | {12})


def _batch(**change) -> ExperienceBatch:
    exps = [
        Experience(id=f"e-{g}-{k}", group=f"g{g}", prompt=(10, 1, 11), response=(1, 12), logprobs=(-0.5, -0.1),
                   reward=1.0 * k, model_version=2)
        for g in range(2) for k in range(2)
    ]
    exps[1] = dataclasses.replace(exps[1], **change)
    return ExperienceBatch(member="explorer-0", explore_step=5, model_version=2, experiences=tuple(exps))


def test_a_batch_that_fits_passes():
    validate_batch(_batch(), LIMITS)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"response": (1, 99)}, "outside the vocabulary"),
        ({"prompt": (10, -1, 11)}, "outside the vocabulary"),
        ({"response": (1, 10)}, "not one the policy samples"),
        ({"prompt": (10, 1, 2, 11)}, "prompt has 4 tokens"),
        ({"response": (1, 2, 3, 4, 12), "logprobs": (-1.0,) * 5}, "more than the engine's 4"),
        ({"logprobs": (-0.5,)}, "1 logprobs for 2 response tokens"),
        ({"reward": math.nan}, "reward nan is not finite"),
        ({"reward": math.inf}, "reward inf is not finite"),
        ({"logprobs": (-0.5, -math.inf)}, "logprob is not finite"),
        ({"group": "g9"}, "has 1 responses"),
        ({"id": "e-0-0"}, "id repeated"),
        ({"model_version": 3}, "model_version 3 outside 0..2"),
        ({"loss_mask": (1,)}, "loss_mask has 1 entries for 2 response tokens"),
        ({"loss_mask": (1, 2)}, "loss_mask holds a value other than 0 and 1"),
        ({"token_versions": ((1, 2),)}, "token_versions cover 1 tokens, the response has 2"),
        ({"token_versions": ((2, 3),)}, "a token version outside 2..2"),
        ({"token_versions": ((0, 2), (2, 2))}, "a run of fewer than 1 token"),
        ({"model_version": 1, "token_versions": ((1, 0), (1, 2))}, "a token version outside 1..2"),
    ],
)
def test_each_rule_names_the_batch_the_experience_and_the_problem(change, words):
    with pytest.raises(MalformedExperience) as err:
        validate_batch(_batch(**change), LIMITS)
    assert "experience batch explorer-0/5" in str(err.value)
    assert words in str(err.value)


def test_only_the_tokens_the_policy_sampled_must_be_ones_it_samples():
    """A tool's answer (mask 0) may hold any token of the vocabulary; a sampled one may not."""
    validate_batch(_batch(response=(13, 12), loss_mask=(0, 1)), LIMITS)
    with pytest.raises(MalformedExperience, match="response token 13 is not one the policy samples"):
        validate_batch(_batch(response=(13, 12), loss_mask=(1, 1)), LIMITS)


def test_an_empty_batch_is_refused():
    with pytest.raises(MalformedExperience, match="holds no experience"):
        validate_batch(ExperienceBatch(member="e", explore_step=1, model_version=0), LIMITS)


def test_tiny_engine_limits_describe_what_it_trains_on():
    engine = TinyTrainEngine(TinyConfig(task_length=3, group_size=4))
    limits = engine.experience_limits
    assert (limits.vocab_size, limits.prompt_length, limits.max_response_length, limits.group_size) == (14, 5, 4, 4)


def test_a_nonfinite_update_is_skipped_counted_and_leaves_the_weights_alone():
    engine = TinyTrainEngine(TinyConfig(task_length=2, group_size=2, minibatches=2))
    before = {k: v.clone() for k, v in engine.weights().items()}
    exps = [Experience(id=f"x{g}{k}", group=f"g{g}", prompt=(10, 1, 2, 11), response=(2, 1, 12),
                       logprobs=(-0.1, -0.1, -0.1), reward=math.nan if g == 0 else float(k), model_version=0)
            for g in range(2) for k in range(2)]

    metrics = engine.train_step(exps, current_version=0)

    # Group 0's NaN reward makes its minibatch's loss NaN: skipped. Group 1's update goes through.
    assert metrics["updates_skipped_nonfinite"] == 1.0
    assert math.isfinite(metrics["loss"]) and engine.step == 1
    assert all(torch.isfinite(v).all() for v in engine.weights().values())
    assert any(not torch.equal(before[k], v) for k, v in engine.weights().items())
