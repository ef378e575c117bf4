"""Hand-made multi-turn episodes for the train engines' tests: seeded, with prompts of several lengths
and responses of sampled turns between which an environment's tokens sit (loss mask 0, logprob 0.0)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import torch

from rolectl.bus.experiences import ExperienceBatch, decode_batch, encode_batch
from rolectl.sync_protocol.experience import Experience

__all__ = ["multi_turn_episodes", "logit_gradients", "over_the_wire", "assert_gradient_on_sampled_tokens_only",
           "assert_a_step_trains_and_counts_tokens", "assert_hf_trains_on_sampled_tokens_only"]


def multi_turn_episodes(*, sampled: Sequence[int], observed: Sequence[int], groups: int = 3, group_size: int = 2,
                        max_prompt: int = 6, max_response: int = 9, seed: int = 0,
                        id_prefix: str = "ep") -> list[Experience]:
    """`groups` x `group_size` episodes: a prompt of 2..`max_prompt` tokens, then turns of tokens from
    `sampled` (logprobs as a sampler's: negative) with observations from `observed` between them
    (mask 0), `max_response` tokens at most, the last one sampled; rewards in [0, 1]."""
    g = torch.Generator().manual_seed(seed)

    def pick(tokens: Sequence[int], n: int) -> list[int]:
        return [int(tokens[i]) for i in torch.randint(len(tokens), (n,), generator=g)]

    out = []
    for group in range(groups):
        prompt = tuple(pick(sampled, int(torch.randint(2, max_prompt + 1, (1,), generator=g))))
        for k in range(group_size):
            response: list[int] = []
            mask: list[int] = []
            while len(response) < max_response - 1:
                turn = int(torch.randint(1, 4, (1,), generator=g))
                response += pick(sampled, turn)
                mask += [1] * turn
                gap = int(torch.randint(1, 3, (1,), generator=g))
                response += pick(observed, gap)
                mask += [0] * gap
            response, mask = response[:max_response - 1] + pick(sampled, 1), mask[:max_response - 1] + [1]
            logprobs = [-float(torch.rand(1, generator=g)) * 2 - 0.05 if m else 0.0 for m in mask]
            out.append(Experience(id=f"{id_prefix}-{group}-{k}", group=f"{id_prefix}-{group}", prompt=prompt,
                                  response=tuple(response), logprobs=tuple(logprobs),
                                  reward=float(torch.rand(1, generator=g)), model_version=0, loss_mask=tuple(mask)))
    return out


def logit_gradients(head: torch.nn.Module, train: Callable[[], Any]) -> list[torch.Tensor]:
    """d loss / d logits of each forward through `head` (a model's output layer) that `train()` makes
    with a gradient: `(rows, positions, vocab)` each, in the order of the forwards."""
    captured: list[torch.Tensor] = []

    def keep(module, inputs, output):
        if output.requires_grad:  # not a reference model's forward under no_grad
            output.retain_grad()
            captured.append(output)

    handle = head.register_forward_hook(keep)
    try:
        train()
    finally:
        handle.remove()
    return [logits.grad for logits in captured]


def assert_gradient_on_sampled_tokens_only(grad: torch.Tensor, experiences: Sequence[Experience]) -> None:
    """Row `b` of `grad` is experience `b`'s: the logits that predict its response token `j` (at
    `len(prompt) - 1 + j`) have a gradient exactly when the policy sampled that token."""
    for row, e in enumerate(experiences):
        for j, sampled in enumerate(e.mask()):
            position = grad[row, len(e.prompt) - 1 + j]
            assert bool(torch.count_nonzero(position)) == bool(sampled), (row, j, sampled)


def over_the_wire(experiences: Sequence[Experience]) -> list[Experience]:
    """`experiences` as a trainer receives them: sent as one batch (schema 2) and decoded."""
    wire = ExperienceBatch(member="e0", explore_step=1, model_version=0, experiences=tuple(experiences))
    assert msgpack.unpackb(encode_batch(wire))["schema"] == 2
    return list(decode_batch(encode_batch(wire)).experiences)


def assert_a_step_trains_and_counts_tokens(engine, experiences: Sequence[Experience], *, max_entropy: float) -> None:
    """`engine.train_step` on multi-turn episodes moves the weights and counts their tokens."""
    before = engine.weights()
    metrics = engine.train_step(experiences, current_version=0)
    assert math.isfinite(metrics["loss"]) and metrics["updates_skipped_nonfinite"] == 0
    assert any(not torch.equal(t, before[n]) for n, t in engine.weights().items())
    assert metrics["trained_tokens"] == sum(sum(e.mask()) for e in experiences)
    assert metrics["masked_tokens"] == sum(e.mask().count(0) for e in experiences) > 0
    assert 0 < metrics["entropy"] <= max_entropy


def _on_policy_batch(trainer, experiences):
    """`experiences` as a TrainBatch whose old logprobs are the trainer's own: no ratio is clipped."""
    from rolectl.roles.engines.hf import response_logprobs
    from rolectl.roles.engines.losses import experience_batch

    batch = experience_batch(experiences, trainer.algorithm.advantages)
    with torch.no_grad():
        own, _ = response_logprobs(trainer.model, batch.prompts, batch.responses, pad_id=trainer.pad_id, device="cpu")
    return dataclasses.replace(batch, old_logprobs=torch.where(batch.loss_mask, own, 0.0))


def assert_hf_trains_on_sampled_tokens_only(trainer) -> None:
    """One minibatch in one pass over multi-turn episodes (over the model's vocabulary, special tokens
    left out): the logits that predict an environment's token get exactly zero gradient, the sampled
    tokens' do not; and the same episodes through `train_step` move the weights and count the tokens."""
    words = range(4, trainer.vocab_size)
    experiences = over_the_wire(multi_turn_episodes(sampled=words, observed=words, group_size=trainer.group_size))
    batch = _on_policy_batch(trainer, experiences)
    head = trainer.model.get_output_embeddings()
    [grad] = logit_gradients(head, lambda: trainer.update.train_batch(batch, trainer.loss_fn))
    assert_gradient_on_sampled_tokens_only(grad, experiences)
    assert_a_step_trains_and_counts_tokens(trainer, experiences, max_entropy=math.log(trainer.vocab_size))
