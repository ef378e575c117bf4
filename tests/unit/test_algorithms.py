"""verl's core_algos as the hf trainer uses them, and the tiny engine's own loss checked against verl's,
in each loss aggregation mode, on masked (multi-turn) tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rolectl.roles.config_base import CHECK_ENGINES, validate_section
from rolectl.roles.engines.algorithms import AlgorithmConfig, VerlAlgorithm
from rolectl.roles.engines.grpo import clipped_policy_loss, group_advantages
from rolectl.roles.engines.losses import aggregate


def batch(seed: int = 0, rows: int = 12, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=g) * 3
    new = old + (torch.rand(rows, width, generator=g) - 0.5) * 0.8  # ratios within e^±0.4: no dual clip
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = torch.rand(rows, generator=g)
    groups = [f"g{i // 4}" for i in range(rows)]
    return old, new, mask, rewards, groups


def test_the_tiny_loss_equals_verls_vanilla_policy_loss():
    from verl.trainer.ppo import core_algos

    old, new, mask, rewards, groups = batch()
    advantages = group_advantages(rewards, groups)
    ours, stats = clipped_policy_loss(new, old, advantages, mask, clip_eps=0.2)
    algorithm = VerlAlgorithm(AlgorithmConfig(clip_ratio=0.2), group_size=4)
    theirs, metrics = algorithm.policy_loss(old, new, advantages.unsqueeze(-1) * mask, mask,
                                            batch_num_tokens=int(mask.sum()), global_batch_size=len(mask))
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    assert core_algos.get_policy_loss_fn("vanilla") is algorithm.policy_loss_fn
    assert "actor/pg_clipfrac" in metrics and metrics["actor/pg_clipfrac"] > 0


def test_the_tiny_advantages_are_verls_grpo_with_the_population_std():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    _, _, mask, rewards, groups = batch(seed=1)
    token_rewards = torch.zeros(mask.shape)
    token_rewards[:, 0] = rewards
    centred, _ = compute_grpo_outcome_advantage(token_rewards, torch.ones(mask.shape), np.array(groups),
                                                norm_adv_by_std_in_grpo=False)
    ours = group_advantages(rewards, groups)
    for group in set(groups):
        rows = [i for i, g in enumerate(groups) if g == group]
        population_std = rewards[rows].std(correction=0)
        assert (ours[rows] * (population_std + 1e-6)).tolist() == pytest.approx(centred[rows, 0].tolist(), abs=1e-6)


def test_outcome_advantages_sit_on_every_response_token_and_nowhere_else():
    _, _, mask, rewards, groups = batch(seed=2)
    advantages = VerlAlgorithm(AlgorithmConfig(), group_size=4).advantages(rewards, mask, groups)
    assert advantages.shape == mask.shape
    assert torch.all(advantages[~mask] == 0)
    for row in range(len(mask)):
        values = advantages[row, mask[row]]
        assert torch.allclose(values, values[0].expand_as(values))
    # verl's GRPO: (r - group mean) / (sample std + eps)
    first = [i for i, g in enumerate(groups) if g == "g0"]
    expected = (rewards[first] - rewards[first].mean()) / (rewards[first].std() + 1e-6)
    assert advantages[first, 0].tolist() == pytest.approx(expected.tolist(), abs=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_add_up_to_the_whole_minibatch(mode):
    old, new, mask, rewards, groups = batch(seed=3)
    algorithm = VerlAlgorithm(AlgorithmConfig(loss_agg_mode=mode), group_size=4)
    advantages = algorithm.advantages(rewards, mask, groups)
    whole = dict(batch_num_tokens=int(mask.sum()), global_batch_size=len(mask))
    full, _ = algorithm.policy_loss(old, new, advantages, mask, **whole)
    parts = sum(algorithm.policy_loss(old[s], new[s], advantages[s], mask[s], **whole)[0]
                for s in (slice(0, 5), slice(5, 12)))
    assert float(parts) == pytest.approx(float(full), abs=1e-6)


def test_kl_loss_uses_verls_estimator():
    from verl.trainer.ppo.core_algos import kl_penalty

    old, new, mask, _, _ = batch(seed=4)
    algorithm = VerlAlgorithm(AlgorithmConfig(kl_coef=0.1, kl_penalty="low_var_kl"), group_size=4)
    got = algorithm.kl_loss(new, old, mask, batch_num_tokens=int(mask.sum()), global_batch_size=len(mask))
    expected = (kl_penalty(new, old, "low_var_kl") * mask).sum() / mask.sum()
    assert float(got) == pytest.approx(float(expected), abs=1e-6) and float(got) > 0


def algorithm_config_problems(values):
    """The `algorithm:` section's problems, as a job loaded with its engines reports them."""
    return validate_section(AlgorithmConfig, values, where="algorithm", context=CHECK_ENGINES)[1]


