"""vLLM tensor parallelism on CPU: an explorer's `tensor_parallel_size: 2` is one vLLM engine with two
worker processes, and weights arriving through each transport (object store on a real nats-server,
checkpoint files, a torch.distributed gloo broadcast) reach both workers: each worker's shard of every
tensor is bit-exact the matching slice of what was sent, and the engine samples with them."""

from __future__ import annotations

import asyncio

import nats
import pytest
import torch

from rolectl.bus.server import free_port
from rolectl.bus.weights.checkpoint import CheckpointTransport
from rolectl.bus.weights.object_store import ObjectStoreTransport
from rolectl.bus.weights.torch_dist import TorchDistTransport
from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_rollout_engine, make_taskset
from rolectl.roles.engines.hf import response_logprobs
from rolectl.roles.engines.vllm_engine import cpu_binding
from rolectl.sync_protocol import MemberRef, RankAssignment, RendezvousReady, Role, SyncMethod
from tests.support.tiny_llm import built_model, data_section, model_section

TP = 2
# starting vLLM's two worker processes (each imports vLLM and torch) takes minutes on a loaded 2-core host
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    model_dir = built_model(tmp_path_factory.mktemp("vllm-tp"))
    return parse_config({"job": "vllm-tp", "model": model_section(model_dir, rollout_engine="vllm",
                                                       # a small KV cache: two workers on a shared machine
                                                       vllm={"kv_cache_memory_bytes": 64 << 20}),
                         "data": data_section(), "explorers": {"count": 1, "tensor_parallel_size": TP}})


@pytest.fixture(scope="module")
def engine(cfg):
    return make_rollout_engine(cfg, "explorer-0")


def _shard_reader():
    """A function run in every vLLM worker (`collective_rpc`): each parallel layer's local weights.

    Linear layers are read through their own forward (`quant_method.apply` on an identity input,
    without the bias), since vLLM's CPU backend repacks linear weights into its GEMM's layout; a
    product with an identity matrix is exact in float32."""

    def read(worker) -> dict:
        import torch
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        out = {}
        with torch.no_grad():
            for name, module in worker.model_runner.model.named_modules():
                if isinstance(module, LinearBase):
                    eye = torch.eye(module.input_size_per_partition, dtype=torch.float32)
                    out[name + ".weight"] = module.quant_method.apply(module, eye, None).t().contiguous()
                    if getattr(module, "bias", None) is not None:
                        out[name + ".bias"] = module.bias.detach().clone()
                elif isinstance(module, VocabParallelEmbedding) or name.endswith("norm"):
                    out[name + ".weight"] = module.weight.detach().clone()
        return out

    return read


def _expected_shard(sent: dict[str, torch.Tensor], name: str, rank: int, local: torch.Tensor) -> torch.Tensor:
    """The slice of the sent HF tensors that vLLM's `load_weights` gives rank `rank` as `name`."""

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(TP, dim=dim)[rank]

    base, kind = name.rsplit(".", 1)
    if base.endswith("qkv_proj"):
        stem = base[: -len("qkv_proj")]
        return torch.cat([part(sent[f"{stem}{p}.{kind}"], 0) for p in ("q_proj", "k_proj", "v_proj")])
    if base.endswith("gate_up_proj"):
        stem = base[: -len("gate_up_proj")]
        return torch.cat([part(sent[f"{stem}{p}.{kind}"], 0) for p in ("gate_proj", "up_proj")])
    if base.endswith(("o_proj", "down_proj")):
        return part(sent[name], 1)
    if base.endswith(("embed_tokens", "lm_head")):  # vocabulary rows, padded to the shard size
        rows = local.shape[0]
        full = sent[name]
        got = full[rank * rows:(rank + 1) * rows]
        return torch.cat([got, local[got.shape[0]:]]) if got.shape[0] < rows else got
    return sent[name]  # norms: replicated


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _new_version(engine, seed: int) -> dict[str, torch.Tensor]:
    """The engine's weights moved by seeded noise: a version no worker holds yet."""
    gen = torch.Generator().manual_seed(seed)
    moved = {n: (t + 0.05 * torch.randn(t.shape, generator=gen, dtype=t.dtype)).contiguous()
             for n, t in engine.weight_buffers().items()}
    if engine.hf_config.tie_word_embeddings:  # one tensor in the trainer: sent twice, equal
        moved["lm_head.weight"] = moved["model.embed_tokens.weight"].clone()
    return moved


