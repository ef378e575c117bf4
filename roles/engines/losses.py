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

Only the tokens the policy sampled are trained on: `loss_mask` is 0 on padding and on the tokens an
environment, a tool or the chat template put into a multi-turn episode (`Experience.mask()`), the
step hands a loss logprobs (and entropies) that are 0 there, and `num_tokens` counts the masked
tokens only (a sequence-mean's per-sequence count is its masked count, as verl's `agg_loss` takes it).

A new objective is a new `LossFunction` and at most a new `TrainBatch` field (read with
`MicroBatch.take`): an SFT loss reads
`logprobs` and `loss_mask`; DPO sets `keeps_groups` (a chosen/rejected pair never splits across
micro-batches or ranks) and `needs_reference` (the step runs the frozen reference for
`ref_logprobs`); off-policy correction compares `logprobs` with the behaviour policy's
`old_logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from rolectl.sync_protocol.experience import Experience

from .sections import TINY_LOSS_AGG_MODES

__all__ = ["TrainBatch", "TokenScores", "MicroBatch", "LossFunction", "LossSum", "experience_batch",
           "token_entropy", "aggregate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBatch:
    """One train step's sequences: row `i` is sequence `i`; token tensors are `(rows, width)`, padded
    on the right to the longest response (`width`); a group's rows stay in one minibatch."""

    prompts: tuple[tuple[int, ...], ...]
    responses: tuple[tuple[int, ...], ...]
    groups: tuple[str, ...]
    loss_mask: Tensor
    """bool: the response tokens a loss counts: those the policy sampled (0 on padding, and on the
    environment, tool and template tokens of a multi-turn episode)."""
    old_logprobs: Tensor
    """float: the logprobs the sampler drew each token with (the behaviour policy)."""
    advantages: Tensor
    """float: per-token advantages (read where `loss_mask` is set)."""
    rewards: Tensor
    """float `(rows,)`: one scalar reward per sequence."""
    proximal_logprobs: Tensor | None = None
    """float: the trainer's logprobs before the step's update (decoupled PPO's proximal policy),
    set by the step's off-policy correction; None: PPO's ratio is against `old_logprobs`."""
    is_weights: Tensor | None = None
    """float: the off-policy correction's truncated importance weight of each token; None: none."""
    on_policy: Tensor | None = None
    """bool: the tokens the weights the step starts from sampled (their version is the trainer's
    `current_version`): their sampler and trainer logprobs differ only by numerics, so a gap there
    is a fault, not staleness (the mismatch alarm's tokens); None: versions not known."""
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


def experience_batch(experiences: Sequence[Experience], advantages: AdvantageEstimator, *,
                     current_version: int | None = None) -> TrainBatch:
    """The experiences of a train step as a `TrainBatch`, with `advantages` from their rewards; its
    `loss_mask` is each experience's `mask()` (the tokens the policy sampled), off on the padding;
    with `current_version` (the version the trainer holds), `on_policy` marks that version's tokens."""
    if not experiences:
        raise ValueError("train_step needs at least one experience")
    width = max(1, max(len(e.response) for e in experiences))
    # filled in numpy: torch.tensor reads a tuple of Python numbers an order of magnitude slower;
    # a mask of 0/1 reads fastest as bytes
    old_logprobs = np.zeros((len(experiences), width), dtype=np.float32)
    mask = np.zeros((len(experiences), width), dtype=np.bool_)
    for row, e in enumerate(experiences):
        old_logprobs[row, :len(e.response)] = e.logprobs
        mask[row, :len(e.response)] = True if e.loss_mask is None else np.frombuffer(bytes(e.loss_mask), np.uint8)
    rewards = torch.tensor([e.reward for e in experiences], dtype=torch.float32)
    groups = tuple(e.group for e in experiences)
    loss_mask = torch.from_numpy(mask)
    on_policy = None
    if current_version is not None:
        held = np.zeros((len(experiences), width), dtype=np.bool_)
        for row, e in enumerate(experiences):  # one version a response, unless a pause split it
            held[row, :len(e.response)] = (e.model_version == current_version if e.token_versions is None
                                           else np.asarray(e.versions()) == current_version)
        on_policy = torch.from_numpy(held)
    return TrainBatch(prompts=tuple(e.prompt for e in experiences), responses=tuple(e.response for e in experiences),
                      groups=groups, loss_mask=loss_mask, old_logprobs=torch.from_numpy(old_logprobs),
                      advantages=advantages(rewards, loss_mask, groups), rewards=rewards, on_policy=on_policy)


@dataclass(frozen=True, slots=True)
class TokenScores:
    """What an engine's model gives for some rows of a batch (`step.Forward`): `(rows, width)`."""

    logprobs: Tensor
    """Each response token's logprob under the model; carries the gradient."""
    entropy: Tensor | None = None
    """The entropy of the model's distribution at each response token, without gradient; None
    when not asked for."""


def token_entropy(logprobs: Tensor) -> Tensor:
    """The entropy of each distribution `(..., vocab)` given as log-probabilities, without gradient; an
    impossible token (probability 0, logprob -inf) adds 0. One leading row at a time: no more
    memory than one row's `(..., vocab)` beside the input."""
    with torch.no_grad():
        rows = [-torch.where(row > float("-inf"), row.exp() * row, 0.0).sum(-1) for row in logprobs]
        return torch.stack(rows) if rows else logprobs.new_zeros(logprobs.shape[:-1])


def aggregate(values: Tensor, mask: Tensor, mode: str, *, num_tokens: int | None = None,
              num_sequences: int | None = None) -> Tensor:
    """verl's `core_algos.agg_loss` on a micro-batch, without verl: `values` `(rows, width)` summed
    over `mask`, divided by the minibatch's `num_tokens` (token-mean) or, per sequence over its
    masked tokens, by `num_sequences` (seq-mean-token-sum / -token-mean); None: this micro-batch's.
    A sequence with no masked token adds nothing (as in verl, whose `num_sequences` counts it)."""
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denominator = mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        return (values * mask).sum() / denominator
    if mode not in TINY_LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {TINY_LOSS_AGG_MODES}, got {mode!r}")
    tokens = mask.sum(dim=-1)
    per_sequence = (values * mask).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / (tokens + 1e-8)
    counted = (tokens > 0).to(values.dtype)
    sequences = counted.sum() if num_sequences is None else num_sequences
    return (per_sequence * counted).sum() / sequences


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatch:
    """What a loss function sees of one micro-batch: the model's logprobs on some rows of the batch,
    and those rows of every batch tensor (`take`), cut to the same width, on the same device."""

    batch: TrainBatch
    rows: list[int]
    logprobs: Tensor
    """`(len(rows), width)` under the policy being trained; carries the gradient; 0 where
    `loss_mask` is 0."""
    ref_logprobs: Tensor | None
    """The same under the frozen reference model, when the loss `needs_reference`; else None."""
    num_tokens: int
    """`loss_mask` tokens of the whole minibatch, every rank's rows: a token-mean's denominator."""
    num_sequences: int
    """Sequences of the whole minibatch, every rank's rows: a sequence-mean's denominator."""
    minibatch: Sequence[int] = ()
    """The whole minibatch's rows, every rank's: a loss over some of them (`sft.OnRows`) counts its
    own `num_tokens` and `num_sequences` there."""
    entropy: Tensor | None = None
    """`(len(rows), width)`: the policy's entropy at each response token (no gradient; 0 where
    `loss_mask` is 0), for the `entropy` metric; None when the engine's forward gives none."""

    def take(self, tensor: Tensor) -> Tensor:
        """This micro-batch's rows of a batch tensor `(rows, ...)`, cut to `width` when it has a token axis."""
        part = tensor[self.rows, :self.logprobs.shape[1]] if tensor.dim() > 1 else tensor[self.rows]
        return part.to(self.logprobs.device)

    @property
    def loss_mask(self) -> Tensor:
        return self.take(self.batch.loss_mask)

    @property
    def proximal_logprobs(self) -> Tensor:
        """What PPO's ratio is taken against: the proximal policy's logprobs where the step's
        off-policy correction computed them (decoupled PPO), else the sampler's."""
        proximal = self.batch.proximal_logprobs
        return self.take(self.batch.old_logprobs if proximal is None else proximal)

    @property
    def is_weights(self) -> Tensor | None:
        """The off-policy correction's importance weights of these rows, or None."""
        return None if self.batch.is_weights is None else self.take(self.batch.is_weights)

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
