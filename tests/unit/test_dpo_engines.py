"""DPO on the `hf` engine: its frozen reference is the starting weights (a frozen copy; under LoRA the
base with the adapter disabled, no copy), and DPO steps move the policy toward the chosen responses."""

from __future__ import annotations

import pytest
import torch

from rolectl.roles.engines.algorithms import AlgorithmConfig
from rolectl.roles.engines.dpo import DPOLoss, TokenPair, preference_batch
from rolectl.roles.engines.hf import AdapterDisabled, HFTrainEngine, response_logprobs
from rolectl.roles.engines.hf_model import HFModelConfig, load_model
from tests.support.tiny_llm import built_model, model_section

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return built_model(tmp_path_factory.mktemp("dpo-hf"))


def _engine(model_dir, **model) -> HFTrainEngine:
    settings = {**model_section(model_dir), "micro_batch_size": 4, "minibatches": 1, "lr": 1e-2, **model}
    settings.pop("engine")
    return HFTrainEngine(HFModelConfig.model_validate(settings), AlgorithmConfig(), model_path=model_dir,
                         keep_reference=True)


def _pairs(vocab_size: int, count: int = 6) -> list[TokenPair]:
    generator = torch.Generator().manual_seed(3)

    def tokens(length: int) -> tuple[int, ...]:
        return tuple(torch.randint(4, vocab_size, (length,), generator=generator).tolist())

    return [TokenPair(id=f"p{i}", prompt=tokens(4), chosen=tokens(3), rejected=tokens(2)) for i in range(count)]


def _logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logprobs, mask = response_logprobs(model, batch.prompts, batch.responses, pad_id=0, device="cpu")
    return (logprobs * mask).sum(-1)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_the_dpo_reference_is_the_starting_weights_and_stays_them(model_dir, lora):
    engine = _engine(model_dir, lora=lora)
    start = load_model(HFModelConfig.model_validate({"path": str(model_dir)}), model_dir).eval()
    if lora is None:
        assert isinstance(engine.reference, torch.nn.Module) and not any(
            p.requires_grad for p in engine.reference.parameters())
    else:  # the adapter switched off: the base model the adapter sits on, not a copy of it
        assert isinstance(engine.reference, AdapterDisabled) and engine.reference.model is engine.model
    batch = preference_batch(_pairs(engine.vocab_size))
    loss = DPOLoss(beta=0.5)
    first = engine.update.train_batch(batch, loss)
    for _ in range(5):
        last = engine.update.train_batch(batch, loss)
    assert first.metrics["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as the reference
    assert last.loss < first.loss and last.metrics["dpo/reward_margin"] > 0 and last.metrics["dpo/accuracy"] > 0.5
    reference, base, policy = (_logprobs(m, batch) for m in (engine.reference, start, engine.model))
    assert torch.allclose(reference, base, atol=1e-5)  # after training, still the starting weights
    assert not torch.allclose(policy, base, atol=1e-3)  # while the policy moved
    chosen = batch.chosen
    assert ((policy - base)[chosen] - (policy - base)[~chosen]).mean() > 0  # toward the chosen responses


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_dpo_stage_resumed_from_its_checkpoint_takes_the_same_next_step(model_dir, tmp_path, lora):
    """The reference is rebuilt from the starting weights, the policy and optimizer from the checkpoint."""
    straight = _engine(model_dir, lora=lora)
    batches = [preference_batch(_pairs(straight.vocab_size, 4)[i:i + 2]) for i in (0, 2)]
    straight.train_batch(batches[0], DPOLoss(beta=0.5))
    straight.save_checkpoint(tmp_path / "step-1")
    expected = straight.train_batch(batches[1], DPOLoss(beta=0.5))
    resumed = _engine(model_dir, lora=lora)
    resumed.load_checkpoint(tmp_path / "step-1")
    got = resumed.train_batch(batches[1], DPOLoss(beta=0.5))
    assert got == expected  # every figure, bit for bit
    assert all(torch.equal(t, resumed.weights()[n]) for n, t in straight.weights().items())


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_a_stage_started_from_another_jobs_checkpoint_takes_its_weights_as_the_reference(model_dir, tmp_path, lora):
    earlier = _engine(model_dir, lora=lora)
    batch = preference_batch(_pairs(earlier.vocab_size))
    for _ in range(3):
        earlier.train_batch(batch, DPOLoss(beta=0.5))
    earlier.save_checkpoint(tmp_path / "step-3")
    started = _engine(model_dir, lora=lora, init_from=str(tmp_path / "step-3"))
    assert not isinstance(started.reference, AdapterDisabled)  # a trained adapter is part of the start
    reference, start, base = (_logprobs(m, batch) for m in (started.reference, earlier.model, started.model))
    assert torch.allclose(reference, start, atol=1e-6) and torch.allclose(base, start, atol=1e-6)
    first = started.train_batch(batch, DPOLoss(beta=0.5))
    assert first["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-5)  # DPO starts at the checkpoint


def test_an_engine_keeps_no_reference_unless_a_loss_needs_one(model_dir):
    settings = {**model_section(model_dir)}
    settings.pop("engine")
    engine = HFTrainEngine(HFModelConfig.model_validate(settings), AlgorithmConfig(), model_path=model_dir)
    assert engine.reference is None
    with pytest.raises(ValueError, match="DPOLoss needs a frozen reference model"):
        engine.update.train_batch(preference_batch(_pairs(engine.vocab_size, 2)), DPOLoss(beta=0.1))
