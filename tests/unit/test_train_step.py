"""The one training step (`roles.engines.step`) and its loss-function seam, on the tiny engine: a loss
plugged in trains, micro-batches accumulate to the one-pass step, groups stay whole when a loss asks;
multi-turn episodes train on the tokens the policy sampled only, and single-turn jobs as before."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rolectl.roles.engines import TinyConfig, TinyRolloutEngine, TinyTrainEngine, build_task_set
from rolectl.roles.engines.grpo import ClippedPolicyLoss, token_group_advantages
from rolectl.roles.engines.losses import (
    LossFunction,
    LossSum,
    MicroBatch,
    TokenScores,
    TrainBatch,
    experience_batch,
)
from rolectl.roles.engines.step import TrainStep, micro_batches
from rolectl.roles.engines.task import BOS, EOS, PAD, RESPONSE_TOKENS, SEP
from rolectl.sync_protocol.experience import Experience
from tests.support.trajectories import (
    assert_a_step_trains_and_counts_tokens,
    assert_gradient_on_sampled_tokens_only,
    logit_gradients,
    multi_turn_episodes,
    over_the_wire,
)

SMALL = TinyConfig(seed=0, task_length=2, group_size=4, tasks_per_step=8, minibatches=2)


def _batch(config: TinyConfig = SMALL, *, seed: int = 0) -> tuple[list, TrainBatch]:
    explorer = TinyRolloutEngine(config, member="e0", sampling_seed=seed)
    experiences = explorer.rollout(build_task_set(config, seed=seed).next_batch(), explore_step=1)
    return experiences, experience_batch(experiences, token_group_advantages)


class NegativeLogLikelihood:
    """A toy loss through the seam: the responses' mean negative logprob (no advantages, no reference)."""

    needs_reference = False
    keeps_groups = False

    def __call__(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro.loss_mask.float()
        loss = -(micro.logprobs * mask).sum() / micro.num_tokens
        return loss, {"nll": float(-(micro.logprobs.detach() * mask).sum() / mask.sum())}


def test_a_loss_function_plugged_into_the_step_trains_the_tiny_engine():
    engine = TinyTrainEngine(SMALL)
    _, batch = _batch()
    assert isinstance(NegativeLogLikelihood(), LossFunction)
    losses = [engine.update.train_batch(batch, NegativeLogLikelihood()).loss for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0], losses  # the sampled responses became far more likely
    result = engine.update.train_batch(batch, NegativeLogLikelihood())
    assert result.updates_skipped == 0 and result.grad_norm > 0 and set(result.metrics) == {"nll"}


def test_micro_batches_accumulate_to_the_one_pass_step():
    """A loss normalised by the minibatch's tokens: 3-row micro-batches take the step one pass takes
    (plain SGD: Adam's first steps are about the gradient's sign, which rounding can flip near 0)."""
    _, batch = _batch()
    weights = []
    for size in (None, 3):
        engine = TinyTrainEngine(SMALL)
        optimizer = torch.optim.SGD(engine.policy.parameters(), lr=0.1)
        step = TrainStep(model=engine.policy, optimizer=optimizer, forward=engine._logprobs,
                         max_grad_norm=SMALL.max_grad_norm, minibatches=SMALL.minibatches, micro_batch_size=size)
        result = step.train_batch(batch, ClippedPolicyLoss(clip_eps=SMALL.clip_eps))
        weights.append(engine.weights())
        assert result.updates_skipped == 0
    assert any(not torch.equal(t, TinyTrainEngine(SMALL).weights()[n]) for n, t in weights[0].items())
    for name, tensor in weights[0].items():
        assert torch.allclose(tensor, weights[1][name], atol=1e-6), name


def test_rows_are_dealt_to_ranks_and_every_rank_makes_the_same_passes():
    rows, groups = [0, 1, 2, 3, 4, 5, 6], ["a", "a", "b", "b", "c", "c", "c"]
    plans = [micro_batches(rows, groups, size=2, rank=r, world_size=2) for r in range(2)]
    assert plans == [([[0, 2], [4, 6]], 2), ([[1, 3], [5]], 2)]
    assert micro_batches(rows, groups, size=None) == ([rows], 1)


def test_a_loss_that_keeps_groups_gets_whole_groups_per_micro_batch_and_rank():
    rows, groups = [0, 1, 2, 3, 4, 5, 6], ["a", "a", "b", "b", "c", "c", "c"]
    assert micro_batches(rows, groups, size=1, keep_groups=True) == ([[0, 1], [2, 3], [4, 5, 6]], 3)
    assert micro_batches(rows, groups, size=4, rank=0, world_size=2, keep_groups=True) == ([[0, 1], [4, 5, 6]], 2)
    assert micro_batches(rows, groups, size=4, rank=1, world_size=2, keep_groups=True) == ([[2, 3]], 2)

    seen: list[list[str]] = []

    class PairLoss(NegativeLogLikelihood):
        keeps_groups = True

        def __call__(self, micro):
            seen.append(micro.groups)
            return super().__call__(micro)

    engine = TinyTrainEngine(SMALL)
    step = TrainStep(model=engine.policy, optimizer=engine.optimizer, forward=engine._logprobs,
                     max_grad_norm=1.0, minibatches=1, micro_batch_size=1)
    _, batch = _batch()
    step.train_batch(batch, PairLoss())
    assert len(seen) == len(set(batch.groups))  # one group per micro-batch, never a split one
    assert all(len(set(groups)) == 1 and len(groups) == SMALL.group_size for groups in seen)


def test_a_loss_that_needs_the_reference_is_refused_by_an_engine_without_one():
    class Anchored(NegativeLogLikelihood):
        needs_reference = True

    _, batch = _batch()
    with pytest.raises(ValueError, match="Anchored needs a frozen reference model"):
        TinyTrainEngine(SMALL).update.train_batch(batch, LossSum(NegativeLogLikelihood(), (0.1, Anchored())))


# -- trajectories: multi-turn episodes train on the policy's own tokens only ----------------------------

TRAJ = TinyConfig(seed=0, task_length=6, group_size=2, tasks_per_step=3, minibatches=1)
"""15 positions: prompts of 2..6 tokens and 9-token episodes fit."""


def _episodes(seed: int = 0) -> list[Experience]:
    # an observation's tokens (BOS, SEP, PAD) are ones the tiny policy never samples: logprob -inf
    return multi_turn_episodes(sampled=RESPONSE_TOKENS, observed=(BOS, SEP, PAD), seed=seed)


def _forward_before(policy, batch: TrainBatch, rows, *, entropy: bool) -> TokenScores:
    """The tiny engine's forward as it was before trajectories (7c07698): prompts of one length, the
    responses padded with EOS, one slice of the logits."""
    prompts = torch.tensor([batch.prompts[row] for row in rows])
    responses = torch.full((len(rows), batch.loss_mask.shape[1]), EOS)
    for index, row in enumerate(rows):
        responses[index, :len(batch.responses[row])] = torch.tensor(batch.responses[row], dtype=torch.long)
    tokens = torch.cat([prompts, responses], dim=1)
    logits = policy(tokens[:, :-1])[:, prompts.shape[1] - 1:] / SMALL.temperature
    disallowed = torch.ones(logits.shape[-1], dtype=torch.bool)
    disallowed[list(RESPONSE_TOKENS)] = False
    logprobs = torch.log_softmax(logits.masked_fill(disallowed, float("-inf")), dim=-1)
    return TokenScores(logprobs=logprobs.gather(-1, responses.unsqueeze(-1)).squeeze(-1))


class _LossBefore:
    """The tiny engine's clipped loss as it was before trajectories (7c07698)."""

    needs_reference = False
    keeps_groups = False

    def __call__(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro.loss_mask.to(micro.logprobs.dtype)
        log_ratio = (micro.logprobs - micro.old_logprobs) * mask
        ratio = log_ratio.exp()
        unclipped = ratio * micro.advantages
        clipped = ratio.clamp(1.0 - SMALL.clip_eps, 1.0 + SMALL.clip_eps) * micro.advantages
        denominator = torch.tensor(float(max(micro.num_tokens, 1)), dtype=mask.dtype)
        return -(torch.minimum(unclipped, clipped) * mask).sum() / denominator, {}


def test_single_turn_training_is_bit_identical_to_the_step_before_trajectories():
    """Prompts of any length, masked losses, entropy: none of it changes a single-turn job's numbers."""
    now, before = TinyTrainEngine(SMALL), TinyTrainEngine(SMALL)
    step_before = TrainStep(model=before.policy, optimizer=before.optimizer, forward=_forward_before,
                            max_grad_norm=SMALL.max_grad_norm, minibatches=SMALL.minibatches, micro_batch_size=None)
    for seed in (0, 1):
        experiences, batch = _batch(seed=seed)
        metrics = now.train_step(experiences, current_version=0)
        result = step_before.train_batch(batch, _LossBefore())
        assert metrics["loss"] == result.loss and metrics["grad_norm"] == result.grad_norm
    for name, tensor in now.weights().items():
        assert torch.equal(tensor, before.weights()[name]), name


def test_prompts_of_several_lengths_score_as_each_alone():
    engine = TinyTrainEngine(TRAJ)
    batch = experience_batch(_episodes(), token_group_advantages)
    assert len({len(p) for p in batch.prompts}) > 1
    with torch.no_grad():
        together = engine._logprobs(engine.policy, batch, range(len(batch)), entropy=True)
        for row in range(len(batch)):
            alone = engine._logprobs(engine.policy, batch, [row], entropy=True)
            length = len(batch.responses[row])
            assert torch.allclose(together.logprobs[row, :length], alone.logprobs[0, :length], atol=1e-6)
            assert torch.allclose(together.entropy[row, :length], alone.entropy[0, :length], atol=1e-6)


def test_a_token_the_policy_did_not_sample_gets_no_gradient():
    """The logits that predict an environment's token get exactly zero gradient, though the policy
    gives the token probability 0 (logprob -inf); the sampled tokens' do not."""
    engine = TinyTrainEngine(TRAJ)
    experiences = _episodes()
    batch = experience_batch(experiences, token_group_advantages)
    with torch.no_grad():  # on-policy: no ratio is clipped, so every sampled token has a gradient
        own = engine._logprobs(engine.policy, batch, range(len(batch)), entropy=False).logprobs
    on_policy = dataclasses.replace(batch, old_logprobs=torch.where(batch.loss_mask, own, 0.0))
    [grad] = logit_gradients(engine.policy.head, lambda: engine.update.train_batch(on_policy, engine.loss_fn))
    assert_gradient_on_sampled_tokens_only(grad, experiences)


def test_what_a_masked_token_carries_changes_nothing():
    """Another old logprob and advantage at every mask-0 position: the same loss, the same weights."""
    experiences = _episodes()
    batch = experience_batch(experiences, token_group_advantages)
    hidden = ~batch.loss_mask
    noise = torch.randn(batch.old_logprobs.shape, generator=torch.Generator().manual_seed(5))
    perturbed = dataclasses.replace(batch, old_logprobs=torch.where(hidden, noise - 30, batch.old_logprobs),
                                    advantages=torch.where(hidden, noise * 100, batch.advantages))
    engines = [TinyTrainEngine(TRAJ), TinyTrainEngine(TRAJ)]
    results = [engine.update.train_batch(b, engine.loss_fn) for engine, b in zip(engines, (batch, perturbed))]
    assert results[0].loss == results[1].loss and math.isfinite(results[0].loss)
    for name, tensor in engines[0].weights().items():
        assert torch.equal(tensor, engines[1].weights()[name]), name


def test_a_schema_2_batch_trains_the_tiny_engine_and_counts_its_tokens():
    assert_a_step_trains_and_counts_tokens(TinyTrainEngine(TRAJ), over_the_wire(_episodes()),
                                           max_entropy=math.log(len(RESPONSE_TOKENS)))


def test_a_minibatch_without_a_sampled_token_is_no_update():
    """Every episode of it ended before the model's first turn (an environment that failed to reset)."""
    empty = [dataclasses.replace(e, response=(), logprobs=(), loss_mask=()) for e in _episodes()]
    engine = TinyTrainEngine(TRAJ)
    before = engine.weights()
    metrics = engine.train_step(empty, current_version=0)
    assert metrics["updates_skipped_nonfinite"] == 0 and metrics["loss"] == 0.0 and metrics["trained_tokens"] == 0
    assert all(torch.equal(t, before[n]) for n, t in engine.weights().items())
