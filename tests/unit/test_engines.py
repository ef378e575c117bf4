"""The engine interfaces and the pure-PyTorch reference pair: weights, rollouts, GRPO, checkpoints, learning."""

from __future__ import annotations

import pytest
import torch

from rolectl.bus.experiences import Experience
from rolectl.roles.engines import (
    ReverseDigitsTaskSet,
    RolloutEngine,
    TaskSet,
    TinyConfig,
    TinyRolloutEngine,
    TinyTrainEngine,
    TrainEngine,
    WeightsMismatch,
    build_task_set,
    make_rollout_engine,
    make_taskset,
    make_train_engine,
    model_config_problems,
    score_response,
)
from rolectl.roles.engines.grpo import group_advantages
from rolectl.roles.engines.model import response_logprobs
from rolectl.roles.engines.task import BOS, EOS, RESPONSE_TOKENS, SEP, make_reverse_task

# Small enough that the whole file runs in seconds, big enough to learn (see `learned` below).
SMALL = TinyConfig(seed=0, task_length=2, group_size=8, tasks_per_step=32, minibatches=4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Like the roles (one core each): tiny ops are slower, not faster, with intra-op threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(config: TinyConfig, steps: int) -> tuple[TinyTrainEngine, TinyRolloutEngine, list[float]]:
    """On-policy loop: rollout with the latest weights, train, ship the weights back."""
    trainer = TinyTrainEngine(config)
    explorer = TinyRolloutEngine(config, member="e0", sampling_seed=1)
    tasks = build_task_set(config, seed=1)
    rewards = []
    for step in range(1, steps + 1):
        experiences = explorer.rollout(tasks.next_batch(), explore_step=step)
        rewards.append(trainer.train_step(experiences, current_version=trainer.step)["reward_mean"])
        explorer.load_weights(trainer.weights(), trainer.step)
    return trainer, explorer, rewards


@pytest.fixture(scope="module")
def learned() -> tuple[TinyTrainEngine, TinyRolloutEngine, list[float]]:
    return _train(SMALL, steps=40)


def problems_of(model: dict) -> dict[str, str]:
    return dict(model_config_problems(model))


def _mean_reward(experiences: list[Experience]) -> float:
    return sum(e.reward for e in experiences) / len(experiences)


def test_reference_engines_satisfy_the_protocols():
    assert isinstance(TinyTrainEngine(SMALL), TrainEngine)
    assert isinstance(TinyRolloutEngine(SMALL, member="e0"), RolloutEngine)
    assert isinstance(build_task_set(SMALL, seed=0), TaskSet)


def test_weights_match_weight_buffers_in_names_shapes_and_dtypes():
    shipped = TinyTrainEngine(SMALL).weights()
    buffers = TinyRolloutEngine(SMALL, member="e0").weight_buffers()
    assert shipped.keys() == buffers.keys()
    for name, tensor in shipped.items():
        assert (tensor.shape, tensor.dtype) == (buffers[name].shape, buffers[name].dtype), name
        assert tensor.is_contiguous() and not tensor.requires_grad


def test_trainer_and_explorer_start_from_identical_base_weights():
    shipped = TinyTrainEngine(SMALL).weights()
    buffers = TinyRolloutEngine(SMALL, member="e0").weight_buffers()
    assert all(torch.equal(shipped[name], buffers[name]) for name in shipped)


def test_weights_are_a_snapshot_not_a_view_of_the_training_parameters():
    trainer = TinyTrainEngine(SMALL)
    before = trainer.weights()
    explorer = TinyRolloutEngine(SMALL, member="e0")
    trainer.train_step(explorer.rollout(build_task_set(SMALL, seed=0).next_batch(), explore_step=1),
                       current_version=0)
    assert any(not torch.equal(before[n], t) for n, t in trainer.weights().items())
    assert all(torch.equal(before[n], t) for n, t in TinyTrainEngine(SMALL).weights().items())


def test_load_weights_copies_in_place_and_sets_the_version():
    explorer = TinyRolloutEngine(SMALL, member="e0")
    buffers = explorer.weight_buffers()
    pointers = {name: t.data_ptr() for name, t in buffers.items()}
    new = {name: torch.full_like(t, 0.5) for name, t in buffers.items()}
    explorer.load_weights(new, version=7)
    assert explorer.version == 7
    after = explorer.weight_buffers()
    assert {name: t.data_ptr() for name, t in after.items()} == pointers
    assert all(torch.equal(after[name], new[name]) for name in new)


def test_load_weights_of_its_own_buffers_only_sets_the_version():
    explorer = TinyRolloutEngine(SMALL, member="e0")
    explorer.load_weights(explorer.weight_buffers(), version=3)
    assert explorer.version == 3


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda w: w.pop("head.weight"), "missing head.weight"),
        (lambda w: w.update(extra=torch.zeros(1)), "unexpected extra"),
        (lambda w: w.update({"head.weight": torch.zeros(3, 3)}), "head.weight: got torch.float32 (3, 3)"),
        (lambda w: w.update({"head.weight": w["head.weight"].double()}), "head.weight: got torch.float64"),
    ],
    ids=["missing", "unexpected", "shape", "dtype"],
)
def test_load_weights_rejects_a_mismatch_before_copying_anything(damage, message):
    explorer = TinyRolloutEngine(SMALL, member="e0")
    before = {name: t.clone() for name, t in explorer.weight_buffers().items()}
    received = {name: torch.full_like(t, 0.5) for name, t in before.items()}
    damage(received)
    with pytest.raises(WeightsMismatch, match="e0: weights for version 5 .*kept version 0") as error:
        explorer.load_weights(received, version=5)
    assert message in str(error.value)
    assert explorer.version == 0
    assert all(torch.equal(before[n], t) for n, t in explorer.weight_buffers().items())


