"""The `fsdp` engine on CPU, its ranks real processes started by the trainer's own rank launcher: 2 ranks
(gloo) train as one `hf` process, stream their weights, checkpoint 2 -> 1 with DCP and export a Hugging
Face model, with and without a LoRA adapter; on multi-turn episodes, they give one process's loss; and
DPO (a frozen sharded reference) as one `hf` process."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rolectl.roles.engines.algorithms import AlgorithmConfig
from rolectl.roles.engines.hf import HFTrainEngine
from rolectl.roles.engines.hf_model import HFModelConfig
from tests.support import fsdp_ranks
from tests.support.fsdp_ranks import ROUNDING
from tests.support.fsdp_ranks import assert_close as _assert_close
from tests.support.fsdp_ranks import assert_same_training as _assert_same_training
from tests.support.tiny_llm import built_model, model_section
from tests.support.trajectories import multi_turn_episodes


def _experiences(vocab_size: int, *, batches: int = 4, groups: int = 3, group_size: int = 3) -> list[list[dict]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for step in range(batches):
        batch = []
        for g in range(groups):
            prompt = torch.randint(4, vocab_size, (4,), generator=generator).tolist()
            for k in range(group_size):
                length = int(torch.randint(1, 6, (1,), generator=generator))
                response = torch.randint(4, vocab_size, (length,), generator=generator).tolist()
                batch.append({"id": f"e-{step}-{g}-{k}", "group": f"e-{step}-{g}", "prompt": prompt,
                              "response": response, "logprobs": [-2.9] * length,
                              "reward": float(torch.rand(1, generator=generator)), "model_version": step})
        out.append(batch)
    return out


def _pairs(vocab_size: int, *, batches: int = 4, pairs: int = 8) -> list[list[dict]]:
    """Preference pairs of random tokens: `pairs` per batch, an even number per minibatch of 2."""
    generator = torch.Generator().manual_seed(2)

    def tokens(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(4, vocab_size, (length,), generator=generator).tolist()

    return [[{"id": f"p-{step}-{i}", "prompt": tokens(2, 6), "chosen": tokens(1, 6), "rejected": tokens(1, 6)}
             for i in range(pairs)] for step in range(batches)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp")
    model = built_model(root)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    (root / "experiences.json").write_text(json.dumps(_experiences(vocab_size)))
    (root / "pairs.json").write_text(json.dumps(_pairs(vocab_size)))
    return root


@pytest.fixture(scope="module")
def two_ranks(workdir) -> list[dict]:
    return fsdp_ranks.run_ranks("train", workdir, 2)


@pytest.fixture(scope="module")
def hf_run(workdir) -> dict:
    """The same 4 steps by the one-process `hf` engine (micro-batches of 4 rows, not 1)."""
    settings = {**model_section(workdir / "model"), "group_size": 3, "minibatches": 2, "micro_batch_size": 4}
    settings.pop("engine")
    engine = HFTrainEngine(HFModelConfig.model_validate(settings), AlgorithmConfig(**fsdp_ranks.ALGORITHM),
                           model_path=workdir / "model")
    batches = fsdp_ranks.load_batches(workdir)
    initial = engine.weights()
    metrics = [engine.train_step(batch, current_version=step) for step, batch in enumerate(batches[:3])]
    after_3 = engine.weights()
    metrics.append(engine.train_step(batches[3], current_version=3))
    return {"initial": initial, "metrics": metrics, "weights_3": after_3, "weights_4": engine.weights()}


@pytest.fixture(scope="module")
def lora_ranks(workdir) -> list[dict]:
    return fsdp_ranks.run_ranks("lora-train", workdir, 2)


@pytest.fixture(scope="module")
def hf_lora_run(workdir) -> dict:
    """The same 3 steps under the same `model.lora` by the one-process `hf` engine."""
    settings = {**model_section(workdir / "model"), "group_size": 3, "minibatches": 2, "micro_batch_size": 4,
                "lora": fsdp_ranks.LORA}
    settings.pop("engine")
    engine = HFTrainEngine(HFModelConfig.model_validate(settings), AlgorithmConfig(**fsdp_ranks.ALGORITHM),
                           model_path=workdir / "model")
    initial = engine.weights()
    metrics = [engine.train_step(batch, current_version=step)
               for step, batch in enumerate(fsdp_ranks.load_batches(workdir)[:3])]
    return {"initial": initial, "metrics": metrics, "weights_3": engine.weights()}


def test_two_fsdp_ranks_train_as_one_hf_process(workdir, two_ranks, hf_run):
    fsdp_weights = load_file(workdir / "train" / "weights-3.safetensors")
    assert any(not torch.equal(fsdp_weights[n], t) for n, t in hf_run["initial"].items())  # training moved them
    _assert_same_training(fsdp_weights, hf_run["weights_3"], hf_run["initial"])
    for rank in two_ranks:  # every rank reports the whole batch's metrics
        assert rank["world_size"] == 2
        losses = [m["loss"] for m in rank["metrics"]]
        assert losses == pytest.approx([m["loss"] for m in hf_run["metrics"][:3]], rel=1e-4, abs=1e-6)
        grad_norms = [m["grad_norm"] for m in rank["metrics"]]
        assert grad_norms == pytest.approx([m["grad_norm"] for m in hf_run["metrics"][:3]], rel=1e-4)
        # verl's per-micro-batch statistics are averaged over micro-batches, whose size differs here
        assert all(0 <= m["pg_clipfrac"] <= 1 for m in rank["metrics"])
        assert rank["metrics"][2]["kl_loss"] > 0  # the frozen reference is the version-0 model
    _assert_same_training(load_file(workdir / "train" / "weights-4.safetensors"), hf_run["weights_4"],
                          hf_run["initial"])


def test_the_weight_stream_gathers_bucket_by_bucket_into_rank_0_only(workdir, two_ranks, hf_run):
    rank0, rank1 = two_ranks[0]["buckets"], two_ranks[1]["buckets"]
    assert len(rank0) == len(rank1) > 1 and all(bucket == [] for bucket in rank1)
    expected = hf_run["weights_3"]
    assert [name for bucket in rank0 for name, _ in bucket] == list(expected)  # every name once, in order
    for bucket in rank0:
        sizes = [torch.Size(shape).numel() * 4 for _, shape in bucket]
        assert len(bucket) == 1 or sum(sizes) <= fsdp_ranks.BUCKET_BYTES, bucket
        assert all(tuple(shape) == tuple(expected[name].shape) for name, shape in bucket)


def test_a_checkpoint_written_by_two_ranks_resumes_on_one(workdir, two_ranks):
    (report,) = fsdp_ranks.run_ranks("resume", workdir, 1)
    assert report["step_after_load"] == 3
    assert report["snapshot_unchanged"]  # one rank: the stream copies rather than hands out live shards
    assert report["extra"] == {"data_position": 3, "trained": ["a", "b"]}
    saved, loaded = (load_file(workdir / run / "weights-3.safetensors") for run in ("train", "resume"))
    _assert_close(loaded, saved, atol=0.0)
    # The optimizer's moments came back too: the next step is the 2-rank trainer's 4th step.
    _assert_close(load_file(workdir / "resume" / "weights-4.safetensors"),
                  load_file(workdir / "train" / "weights-4.safetensors"), atol=ROUNDING)
    assert report["metrics_4"]["loss"] == pytest.approx(two_ranks[0]["metrics_4"]["loss"], rel=1e-4, abs=1e-6)


def test_the_hugging_face_export_loads_and_gives_the_engines_logits(workdir, two_ranks):
    import transformers

    export = workdir / "hf"
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= {p.name for p in export.iterdir()}
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in export.iterdir())
    model = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True, dtype=torch.float32)
    _assert_close(dict(model.state_dict()), load_file(workdir / "train" / "weights-3.safetensors"), atol=0.0)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(fsdp_ranks.PROBE)).logits.float()
    expected = load_file(workdir / "train" / "logits.safetensors")["logits"]
    assert float((logits - expected).abs().max()) <= 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert tokenizer.eos_token == "<eos>"


def test_two_fsdp_ranks_train_a_lora_adapter_as_one_hf_process(workdir, lora_ranks, hf_lora_run):
    adapter = load_file(workdir / "lora-train" / "weights-3.safetensors")
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)  # the adapter alone moves
    assert any(not torch.equal(adapter[n], t) for n, t in hf_lora_run["initial"].items())
    _assert_close(adapter, hf_lora_run["weights_3"], atol=ROUNDING)  # same names, same seeded start, same steps
    for rank in lora_ranks:
        losses = [m["loss"] for m in rank["metrics"]]
        assert losses == pytest.approx([m["loss"] for m in hf_lora_run["metrics"]], rel=1e-4, abs=1e-6)
        assert rank["metrics"][2]["kl_loss"] > 0  # the anchor is the base with the adapter disabled
        trainable = rank["metrics"][0]["trainable_parameters"]
        assert 0 < trainable == hf_lora_run["metrics"][0]["trainable_parameters"] < rank["metrics"][0][
            "model_parameters"]


def test_a_lora_checkpoint_holds_the_adapter_only_and_resumes_on_one_rank(workdir, lora_ranks):
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(workdir / "lora-ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys  # the frozen base is reloaded
    (report,) = fsdp_ranks.run_ranks("lora-resume", workdir, 1)
    assert report["step_after_load"] == 3
    _assert_close(load_file(workdir / "lora-resume" / "weights-3.safetensors"),
                  load_file(workdir / "lora-train" / "weights-3.safetensors"), atol=0.0)
    _assert_close(load_file(workdir / "lora-resume" / "weights-4.safetensors"),
                  load_file(workdir / "lora-train" / "weights-4.safetensors"), atol=ROUNDING)


def test_the_lora_export_is_a_peft_adapter_and_a_merged_model(workdir, lora_ranks):
    import transformers
    from peft import PeftModel

    export = workdir / "lora-hf"
    assert json.loads((export / "adapter_config.json").read_text())["r"] == fsdp_ranks.LORA["rank"]
    adapter = load_file(export / "adapter_model.safetensors")
    _assert_close(adapter, load_file(workdir / "lora-train" / "weights-3.safetensors"), atol=0.0)
    base = transformers.AutoModelForCausalLM.from_pretrained(workdir / "model", local_files_only=True)
    probe = torch.tensor(fsdp_ranks.PROBE)
    expected = load_file(workdir / "lora-train" / "logits.safetensors")["logits"]
    with torch.no_grad():
        with_adapter = PeftModel.from_pretrained(base, export).eval()(input_ids=probe).logits.float()
        merged = transformers.AutoModelForCausalLM.from_pretrained(export / "merged", local_files_only=True)
        merged_logits = merged.eval()(input_ids=probe).logits.float()
    assert float((with_adapter - expected).abs().max()) <= 1e-5
    assert float((merged_logits - expected).abs().max()) <= 1e-4
    assert not any("lora_" in n for n in merged.state_dict())


@pytest.fixture(scope="module")
def dpo_ranks(workdir) -> list[dict]:
    return fsdp_ranks.run_ranks("dpo-train", workdir, 2)


@pytest.fixture(scope="module")
def hf_dpo_run(workdir) -> dict:
    """The same 4 DPO steps by the one-process `hf` engine (micro-batches of 2 pairs, not 1)."""
    settings = {**model_section(workdir / "model"), "group_size": 3, "minibatches": 2, "micro_batch_size": 4}
    settings.pop("engine")
    engine = HFTrainEngine(HFModelConfig.model_validate(settings), AlgorithmConfig(), model_path=workdir / "model",
                           keep_reference=True)
    batches = fsdp_ranks.load_pair_batches(workdir)
    initial = engine.weights()
    metrics = [fsdp_ranks.dpo_step(engine, batch) for batch in batches[:3]]
    after_3 = engine.weights()
    metrics.append(fsdp_ranks.dpo_step(engine, batches[3]))
    return {"initial": initial, "metrics": metrics, "weights_3": after_3, "weights_4": engine.weights()}


DPO_METRICS = ("dpo/loss", "dpo/reward_chosen", "dpo/reward_rejected", "dpo/reward_margin", "dpo/accuracy")


def test_two_fsdp_ranks_train_dpo_as_one_hf_process(workdir, dpo_ranks, hf_dpo_run):
    fsdp_weights = load_file(workdir / "dpo-train" / "weights-3.safetensors")
    assert any(not torch.equal(fsdp_weights[n], t) for n, t in hf_dpo_run["initial"].items())  # DPO moved them
    _assert_same_training(fsdp_weights, hf_dpo_run["weights_3"], hf_dpo_run["initial"])
    expected = hf_dpo_run["metrics"]
    assert expected[2]["dpo/reward_margin"] > 0  # the reference stayed at the start while the policy moved
    for rank in dpo_ranks:
        got = rank["metrics"]
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in expected[:3]], rel=1e-5, abs=1e-7)
        assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in expected[:3]], rel=1e-4)
        # every micro-batch holds the same number of pairs in both (1 per rank's pass; 2 per hf pass),
        # so the means over micro-batches are the means over pairs
        for name in DPO_METRICS:
            assert [m[name] for m in got] == pytest.approx([m[name] for m in expected[:3]], rel=1e-4, abs=1e-6), name
    _assert_same_training(load_file(workdir / "dpo-train" / "weights-4.safetensors"), hf_dpo_run["weights_4"],
                          hf_dpo_run["initial"])


def test_a_dpo_checkpoint_resumes_against_the_starting_reference(workdir, dpo_ranks):
    """The reference is rebuilt from the starting weights, not from the checkpoint: the resumed 4th
    step is the 2-rank trainer's 4th step."""
    (report,) = fsdp_ranks.run_ranks("dpo-resume", workdir, 1)
    assert report["step_after_load"] == 3
    assert report["metrics_4"]["loss"] == pytest.approx(dpo_ranks[0]["metrics_4"]["loss"], rel=1e-5, abs=1e-7)
    for name in DPO_METRICS:
        assert report["metrics_4"][name] == pytest.approx(dpo_ranks[0]["metrics_4"][name], rel=1e-4, abs=1e-6)
    _assert_close(load_file(workdir / "dpo-resume" / "weights-4.safetensors"),
                  load_file(workdir / "dpo-train" / "weights-4.safetensors"), atol=ROUNDING)


