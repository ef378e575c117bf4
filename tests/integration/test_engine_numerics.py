"""The `hf` and `fsdp` (one rank) trainers' numerics: the same losses over 3 train steps on CPU and on
CUDA in fp32, and bf16 within a stated tolerance of fp32.

The CPU half runs everywhere (CI): one fsdp rank trains as the hf engine, and bf16 stays near fp32
on CPU too. The CUDA half needs a CUDA device and is skipped only when there is none; the GPU suite
(benchmarks/gpu_suite.py, GPU_TESTS) runs it. Each run builds its engine from the same tiny
random-init Qwen2 and trains it on the same seeded batches: 3 steps of 2 minibatches (6 AdamW
updates at the LLM quickstart's lr, 1e-3), micro-batches of 4.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_train_engine
from rolectl.roles.engines.hf import response_logprobs
from rolectl.roles.engines.hf_model import load_tokenizer
from rolectl.sync_protocol.experience import Experience
from tests.support.tiny_llm import built_model, data_section, model_section

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
ENGINES = ["hf", "fsdp"]
STEPS = 3
LR = 1e-3

# The same engine on the same device in fp32: one fsdp rank gathers, reduces (a sum over one rank)
# and copies exactly, so the hf engine's kernels run in the same order (measured: bit-identical).
SAME_DEVICE_RTOL = 1e-6
# fp32 on CUDA against fp32 on CPU: the kernels (cuBLAS and SDPA against CPU BLAS) sum in another
# order, so each logprob differs at fp32 rounding (~1e-7 relative); the loss is a mean of +-terms of
# order one that nearly cancel (group-normalised advantages), so it is compared absolutely too. AdamW
# turns a rounding difference into a step only where a gradient is itself at rounding level
# (its update is ~lr x gradient / eps there), so 6 updates keep the losses within 1e-4 relative,
# as two fsdp ranks against one hf process do on CPU (tests/unit/test_fsdp_engine.py). TF32 is off
# (torch's default, asserted below): it would round matmul inputs to 10 bits.
DEVICE_RTOL, DEVICE_ATOL = 1e-4, 1e-5
# bf16 against fp32, on the same device: bf16 keeps 8 significant bits (2^-8 = 0.0039 relative).
# The loss is a mean of -advantage x ratio terms of order one (unit-std advantages, ratios near 1),
# each computed from bf16 logits; the fsdp engine keeps fp32 master weights and reduces in fp32,
# the hf engine in bf16 holds bf16 weights and AdamW state. One bf16 rounding of each term bounds the
# mean's difference by ~0.004; 0.01 allows that from the logits and the 3 steps' slightly different
# weights (a ratio that crosses the clip range on one side only turns that token's gradient off).
# Measured on CPU: 0.9e-4 to 2e-4 for both engines (1.6e-3 at lr 3e-3).
BF16_ATOL = 1e-2


def _batches(model: Path) -> list[list[Experience]]:
    """3 batches of 4 groups of 4 responses: seeded prompts, responses and rewards, and the old
    logprobs of the version-0 model in fp32, as its explorers would have sampled them (the PPO ratios
    start at 1: few tokens sit on the clip range's edge)."""
    import transformers

    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        batch = []
        for group in range(4):
            prompt = tuple(torch.randint(4, vocab_size, (5,), generator=generator).tolist())
            for k in range(4):
                length = int(torch.randint(1, 6, (1,), generator=generator))
                batch.append(Experience(
                    id=f"e-{step}-{group}-{k}", group=f"e-{step}-{group}", prompt=prompt,
                    response=tuple(torch.randint(4, vocab_size, (length,), generator=generator).tolist()),
                    logprobs=(0.0,) * length, reward=float(torch.rand(1, generator=generator)),
                    model_version=0))
        out.append(batch)
    version_0 = transformers.AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32)
    pad_id = load_tokenizer(model).pad_token_id or 0
    with torch.no_grad():
        for index, batch in enumerate(out):
            logprobs, _ = response_logprobs(version_0, [e.prompt for e in batch], [e.response for e in batch],
                                            pad_id=pad_id, device="cpu")
            out[index] = [dataclasses.replace(e, logprobs=tuple(logprobs[row, :len(e.response)].tolist()))
                          for row, e in enumerate(batch)]
    return out


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    """`losses(engine, device, precision)`: the 3 steps' losses, each combination trained once."""
    model = built_model(tmp_path_factory.mktemp("numerics"))
    batches = _batches(model)
    done: dict[tuple[str, str, str], list[float]] = {}

    def train(engine: str, device: str, precision: str) -> list[float]:
        key = (engine, device, precision)
        if key not in done:
            done[key] = _train(model, batches, engine, device, precision)
        return done[key]

    return train


def _train(model, batches, engine: str, device: str, precision: str) -> list[float]:
    settings = model_section(model, engine=engine, device=device, group_size=4, minibatches=2, micro_batch_size=4,
                             lr=LR)
    if engine == "fsdp":
        # what the GPU suite's job trains with: fp32 master weights, bf16 compute, checkpointing
        settings.update(dtype="float32", fsdp={"param_dtype": precision},
                        gradient_checkpointing=precision == "bfloat16")
        # an existing process group would be joined, with its world size: this test owns one rank
        assert not torch.distributed.is_initialized()
    else:
        settings["dtype"] = precision
    trainer = make_train_engine(parse_config({"job": "numerics", "model": settings, "data": data_section()}))
    try:
        return [trainer.train_step(batch, current_version=step)["loss"] for step, batch in enumerate(batches)]
    finally:
        close = getattr(trainer, "close", None)
        if close is not None:
            close()


def test_one_fsdp_rank_trains_as_the_hf_engine_in_fp32_on_cpu(losses):
    hf, fsdp = losses("hf", "cpu", "float32"), losses("fsdp", "cpu", "float32")
    assert len(set(hf)) == STEPS  # each step trained on another batch with moved weights
    assert fsdp == pytest.approx(hf, rel=SAME_DEVICE_RTOL, abs=0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_stays_within_its_tolerance_of_fp32(losses, engine, device):
    fp32, bf16 = losses(engine, device, "float32"), losses(engine, device, "bfloat16")
    assert bf16 != fp32  # bf16 did compute: not the fp32 path again
    assert bf16 == pytest.approx(fp32, rel=0.0, abs=BF16_ATOL)


@CUDA
@pytest.mark.parametrize("engine", ENGINES)
def test_on_cuda_each_engine_gives_the_cpu_losses_in_fp32(losses, engine):
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmuls are not fp32: this comparison needs them off"
    cpu, cuda = losses(engine, "cpu", "float32"), losses(engine, "cuda", "float32")
    assert cuda == pytest.approx(cpu, rel=DEVICE_RTOL, abs=DEVICE_ATOL)
