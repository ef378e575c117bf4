"""Micro-batches by token budget (`model.micro_batch_tokens`, `step.micro_batches(max_tokens=...)`):
the packing keeps its budget, every row once, groups whole, equal passes and balanced ranks; and on
the `hf` engine a long-tailed batch cut so trains exactly as the batch cut by rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolectl.roles.config import parse_config
from rolectl.roles.engines.algorithms import AlgorithmConfig
from rolectl.roles.engines.dpo import DPOLoss, TokenPair, preference_batch
from rolectl.roles.engines.hf import HFTrainEngine
from rolectl.roles.engines.hf_model import HFModelConfig
from rolectl.roles.engines.step import micro_batches
from rolectl.sync_protocol import ConfigError
from rolectl.sync_protocol.experience import Experience
from tests.support.tiny_llm import built_model, data_section, model_section


def _cost(micro: list[int], lengths: list[int]) -> int:
    return len(micro) * max(lengths[row] for row in micro)


def test_rows_are_packed_longest_first_up_to_the_budget():
    lengths = [3, 20, 4, 3, 9, 2, 30, 5]
    rows, groups = list(range(8)), [f"g{row}" for row in range(8)]
    mine, passes = micro_batches(rows, groups, size=3, max_tokens=20, lengths=lengths)
    # 30 > 20 stands alone; 20 fits once; 9 + 5 (18); 4, 3, 3 (12) and then 2 is past the 3 rows
    assert (mine, passes) == ([[6], [1], [4, 7], [2, 0, 3], [5]], 5)
    assert micro_batches(rows, groups, size=None, max_tokens=1000, lengths=lengths) == (
        [[6, 1, 4, 7, 2, 0, 3, 5]], 1)
    with pytest.raises(ValueError, match="needs each row's length"):
        micro_batches(rows, groups, size=None, max_tokens=10)


def test_ranks_get_like_token_loads_and_make_the_same_passes():
    lengths = [40, 2, 2, 2, 2, 2, 2, 2, 2, 38]
    rows, groups = list(range(10)), [f"g{row}" for row in range(10)]
    plans = [micro_batches(rows, groups, size=None, rank=r, world_size=2, max_tokens=40, lengths=lengths)
             for r in range(2)]
    # dealt by length, not in turn: each rank one long row and half the short ones
    assert plans == [([[0], [2, 4, 6, 8]], 2), ([[9], [1, 3, 5, 7]], 2)]


@st.composite
def _minibatches(draw):
    group_sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=12))
    groups = [f"g{index}" for index, size in enumerate(group_sizes) for _ in range(size)]
    lengths = draw(st.lists(st.integers(1, 60), min_size=len(groups), max_size=len(groups)))
    rows = sorted(draw(st.sets(st.sampled_from(range(len(groups))), min_size=1)))
    return rows, groups, lengths


@settings(max_examples=300, deadline=None)
@given(_minibatches(), st.integers(1, 8) | st.none(), st.integers(1, 200), st.integers(1, 4), st.booleans())
def test_a_token_budget_plan_holds_every_row_once_in_budget(minibatch, size, max_tokens, world_size, keep_groups):
    rows, groups, lengths = minibatch
    plans = [micro_batches(rows, groups, size=size, rank=r, world_size=world_size, keep_groups=keep_groups,
                           max_tokens=max_tokens, lengths=lengths) for r in range(world_size)]
    assert len({passes for _, passes in plans}) == 1
    assert plans[0][1] == max(len(mine) for mine, _ in plans)
    every = [row for mine, _ in plans for micro in mine for row in micro]
    assert sorted(every) == rows  # every row exactly once
    loads = []
    for mine, _ in plans:
        widths = [max(lengths[row] for row in micro) for micro in mine]
        assert widths == sorted(widths, reverse=True)  # longest first: rows of like length together
        for micro in mine:
            whole = len({groups[row] for row in micro}) if keep_groups else len(micro)
            if whole > 1:  # more than one row (group): within the budget and the row cap
                assert _cost(micro, lengths) <= max_tokens and (size is None or len(micro) <= size)
        loads.append(sum(lengths[row] for micro in mine for row in micro))
    if keep_groups:
        by_rank = [{groups[row] for micro in mine for row in micro} for mine, _ in plans]
        assert sum(len(names) for names in by_rank) == len({groups[row] for row in rows})  # a group on one rank
        for mine, _ in plans:
            for micro in mine:  # a group whole in its micro-batch
                assert all(sum(groups[r] == groups[row] for r in micro) == sum(groups[r] == groups[row] for r in rows)
                           for row in micro)
    else:  # longest-first to the least loaded: ranks differ by at most the costliest row
        assert max(loads) - min(loads) <= max(lengths[row] for row in rows) or world_size == 1


def test_without_a_budget_the_plan_is_the_one_by_rows():
    rows, groups = [0, 1, 2, 3, 4, 5, 6], ["a", "a", "b", "b", "c", "c", "c"]
    assert micro_batches(rows, groups, size=2, rank=1, world_size=2, lengths=[9, 1, 9, 1, 9, 1, 9]) == (
        [[1, 3], [5]], 2)


def test_a_bad_budget_is_an_error_naming_the_field(tmp_path):
    model = {**model_section(tmp_path / "model"), "micro_batch_tokens": 0}
    with pytest.raises(ConfigError, match=r"model\.micro_batch_tokens"):
        parse_config({"job": "budget", "model": model, "data": data_section()})
    with pytest.raises(ConfigError, match=r"model\.micro_batch_tokens"):
        parse_config({"job": "budget", "model": {**model, "micro_batch_tokens": "many"}, "data": data_section()})


# -- the same step on the hf engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return built_model(tmp_path_factory.mktemp("budget"))


def _engine(model_dir, algorithm: AlgorithmConfig, **model) -> HFTrainEngine:
    """The tiny model's hf trainer, on plain SGD: its weights move by the gradient itself (AdamW's
    first steps are about the gradient's sign, which rounding flips where a gradient is near 0)."""
    settings = {**model_section(model_dir), "minibatches": 2, "micro_batch_size": 16, **model}
    settings.pop("engine")
    torch.manual_seed(0)
    engine = HFTrainEngine(HFModelConfig.model_validate(settings), algorithm, model_path=model_dir,
                           keep_reference=True)
    engine.optimizer = engine.update.optimizer = torch.optim.SGD(engine.model.parameters(), lr=0.1)
    return engine


