"""The tiny trainer scores only the tokens that exist (`roles.engines.tiny.length_buckets`): rows of
like length in buckets, each padded to its own longest row; the same logprobs, entropies, gradients
and train steps as the forward that padded every row to the batch's longest, on long-tailed batches
with and without prompt padding."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rolectl.roles.engines.grpo import token_group_advantages
from rolectl.roles.engines.losses import TokenScores, TrainBatch, experience_batch
from rolectl.roles.engines.model import scored_tokens
from rolectl.roles.engines.step import TrainStep
from rolectl.roles.engines.task import EOS, make_reverse_task
from rolectl.roles.engines.tiny import TinyConfig, TinyTrainEngine, length_buckets
from rolectl.sync_protocol.experience import Experience

CONFIG = TinyConfig(seed=0, task_length=2, long_task_length=12, long_task_fraction=0.25, group_size=3,
                    tasks_per_step=8, minibatches=2)
"""Prompts of 4..14 tokens, responses of up to 13."""


def _experiences(*, digits: tuple[int, ...], padded: bool, seed: int = 0) -> list[Experience]:
    """A group per task of `digits[i]` digits; each response of its own length (1 token up to the
    longest), random digits and EOS (some cut short of EOS), random rewards."""
    rng = random.Random(seed)
    experiences = []
    for index, count in enumerate(digits):
        task = make_reverse_task(f"t{index}", [rng.randrange(10) for _ in range(count)],
                                 prompt_length=CONFIG.prompt_length if padded else None)
        for k in range(CONFIG.group_size):
            length = rng.randint(1, min(CONFIG.max_response_length, count + 2))
            response = tuple(rng.randrange(10) for _ in range(length - 1)) + (EOS if rng.random() < 0.8 else 3,)
            experiences.append(Experience(id=f"t{index}-{k}", group=f"t{index}", prompt=task.prompt, response=response,
                                          logprobs=tuple(-2.0 - rng.random() for _ in response),
                                          reward=rng.random(), model_version=0))
    return experiences


MIXED = (2, 12, 2, 3, 2, 12, 1, 7)


def _padded_forward(engine: TinyTrainEngine):
    """The tiny forward before buckets: every row of a micro-batch in one tensor, padded with EOS to
    its longest prompt + the batch's width, one `scored_tokens` call."""

    def forward(policy, batch: TrainBatch, rows, *, entropy: bool) -> TokenScores:
        width = batch.loss_mask.shape[1]
        starts = [len(batch.prompts[row]) for row in rows]
        tokens = torch.full((len(rows), max(starts) + width), EOS)
        for index, row in enumerate(rows):
            sequence = (*batch.prompts[row], *batch.responses[row])
            tokens[index, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        logprobs, entropies = scored_tokens(policy, tokens, torch.tensor(starts), width=width,
                                            allowed_tokens=engine.allowed_tokens,
                                            temperature=engine.config.temperature, entropy=entropy)
        return TokenScores(logprobs=logprobs, entropy=entropies)

    return forward


def _passes(engine: TinyTrainEngine, batch: TrainBatch, rows: list[int]) -> int:
    """How many times the policy runs to score `rows`."""
    calls = []
    handle = engine.policy.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            engine._logprobs(engine.policy, batch, rows, entropy=False)
    finally:
        handle.remove()
    return len(calls)


def test_rows_are_bucketed_by_real_length_each_bucket_in_the_rows_order():
    # short rows: prompt 4 + response 3; long: prompt 22 + response 21; one row 4 + 5 (within 1.5 x 7)
    starts, lengths = [4, 22, 4, 4, 22, 4], [3, 21, 3, 5, 21, 3]
    assert length_buckets(starts, lengths) == [[0, 2, 3, 5], [1, 4]]
    assert length_buckets(starts, lengths, growth=math.inf) == [[0, 1, 2, 3, 4, 5]]
    # a bucket is as wide as its longest prompt + its longest response: 22 + 3 > 1.5 x (4 + 12)
    assert length_buckets([4, 22], [12, 3]) == [[0], [1]]
    assert length_buckets([4, 4, 4], [0, 0, 0]) == [[0, 1, 2]]


@pytest.mark.parametrize("padded", [False, True], ids=["own-prompt-lengths", "prompts-padded"])
def test_bucketed_scores_and_gradients_are_the_padded_forwards(padded: bool):
    engine = TinyTrainEngine(CONFIG)
    batch = experience_batch(_experiences(digits=MIXED, padded=padded), token_group_advantages)
    rows = list(range(len(batch)))[::-1]  # any order of rows, not the batch's
    assert _passes(engine, batch, rows) > 1
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0))
    mask = batch.loss_mask[rows]
    found = {}
    for name, forward in (("bucketed", engine._logprobs), ("padded", _padded_forward(engine))):
        engine.policy.zero_grad(set_to_none=True)
        scores = forward(engine.policy, batch, rows, entropy=True)
        assert scores.logprobs.shape == scores.entropy.shape == (len(rows), batch.loss_mask.shape[1])
        (torch.where(mask, scores.logprobs, 0.0) * weights[rows]).sum().backward()
        grads = {n: p.grad.clone() for n, p in engine.policy.named_parameters()}
        assert all(torch.isfinite(g).all() for g in grads.values()), name
        found[name] = (scores.logprobs.detach(), scores.entropy, grads)
    (bucketed, entropy, grads), (padded_logprobs, padded_entropy, padded_grads) = found["bucketed"], found["padded"]
    assert torch.allclose(bucketed[mask], padded_logprobs[mask], atol=1e-5)
    assert torch.allclose(entropy[mask], padded_entropy[mask], atol=1e-5)
    assert torch.isfinite(bucketed).all() and torch.isfinite(entropy).all()
    assert any(g.abs().sum() > 0 for g in grads.values())
    for name, grad in grads.items():
        assert torch.allclose(grad, padded_grads[name], atol=1e-5), name