def test_a_dpo_stage_from_another_jobs_checkpoint_takes_its_weights_as_the_sharded_reference(workdir, dpo_ranks):
    """`model.init_from`: every rank copies its shards of the loaded weights into the reference."""
    ranks = fsdp_ranks.run_ranks("dpo-from-ckpt", workdir, 2)
    _assert_close(load_file(workdir / "dpo-from-ckpt" / "weights-start.safetensors"),
                  load_file(workdir / "dpo-train" / "weights-3.safetensors"), atol=0.0)
    for rank in ranks:  # the policy starts as the reference: no margin, the loss is log 2 (one minibatch:
        # a second one would be taken after the first's update)
        first = rank["metrics_4"]
        assert first["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)
        assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert dpo_ranks[0]["metrics_4"]["dpo/reward_margin"] != pytest.approx(0.0, abs=1e-3)  # vs the model.path start


# -- multi-turn episodes: the loss over the tokens the policy sampled ---------------------------------

@pytest.fixture(scope="module")
def masked_ranks(workdir) -> list[dict]:
    vocab_size = json.loads((workdir / "model" / "config.json").read_text())["vocab_size"]
    words = range(4, vocab_size)
    batches = [multi_turn_episodes(sampled=words, observed=words, groups=3, group_size=3, seed=seed,
                                   id_prefix=f"m{seed}") for seed in (0, 1)]
    (workdir / "masked.json").write_text(json.dumps([[dataclasses.asdict(e) for e in b] for b in batches]))
    return fsdp_ranks.run_ranks("masked", workdir, 2)


def _hf_masked_run(workdir, algorithm: dict, **model) -> list[dict]:
    settings = {**model_section(workdir / "model"), "group_size": 3, "minibatches": 2, "micro_batch_size": 4, **model}
    settings.pop("engine")
    engine = HFTrainEngine(HFModelConfig.model_validate(settings), AlgorithmConfig(**algorithm),
                           model_path=workdir / "model")
    return [engine.train_step(batch, current_version=step)
            for step, batch in enumerate(fsdp_ranks.load_batches(workdir, "masked.json"))]


@pytest.mark.parametrize("run", ["full", "lora"])
def test_two_fsdp_ranks_and_one_hf_process_give_the_same_loss_on_multi_turn_episodes(workdir, masked_ranks, run):
    """Losses over the masked tokens only, summed over ranks (seq-mean-token-mean counts sequences
    across them): the same as one process's up to fp32 reduction order. The second step's loss is
    taken after the first update, so it checks the update too, without comparing weights that
    Adam's first steps move by ±lr wherever a gradient rounds to another sign."""
    expected = _hf_masked_run(workdir, fsdp_ranks.MASKED_ALGORITHM if run == "full" else fsdp_ranks.ALGORITHM,
                              **({"lora": fsdp_ranks.LORA} if run == "lora" else {}))
    batches = fsdp_ranks.load_batches(workdir, "masked.json")
    for rank in masked_ranks:
        assert rank["world_size"] == 2
        got = rank[run]
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in expected], rel=1e-4, abs=1e-6)
        assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in expected], rel=1e-4)
        for metrics, batch in zip(got, batches):
            assert metrics["trained_tokens"] == sum(sum(e.mask()) for e in batch)
            assert metrics["masked_tokens"] == sum(e.mask().count(0) for e in batch) > 0
            assert metrics["updates_skipped_nonfinite"] == 0 and metrics["entropy"] > 0 and metrics["kl_loss"] >= 0
        assert got[1]["kl_loss"] > 0  # the update moved the policy off its anchor
        if run == "full":  # every rank corrects by the whole batch's gap, as one process does
            for key in ("rollout_corr/k3_kl", "rollout_corr/log_gap_max", "rollout_corr/rollout_is_mean"):
                assert [m[key] for m in got] == pytest.approx([m[key] for m in expected], rel=1e-4), key
            assert got[0]["rollout_corr/k3_kl"] > 0
