"""The loss-function seam of the one training step: the batch a step trains on, what a loss sees of
one micro-batch, and the `LossFunction` protocol every objective (RL, SFT, DPO, ...) implements.

The step (`roles.engines.step.TrainStep.train_batch`) owns the loop: minibatches, micro-batches per
rank, forward, backward, clipping, the non-finite skip, the optimizer step. A loss owns only the
arithmetic of one micro-batch. The contract that keeps gradient accumulation exact: a loss returns
its micro-batch's *share* of the minibatch loss, normalised by the whole minibatch's
`num_tokens` / `num_sequences` (every rank's rows), not by its own size, so the sum over
micro-batches and ranks is the minibatch loss. These are verl's `batch_num_tokens` and
`global_batch_size`, so `core_algos.agg_loss` does `token-mean`, `seq-mean-token-sum` and
`seq-mean-token-mean` on a micro-batch as it stands.

A new objective is a new `LossFunction` and at most a new `TrainBatch` field (read with
`MicroBatch.take`): a per-token mask that drops tool tokens is `loss_mask`; an SFT loss reads
`logprobs` and `loss_mask`; DPO sets `keeps_groups` (a chosen/rejected pair never splits across
micro-batches or ranks) and `needs_reference` (the step runs the frozen reference for
`ref_logprobs`); off-policy correction compares `logprobs` with the behaviour policy's
`old_logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from rolectl.sync_protocol.experience import Experience

__all__ = ["TrainBatch", "MicroBatch", "LossFunction", "LossSum", "experience_batch"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBatch:
    """One train step's sequences: row `i` is sequence `i`; token tensors are `(rows, width)`, padded
    on the right to the longest response (`width`); a group's rows stay in one minibatch."""

    prompts: tuple[tuple[int, ...], ...]
    responses: tuple[tuple[int, ...], ...]
    groups: tuple[str, ...]
    loss_mask: Tensor
    """bool: the response tokens a loss counts (0 on padding; for agent trajectories, 0 on tool tokens)."""
    old_logprobs: Tensor
    """float: the logprobs the sampler drew each token with (the behaviour policy)."""
    advantages: Tensor
    """float: per-token advantages (read where `loss_mask` is set)."""
    rewards: Tensor
    """float `(rows,)`: one scalar reward per sequence."""
    demonstration: Tensor | None = None
    """bool `(rows,)`: the row is a demonstration (SFT's rows, or those `trainer.expert_data` mixes
    into an RL step, trained with the SFT loss); None: no row is (`roles.engines.sft`)."""
    chosen: Tensor | None = None
    """bool `(rows,)` of preference pairs (each group two rows, `prompt` + two responses): the
    preferred row of its pair; None for any other batch (`roles.engines.dpo`)."""

    def __len__(self) -> int:
        return len(self.groups)


AdvantageEstimator = Callable[[Tensor, Tensor, Sequence[str]], Tensor]
"""`(rewards (rows,), loss_mask (rows, width), groups) -> advantages (rows, width)`."""


def experience_batch(experiences: Sequence[Experience], advantages: AdvantageEstimator) -> TrainBatch:
    """The experiences of a train step as a `TrainBatch`, with `advantages` from their rewards."""
    if not experiences:
        raise ValueError("train_step needs at least one experience")
    width = max(1, max(len(e.response) for e in experiences))
    old_logprobs = torch.zeros(len(experiences), width)
    mask = torch.zeros(len(experiences), width, dtype=torch.bool)
    for row, e in enumerate(experiences):
        old_logprobs[row, :len(e.response)] = torch.tensor(e.logprobs, dtype=torch.float32)
        mask[row, :len(e.response)] = True
    rewards = torch.tensor([e.reward for e in experiences], dtype=torch.float32)
    groups = tuple(e.group for e in experiences)
    return TrainBatch(prompts=tuple(e.prompt for e in experiences), responses=tuple(e.response for e in experiences),
                      groups=groups, loss_mask=mask, old_logprobs=old_logprobs,
                      advantages=advantages(rewards, mask, groups), rewards=rewards)


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatch:
    """What a loss function sees of one micro-batch: the model's logprobs on some rows of the batch,
    and those rows of every batch tensor (`take`), cut to the same width, on the same device."""

    batch: TrainBatch
    rows: list[int]
    logprobs: Tensor
    """`(len(rows), width)` under the policy being trained; carries the gradient."""
    ref_logprobs: Tensor | None
    """The same under the frozen reference model, when the loss `needs_reference`; else None."""
    num_tokens: int
    """`loss_mask` tokens of the whole minibatch, every rank's rows: a token-mean's denominator."""
    num_sequences: int
    """Sequences of the whole minibatch, every rank's rows: a sequence-mean's denominator."""
    minibatch: Sequence[int] = ()
    """The whole minibatch's rows, every rank's: a loss over some of them (`sft.OnRows`) counts its
    own `num_tokens` and `num_sequences` there."""

    def take(self, tensor: Tensor) -> Tensor:
        """This micro-batch's rows of a batch tensor `(rows, ...)`, cut to `width` when it has a token axis."""
        part = tensor[self.rows, :self.logprobs.shape[1]] if tensor.dim() > 1 else tensor[self.rows]
        return part.to(self.logprobs.device)

    @property
    def loss_mask(self) -> Tensor:
        return self.take(self.batch.loss_mask)

    @property
    def old_logprobs(self) -> Tensor:
        return self.take(self.batch.old_logprobs)

    @property
    def advantages(self) -> Tensor:
        return self.take(self.batch.advantages)

    @property
    def groups(self) -> list[str]:
        return [self.batch.groups[row] for row in self.rows]


@runtime_checkable
class LossFunction(Protocol):
    """One training objective: a micro-batch's share of the minibatch loss, and its metrics."""

    needs_reference: bool
    """The step computes `MicroBatch.ref_logprobs` with the engine's frozen reference model."""
    keeps_groups: bool
    """Micro-batches (and ranks) get whole groups: a group is never split (DPO's pairs)."""

    def __call__(self, micro: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        """(a scalar to backpropagate, normalised by `micro.num_tokens` / `num_sequences`; metrics of
        this micro-batch, which the step averages over micro-batches and ranks)."""


class LossSum:
    """`terms[0] + weight_1 * terms[1] + ...`, e.g. a policy loss plus `kl_coef` x a KL penalty;
    metrics of every term (later terms win a name clash)."""

    def __init__(self, first: LossFunction, *weighted: tuple[float, LossFunction]) -> None:
        self.terms = (first, *(term for _, term in weighted))
        self.weights = (1.0, *(weight for weight, _ in weighted))
        self.needs_reference = any(term.needs_reference for term in self.terms)
        self.keeps_groups = any(term.keeps_groups for term in self.terms)

    def __call__(self, micro: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        total, metrics = self.terms[0](micro)
        metrics = dict(metrics)
        for weight, term in zip(self.weights[1:], self.terms[1:]):
            value, more = term(micro)
            total = total + weight * value
            metrics.update(more)
        return total, metrics

    def __str__(self) -> str:
        """What it adds up, for messages: `VerlPolicyLoss + 0.05 x VerlKLPenalty`."""
        return " + ".join([type(self.terms[0]).__name__, *(f"{weight:g} x {type(term).__name__}"
                                                           for weight, term in zip(self.weights[1:], self.terms[1:]))])
