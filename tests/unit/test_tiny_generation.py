"""The tiny engine's generation pool (KV cache, ragged rows, continuous batching) scores its tokens as
the trainer's full forward does, samples a row the same whatever shares its batch, recomputes its
cache after new weights, and streams groups across explore steps (`admit`/`collect`/`abandon`)."""

from __future__ import annotations

import pytest
import torch

from rolectl.roles.engines.model import KVCache, build_base_policy, scored_tokens
from rolectl.roles.engines.task import EOS, RESPONSE_TOKENS, ReverseDigitsTaskSet
from rolectl.roles.engines.tiny import TinyConfig, TinyRolloutEngine
from rolectl.roles.engines.tiny_generation import GenerationPool
from tests.support.pause import PauseAfter, changed_weights

ALLOWED = torch.tensor(RESPONSE_TOKENS)
PROMPTS = [(10, 3, 11), (10, 1, 2, 3, 4, 5, 6, 11), (10, 7, 7, 11), (13, 13, 10, 9, 8, 11), (10, 5, 11)]
CONFIG = TinyConfig(seed=0, task_length=8, group_size=2, tasks_per_step=8)  # responses of 1..9 tokens


def _policy(seed: int = 0):
    return build_base_policy(seed=seed, vocab_size=14, max_seq_len=24, d_model=32, n_layers=2, n_heads=4,
                             d_ff=64).eval().requires_grad_(False)


def _run(policy, prompts, *, seeds, max_new=8, temperature=1.0):
    pool = GenerationPool(policy, allowed_tokens=ALLOWED, stop_tokens=(EOS,), temperature=temperature)
    for index, (prompt, seed) in enumerate(zip(prompts, seeds)):
        pool.admit(index, prompt, max_new_tokens=max_new, seed=seed)
    rows, live = {}, []
    while pool.live:
        live.append(pool.live)
        rows.update({row.key: row for row in pool.step(version=0, weights_epoch=0)})
    return [rows[i] for i in range(len(prompts))], live, pool


def _scored(policy, prompt, response, temperature=1.0):
    tokens = torch.tensor([[*prompt, *response]])
    logprobs, _ = scored_tokens(policy, tokens, torch.tensor([len(prompt)]), width=len(response),
                                allowed_tokens=ALLOWED, temperature=temperature)
    return logprobs[0].tolist()