def test_rollout_tags_every_experience_with_version_ids_and_groups():
    explorer = TinyRolloutEngine(SMALL, member="explorer-1")
    explorer.load_weights(explorer.weight_buffers(), version=4)
    tasks = build_task_set(SMALL, seed=0).next_batch()[:3]
    experiences = explorer.rollout(tasks, explore_step=9)
    assert len(experiences) == 3 * SMALL.group_size
    assert [e.id for e in experiences[: SMALL.group_size + 1]] == [
        *(f"explorer-1-9-0-{k}" for k in range(SMALL.group_size)),
        "explorer-1-9-1-0",
    ]
    for e in experiences:
        assert e.model_version == 4
        assert e.group == e.id.rsplit("-", 1)[0]
        assert 1 <= len(e.response) <= SMALL.max_response_length
        assert len(e.logprobs) == len(e.response) and all(lp <= 0.0 for lp in e.logprobs)
        assert set(e.response) <= set(RESPONSE_TOKENS)
        assert e.reward == score_response(e.response, tasks[int(e.group.rsplit("-", 1)[1])].target)


def test_same_weights_and_seed_give_identical_rollouts(learned):
    trainer, _, _ = learned
    tasks = build_task_set(SMALL, seed=5).next_batch()
    runs = []
    for _ in range(2):
        explorer = TinyRolloutEngine(SMALL, member="e0", sampling_seed=11)
        explorer.load_weights(trainer.weights(), trainer.step)
        runs.append(explorer.rollout(tasks, explore_step=3))
    assert runs[0] == runs[1]
    other_step = TinyRolloutEngine(SMALL, member="e0", sampling_seed=11).rollout(tasks, explore_step=4)
    assert [e.response for e in other_step] != [e.response for e in runs[0]]


def test_explorer_samples_with_the_weights_it_was_sent(learned):
    trainer, _, _ = learned
    tasks = build_task_set(SMALL, seed=5).next_batch()
    base = TinyRolloutEngine(SMALL, member="e0", sampling_seed=11)
    synced = TinyRolloutEngine(SMALL, member="e0", sampling_seed=11)
    synced.load_weights(trainer.weights(), trainer.step)
    assert _mean_reward(synced.rollout(tasks, explore_step=1)) > _mean_reward(base.rollout(tasks, explore_step=1)) + 0.3


