"""The LoRA quickstart ("lora_quickstart.yaml"), shortened, as real processes (nats-server, synchronizer,
hf trainer, two hf explorers serving the adapter), from the base its header says to make first: the
SFT example ("sft_base.yaml"), shortened, run by `rolectl up` into a fixed export directory that the
LoRA job names as its model.path. With kill -9 of the trainer mid-job: it restarts from its adapter
checkpoint and the job completes; every version moved is the adapter alone, and the end leaves a peft
adapter and the merged model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import yaml

from rolectl.roles.observe.replay import summarize
from rolectl.sync_protocol import MemberJoined, Role, StepFinished, VersionPublished, WeightsLoaded
from tests.support.e2e import ROOT, LiveJob, assert_decisions_replay, last_trainer_step, of_kind

# the SFT base is tests/e2e/conftest.py's `sft_base`, built once per test run
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("sft-base")]

EXPLORERS = ["explorer-0", "explorer-1"]
STEPS = 6


def shortened(tmp_path: Path, base: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "lora_quickstart.yaml").read_text())
    assert data["model"]["path"] == "runs/bases/digits-sft" and "build" not in data["model"]  # the SFT export
    data["run_dir"] = str(tmp_path / "runs")
    data["trainer"].update(total_steps=STEPS, save_interval=2, train_batch_tasks=8)
    data["explorers"]["total_steps"] = STEPS + 1
    data["buffer"]["batch_size"] = 4
    data["model"]["path"] = str(base)
    path = tmp_path / "lora_quickstart.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.timeout(900)
async def test_a_lora_job_survives_kill9_of_its_trainer_and_moves_only_the_adapter(tmp_path, sft_base):
    base = sft_base
    config = shortened(tmp_path, base)
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.wait_for(lambda recs: last_trainer_step(recs) >= 3, timeout=420, what="trainer step 3")
        job.kill9("trainer")
        job.start("trainer", "trainer")
        await job.all_exit_zero(["trainer", *EXPLORERS], timeout=420)
        await job.stream_caught_up()
        records = job.records

    incarnations = [r.event.member.incarnation for r in of_kind(records, MemberJoined, role=Role.TRAINER)]
    assert len(incarnations) == 2, incarnations
    steps = [r.event.step for r in of_kind(records, StepFinished, role=Role.TRAINER)]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), steps  # resumed from step 2's checkpoint
    published = [r.event for r in of_kind(records, VersionPublished)]
    versions = [e.version for e in published]
    assert versions == sorted(set(versions)) and versions[-1] == STEPS, versions
    # every version is the adapter alone: rank 8 on GPT-2's 4 linear (Conv1D) layers of 3 blocks, float32
    # (c_attn 128 -> 384, attn.c_proj 128 -> 128, c_fc 128 -> 256, mlp.c_proj 256 -> 128)
    adapter_bytes = 3 * 8 * ((128 + 384) + (128 + 128) + (128 + 256) + (256 + 128)) * 4
    full_sync_bytes = 4 * sum(t.numel() for t in safetensors.torch.load_file(base / "model.safetensors").values())
    assert {e.nbytes for e in published} == {adapter_bytes}, {e.nbytes for e in published}
    loads = [r.event for r in of_kind(records, WeightsLoaded) if r.event.nbytes]
    assert loads and {e.nbytes for e in loads} == {adapter_bytes}
    summary = summarize(records, job=job.cfg.job)
    assert summary["complete"] and summary["weights_bytes_per_sync"] == adapter_bytes
    assert adapter_bytes <= full_sync_bytes / 10  # the bound: at most 10 % of the full model
    # the end: the adapter in peft's format, and the merged model beside it
    final = job.cfg.hf_export_dir / "final"
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 8
    assert (final / "adapter_model.safetensors").is_file() and (final / "merged" / "config.json").is_file()
    assert_decisions_replay(records)
