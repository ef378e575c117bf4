"""The `hf` engines on the tests' tiny random-init Qwen2 (and a GPT-2 build): build, generate, train, resume,
config; multi-turn episodes trained on the policy's own tokens only."""

from __future__ import annotations

import pytest
import torch

from rolectl.roles.config import parse_config
from rolectl.roles.engines import WeightsMismatch, make_rollout_engine, make_taskset, make_train_engine
from rolectl.roles.engines.hf import response_logprobs
from rolectl.roles.engines.hf_model import load_tokenizer
from rolectl.sync_protocol import ConfigError
from tests.support.tiny_llm import built_model, data_section, model_section
from tests.support.trajectories import assert_hf_trains_on_sampled_tokens_only


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return built_model(tmp_path_factory.mktemp("hf"))


@pytest.fixture
def job(model_dir):
    def make(rollout="hf", **model):
        return parse_config({"job": "hf-test", "model": model_section(model_dir, rollout_engine=rollout, **model),
                             "data": data_section(), "explorers": {"count": 2}})
    return make


def test_the_built_tokenizer_is_word_level_and_round_trips(model_dir):
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer("reverse 3 1 4 =")["input_ids"]
    assert len(ids) == 5
    assert tokenizer.decode(ids) == "reverse 3 1 4 ="
    assert tokenizer.decode([*ids[1:4], tokenizer.eos_token_id], skip_special_tokens=True) == "3 1 4"


def test_rollout_samples_groups_tagged_with_their_version_and_seeded(job):
    cfg = job()
    engine = make_rollout_engine(cfg, "explorer-0")
    tasks = make_taskset(cfg, seed=0, batch_size=3).next_batch()
    experiences = engine.rollout(tasks, explore_step=7)
    assert [e.id for e in experiences] == [f"explorer-0-7-{t}-{k}" for t in range(3) for k in range(4)]
    eos = engine.tokenizer.eos_token_id
    for e in experiences:
        assert e.model_version == 0 and len(e.logprobs) == len(e.response) > 0
        assert e.response[-1] == eos or len(e.response) == 5
        assert eos not in e.response[:-1]
        assert all(lp <= 0 for lp in e.logprobs) and 0 <= e.reward <= 1
    assert set(engine.rollout_metrics) == {"reward/positional_match", "reward/exact_match"}
    again = engine.rollout(tasks, explore_step=7)
    assert [(e.response, e.logprobs) for e in again] == [(e.response, e.logprobs) for e in experiences]
    other = engine.rollout(tasks, explore_step=8)
    assert [e.response for e in other] != [e.response for e in experiences]


def test_sampling_logprobs_match_the_trainers_forward(job):
    cfg = job()
    rollout, trainer = make_rollout_engine(cfg, "explorer-0"), make_train_engine(cfg)
    experiences = rollout.rollout(make_taskset(cfg, seed=1, batch_size=4).next_batch(), explore_step=1)
    with torch.no_grad():
        logprobs, mask = response_logprobs(trainer.model, [e.prompt for e in experiences],
                                           [e.response for e in experiences], pad_id=trainer.pad_id, device="cpu")
    for row, e in enumerate(experiences):
        assert logprobs[row, :len(e.response)].tolist() == pytest.approx(list(e.logprobs), abs=1e-5)
        assert int(mask[row].sum()) == len(e.response)