@pytest.mark.parametrize(
    ("response", "target", "reward"),
    [
        ((3, 2, 1, EOS), (3, 2, 1), 1.0),
        ((3, 2, 1), (3, 2, 1), 1.0),  # ran out of tokens before EOS: still an exact answer
        ((3, 9, 1, EOS), (3, 2, 1), 2 / 3),
        ((3, 2, EOS), (3, 2, 1), 2 / 3),  # too short
        ((3, 2, 1, 0, EOS), (3, 2, 1), 3 / 4),  # too long: extra digits cost credit
        ((3, 2, 1, EOS, 7), (3, 2, 1), 1.0),  # anything after EOS is ignored
        ((EOS,), (3, 2, 1), 0.0),
        ((), (3, 2, 1), 0.0),
        ((1, 2, 3, EOS), (3, 2, 1), 1 / 3),
    ],
    ids=["exact", "exact-no-eos", "partial", "short", "long", "after-eos", "empty-eos", "empty", "unreversed"],
)
def test_score_response(response, target, reward):
    assert score_response(response, target) == pytest.approx(reward)


def test_group_advantages_are_normalised_within_groups_and_zero_without_signal():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.9])
    advantages = group_advantages(rewards, ["a", "a", "b", "b", "c"])
    assert advantages[0] == pytest.approx(1.0, abs=1e-4) and advantages[1] == pytest.approx(-1.0, abs=1e-4)
    assert advantages[2:].tolist() == [0.0, 0.0, 0.0]


def test_train_step_raises_the_logprob_of_the_better_response():
    engine = TinyTrainEngine(SMALL)
    task = make_reverse_task("t", [3, 7])
    good, bad = (7, 3, EOS), (1, 1, EOS)
    prompts = torch.tensor([task.prompt, task.prompt])
    responses = torch.tensor([good, bad])

    def logprobs() -> torch.Tensor:
        with torch.no_grad():
            return response_logprobs(engine.policy, prompts, responses,
                                     allowed_tokens=torch.tensor(RESPONSE_TOKENS), temperature=1.0)

    old = logprobs()
    experiences = [
        Experience(id=f"x-{k}", group="x", prompt=task.prompt, response=response,
                   logprobs=tuple(old[k].tolist()), reward=score_response(response, task.target), model_version=0)
        for k, response in enumerate((good, bad))
    ]
    engine.train_step(experiences, current_version=0)
    new = logprobs()
    assert new[0].sum() > old[0].sum()
    assert new[1].sum() < old[1].sum()


def test_train_step_reports_metrics_and_counts_steps():
    engine = TinyTrainEngine(SMALL)
    explorer = TinyRolloutEngine(SMALL, member="e0")
    metrics = engine.train_step(explorer.rollout(build_task_set(SMALL, seed=0).next_batch(), explore_step=1),
                                current_version=2)
    assert engine.step == 1
    assert {"loss", "reward_mean", "clip_fraction", "approx_kl", "grad_norm"} <= metrics.keys()
    assert metrics["staleness_mean"] == 2.0  # sampled with version 0, trainer at 2


def test_checkpoint_round_trip_restores_weights_optimizer_step_and_next_step(tmp_path):
    explorer = TinyRolloutEngine(SMALL, member="e0")
    tasks = build_task_set(SMALL, seed=0)
    original = TinyTrainEngine(SMALL)
    for step in (1, 2):
        original.train_step(explorer.rollout(tasks.next_batch(), explore_step=step), current_version=original.step)
    original.save_checkpoint(tmp_path / "ckpt")

    restored = TinyTrainEngine(SMALL)
    restored.load_checkpoint(tmp_path / "ckpt")
    assert restored.step == 2
    assert all(torch.equal(t, restored.weights()[n]) for n, t in original.weights().items())
    original_state, restored_state = original.optimizer.state_dict(), restored.optimizer.state_dict()
    assert original_state["param_groups"] == restored_state["param_groups"]
    for index, state in original_state["state"].items():
        for key, value in state.items():
            assert torch.equal(value, restored_state["state"][index][key]), (index, key)

    batch = explorer.rollout(tasks.next_batch(), explore_step=3)
    assert original.train_step(batch, current_version=2) == restored.train_step(batch, current_version=2)
    assert all(torch.equal(t, restored.weights()[n]) for n, t in original.weights().items())


