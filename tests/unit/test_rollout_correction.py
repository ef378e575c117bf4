"""Off-policy correction in the one training step (`algorithm.rollout_correction`, verl's rollout
correction): decoupled PPO against the trainer's own logprobs before the update, truncated and masked
importance sampling on the gap to the sampler's, the gap's metrics and the mismatch alarm."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rolectl.roles.config_base import CHECK_ENGINES, validate_section
from rolectl.roles.engines import TinyConfig, TinyRolloutEngine, TinyTrainEngine, build_task_set
from rolectl.roles.engines.algorithms import MISMATCH_ALARM, AlgorithmConfig, VerlAlgorithm
from rolectl.roles.engines.losses import MicroBatch, TrainBatch, experience_batch
from rolectl.roles.engines.sections import RolloutCorrectionSection
from rolectl.roles.engines.step import StepResult, TrainStep

CONFIG = TinyConfig(seed=0, task_length=2, group_size=4, tasks_per_step=8, minibatches=1)


def _on_policy_batch(algorithm: VerlAlgorithm) -> TrainBatch:
    """A batch the explorer sampled with the trainer's own weights (version 0, the same seed)."""
    explorer = TinyRolloutEngine(CONFIG, member="e0", sampling_seed=0)
    experiences = explorer.rollout(build_task_set(CONFIG, seed=0).next_batch(), explore_step=1)
    return experience_batch(experiences, algorithm.advantages)


def _stale(batch: TrainBatch, by: float = 1.5) -> TrainBatch:
    """The batch as if every other row had been sampled by weights that gave its tokens e^-by of
    the probability the trainer gives them (stale or wrong weights in that explorer)."""
    behaviour = batch.old_logprobs.clone()
    behaviour[::2] -= by * batch.loss_mask[::2]
    return dataclasses.replace(batch, old_logprobs=behaviour)


class _Recording:
    """The algorithm's policy loss, keeping the micro-batches it saw."""

    needs_reference = False
    keeps_groups = False

    def __init__(self, algorithm: VerlAlgorithm) -> None:
        self.inner, self.seen = algorithm.loss_function(), []

    def __call__(self, micro: MicroBatch):
        self.seen.append(micro)
        return self.inner(micro)


def _step(correction: dict | None, batch_of=lambda b: b) -> tuple[StepResult, _Recording, TinyTrainEngine]:
    algorithm = VerlAlgorithm(AlgorithmConfig(rollout_correction=correction), group_size=CONFIG.group_size)
    engine = TinyTrainEngine(CONFIG)
    step = TrainStep(model=engine.policy, optimizer=torch.optim.SGD(engine.policy.parameters(), lr=0.1),
                     forward=engine._logprobs, max_grad_norm=1.0, minibatches=1, micro_batch_size=16,
                     correction=algorithm.correction())
    loss = _Recording(algorithm)
    return step.train_batch(batch_of(_on_policy_batch(algorithm)), loss), loss, engine


def test_on_policy_the_gap_is_nil_and_decoupled_ppo_steps_as_plain_ppo():
    corrected, _, engine = _step({"rollout_is": "token"})
    assert corrected.metrics["rollout_corr/k3_kl"] < 1e-8 and corrected.metrics["rollout_corr/log_gap_max"] < 1e-4
    assert corrected.metrics[MISMATCH_ALARM] == 0.0
    assert corrected.metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    plain, _, plain_engine = _step(None)
    assert not any(key.startswith("rollout_corr/") for key in plain.metrics)
    for name, tensor in plain_engine.weights().items():
        assert torch.allclose(tensor, engine.weights()[name], atol=1e-5), name


def test_a_stale_sampler_is_measured_truncated_and_raises_the_alarm():
    result, loss, _ = _step({"rollout_is": "token", "rollout_is_threshold": 2.0}, _stale)
    m = result.metrics
    assert m["rollout_corr/log_gap_max"] == pytest.approx(1.5, abs=1e-4)
    assert m["rollout_corr/k3_kl"] > 0.1 and m[MISMATCH_ALARM] == 1.0
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)  # e^1.5 capped (TIS)
    assert 0.3 < m["rollout_corr/rollout_is_ratio_fraction_high"] < 0.7  # the stale half
    weights = torch.cat([micro.is_weights[micro.loss_mask] for micro in loss.seen])
    assert set(weights.round(decimals=4).tolist()) <= {1.0, 2.0} and weights.max() == 2.0


def test_decoupled_ppo_clips_against_the_trainer_not_the_sampler():
    # PPO's ratio is to the weights before the update: a stale sampler's e^1.5 is the importance
    # weight's to carry (capped), not the clip's, which on the first update clips nothing
    decoupled, _, _ = _step({"rollout_is": "token"}, _stale)
    bypassed, _, _ = _step(None, _stale)
    assert decoupled.metrics["pg_clipfrac"] == 0.0 < bypassed.metrics["pg_clipfrac"]


def test_masked_importance_sampling_trains_nothing_on_the_rejected_tokens():
    result, loss, _ = _step({"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"}, _stale)
    seen = torch.cat([micro.loss_mask for micro in loss.seen]).sum()
    stale_batch = _stale(_on_policy_batch(VerlAlgorithm(AlgorithmConfig(), group_size=CONFIG.group_size)))
    assert int(seen) == int(stale_batch.loss_mask[1::2].sum())  # only the rows the trainer's weights sampled
    assert result.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        float(stale_batch.loss_mask[::2].sum() / stale_batch.loss_mask.sum()))