def test_rows_of_one_length_are_one_pass():
    engine = TinyTrainEngine(CONFIG)
    experiences = [e for e in _experiences(digits=(3,) * 8, padded=False) if len(e.response) == 3]
    batch = experience_batch(experiences, token_group_advantages)
    assert len(batch) > 4 and _passes(engine, batch, list(range(len(batch)))) == 1
    mixed = experience_batch(_experiences(digits=MIXED, padded=False), token_group_advantages)
    starts = [len(p) for p in mixed.prompts]
    lengths = [len(r) for r in mixed.responses]
    assert _passes(engine, mixed, list(range(len(mixed)))) == len(length_buckets(starts, lengths))


@pytest.mark.parametrize("padded", [False, True], ids=["own-prompt-lengths", "prompts-padded"])
def test_a_train_step_on_a_long_tailed_batch_is_the_padded_forwards(padded: bool):
    """Two steps of 2 minibatches: the same losses, gradients, entropies and weights. Plain SGD: Adam
    turns a gradient that is rounding noise (the attention's key bias: softmax ignores it) into a
    step of `lr`, whatever its size."""
    experiences = _experiences(digits=MIXED, padded=padded, seed=1)
    engines = []
    for forward in ("bucketed", "padded"):
        engine = TinyTrainEngine(CONFIG)
        engine.update = TrainStep(model=engine.policy, optimizer=torch.optim.SGD(engine.policy.parameters(), lr=0.1),
                                  forward=engine._logprobs if forward == "bucketed" else _padded_forward(engine),
                                  max_grad_norm=CONFIG.max_grad_norm, minibatches=CONFIG.minibatches,
                                  micro_batch_size=None)
        engines.append(engine)
    now, before = engines
    for version in range(2):
        metrics, expected = (engine.train_step(experiences, current_version=version) for engine in engines)
        assert metrics["updates_skipped_nonfinite"] == 0 and math.isfinite(metrics["loss"])
        for key in ("loss", "grad_norm", "entropy"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    moved = False
    for name, tensor in now.weights().items():
        assert torch.allclose(tensor, before.weights()[name], atol=1e-6), name
        moved |= not torch.equal(tensor, TinyTrainEngine(CONFIG).weights()[name])
    assert moved


def test_the_engines_own_step_trains_a_long_tailed_batch_as_the_padded_forward():
    """With its Adam, the losses of the engine's `train_step` are the padded forward's."""
    experiences = _experiences(digits=MIXED, padded=False, seed=2)
    now, before = TinyTrainEngine(CONFIG), TinyTrainEngine(CONFIG)
    before.update.forward = _padded_forward(before)
    for version in range(3):
        metrics, expected = (engine.train_step(experiences, current_version=version) for engine in (now, before))
        assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)


def test_a_row_without_a_response_beside_long_ones_gets_no_nan():
    experiences = _experiences(digits=MIXED, padded=False)
    experiences[0] = Experience(id="empty", group=experiences[0].group, prompt=experiences[0].prompt, response=(),
                                logprobs=(), reward=0.0, model_version=0)
    engine = TinyTrainEngine(CONFIG)
    metrics = engine.train_step(experiences, current_version=0)
    assert metrics["updates_skipped_nonfinite"] == 0 and math.isfinite(metrics["loss"])
    assert all(torch.isfinite(t).all() for t in engine.weights().values())