def test_checkpoint_of_a_different_model_is_rejected(tmp_path):
    TinyTrainEngine(SMALL).save_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="different d_model"):
        TinyTrainEngine(SMALL.replace(d_model=32)).load_checkpoint(tmp_path)


def test_task_set_is_deterministic_resumable_and_finite():
    first = ReverseDigitsTaskSet(seed=3, tasks_per_batch=4, length=5, num_batches=3)
    batches = [first.next_batch() for _ in range(3)]
    assert first.next_batch() is None
    resumed = ReverseDigitsTaskSet(seed=3, tasks_per_batch=4, length=5, num_batches=3)
    state = {"seed": 3, "next_index": 1}
    resumed.load_state_dict(state)
    assert resumed.next_batch() == batches[1]
    assert batches[0] != batches[1]
    assert all(task.target == tuple(reversed(task.prompt[1:-1])) for task in batches[0])
    with pytest.raises(ValueError, match="seed"):
        ReverseDigitsTaskSet(seed=4, tasks_per_batch=4, length=5).load_state_dict(first.state_dict())


def test_long_tasks_draw_long_tailed_lengths_each_with_its_own_unpadded_prompt():
    tasks = ReverseDigitsTaskSet(seed=3, tasks_per_batch=200, length=2, long_length=20, long_fraction=0.1)
    batch = tasks.next_batch()
    long = [task for task in batch if len(task.target) == 20]
    assert 5 <= len(long) <= 40 and all(len(task.target) in (2, 20) for task in batch)  # about a tenth long
    assert {len(task.prompt) for task in batch} == {4, 22}  # rows of any prompt length: no padding
    short = next(task for task in batch if len(task.target) == 2)
    assert short.prompt == (BOS, *reversed(short.target), SEP)
    # without long tasks the stream is the one it always was
    assert ReverseDigitsTaskSet(seed=3, tasks_per_batch=4, length=5, long_length=20).next_batch() == \
        ReverseDigitsTaskSet(seed=3, tasks_per_batch=4, length=5).next_batch()
    with pytest.raises(ValueError, match="long_length more than length"):
        ReverseDigitsTaskSet(seed=3, tasks_per_batch=4, length=5, long_length=5, long_fraction=0.1)


def test_the_model_section_sizes_the_policy_for_its_long_tasks():
    config = SMALL.replace(long_task_length=12, long_task_fraction=0.25, tasks_per_step=8)
    assert (config.prompt_length, config.max_response_length) == (14, 13)
    assert problems_of({"long_task_fraction": 0.1}) == {"model": "long_task_fraction 0.1 needs long_task_length "
                                                        "more than task_length (4), got None"}
    explorer, trainer = TinyRolloutEngine(config, member="e0"), TinyTrainEngine(config)
    tasks = build_task_set(config, seed=2)
    experiences = explorer.rollout(tasks.next_batch(), explore_step=1)
    assert max(len(e.response) for e in experiences) <= 13
    trainer.train_step(experiences, current_version=0)  # the trainer takes the padded prompts


def test_a_short_run_learns(learned):
    _, _, rewards = learned
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.3, (first, last)


def test_model_config_problems_lists_every_problem():
    # every problem at once: a bad type does not hide a broken constraint (d_model % n_heads)
    problems = dict(model_config_problems({"lr": "fast", "d_model": 30, "wings": 2}))
    assert problems.keys() == {"model.lr", "model.wings", "model.d_model"}
    problems = dict(model_config_problems({"d_model": 30, "group_size": 1}))
    assert problems.keys() == {"model.d_model", "model.group_size"}
    assert model_config_problems({"engine": "tiny", "lr": 0.001}) == []


