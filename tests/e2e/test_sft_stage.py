"""An SFT stage as real processes: the trainer alone on a real nats-server (no synchronizer, no explorer),
killed with -9 mid-stage and started again, continues exactly where its last checkpoint stopped: the
steps after the kill have the losses and learning rates of an uninterrupted run, and the job ends
complete with its export where `trainer.export_dir` says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
import yaml

from rolectl.roles.observe.replay import summarize
from rolectl.sync_protocol import MemberJoined, Role, StepFinished
from tests.support.e2e import LiveJob, last_trainer_step, of_kind
from tests.support.tiny_llm import BUILD, DATA

pytestmark = pytest.mark.e2e

STEPS = 10  # 60 rows, 6 a step
KILL_AFTER = 4


def stage_config(tmp_path: Path, model: Path) -> Path:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:66]]
    (tmp_path / "demos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:60]))
    (tmp_path / "held-out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[60:]))
    data = {"job": "sft-resume", "run_dir": str(tmp_path / "runs"), "stage": "sft",
            "synchronizer": {"heartbeat_period": 1, "heartbeat_expiry": 30},
            "trainer": {"save_interval": 1, "export_dir": str(tmp_path / "export")},
            "model": {"engine": "hf", "path": str(model), "build": BUILD, "lr": 3e-3, "micro_batch_size": 4,
                      "max_new_tokens": 4},
            "sft": {"path": str(tmp_path / "demos.jsonl"), "prompt_key": "prompt", "response_key": "answer",
                    "batch_size": 6, "epochs": 1, "warmup_steps": 2, "eval_path": str(tmp_path / "held-out.jsonl"),
                    "eval_interval": 5, "eval_rewards": ["exact_match"]}}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def step_figures(records) -> dict[int, dict]:
    """The last report of each step (a step a restart trained again is reported again)."""
    return {r.event.step: dict(r.event.metrics) for r in of_kind(records, StepFinished, role=Role.TRAINER)}


async def run_stage(tmp_path: Path, model: Path, *, kill_after: int | None) -> list:
    tmp_path.mkdir()
    async with LiveJob(tmp_path, stage_config(tmp_path, model)) as job:
        job.start("trainer", "trainer")
        if kill_after is not None:
            await job.wait_for(lambda recs: last_trainer_step(recs) >= kill_after, timeout=300,
                               what=f"stage step {kill_after}")
            job.kill9("trainer")
            job.start("trainer", "trainer")
        await job.all_exit_zero(["trainer"], timeout=300)
        await job.stream_caught_up()
        return job.records


@pytest.mark.timeout(900)
async def test_a_stage_killed_mid_way_continues_exactly_where_it_stopped(tmp_path):
    model = tmp_path / "model"  # built once by the first run, read by the second
    straight = await run_stage(tmp_path / "straight", model, kill_after=None)
    killed = await run_stage(tmp_path / "killed", model, kill_after=KILL_AFTER)

    incarnations = [r.event.member.incarnation for r in of_kind(killed, MemberJoined, role=Role.TRAINER)]
    assert len(incarnations) == 2  # the same member, a new incarnation
    assert not any(r.event.member.role is not Role.TRAINER for r in killed)  # no synchronizer, no explorer
    expected, got = step_figures(straight), step_figures(killed)
    assert sorted(expected) == sorted(got) == list(range(1, STEPS + 1))
    first, second = ([r.event.step for r in of_kind(killed, StepFinished, role=Role.TRAINER)
                      if r.event.member.incarnation == n] for n in incarnations)
    assert first[-1] >= KILL_AFTER and second[0] == first[-1] + 1, (first, second)  # nothing lost, nothing twice
    for step in range(1, STEPS + 1):  # the same rows, weights, optimizer and schedule: the same numbers
        for key in ("loss", "grad_norm", "lr", "tokens", "sft/epoch", "sft/tokens"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6), (step, key)
    assert got[5]["sft/eval_loss"] == pytest.approx(expected[5]["sft/eval_loss"], rel=1e-6)
    assert {"sft/eval_loss", "sft/eval/exact_match"} <= set(got[STEPS])
    assert got[1]["lr"] == 0.0 and got[3]["lr"] == pytest.approx(3e-3, rel=0.05)  # warmed up, then cosine
    assert got[STEPS]["sft/epoch"] == 1.0 and got[STEPS]["loss"] < got[2]["loss"]
    summary = summarize(killed, job="sft-resume")
    assert summary["complete"] and summary["trainer_steps"] == STEPS
    assert summary["stage"]["name"] == "sft" and summary["stage"]["rows_trained"] == 60
    # the export is a Hugging Face model the next stage names as its model.path
    export = tmp_path / "killed" / "export"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert loaded.config.vocab_size == 16 and (export / "tokenizer.json").is_file()
