"""Group-relative policy gradient (GRPO-style): group-normalised advantages and a clipped PPO loss."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from .losses import MicroBatch, aggregate
from .sections import TINY_LOSS_AGG_MODES

__all__ = ["group_advantages", "token_group_advantages", "clipped_policy_loss", "ClippedPolicyLoss"]


def group_advantages(rewards: Tensor, groups: Sequence[str], *, eps: float = 1e-6) -> Tensor:
    """`(r - group mean) / (group std + eps)` per experience.

    A group with one member, or whose members all got the same reward, carries no signal about
    which response was better: its advantages are 0, not noise.
    """
    advantages = torch.zeros_like(rewards)
    members: dict[str, list[int]] = defaultdict(list)
    for index, group in enumerate(groups):
        members[group].append(index)
    for indices in members.values():
        if len(indices) < 2:
            continue
        group_rewards = rewards[indices]
        std = group_rewards.std(correction=0)
        advantages[indices] = (group_rewards - group_rewards.mean()) / (std + eps)
    return advantages


def token_group_advantages(rewards: Tensor, mask: Tensor, groups: Sequence[str]) -> Tensor:
    """`group_advantages` on every token of each response: `(batch, response_len)` like `mask`."""
    return group_advantages(rewards, groups).unsqueeze(-1).expand(mask.shape)


def clipped_policy_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    loss_tokens: int | None = None,
    loss_agg_mode: str = "token-mean",
    loss_sequences: int | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Token-level PPO clipped objective over the tokens under `mask`, aggregated as verl's `agg_loss`
    does by `loss_agg_mode` (`roles.engines.losses.aggregate`).

    `old_logprobs` are the explorer's sampling logprobs, so the ratio corrects for weights that are
    a few versions stale; clipping bounds how far one step moves on such data. `token-mean` (the
    default) averages over all tokens (not per sequence first): long and short responses weigh by
    their tokens; the `seq-mean-*` modes weigh each sequence alike.
    Shapes: logprobs and mask `(batch, response_len)`, advantages `(batch,)` or per token.
    `loss_tokens` / `loss_sequences`: the tokens / sequences the loss is averaged over when this
    batch is one micro-batch of a larger one (its statistics stay this batch's own); by default
    this batch's.
    """
    mask = mask.to(new_logprobs.dtype)
    log_ratio = (new_logprobs - old_logprobs) * mask
    ratio = log_ratio.exp()
    per_token_advantage = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
    unclipped = ratio * per_token_advantage
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * per_token_advantage
    num_tokens = mask.sum().clamp(min=1.0)
    per_token_loss = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token_loss = per_token_loss * is_weights
    loss = aggregate(per_token_loss, mask, loss_agg_mode,
                     num_tokens=None if loss_tokens is None else max(loss_tokens, 1), num_sequences=loss_sequences)
    with torch.no_grad():
        was_clipped = ((ratio - 1.0).abs() > clip_eps).to(mask.dtype) * mask
        stats = {
            "ratio_mean": float((ratio * mask).sum() / num_tokens),
            "clip_fraction": float(was_clipped.sum() / num_tokens),
            # k3 estimator of KL(old || new): non-negative, low variance.
            "approx_kl": float(((ratio - 1.0 - log_ratio) * mask).sum() / num_tokens),
        }
    return loss, stats


class ClippedPolicyLoss:
    """`clipped_policy_loss` as a `LossFunction` for the one training step (the tiny engine's); its
    metrics add `entropy`, the policy's over the trained tokens, aggregated by `loss_agg_mode`."""

    needs_reference = False
    keeps_groups = False

    def __init__(self, *, clip_eps: float, loss_agg_mode: str = "token-mean") -> None:
        if loss_agg_mode not in TINY_LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {TINY_LOSS_AGG_MODES}, got {loss_agg_mode!r}")
        self.clip_eps = clip_eps
        self.loss_agg_mode = loss_agg_mode

    def __call__(self, micro: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        # the proximal policy's logprobs under an off-policy correction, else the sampler's
        loss, stats = clipped_policy_loss(micro.logprobs, micro.proximal_logprobs, micro.advantages,
                                          micro.loss_mask, clip_eps=self.clip_eps, loss_tokens=micro.num_tokens,
                                          loss_agg_mode=self.loss_agg_mode, loss_sequences=micro.num_sequences,
                                          is_weights=micro.is_weights)
        if micro.entropy is not None:
            stats["entropy"] = float(aggregate(micro.entropy, micro.loss_mask, self.loss_agg_mode))
        return loss, stats
