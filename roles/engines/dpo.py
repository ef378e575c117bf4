"""Direct preference optimisation: the DPO loss (sigmoid, or IPO) on batches of preference pairs.

A preference pair is a prompt and two responses, the preferred (`chosen`) and the other
(`rejected`). In a `TrainBatch` it is one group of two rows, `TrainBatch.chosen` marking the
preferred one (`preference_batch`), so the step's `keeps_groups` keeps a pair on one micro-batch and
one rank. The loss compares each response's sequence logprob under the policy (`π`) with the frozen
reference's (`ref`, the stage's starting weights) as TRL's `DPOTrainer.dpo_loss` does
(trl/trainer/dpo_trainer.py; Rafailov et al. 2023, eq. 7; Azar et al. 2023, eq. 17):

    h = (π_chosen − ref_chosen) − (π_rejected − ref_rejected)    (TRL's `logits`)
    sigmoid: −log σ(β·h)                                          (`loss_type="sigmoid"`, no label smoothing)
    ipo:     (h − 1/(2β))²                                        (`loss_type="ipo"`)

A sequence's logprob is the sum of its response tokens' logprobs (`loss_mask`); for IPO their mean,
as TRL divides by the response length under `loss_type="ipo"`. The reported rewards are TRL's:
`β·(π − ref)` of each response (`dpo/reward_chosen`, `dpo/reward_rejected`), their difference
(`dpo/reward_margin`) and the fraction of pairs whose margin is positive (`dpo/accuracy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .losses import MicroBatch, TrainBatch

__all__ = ["DPO_LOSSES", "DPOLoss", "TokenPair", "preference_batch"]

DPO_LOSSES = ("sigmoid", "ipo")


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenPair:
    """One preference pair, tokenized: the prompt and the two responses that follow it."""

    id: str
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


def preference_batch(pairs: Sequence[TokenPair]) -> TrainBatch:
    """The pairs as a `TrainBatch`: pair `i` is group `pairs[i].id`, its chosen response row `2i`
    and its rejected one row `2i + 1`; `chosen` marks the first. No sampler drew these tokens, so
    `old_logprobs`, `advantages` and `rewards` are zero."""
    if not pairs:
        raise ValueError("a preference batch needs at least one pair")
    ids = [pair.id for pair in pairs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"preference pairs need distinct ids (each is a group), got {ids}")
    responses = tuple(response for pair in pairs for response in (pair.chosen, pair.rejected))
    empty = [pair.id for pair in pairs if not pair.chosen or not pair.rejected]
    if empty:
        raise ValueError(f"preference pairs {empty[:5]}: a chosen or rejected response has no tokens")
    width = max(len(r) for r in responses)
    mask = torch.zeros(len(responses), width, dtype=torch.bool)
    for row, response in enumerate(responses):
        mask[row, :len(response)] = True
    zeros = torch.zeros(len(responses), width)
    return TrainBatch(prompts=tuple(pair.prompt for pair in pairs for _ in range(2)), responses=responses,
                      groups=tuple(pair.id for pair in pairs for _ in range(2)), loss_mask=mask,
                      old_logprobs=zeros, advantages=zeros, rewards=torch.zeros(len(responses)),
                      chosen=torch.tensor([row % 2 == 0 for row in range(len(responses))]))


def _pair_rows(micro: MicroBatch) -> tuple[Tensor, Tensor]:
    """Positions in the micro-batch of each pair's chosen and rejected rows, pair by pair."""
    if micro.batch.chosen is None:
        raise ValueError("the DPO loss trains on preference pairs: build the batch with "
                         "roles.engines.dpo.preference_batch (TrainBatch.chosen is None)")
    chosen = micro.batch.chosen[micro.rows].tolist()
    rows: dict[str, list[int]] = {}
    for position, group in enumerate(micro.groups):
        rows.setdefault(group, []).append(position)
    chosen_at, rejected_at = [], []
    for group, positions in rows.items():
        marks = [chosen[p] for p in positions]
        if len(positions) != 2 or sorted(marks) != [False, True]:
            raise ValueError(f"group {group!r} is not a preference pair here: {len(positions)} rows, "
                             f"{sum(marks)} marked chosen (a pair is two rows, one chosen; the loss "
                             "keeps groups whole)")
        chosen_at.append(positions[marks.index(True)])
        rejected_at.append(positions[marks.index(False)])
    device = micro.logprobs.device
    return torch.tensor(chosen_at, device=device), torch.tensor(rejected_at, device=device)


class DPOLoss:
    """The DPO objective as a `LossFunction`: `loss` "sigmoid" (DPO) or "ipo", temperature `beta`.

    A micro-batch returns its pairs' summed losses over the minibatch's pairs (`num_sequences / 2`,
    every rank's), so micro-batches and ranks add up to the minibatch's mean pair loss.
    """

    needs_reference = True
    keeps_groups = True

    def __init__(self, *, beta: float, loss: Literal["sigmoid", "ipo"] = "sigmoid") -> None:
        if not beta > 0:
            raise ValueError(f"dpo beta must be > 0, got {beta}")
        if loss not in DPO_LOSSES:
            raise ValueError(f"dpo loss must be one of {DPO_LOSSES}, got {loss!r}")
        self.beta = float(beta)
        self.loss = loss

    def _sequence_logprobs(self, logprobs: Tensor, mask: Tensor) -> Tensor:
        total = (logprobs * mask).sum(-1)
        return total / mask.sum(-1).clamp(min=1.0) if self.loss == "ipo" else total

    def __call__(self, micro: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        assert micro.ref_logprobs is not None  # the step computes them for a loss that needs them
        mask = micro.loss_mask.float()
        policy = self._sequence_logprobs(micro.logprobs, mask)
        reference = self._sequence_logprobs(micro.ref_logprobs.detach(), mask)
        chosen, rejected = _pair_rows(micro)
        chosen_ratio = policy[chosen] - reference[chosen]
        rejected_ratio = policy[rejected] - reference[rejected]
        h = chosen_ratio - rejected_ratio
        if self.loss == "sigmoid":
            losses = -F.logsigmoid(self.beta * h)
        else:
            losses = (h - 1.0 / (2.0 * self.beta)) ** 2
        pairs = micro.num_sequences / 2
        chosen_reward = self.beta * chosen_ratio.detach()
        rejected_reward = self.beta * rejected_ratio.detach()
        margin = chosen_reward - rejected_reward
        return losses.sum() / pairs, {
            "dpo/loss": float(losses.detach().mean()),
            "dpo/reward_chosen": float(chosen_reward.mean()),
            "dpo/reward_rejected": float(rejected_reward.mean()),
            "dpo/reward_margin": float(margin.mean()),
            "dpo/accuracy": float((margin > 0).float().mean()),
        }