def test_the_cached_forward_is_the_full_forward():
    policy = _policy()
    tokens = torch.randint(0, 14, (3, 12), generator=torch.Generator().manual_seed(0))
    cache = KVCache(policy, 3)
    pieces = [policy.forward_cached(tokens[:, :5], cache)]
    pieces += [policy.forward_cached(tokens[:, i:i + 1], cache) for i in range(5, 12)]
    assert torch.allclose(torch.cat(pieces, dim=1), policy(tokens), atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_pool_logprobs_are_the_trainers_full_forward(temperature):
    policy = _policy()
    rows, _, _ = _run(policy, PROMPTS, seeds=range(len(PROMPTS)), temperature=temperature)
    assert any(len(row.tokens) > 1 for row in rows)
    for prompt, row in zip(PROMPTS, rows):
        # greedy rows carry their logprob at temperature 1, as the sampler always did
        expected = _scored(policy, prompt, row.tokens, temperature or 1.0)
        assert row.logprobs == pytest.approx(expected, abs=1e-5)
        assert row.stopped == (row.tokens[-1] == EOS) and (row.stopped or len(row.tokens) == 8)


def test_a_row_samples_the_same_alone_or_batched_with_others():
    policy = _policy()
    alone, _, _ = _run(policy, PROMPTS[1:2], seeds=[41])
    batched, _, _ = _run(policy, PROMPTS, seeds=[1, 41, 2, 3, 4])
    assert batched[1].tokens == alone[0].tokens
    assert batched[1].logprobs == pytest.approx(alone[0].logprobs, abs=1e-5)


def test_finished_rows_leave_the_batch_at_once():
    policy = _policy()
    rows, live, pool = _run(policy, PROMPTS, seeds=range(len(PROMPTS)))
    lengths = sorted(len(row.tokens) for row in rows)
    # one step per token of the longest row; at each step, the rows still generating are live
    assert live == [sum(n > step for n in lengths) for step in range(lengths[-1])]
    assert len(set(lengths)) > 1 and live[-1] < live[0]
    prompt_lengths = {len(p) for p in PROMPTS}
    assert pool.forwards == len(prompt_lengths) + lengths[-1] - 1  # a prefill per prompt length, then decodes


def test_new_weights_recompute_the_cache_and_score_later_tokens_with_them():
    policy, new = _policy(), _policy(seed=7)
    pool = GenerationPool(policy, allowed_tokens=ALLOWED, stop_tokens=(), temperature=1.0)  # no EOS: all go on
    for index, prompt in enumerate(PROMPTS):
        pool.admit(index, prompt, max_new_tokens=6, seed=index)
    for _ in range(2):
        pool.step(version=0, weights_epoch=0)
    old = {name: t.clone() for name, t in policy.state_dict().items()}
    policy.load_state_dict(new.state_dict())
    finished = list(pool.run_to_end(version=1, weights_epoch=1))
    policy.load_state_dict(old)
    for row in finished:
        assert row.versions == [0, 0, 1, 1, 1, 1]
        assert row.logprobs[:2] == pytest.approx(_scored(policy, row.prompt, row.tokens)[:2], abs=1e-5)
        assert row.logprobs[2:] == pytest.approx(_scored(new, row.prompt, row.tokens)[2:], abs=1e-5)


def _tasks(batch: int = 0):
    tasks = ReverseDigitsTaskSet(seed=batch, tasks_per_batch=CONFIG.tasks_per_step, length=CONFIG.task_length)
    return tasks.next_batch()


def test_rollout_is_deterministic_and_streaming_samples_the_same_rows():
    tasks = _tasks()
    first = TinyRolloutEngine(CONFIG, member="e").rollout(tasks, explore_step=3)
    assert first == TinyRolloutEngine(CONFIG, member="e").rollout(tasks, explore_step=3)
    assert first != TinyRolloutEngine(CONFIG, member="e").rollout(tasks, explore_step=4)
    assert [e.group for e in first[::CONFIG.group_size]] == [f"e-3-{i}" for i in range(len(tasks))]
    streaming = TinyRolloutEngine(CONFIG, member="e")
    streaming.admit(tasks[:2], explore_step=9)  # other rows in flight change nothing of a row's own
    streaming.admit(tasks, explore_step=3)
    collected = streaming.collect(len(tasks) + 2)
    same = sorted((e for e in collected if e.group.startswith("e-3-")), key=lambda e: e.id)
    assert [(e.id, e.response) for e in same] == sorted((e.id, e.response) for e in first)
    for streamed, alone in zip(same, sorted(first, key=lambda e: e.id)):  # the same up to float rounding
        assert streamed.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_collect_returns_whole_groups_earliest_finished_first_and_keeps_the_rest():
    engine = TinyRolloutEngine(CONFIG, member="e")
    tasks = _tasks()
    engine.admit(tasks, explore_step=2)  # (its groups finish after 5 to 9 tokens)
    assert engine.in_flight_groups() == len(tasks)
    finish_order = []
    for left in range(len(tasks) - 1, 1, -1):
        experiences = engine.collect(1)
        assert len(experiences) == CONFIG.group_size and len({e.group for e in experiences}) == 1
        assert [e.id for e in experiences] == [f"{experiences[0].group}-{k}" for k in range(CONFIG.group_size)]
        assert engine.in_flight_groups() == left
        # admitted together, a group finishes with its longest response; ties go in admission order
        finish_order.append((max(len(e.response) for e in experiences), int(experiences[0].group.split("-")[-1])))
    assert finish_order == sorted(finish_order) and len({n for n, _ in finish_order}) > 1
    engine.admit(_tasks(1), explore_step=1)  # the rest carries over beside the new step's groups
    rest = engine.collect(100)
    groups = [e.group for e in rest[::CONFIG.group_size]]
    assert len(rest) == CONFIG.group_size * (2 + len(tasks)) and len(set(groups)) == len(groups)
    assert engine.in_flight_groups() == 0 and engine.collect(3) == []
    engine.admit(tasks, explore_step=3)
    assert engine.collect(0) == [] and engine.abandon() == len(tasks) and engine.in_flight_groups() == 0
    assert engine.collect(1) == []


def test_a_row_straddling_a_weight_load_continues_with_the_new_weights():
    engine = TinyRolloutEngine(CONFIG, member="e")
    reference = TinyRolloutEngine(CONFIG, member="e")
    new_weights = changed_weights(engine)
    engine.admit(_tasks(), explore_step=3)  # (its first group finishes after 4 tokens, the others later)
    engine.collect(1, pause_point=PauseAfter(engine, new_weights, 1, after=10**9))  # no pause yet
    engine.load_weights(new_weights, 1)  # between two collects, as the streaming explorer does
    straddled = [e for e in engine.collect(100) if e.token_versions is not None]
    assert straddled and all(e.model_version == 0 and e.versions()[-1] == 1 for e in straddled)
    reference.load_weights(new_weights, 1)
    for experience in straddled:
        old = experience.versions().count(0)
        expected = _scored(reference.policy, experience.prompt, experience.response, CONFIG.temperature)
        assert experience.logprobs[old:] == pytest.approx(expected[old:], abs=1e-5)


def test_a_pause_inside_collect_loads_between_two_tokens():
    engine = TinyRolloutEngine(CONFIG, member="e")
    pause = PauseAfter(engine, changed_weights(engine), 4, after=1)
    engine.admit(_tasks(), explore_step=0)
    experiences = engine.collect(len(_tasks()), pause_point=pause)
    assert pause.loads == 1 and engine.version == 4
    assert {e.versions()[0] for e in experiences} == {0}
    assert any(e.versions()[1:] and set(e.versions()[1:]) == {4} for e in experiences)


def test_an_explorer_holding_the_wire_dtype_generates_in_it():
    """`transport.wire_dtype: bfloat16`: the rollout engine samples with bf16 weights, and its cache
    and logits are bf16 too (a float32 cache refused the bf16 keys)."""
    from rolectl.roles.config import parse_config
    from rolectl.roles.engines import make_rollout_engine, make_taskset

    cfg = parse_config({"job": "bf16", "model": {"engine": "tiny", "group_size": 4, "task_length": 2,
                                                 "long_task_length": 6, "long_task_fraction": 0.5},
                        "synchronizer": {"sync_method": "memory"}, "transport": {"wire_dtype": "bfloat16"}})
    engine = make_rollout_engine(cfg, "explorer-0")
    assert engine.policy.head.weight.dtype == torch.bfloat16
    tasks = make_taskset(cfg, seed=0, batch_size=3).next_batch()
    experiences = engine.rollout(tasks, explore_step=1)
    assert len(experiences) == 3 * 4 and all(len(e.logprobs) == len(e.response) > 0 for e in experiences)
    engine.admit(tasks, explore_step=2)
    assert len({e.group for e in engine.collect(2)}) == 2