def test_algorithm_problems_name_verls_registries():
    problems = dict(algorithm_config_problems({"advantage": "gae", "policy_loss": "nope", "clip_ratio": -1,
                                               "clip_ratio_c": 1.0, "kl_penalty": "x", "speed": 3}))
    assert set(problems) == {"algorithm.advantage", "algorithm.policy_loss", "algorithm.clip_ratio",
                             "algorithm.clip_ratio_c", "algorithm.kl_penalty", "algorithm.speed"}
    assert "vanilla" in problems["algorithm.policy_loss"] and "gspo" in problems["algorithm.policy_loss"]
    assert algorithm_config_problems({"advantage": "rloo", "policy_loss": "gspo"}) == []


# -- the loss aggregation modes on masked (multi-turn) tokens ---------------------------------------

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def test_the_aggregation_modes_on_a_hand_made_batch():
    """A sequence's token count is its masked count: row 0 trains tokens 0 and 2, row 1 tokens 0 and 1."""
    from verl.trainer.ppo.core_algos import agg_loss

    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    expected = {"token-mean": (1 + 3 + 10 + 20) / 4, "seq-mean-token-sum": (4 + 30) / 2,
                "seq-mean-token-mean": (2 + 15) / 2}
    for mode, value in expected.items():
        assert float(aggregate(values, mask, mode)) == pytest.approx(value, rel=1e-6)
        assert float(agg_loss(values, mask.float(), mode)) == pytest.approx(value, rel=1e-6)


def multi_turn_batch(seed: int):
    """`batch(seed)` with holes in the masks (an environment's tokens between turns), one row masked whole."""
    old, new, mask, rewards, groups = batch(seed=seed)
    holes = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed + 100)) < 0.3
    mask = mask & ~holes
    mask[3] = False
    return old, new, mask, rewards, groups


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("whole", [True, False], ids=["minibatch", "micro-batch"])
def test_the_aggregation_modes_give_verls_numbers_on_masked_tokens(mode, whole):
    """`aggregate` is verl's `agg_loss`, normalised by this micro-batch or by a whole minibatch's counts."""
    from verl.trainer.ppo.core_algos import agg_loss

    _, new, mask, _, _ = multi_turn_batch(seed=5)
    counts = dict(num_tokens=int(mask.sum()) + 7, num_sequences=len(mask) + 3) if not whole else {}
    verl_counts = dict(batch_num_tokens=counts["num_tokens"], global_batch_size=counts["num_sequences"]) \
        if counts else {}
    ours = aggregate(new, mask, mode, **counts)
    theirs = agg_loss(new, mask.float(), mode, **verl_counts)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_the_tiny_loss_is_verls_vanilla_policy_loss_in_every_mode(mode):
    old, new, mask, rewards, groups = multi_turn_batch(seed=6)
    advantages = group_advantages(rewards, groups).unsqueeze(-1) * mask
    whole = dict(batch_num_tokens=int(mask.sum()), global_batch_size=len(mask))
    ours, _ = clipped_policy_loss(new, old, advantages, mask, clip_eps=0.2, loss_agg_mode=mode,
                                  loss_tokens=whole["batch_num_tokens"], loss_sequences=whole["global_batch_size"])
    algorithm = VerlAlgorithm(AlgorithmConfig(clip_ratio=0.2, loss_agg_mode=mode), group_size=4)
    theirs, _ = algorithm.policy_loss(old, new, advantages, mask, **whole)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-7)
    # and the micro-batches of a minibatch add up to it
    parts = sum(clipped_policy_loss(new[s], old[s], advantages[s], mask[s], clip_eps=0.2, loss_agg_mode=mode,
                                    loss_tokens=whole["batch_num_tokens"],
                                    loss_sequences=whole["global_batch_size"])[0]
                for s in (slice(0, 5), slice(5, 12)))
    assert float(parts) == pytest.approx(float(ours), abs=1e-6)


def test_an_outcome_reward_sits_on_the_last_trained_token():
    """A trajectory that ends with an environment's tokens: its reward is still counted (verl's
    estimators read it where the last sampled token is)."""
    _, _, _, rewards, groups = batch(seed=7)
    mask = torch.zeros(len(rewards), 7, dtype=torch.bool)
    mask[:, [0, 1, 4]] = True  # turn, observation, turn, observation
    advantages = VerlAlgorithm(AlgorithmConfig(advantage="reinforce_plus_plus"), group_size=4).advantages(
        rewards, mask, groups)
    assert torch.all(advantages[~mask] == 0)
    # REINFORCE++'s return-to-go: every trained token up to the reward's carries it, normalised over them
    returns = rewards.unsqueeze(-1).expand(-1, 3)
    expected = (returns - returns.mean()) / (returns.std() + 1e-8)
    assert advantages[:, [0, 1, 4]].flatten().tolist() == pytest.approx(expected.flatten().tolist(), abs=1e-4)


def test_norm_adv_by_std_in_grpo_false_leaves_the_advantages_centred():
    _, _, mask, rewards, groups = batch(seed=8)
    advantages = VerlAlgorithm(AlgorithmConfig(norm_adv_by_std_in_grpo=False), group_size=4).advantages(
        rewards, mask, groups)
    first = [i for i, g in enumerate(groups) if g == "g0"]
    assert advantages[first, 0].tolist() == pytest.approx((rewards[first] - rewards[first].mean()).tolist(),
                                                          abs=1e-6)