def test_cpu_binding_splits_the_cpus_and_refuses_too_few():
    assert cpu_binding(2, [3, 0, 1, 2]) == "0,1|2,3"
    assert cpu_binding(2, [0, 1]) == "0|1"
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs at least 2 CPUs"):
        cpu_binding(2, [0])


def test_one_engine_with_two_workers_each_holding_half_of_every_parallel_layer(engine):
    assert engine.worker_count() == TP
    shards = engine.llm.collective_rpc(_shard_reader())
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    sent = engine.weight_buffers()
    full_rows = sum(sent[f"model.layers.0.self_attn.{p}.weight"].shape[0] for p in ("q_proj", "k_proj", "v_proj"))
    assert [s[qkv].shape[0] for s in shards] == [full_rows // TP] * TP


async def _through(kind: str, sent: dict[str, torch.Tensor], version: int, engine, nats_url, job_name, tmp_path):
    """Move `sent` as `version` through transport `kind` into the engine, as the explorer does."""
    if kind == "torch_dist":
        me = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=0)
        ready = RendezvousReady.for_group(round=1, cause_seq=1, method=SyncMethod.NCCL, version=version, epoch=1,
                                          master_addr="127.0.0.1", master_port=free_port(),
                                          participants=(RankAssignment(member=me, rank_offset=1, ranks=1),))
        async with TorchDistTransport(timeout=30.0, connect_timeout=60.0) as trainer, \
                TorchDistTransport(timeout=30.0, connect_timeout=60.0) as explorer:
            await asyncio.gather(trainer.send(ready, sent), explorer.receive(ready, me, engine.weight_buffers()))
        engine.load_weights(engine.weight_buffers(), version)  # received in place: the explorer's reload
        return
    if kind == "memory":
        nc = await nats.connect(nats_url)
        transport = ObjectStoreTransport(nc, job_name, chunk_size=64 * 1024)
    else:
        nc, transport = None, CheckpointTransport(tmp_path / job_name, fsync=False)
    try:
        ref = await transport.publish(version, sent)
        engine.load_weights(await transport.fetch(ref), ref.version)
    finally:
        await transport.aclose()
        if nc is not None:
            await nc.close()


@pytest.mark.parametrize("kind", ["memory", "checkpoint", "torch_dist"])
async def test_weights_through_each_transport_reach_both_workers_bit_exact(cfg, engine, kind, nats_url, job_name,
                                                                          tmp_path):
    version = engine.version + 1
    sent = _new_version(engine, seed=version)
    await _through(kind, sent, version, engine, nats_url, job_name, tmp_path)
    assert engine.version == version
    shards = engine.llm.collective_rpc(_shard_reader())
    assert len(shards) == TP
    for rank, shard in enumerate(shards):
        assert any(n.endswith("qkv_proj.weight") for n in shard) and any(n.endswith("lm_head.weight") for n in shard)
        wrong = [n for n, local in shard.items() if _raw(local) != _raw(_expected_shard(sent, n, rank, local))]
        assert wrong == [], f"rank {rank}: {wrong}"

    # the engine samples with the new weights: its logprobs are those of the sent model's forward
    hf = make_rollout_engine(cfg.with_overrides(model=cfg.model.replace(rollout_engine="hf")), "explorer-1")
    hf.load_weights(sent, version)
    tasks = make_taskset(cfg, seed=1, batch_size=2).next_batch()
    experiences = engine.rollout(tasks, explore_step=version)
    assert all(e.model_version == version for e in experiences)
    with torch.no_grad():
        logprobs, _ = response_logprobs(hf.model, [e.prompt for e in experiences], [e.response for e in experiences],
                                        pad_id=engine.tokenizer.pad_token_id or 0, device="cpu")
    for i, e in enumerate(experiences):
        assert logprobs[i, :len(e.response)].tolist() == pytest.approx(list(e.logprobs), abs=1e-4)
