"""`model.lora` on the hf engines (peft): the section's validation, only the adapter trained and sent,
explorers holding the same adapter, resume, the peft-format export and the merged model; multi-turn
episodes trained on the policy's own tokens only."""

from __future__ import annotations

import json

import pytest
import torch

from rolectl.roles.config import parse_config
from rolectl.roles.engines import WeightsMismatch, make_rollout_engine, make_taskset, make_train_engine
from rolectl.roles.engines.hf import response_logprobs
from rolectl.sync_protocol import ConfigError
from tests.support.tiny_llm import built_model, data_section, model_section
from tests.support.trajectories import assert_hf_trains_on_sampled_tokens_only

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return built_model(tmp_path_factory.mktemp("lora"))


@pytest.fixture
def job(model_dir):
    def make(lora=None, rollout="hf", algorithm=None, **model):
        return parse_config({"job": "lora-test",
                             "model": model_section(model_dir, rollout_engine=rollout, lora=lora or LORA, **model),
                             "data": data_section(), "algorithm": algorithm or {}, "explorers": {"count": 1}})
    return make


def _problems(model_dir, lora, engine="hf") -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config({"job": "bad", "model": {**model_section(model_dir), "engine": engine, "lora": lora},
                      "data": data_section()})
    return dict(info.value.problems)


@pytest.mark.parametrize("lora,path,words", [
    ({"rank": 0}, "model.lora.rank", "> 0"),
    ({"rank": "8"}, "model.lora.rank", "integer"),
    ({"alpha": -1.0}, "model.lora.alpha", "> 0"),
    ({"dropout": 1.0}, "model.lora.dropout", "< 1"),
    ({"target_modules": []}, "model.lora.target_modules", "non-empty list"),
    ({"target_modules": "q_proj"}, "model.lora.target_modules", "all-linear or"),
    ({"merge_on_save": "yes"}, "model.lora.merge_on_save", "true or false"),
    ({"ranks": 8}, "model.lora.ranks", ""),
])
def test_a_bad_lora_section_names_the_field(model_dir, lora, path, words):
    problems = _problems(model_dir, lora)
    assert path in problems, problems
    assert words in problems[path], problems[path]


def test_an_unknown_target_module_is_named_when_the_engine_starts(job):
    with pytest.raises(ValueError, match=r"model.lora.target_modules \['nope_proj'\]"):
        make_train_engine(job(lora={"target_modules": ["nope_proj"]}))


def test_only_the_adapter_is_trained_and_sent(job):
    cfg = job()
    trainer, rollout = make_train_engine(cfg), make_rollout_engine(cfg, "explorer-0")
    sent = trainer.weights()
    # the adapter's names as peft saves them: A and B of each targeted module, nothing of the base
    assert sent and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in sent), sorted(sent)
    assert {n.split(".")[-3] for n in sent} == {"q_proj", "v_proj", "down_proj"}
    assert len(sent) == 2 * 3 * 2  # A and B, 3 modules, 2 layers
    assert sum(t.numel() for t in sent.values()) == trainer.trainable_parameters < trainer.num_parameters / 10
    assert [n for n, _ in (pair for bucket in trainer.iter_weight_buckets(1 << 10) for pair in bucket)] == list(sent)
    # both sides start from the same adapter (seeded A, zero B: the base model's outputs)
    assert sent.keys() == rollout.weight_buffers().keys()
    assert all(torch.equal(sent[n], rollout.weight_buffers()[n]) for n in sent)
    assert all(not t.any() for n, t in sent.items() if "lora_B" in n)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    batch = rollout.rollout(make_taskset(cfg, seed=0, batch_size=8).next_batch(), explore_step=1)
    metrics = trainer.train_step(batch, current_version=0)
    assert metrics["trainable_parameters"] == trainer.trainable_parameters
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)
    after = trainer.weights()
    assert any(not torch.equal(sent[n], after[n]) for n in sent if "lora_B" in n)