def test_a_train_step_moves_the_weights_and_reports_verl_metrics(job):
    cfg = job()
    rollout, trainer = make_rollout_engine(cfg, "explorer-0"), make_train_engine(cfg)
    before = trainer.weights()
    experiences = rollout.rollout(make_taskset(cfg, seed=0, batch_size=8).next_batch(), explore_step=1)
    metrics = trainer.train_step(experiences, current_version=0)
    assert trainer.step == 1
    assert {"loss", "reward_mean", "grad_norm", "pg_clipfrac", "ppo_kl", "model_parameters"} <= set(metrics)
    assert metrics["model_parameters"] == trainer.num_parameters == sum(p.numel() for p in trainer.model.parameters())
    after = trainer.weights()
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_weights_are_one_flat_map_on_both_sides_tied_head_included(job):
    cfg = job()
    trainer, rollout = make_train_engine(cfg), make_rollout_engine(cfg, "explorer-0")
    weights, buffers = trainer.weights(), rollout.weight_buffers()
    assert "lm_head.weight" in weights and "model.embed_tokens.weight" in weights
    assert {n: (t.shape, t.dtype) for n, t in weights.items()} == {n: (t.shape, t.dtype) for n, t in buffers.items()}
    weights = {n: t + 0.5 for n, t in weights.items()}
    rollout.load_weights(weights, 3)
    assert rollout.version == 3
    for name, tensor in rollout.weight_buffers().items():
        assert torch.equal(tensor, weights[name]), name


def test_mismatched_weights_are_refused_before_anything_is_copied(job):
    cfg = job()
    rollout = make_rollout_engine(cfg, "explorer-0")
    kept = {n: t.clone() for n, t in rollout.weight_buffers().items()}
    bad = {n: torch.zeros_like(t) for n, t in kept.items()}
    bad["model.norm.weight"] = torch.zeros(3)
    del bad["lm_head.weight"]
    bad["extra"] = torch.zeros(1)
    with pytest.raises(WeightsMismatch) as info:
        rollout.load_weights(bad, 1)
    assert all(s in str(info.value) for s in ("missing lm_head.weight", "unexpected extra", "model.norm.weight"))
    assert rollout.version == 0
    assert all(torch.equal(t, kept[n]) for n, t in rollout.weight_buffers().items())


def test_resume_from_a_checkpoint_is_bit_exact(job, tmp_path):
    cfg = job()
    rollout = make_rollout_engine(cfg, "explorer-0")
    taskset = make_taskset(cfg, seed=0, batch_size=6)
    batches = [rollout.rollout(taskset.next_batch(), explore_step=s) for s in (1, 2)]
    straight = make_train_engine(cfg)
    straight.train_step(batches[0], current_version=0)
    straight.save_checkpoint(tmp_path / "step-1")
    assert not any(p.suffix in (".pt", ".pkl", ".bin") for p in (tmp_path / "step-1").iterdir())
    straight.train_step(batches[1], current_version=1)
    resumed = make_train_engine(cfg)
    resumed.load_checkpoint(tmp_path / "step-1")
    assert resumed.step == 1
    resumed.train_step(batches[1], current_version=1)
    expected, got = straight.weights(), resumed.weights()
    assert all(torch.equal(expected[n], got[n]) for n in expected)


