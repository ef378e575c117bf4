"""The DPO loss (`roles.engines.dpo`): TRL's sigmoid and IPO formulas against hand-computed values,
pairs kept whole on every micro-batch and rank, micro-batches adding up to one pass, and DPO moving
a model toward the chosen responses on the tiny engine."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rolectl.roles.engines import TinyConfig, TinyTrainEngine
from rolectl.roles.engines.dpo import DPOLoss, TokenPair, preference_batch
from rolectl.roles.engines.losses import LossFunction, MicroBatch
from rolectl.roles.engines.step import TrainStep, micro_batches
from rolectl.roles.engines.task import BOS, EOS, SEP

# Two pairs; pair "a": chosen 2 tokens, rejected 1; pair "b": chosen 1, rejected 2.
PAIRS = [TokenPair(id="a", prompt=(BOS, 1, 2, SEP), chosen=(2, 1), rejected=(1,)),
         TokenPair(id="b", prompt=(BOS, 3, 4, SEP), chosen=(4,), rejected=(3, 4))]
POLICY = torch.tensor([[-1.0, -2.0], [-1.0, 0.0], [-0.5, 0.0], [-2.0, -1.0]])
REFERENCE = torch.tensor([[-1.5, -2.0], [-0.5, 0.0], [-1.0, 0.0], [-1.0, -1.0]])


def _micro(rows: list[int], *, policy: torch.Tensor = POLICY, sequences: int = 4) -> MicroBatch:
    batch = preference_batch(PAIRS)
    return MicroBatch(batch=batch, rows=rows, logprobs=policy[rows], ref_logprobs=REFERENCE[rows],
                      num_tokens=int(batch.loss_mask.sum()), num_sequences=sequences)


def test_a_pair_batch_is_two_rows_per_pair_the_first_chosen():
    batch = preference_batch(PAIRS)
    assert batch.groups == ("a", "a", "b", "b")
    assert batch.chosen.tolist() == [True, False, True, False]
    assert batch.responses == ((2, 1), (1,), (4,), (3, 4))
    assert batch.prompts[0] == batch.prompts[1] == (BOS, 1, 2, SEP)
    assert batch.loss_mask.tolist() == [[True, True], [True, False], [True, False], [True, True]]
    with pytest.raises(ValueError, match="distinct ids"):
        preference_batch([PAIRS[0], PAIRS[0]])
    with pytest.raises(ValueError, match=r"\['e'\]: a chosen or rejected response has no tokens"):
        preference_batch([TokenPair(id="e", prompt=(1,), chosen=(), rejected=(2,))])


def test_the_sigmoid_loss_and_rewards_are_trls_by_hand():
    # a: chosen ratio (-3) - (-3.5) = 0.5, rejected (-1) - (-0.5) = -0.5, h = 1.0
    # b: chosen ratio (-0.5) - (-1) = 0.5, rejected (-3) - (-2) = -1.0, h = 1.5
    beta = 0.5
    loss_fn = DPOLoss(beta=beta)
    assert isinstance(loss_fn, LossFunction) and loss_fn.needs_reference and loss_fn.keeps_groups
    loss, metrics = loss_fn(_micro([0, 1, 2, 3]))
    expected = [math.log1p(math.exp(-beta * h)) for h in (1.0, 1.5)]  # -log sigmoid(beta h)
    assert float(loss) == pytest.approx(sum(expected) / 2, rel=1e-6)
    assert metrics["dpo/loss"] == pytest.approx(sum(expected) / 2, rel=1e-6)
    assert metrics["dpo/reward_chosen"] == pytest.approx(beta * 0.5)
    assert metrics["dpo/reward_rejected"] == pytest.approx(beta * (-0.5 - 1.0) / 2)
    assert metrics["dpo/reward_margin"] == pytest.approx(beta * (1.0 + 1.5) / 2)
    assert metrics["dpo/accuracy"] == 1.0


def test_the_ipo_loss_compares_mean_token_logprobs_by_hand():
    # a: chosen mean (-1.5) - (-1.75) = 0.25, rejected (-1) - (-0.5) = -0.5, h = 0.75
    # b: chosen (-0.5) - (-1) = 0.5, rejected (-1.5) - (-1) = -0.5, h = 1.0
    beta = 0.5  # 1 / (2 beta) = 1
    loss, metrics = DPOLoss(beta=beta, loss="ipo")(_micro([0, 1, 2, 3]))
    assert float(loss) == pytest.approx(((0.75 - 1) ** 2 + (1.0 - 1) ** 2) / 2, rel=1e-6)
    assert metrics["dpo/reward_margin"] == pytest.approx(beta * (0.75 + 1.0) / 2)


def test_a_micro_batch_returns_its_share_of_the_minibatch_loss():
    whole, _ = DPOLoss(beta=0.1)(_micro([0, 1, 2, 3]))
    first, _ = DPOLoss(beta=0.1)(_micro([0, 1]))
    second, metrics = DPOLoss(beta=0.1)(_micro([2, 3]))
    assert float(first + second) == pytest.approx(float(whole), rel=1e-6)
    assert metrics["dpo/loss"] == pytest.approx(2 * float(second), rel=1e-6)  # its own pair's mean


def test_a_wrong_preference_margin_counts_against_accuracy_and_the_gradient_points_to_chosen():
    policy = POLICY.clone().requires_grad_(True)
    loss, metrics = DPOLoss(beta=1.0)(_micro([1, 0], policy=policy))  # rows in any order: marks decide
    assert metrics["dpo/accuracy"] == 1.0
    loss.backward()
    assert (policy.grad[0] < 0).all() and (policy.grad[1, 0] > 0)  # descent raises chosen, lowers rejected
    assert policy.grad[1, 1] == 0  # padding past the rejected response's end is masked
    rejected_favoured = REFERENCE.clone()
    rejected_favoured[1, 0] += 1.0  # the rejected response more likely than under the reference
    _, metrics = DPOLoss(beta=1.0)(_micro([0, 1], policy=rejected_favoured, sequences=2))
    assert metrics["dpo/accuracy"] == 0.0 and metrics["dpo/reward_margin"] == pytest.approx(-1.0)


def test_a_split_pair_or_a_batch_without_marks_is_refused():
    with pytest.raises(ValueError, match="group 'a' is not a preference pair here: 1 rows"):
        DPOLoss(beta=0.1)(_micro([0, 2, 3]))
    batch = preference_batch(PAIRS)
    unmarked = MicroBatch(batch=type(batch)(**{**{f: getattr(batch, f) for f in batch.__slots__}, "chosen": None}),
                          rows=[0, 1], logprobs=POLICY[:2], ref_logprobs=REFERENCE[:2], num_tokens=3,
                          num_sequences=2)
    with pytest.raises(ValueError, match="preference_batch"):
        DPOLoss(beta=0.1)(unmarked)
    with pytest.raises(ValueError, match="beta must be > 0"):
        DPOLoss(beta=0.0)
    with pytest.raises(ValueError, match="sigmoid"):
        DPOLoss(beta=0.1, loss="hinge")  # type: ignore[arg-type]


def _tiny_pairs(count: int) -> list[TokenPair]:
    """Reverse-two-digits prompts, the reversal chosen over the copy."""
    generator = torch.Generator().manual_seed(0)
    pairs = []
    for i in range(count):
        a, b = torch.randint(0, 10, (2,), generator=generator).tolist()
        b = b if b != a else (a + 1) % 10
        pairs.append(TokenPair(id=f"p{i}", prompt=(BOS, a, b, SEP), chosen=(b, a, EOS), rejected=(a, b, EOS)))
    return pairs


TINY = TinyConfig(seed=0, task_length=2, group_size=2, tasks_per_step=8, minibatches=2)


def _dpo_step(engine: TinyTrainEngine, *, micro_batch_size: int | None, minibatches: int = 2,
              optimizer: torch.optim.Optimizer | None = None) -> TrainStep:
    reference = copy.deepcopy(engine.policy).eval().requires_grad_(False)
    return TrainStep(model=engine.policy, optimizer=optimizer or engine.optimizer, forward=engine._logprobs,
                     max_grad_norm=1.0, minibatches=minibatches, micro_batch_size=micro_batch_size,
                     reference=reference)


def test_pairs_never_split_across_micro_batches_or_ranks():
    batch = preference_batch(_tiny_pairs(7))
    rows = list(range(len(batch)))
    for world_size in (1, 2, 3):
        dealt = [micro_batches(rows, batch.groups, size=1, rank=r, world_size=world_size, keep_groups=True)[0]
                 for r in range(world_size)]
        micros = [micro for plan in dealt for micro in plan]
        assert sorted(row for micro in micros for row in micro) == rows  # every row once
        for micro in micros:  # one whole pair each: its two rows, one chosen
            assert len(micro) == 2 and batch.groups[micro[0]] == batch.groups[micro[1]]
            assert sorted(batch.chosen[micro].tolist()) == [False, True]

    seen: list[list[str]] = []

    class Recording(DPOLoss):
        def __call__(self, micro):
            seen.append(micro.groups)
            return super().__call__(micro)

    engine = TinyTrainEngine(TINY)
    _dpo_step(engine, micro_batch_size=3).train_batch(batch, Recording(beta=0.1))
    assert sorted(g for groups in seen for g in groups) == sorted(batch.groups)
    assert all(len(groups) == 2 and groups[0] == groups[1] for groups in seen)  # 3 rows fit one pair


def test_dpo_micro_batches_accumulate_to_the_one_pass_step():
    """Plain SGD (Adam's first steps follow the gradient's sign, which rounding flips near zero)."""
    batch = preference_batch(_tiny_pairs(6))
    weights, losses = [], []
    for size in (None, 2):
        engine = TinyTrainEngine(TINY)
        result = _dpo_step(engine, micro_batch_size=size, optimizer=torch.optim.SGD(engine.policy.parameters(),
                                                                                   lr=0.5)).train_batch(
            batch, DPOLoss(beta=0.5))
        weights.append(engine.weights())
        losses.append(result.loss)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert any(not torch.equal(t, TinyTrainEngine(TINY).weights()[n]) for n, t in weights[0].items())
    for name, tensor in weights[0].items():
        assert torch.allclose(tensor, weights[1][name], atol=1e-6), name


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_makes_the_chosen_responses_more_likely_than_the_rejected(loss):
    engine = TinyTrainEngine(TINY)
    step = _dpo_step(engine, micro_batch_size=4, minibatches=1)
    batch = preference_batch(_tiny_pairs(16))
    first = step.train_batch(batch, DPOLoss(beta=0.5, loss=loss))
    assert first.metrics["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    for _ in range(20):
        last = step.train_batch(batch, DPOLoss(beta=0.5, loss=loss))
    assert last.loss < first.loss
    # IPO pulls the margin toward beta x 1/(2 beta) = 0.5; the sigmoid loss pushes it on past that
    assert last.metrics["dpo/reward_margin"] > (0.5 if loss == "sigmoid" else 0.25)
    assert last.metrics["dpo/accuracy"] == 1.0
    assert last.metrics["dpo/reward_chosen"] > last.metrics["dpo/reward_rejected"]
