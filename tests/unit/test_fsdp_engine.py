"""The `fsdp` engine's config and registration, and the `hf` and `tiny` weight streams, in process (the
ranks' own tests, as processes, are tests/integration/test_fsdp_ranks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rolectl.roles.config_base import CHECK_ENGINES, validate_section
from rolectl.roles.engines import make_train_engine
from rolectl.roles.engines.sections import FSDPModelSection
from rolectl.roles.engines.streaming import buckets_of
from tests.support.tiny_llm import built_model, data_section, model_section


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp")
    built_model(root)
    return root


@pytest.mark.parametrize("engine", ["hf", "tiny"])
def test_hf_and_tiny_engines_stream_their_weights_in_buckets(engine, workdir):
    if engine == "hf":
        trainer = make_train_engine(parse_hf_job(workdir))
    else:
        trainer = make_train_engine({"engine": "tiny"})
    weights = trainer.weights()
    limit = max(t.numel() * t.element_size() for t in weights.values()) // 2
    buckets = list(trainer.iter_weight_buckets(limit))
    assert len(buckets) > 1
    streamed = [(name, tensor) for bucket in buckets for name, tensor in bucket]
    assert [n for n, _ in streamed] == list(weights)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in streamed)
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for _, t in bucket) <= limit


def parse_hf_job(workdir: Path):
    from rolectl.roles.config import parse_config

    return parse_config({"job": "stream", "model": model_section(workdir / "model"), "data": data_section()})


def test_buckets_are_cut_lazily_and_a_large_tensor_stands_alone():
    pulled = []

    def named():
        for index, numel in enumerate([4, 4, 16, 4]):
            pulled.append(index)
            yield f"t{index}", torch.zeros(numel)

    stream = buckets_of(named(), 40)
    assert [n for n, _ in next(stream)] == ["t0", "t1"] and pulled == [0, 1, 2]  # one tensor ahead, no more
    assert [n for n, _ in next(stream)] == ["t2"]
    assert [n for n, _ in next(stream)] == ["t3"]
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer"):
        next(buckets_of(named(), 0))


def test_fsdp_config_problems_are_reported_at_once_by_path(workdir):
    section = {**model_section(workdir / "model"), "engine": "fsdp", "dtype": "fp8",
               "fsdp": {"param_dtype": "fp8", "reshard_after_forward": "yes", "weight_bucket_bytes": 0, "shards": 2}}
    paths = {path for path, _ in fsdp_config_problems(section)}
    assert paths == {"model.dtype", "model.fsdp.param_dtype", "model.fsdp.reshard_after_forward",
                     "model.fsdp.weight_bucket_bytes", "model.fsdp.shards"}
    assert fsdp_config_problems({**model_section(workdir / "model"), "fsdp": {"param_dtype": "bfloat16"}}) == []


def test_an_fsdp_trainer_is_registered_and_pairs_with_hf_or_vllm_explorers(workdir):
    from rolectl.roles.config import parse_config
    from rolectl.roles.engines import engine_names
    from rolectl.sync_protocol import ConfigError

    def job(**model):
        return {"job": "fsdp", "model": {**model_section(workdir / "model"), "engine": "fsdp", **model},
                "data": data_section()}

    config = parse_config(job(fsdp={"param_dtype": "float32", "weight_bucket_bytes": 1 << 20}))
    assert engine_names(config.model) == {"trainer": "fsdp", "explorer": "fsdp"}  # explorers: the hf rollout
    parse_config(job(rollout_engine="hf", fsdp={"reshard_after_forward": False}))
    with pytest.raises(ConfigError) as info:
        parse_config(job(rollout_engine="hf", lr=0, fsdp={"param_dtype": "fp8"}))
    problems = info.value.problems
    assert sorted(path for path, _ in problems) == ["model.fsdp.param_dtype", "model.lr"]  # each once
    with pytest.raises(ConfigError) as info:
        parse_config({**job(), "model": {**job()["model"], "engine": "hf", "fsdp": {}}})
    assert [path for path, _ in info.value.problems] == ["model.fsdp"]  # only an fsdp trainer reads it


def fsdp_config_problems(values):
    """An `fsdp` `model:` section's problems, as a job loaded with its engines reports them."""
    return validate_section(FSDPModelSection, {**values, "engine": "fsdp"}, where="model", context=CHECK_ENGINES)[1]