def _long_tailed(vocab_size: int) -> list[Experience]:
    """4 groups of 4: most responses 1-3 tokens, one of each group 20-30."""
    generator = torch.Generator().manual_seed(5)

    def tokens(length: int) -> tuple[int, ...]:
        return tuple(torch.randint(4, vocab_size, (length,), generator=generator).tolist())

    out = []
    for group in range(4):
        prompt = tokens(3 + group)
        for k in range(4):
            length = int(torch.randint(20, 31, (1,), generator=generator)) if k == group % 4 else k % 3 + 1
            out.append(Experience(id=f"e{group}-{k}", group=f"g{group}", prompt=prompt, response=tokens(length),
                                  logprobs=tuple(-2.0 - 0.1 * i for i in range(length)),
                                  reward=float(torch.rand(1, generator=generator)), model_version=0))
    return out


def _passes(engine: HFTrainEngine) -> list[tuple[int, int]]:
    """(rows, width) of each forward of the policy (appended to as it runs)."""
    shapes: list[tuple[int, int]] = []
    engine.model.register_forward_hook(lambda _m, _args, kwargs, _out: shapes.append(tuple(kwargs["input_ids"].shape)),
                                       with_kwargs=True)
    return shapes


@pytest.mark.parametrize("algorithm", [
    AlgorithmConfig(),
    AlgorithmConfig(kl_coef=0.1, rollout_correction={"rollout_is": "token"}),
], ids=["ppo", "kl-and-correction"])
def test_the_hf_step_is_the_same_cut_by_tokens(model_dir, algorithm):
    """Two steps (4 updates) on a long-tailed batch: the loss, gradient norm and weights of micro-batches of
    at most 30 tokens (a long row alone) are those of micro-batches of 16 rows (one per minibatch)."""
    results, weights, positions = [], [], []
    for budget in (None, 30):
        engine = _engine(model_dir, algorithm, micro_batch_tokens=budget)
        positions.append(_passes(engine))
        experiences = _long_tailed(engine.vocab_size)
        results.append([engine.train_step(experiences, current_version=0) for _ in range(2)])
        weights.append(engine.weights())
    by_rows, by_tokens = ([rows * width for rows, width in shapes] for shapes in positions)
    assert len(by_tokens) > len(by_rows) and sum(by_tokens) < sum(by_rows)  # more passes, less padding
    assert all(rows * width <= 30 or rows == 1 for rows, width in positions[1])  # a long row alone
    for by_rows, by_tokens in zip(*results):
        assert by_tokens["loss"] == pytest.approx(by_rows["loss"], rel=1e-5, abs=1e-6)
        assert by_tokens["grad_norm"] == pytest.approx(by_rows["grad_norm"], rel=1e-5)
    start = _engine(model_dir, algorithm).weights()
    assert any(not torch.equal(t, start[n]) for n, t in weights[0].items())  # the steps moved the weights
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _pairs(vocab_size: int) -> list[TokenPair]:
    """6 pairs: 4-token prompts, chosen responses of 1 or 6 tokens, rejected of 2."""
    generator = torch.Generator().manual_seed(3)

    def tokens(length: int) -> tuple[int, ...]:
        return tuple(torch.randint(4, vocab_size, (length,), generator=generator).tolist())

    return [TokenPair(id=f"p{i}", prompt=tokens(4), chosen=tokens(1 + 5 * (i % 2)), rejected=tokens(2))
            for i in range(6)]


def test_dpo_pairs_stay_whole_and_train_the_same_cut_by_tokens(model_dir):
    """Pairs of 6 tokens two to a micro-batch (24 tokens), of 10 one; DPOLoss refuses a split pair."""
    results, weights = [], []
    for budget in (None, 24):
        engine = _engine(model_dir, AlgorithmConfig(), micro_batch_tokens=budget, minibatches=1)
        shapes = _passes(engine)
        pairs = _pairs(engine.vocab_size)
        results.append(engine.train_batch(preference_batch(pairs), DPOLoss(beta=0.5)))
        weights.append(engine.weights())
    assert shapes == [(2, 10)] * 3 + [(4, 6)] + [(2, 6)]  # the policy's passes under the budget
    assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-5)
    assert results[1]["grad_norm"] == pytest.approx(results[0]["grad_norm"], rel=1e-5)
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