def test_the_hf_explorer_samples_with_the_received_adapter(job):
    cfg = job(lora={**LORA, "target_modules": "all-linear"})
    trainer, rollout = make_train_engine(cfg), make_rollout_engine(cfg, "explorer-0")
    taskset = make_taskset(cfg, seed=0, batch_size=8)
    for step in (1, 2):
        trainer.train_step(rollout.rollout(taskset.next_batch(), explore_step=step), current_version=0)
    sent = trainer.weights()
    rollout.load_weights(sent, 2)
    raw = {n: bytes(t.reshape(-1).view(torch.uint8).numpy()) for n, t in sent.items()}
    assert {n: bytes(t.detach().reshape(-1).view(torch.uint8).numpy())
            for n, t in rollout.weight_buffers().items()} == raw
    experiences = rollout.rollout(taskset.next_batch(), explore_step=3)
    with torch.no_grad():
        logprobs, _ = response_logprobs(trainer.model.eval(), [e.prompt for e in experiences],
                                        [e.response for e in experiences], pad_id=trainer.pad_id, device="cpu")
    for row, e in enumerate(experiences):
        assert logprobs[row, :len(e.response)].tolist() == pytest.approx(list(e.logprobs), abs=1e-5)


def test_full_model_weights_are_refused_by_a_lora_explorer(job):
    rollout = make_rollout_engine(job(), "explorer-0")
    with pytest.raises(WeightsMismatch, match="unexpected model.norm.weight"):
        rollout.load_weights({"model.norm.weight": torch.zeros(64)}, 1)
    assert rollout.version == 0


def test_resume_from_a_lora_checkpoint_is_bit_exact(job, tmp_path):
    cfg = job(algorithm={"kl_coef": 0.1})  # the KL anchor is the base model under the adapter
    rollout = make_rollout_engine(cfg, "explorer-0")
    taskset = make_taskset(cfg, seed=0, batch_size=6)
    batches = [rollout.rollout(taskset.next_batch(), explore_step=s) for s in (1, 2)]
    straight = make_train_engine(cfg)
    prompts, responses = [e.prompt for e in batches[0]], [e.response for e in batches[0]]
    with torch.no_grad():
        anchor, _ = response_logprobs(straight.reference, prompts, responses, pad_id=straight.pad_id, device="cpu")
        own, _ = response_logprobs(straight.model, prompts, responses, pad_id=straight.pad_id, device="cpu")
    assert torch.equal(anchor, own)  # B = 0: the adapter is the base model
    assert straight.train_step(batches[0], current_version=0)["kl_loss"] > 0  # and it moved away
    straight.save_checkpoint(tmp_path / "step-1")
    saved = set(straight.weights())
    straight.train_step(batches[1], current_version=1)
    resumed = make_train_engine(cfg)
    resumed.load_checkpoint(tmp_path / "step-1")
    resumed.train_step(batches[1], current_version=1)
    expected, got = straight.weights(), resumed.weights()
    assert set(expected) == saved and all(torch.equal(expected[n], got[n]) for n in expected)


def test_the_export_is_a_peft_adapter_and_a_merged_model(job, model_dir, tmp_path):
    import transformers
    from peft import PeftModel

    cfg = job(lora={**LORA, "merge_on_save": True})
    trainer, rollout = make_train_engine(cfg), make_rollout_engine(cfg, "explorer-0")
    taskset = make_taskset(cfg, seed=0, batch_size=8)
    trainer.train_step(rollout.rollout(taskset.next_batch(), explore_step=1), current_version=0)
    trainer.save_hf_model(tmp_path / "final")
    out = tmp_path / "final"
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    assert (out / "tokenizer.json").is_file() and (out / "merged" / "config.json").is_file()
    ids = torch.tensor([list(taskset.next_batch()[0].prompt)])
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        adapter = PeftModel.from_pretrained(base, out).eval()(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", local_files_only=True)
        merged_logits = merged.eval()(input_ids=ids).logits
    assert torch.equal(adapter, expected)
    assert torch.allclose(merged_logits, expected, atol=1e-5)
    assert not any(n.endswith(".lora_A.weight") for n in merged.state_dict())
    trainer.save_hf_model(tmp_path / "final")  # the same name again (a restart's export) replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_without_lora_the_hf_export_is_the_whole_model(model_dir, tmp_path):
    import transformers

    cfg = parse_config({"job": "full-export", "model": model_section(model_dir, rollout_engine="hf"),
                        "data": data_section(), "explorers": {"count": 1}})
    trainer = make_train_engine(cfg)
    trainer.save_hf_model(tmp_path / "final")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final", local_files_only=True)
    assert not (tmp_path / "final" / "adapter_config.json").exists()
    assert all(torch.equal(t, loaded.state_dict()[n]) for n, t in trainer.weights().items())


def test_a_lora_trainer_trains_on_the_sampled_tokens_of_multi_turn_episodes(job):
    assert_hf_trains_on_sampled_tokens_only(make_train_engine(job(minibatches=1, algorithm={"kl_coef": 0.05})))
