"""The one training step (`roles.engines.step`) and its loss-function seam, on the tiny engine: a loss
plugged in trains, micro-batches accumulate to the one-pass step, groups stay whole when a loss asks."""

from __future__ import annotations

import pytest
import torch

from rolectl.roles.engines import TinyConfig, TinyRolloutEngine, TinyTrainEngine, build_task_set
from rolectl.roles.engines.grpo import ClippedPolicyLoss, token_group_advantages
from rolectl.roles.engines.losses import LossFunction, LossSum, MicroBatch, TrainBatch, experience_batch
from rolectl.roles.engines.step import TrainStep, micro_batches

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
    losses = [engine.update.train_batch(batch, NegativeLogLikelihood()).loss for _ in range(15)]
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