def test_the_alarm_reads_the_tokens_of_the_version_the_trainer_holds():
    """An older version's tokens differ from the trainer's by the policy's own change (no alarm, as
    in any healthy async job); the held version's own tokens differ only by numerics, so a gap
    there (an explorer whose weights are not the version it says) raises it."""
    def held_as(version, stale=_stale):
        def batch_of(batch):  # the same batch, its tokens' versions compared with `version`
            explorer = TinyRolloutEngine(CONFIG, member="e0", sampling_seed=0)
            experiences = explorer.rollout(build_task_set(CONFIG, seed=0).next_batch(), explore_step=1)
            return stale(experience_batch(experiences, lambda r, m, g: batch.advantages, current_version=version))
        return batch_of

    stale_but_older, _, _ = _step({"rollout_is": "token"}, held_as(1))  # every token is version 0's
    m = stale_but_older.metrics
    assert m["rollout_corr/k3_kl"] > 0.1 and m["rollout_corr/on_policy_tokens"] == 0.0
    assert "rollout_corr/on_policy_k3_kl" not in m and m[MISMATCH_ALARM] == 0.0
    wrong_weights, _, _ = _step({"rollout_is": "token"}, held_as(0))  # the held version's own tokens
    m = wrong_weights.metrics
    assert m["rollout_corr/on_policy_k3_kl"] == pytest.approx(m["rollout_corr/k3_kl"]) and m[MISMATCH_ALARM] == 1.0
    healthy, _, _ = _step({"rollout_is": "token"}, held_as(0, stale=lambda b: b))
    assert healthy.metrics["rollout_corr/on_policy_k3_kl"] < 1e-8 and healthy.metrics[MISMATCH_ALARM] == 0.0


def test_no_alarm_when_it_is_switched_off():
    result, _, _ = _step({"alarm_kl": None}, _stale)
    assert result.metrics[MISMATCH_ALARM] == 0.0 and result.metrics["rollout_corr/k3_kl"] > 0.1


def _problems(values):
    return dict(validate_section(AlgorithmConfig, {"rollout_correction": values}, where="algorithm",
                                 context=CHECK_ENGINES)[1])


def test_bad_settings_say_what_to_write():
    problems = _problems({"rollout_rs": "token_k1"})
    assert "required with rollout_rs" in problems["algorithm.rollout_correction.rollout_rs_threshold"]
    problems = _problems({"rollout_rs": "token_k9", "rollout_rs_threshold": 2.0, "rollout_is": "tokens",
                          "rollout_is_threshold": 0.5})
    assert "'token_k9'" in problems["algorithm.rollout_correction.rollout_rs"]
    assert "seq_mean_k3" in problems["algorithm.rollout_correction.rollout_rs"]
    assert {"algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is_threshold"} <= set(
        problems)
    assert _problems({"rollout_is": "sequence", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.1}) == {}
    assert RolloutCorrectionSection().alarm_kl == 0.1



def test_the_observer_reads_the_alarm_the_engines_write():
    from rolectl.roles.observe import observer

    assert observer.MISMATCH_ALARM == MISMATCH_ALARM


def test_the_tiny_trainer_takes_the_correction_of_its_algorithm_section():
    """`algorithm: {rollout_correction: ...}`, the one algorithm key the tiny engine reads: its
    ClippedPolicyLoss clips against the proximal policy and weighs tokens by the IS weights."""
    from rolectl.roles.config import parse_config
    from rolectl.roles.engines import make_train_engine
    from rolectl.sync_protocol import ConfigError

    job = parse_config({"job": "j", "model": {**CONFIG.model_dump(), "engine": "tiny"},
                        "algorithm": {"rollout_correction": {"rollout_is": "token"}}})
    engine = make_train_engine(job)
    explorer = TinyRolloutEngine(CONFIG, member="e0", sampling_seed=0)
    experiences = explorer.rollout(build_task_set(CONFIG, seed=0).next_batch(), explore_step=1)
    # sampled, it says, by version 1 (the trainer's after one step), its logprobs 1.5 nats off
    stale = [dataclasses.replace(e, logprobs=tuple(x - 1.5 for x in e.logprobs), model_version=1)
             for e in experiences]
    on_policy = engine.train_step(experiences, current_version=0)
    assert on_policy["rollout_corr/k3_kl"] < 1e-8 and on_policy[MISMATCH_ALARM] == 0.0
    assert engine.train_step(stale, current_version=1)[MISMATCH_ALARM] == 1.0  # a 1.5-nat gap
    with pytest.raises(ConfigError) as caught:
        parse_config({"job": "j", "model": {"engine": "tiny"}, "algorithm": {"kl_coef": 0.1}})
    assert "may hold only rollout_correction and the explorers'" in dict(caught.value.problems)["algorithm"]
    with pytest.raises(ConfigError) as caught:
        parse_config({"job": "j", "model": {"engine": "tiny"}, "algorithm": {"rollout_correction": {"rollout_is": 2}}})
    assert "algorithm.rollout_correction.rollout_is" in dict(caught.value.problems)


def test_the_tiny_loss_weighs_each_token_by_its_importance_weight():
    from rolectl.roles.engines.grpo import clipped_policy_loss

    logprobs, advantages, mask = torch.zeros(2, 3), torch.ones(2), torch.ones(2, 3)
    plain, _ = clipped_policy_loss(logprobs, logprobs, advantages, mask, clip_eps=0.2)
    halved, _ = clipped_policy_loss(logprobs, logprobs, advantages, mask, clip_eps=0.2,
                                    is_weights=torch.full((2, 3), 0.5))
    assert float(halved) == pytest.approx(float(plain) / 2)