def test_the_tiny_engine_refuses_data_naming_the_lightest_engine_that_reads_it(tmp_path):
    from rolectl.roles.config import parse_config
    from rolectl.sync_protocol import ConfigError

    (tmp_path / "tasks.jsonl").write_text('{"prompt": "2 + 2 =", "answer": "4"}\n')
    with pytest.raises(ConfigError) as caught:
        parse_config({"job": "j", "model": {"engine": "tiny"}, "data": {"path": str(tmp_path / "tasks.jsonl")}})
    said = dict(caught.value.problems)["data"]
    for fragment in ("reads no text", "engine: hf", "build: {family: gpt2}", "no download, runs on CPU",
                     "pip install -e '.[verl]'", "`.[hf]` alone is not enough", "examples/own_model.yaml"):
        assert fragment in said, said


def test_the_hf_engine_without_verl_asks_for_it(tmp_path):
    """What the tiny engine's refusal says: `.[hf]` alone (no verl) cannot train; the job says so."""
    import subprocess
    import sys

    (tmp_path / "tasks.jsonl").write_text('{"prompt": "2 + 2 =", "answer": "4"}\n')
    job = {"job": "j", "model": {"engine": "hf", "path": str(tmp_path / "m"), "build": {"family": "gpt2"}},
           "data": {"path": str(tmp_path / "tasks.jsonl")}}
    code = ("import sys; sys.modules['verl'] = None  # as if not installed\n"
            "from rolectl.roles.config import parse_config\n"
            "from rolectl.sync_protocol import ConfigError\n"
            f"try:\n    parse_config({job!r})\n"
            "except ConfigError as exc:\n    print(dict(exc.problems)['algorithm'])\n")
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout
    assert "verl's core_algos do not import" in said and "pip install -e '.[verl]'" in said, said


def test_factories_build_engines_from_the_model_section():
    model = {"engine": "tiny", "task_length": 3, "group_size": 4}
    assert make_train_engine(model).group_size == 4
    explorers = [make_rollout_engine(model, f"explorer-{i}") for i in range(2)]
    assert explorers[0].sampling_seed != explorers[1].sampling_seed
    assert make_rollout_engine(model, "explorer-0").sampling_seed == explorers[0].sampling_seed
    tasks = make_taskset(model, seed=1, total_batches=1, batch_size=5)
    batch = tasks.next_batch()
    assert len(batch) == 5 and len(batch[0].target) == 3 and tasks.next_batch() is None
    with pytest.raises(ValueError, match="model.group_size"):
        make_train_engine({"group_size": 1})


def test_an_engine_of_another_package_reads_and_checks_its_own_sections(monkeypatch):
    """An entry-point engine's `model:` keeps the keys only it knows, its `data:` is its own shape,
    and its `EngineSpec.problems` reports on them by path, once, as the job loads."""
    import rolectl.roles.engines as registry
    from rolectl.roles.config import parse_config
    from rolectl.roles.engines import EngineSpec
    from rolectl.sync_protocol import ConfigError

    checked = []

    def problems(sections):
        checked.append(sections)
        return [] if sections.model.width == 3 else [("model.width", f"must be 3, got {sections.model.width!r}")]

    spec = EngineSpec(name="echo", problems=problems, train=lambda s: None, rollout=lambda s, member: None)
    monkeypatch.setitem(registry._BUILTIN, "echo", spec)
    cfg = parse_config({"job": "j", "model": {"engine": "echo", "width": 3}, "data": {"dataset": "hub/x"}})
    assert (cfg.model.width, cfg.data.dataset, len(checked)) == (3, "hub/x", 1)
    with pytest.raises(ConfigError) as info:
        parse_config({"job": "j", "model": {"engine": "echo", "width": 2}})
    assert info.value.problems == [("model.width", "must be 3, got 2")]
