"""The LoRA quickstart ("lora_quickstart.yaml"), shortened, as real processes (nats-server, synchronizer,
hf trainer, two vLLM explorers serving the adapter), with kill -9 of the trainer mid-job: it restarts
from its adapter checkpoint and the job completes; every version moved is the adapter alone, and the
end leaves a peft adapter and the merged model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rolectl.roles.observe.replay import summarize
from rolectl.sync_protocol import MemberJoined, Role, StepFinished, VersionPublished, WeightsLoaded
from tests.support.e2e import ROOT, LiveJob, assert_decisions_replay, last_trainer_step, of_kind

pytestmark = pytest.mark.e2e

EXPLORERS = ["explorer-0", "explorer-1"]
STEPS = 6
# the example's model in float32: every weight, the tied head under both names (what a full sync moves)
FULL_SYNC_BYTES = (495_616 + 16 * 128) * 4


def shortened(tmp_path: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "lora_quickstart.yaml").read_text())
    data["run_dir"] = str(tmp_path / "runs")
    data["trainer"].update(total_steps=STEPS, save_interval=2, train_batch_tasks=8)
    data["explorers"]["total_steps"] = STEPS + 1
    data["buffer"]["batch_size"] = 4
    data["model"]["path"] = str(tmp_path / "model")  # built by the roles on first use, as the example does
    path = tmp_path / "lora_quickstart.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.timeout(900)
async def test_a_lora_job_survives_kill9_of_its_trainer_and_moves_only_the_adapter(tmp_path):
    config = shortened(tmp_path)
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
    # every version is the adapter alone (rank 8 on the 7 linear layers of 3 decoder layers, float32)
    adapter_bytes = 3 * (4 * 8 * (128 + 128) + 2 * 8 * (128 + 256) + 8 * (256 + 128)) * 4
    assert {e.nbytes for e in published} == {adapter_bytes}, {e.nbytes for e in published}
    loads = [r.event for r in of_kind(records, WeightsLoaded) if r.event.nbytes]
    assert loads and {e.nbytes for e in loads} == {adapter_bytes}
    summary = summarize(records, job=job.cfg.job)
    assert summary["complete"] and summary["weights_bytes_per_sync"] == adapter_bytes
    assert adapter_bytes < FULL_SYNC_BYTES / 9
    # the end: the adapter in peft's format, and the merged model beside it
    final = job.cfg.hf_export_dir / "final"
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 8
    assert (final / "adapter_model.safetensors").is_file() and (final / "merged" / "config.json").is_file()
    assert_decisions_replay(records)