def test_every_engine_problem_is_reported_at_once(model_dir, tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_config({
            "job": "bad",
            "model": {"engine": "hf", "rollout_engine": "hf", "path": str(tmp_path / "nothing"), "dtype": "fp8",
                      "group_size": 1, "lr": 0, "build": {"family": "gpt5"}, "colour": "red"},
            "data": {"path": str(tmp_path / "none.jsonl"), "rewards": ["unknown_reward"]},
            "algorithm": {"advantage": "gae", "policy_loss": "made_up", "loss_agg_mode": "mean"},
        })
    paths = {path for path, _ in info.value.problems}
    assert paths >= {"model.dtype", "model.group_size", "model.lr", "model.build.family", "model.colour",
                     "data.path", "data.rewards[0]", "algorithm.advantage", "algorithm.policy_loss",
                     "algorithm.loss_agg_mode"}, paths
    with pytest.raises(ConfigError) as info:
        parse_config({"job": "bad", "model": {"engine": "hf", "rollout_engine": "nope", "path": str(model_dir)}})
    assert "model.rollout_engine" in {p for p, _ in info.value.problems}
    with pytest.raises(ConfigError) as info:
        parse_config({"job": "bad", "model": {"engine": "hf", "path": str(model_dir)}})
    assert {p for p, _ in info.value.problems} == {"data"}
    with pytest.raises(ConfigError) as info:
        parse_config({"job": "bad", "model": {"engine": "tiny"}, "data": data_section()})
    assert {p for p, _ in info.value.problems} == {"data"}


def test_an_explorers_load_leaves_the_trainers_losses_to_the_trainer(model_dir, tmp_path):
    """`rollout_only` (an explorer's load) checks its engines but not verl's names, which only a
    trainer reads: a bad policy loss is the trainer's refusal, and an explorer starts without
    importing verl (seconds of CPU at every start, for names it never uses)."""
    import subprocess
    import sys

    import yaml

    data = {"job": "roles", "model": model_section(model_dir), "data": data_section(),
            "algorithm": {"policy_loss": "made_up"}}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert {p for p, _ in info.value.problems} == {"algorithm.policy_loss"}
    assert parse_config(data, rollout_only=True).algorithm.policy_loss == "made_up"
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({**data, "algorithm": {"policy_loss": "vanilla"}}))
    loaded = subprocess.run([sys.executable, "-c", "import sys; from rolectl.roles.config import load_config; "
                             f"load_config({str(config)!r}, rollout_only=True); "
                             "print(sorted(m for m in sys.modules if m.startswith('verl')))"],
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", (loaded.stdout, loaded.stderr[-2000:])


def test_a_model_path_built_with_other_settings_is_refused(model_dir):
    from rolectl.roles.engines.hf_model import HFModelConfig, ensure_model
    from tests.support.tiny_llm import BUILD

    section = {k: v for k, v in model_section(model_dir).items() if k != "engine"}
    assert ensure_model(HFModelConfig.model_validate(section)) == model_dir  # same settings: reused
    other = HFModelConfig.model_validate({**section, "build": {**BUILD, "seed": 1}})
    with pytest.raises(ValueError, match="built with .* delete"):
        ensure_model(other)


def test_a_gpt2_build_has_absolute_positions_no_dropout_and_trains(tmp_path):
    """The quickstart's family: learned position embeddings, and no dropout (a train step's logprobs
    must be those the explorers sampled with: the first minibatch's ratio is exactly 1)."""
    build = {"family": "gpt2", "hidden_size": 64, "num_layers": 2, "num_heads": 2, "head_dim": 32,
             "intermediate_size": 128, "seed": 0}
    cfg = parse_config({"job": "gpt2", "model": model_section(tmp_path / "gpt2", build=build, minibatches=1),
                        "data": data_section(), "explorers": {"count": 1}})
    trainer = make_train_engine(cfg)
    assert type(trainer.model).__name__ == "GPT2LMHeadModel"
    assert "transformer.wpe.weight" in trainer.weights()
    assert all(getattr(m, "p", 0.0) == 0.0 for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout))
    rollout = make_rollout_engine(cfg, "explorer-0")
    experiences = rollout.rollout(make_taskset(cfg, seed=0, batch_size=2).next_batch(), explore_step=0)
    metrics = trainer.train_step(experiences, current_version=0)
    assert metrics["pg_clipfrac"] == 0.0 and abs(metrics["ppo_kl"]) < 1e-5, metrics
    rollout.load_weights(trainer.weights(), 1)
    assert rollout.version == 1


def test_a_gpt2_build_whose_heads_do_not_fill_its_width_is_refused(tmp_path):
    build = {"family": "gpt2", "hidden_size": 100, "num_heads": 4, "head_dim": 32}
    with pytest.raises(ConfigError) as info:
        parse_config({"job": "bad", "model": model_section(tmp_path / "m", build=build), "data": data_section()})
    assert any(path == "model.build" and "num_heads x head_dim" in why for path, why in info.value.problems), \
        info.value.problems


# -- multi-turn episodes: trained on the tokens the policy sampled only -----------------------------

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_hf_trainer_trains_on_the_sampled_tokens_of_multi_turn_episodes(model_dir, mode):
    cfg = parse_config({"job": "hf-test", "model": model_section(model_dir, minibatches=1), "data": data_section(),
                        "algorithm": {"loss_agg_mode": mode, "kl_coef": 0.05}})
    assert_hf_trains_on_sampled_tokens_only(make_train_engine(cfg))
