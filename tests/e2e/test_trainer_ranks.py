"""A trainer of 2 `fsdp` ranks with real processes: the shortened fsdp LLM quickstart run by
`rolectl up` to the end (one trainer on the stream, its world size and Hugging Face export in the
summary, the export loading in transformers), the same training a LoRA adapter (only it is sent and
exported), and rank 1 killed with kill -9 mid-job: the trainer
restarts as a whole, every step 1..N is trained once, the recorded decisions replay, and every
experience produced is trained or dropped as stale."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rolectl.roles.launch.local import summarize
from rolectl.roles.launch.ranks import RANK_ENV
from rolectl.roles.observe.replay import write_export
from rolectl.sync_protocol import MemberJoined, Role
from tests.e2e.test_llm_quickstart import shortened
from tests.support.e2e import (
    ROOT,
    LiveJob,
    _descendants,
    assert_decisions_replay,
    decision_problems,
    of_kind,
    run_up,
    stream_experiences,
    trainer_steps,
)

pytestmark = pytest.mark.e2e

STEPS = 5


def _rank_pid(agent_pid: int, rank: int) -> int | None:
    """The process of trainer rank `rank` among the agent's children (its environment says which)."""
    for pid in _descendants(agent_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{RANK_ENV}={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.timeout(600)
def test_a_two_rank_fsdp_trainer_runs_the_quickstart_and_exports_a_hf_model(tmp_path):
    import transformers

    run = run_up(shortened(tmp_path, "llm_quickstart_fsdp.yaml", steps=3), tmp_path, timeout=540,
                 extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0, f"exit {run.rc}: {s.get('exit_codes')}\n{run.role_logs()}"
    assert s["complete"] is True and s["trainer_steps"] == 3 and s["final_version"] == 3, s
    assert s["engines"] == {"trainer": "fsdp", "explorer": "hf"}
    assert s["trainer_world_size"] == 2
    # the stream saw one trainer, joined once
    assert [r.event.member.id for r in of_kind(run.records, MemberJoined, role=Role.TRAINER)] == ["trainer"]
    export = Path(s["hf_model_dir"])
    assert export.parent.parent.parent == Path(s["run_dir"]) and export.name == "final"
    model = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert sum(p.numel() for p in model.parameters()) == s["model_parameters"]
    # the export is the trained model: its logits differ from the base model's
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True)
    probe = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=probe).logits, base(input_ids=probe).logits)
    assert_decisions_replay(run.records)


@pytest.mark.timeout(600)
def test_a_two_rank_fsdp_trainer_trains_a_lora_adapter_and_sends_only_it(tmp_path):
    import transformers
    from peft import PeftModel

    config = shortened(tmp_path, "llm_quickstart_fsdp.yaml", steps=3)
    data = yaml.safe_load(config.read_text())
    data["model"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    run = run_up(config, tmp_path, timeout=540, extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0, f"exit {run.rc}: {s.get('exit_codes')}\n{run.role_logs()}"
    assert s["complete"] is True and s["trainer_steps"] == 3 and s["trainer_world_size"] == 2, s
    assert 0 < s["trainable_parameters"] < s["model_parameters"] / 10, s
    assert s["weights_bytes_per_sync"] < 4 * s["trainable_parameters"] * 1.01, s  # the adapter, not the model
    export = Path(s["hf_model_dir"])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True)
    probe = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = base(input_ids=probe).logits
        after = PeftModel.from_pretrained(base, export)(input_ids=probe).logits
    assert not torch.allclose(after, before)  # the exported adapter is the trained one
    assert_decisions_replay(run.records)


@pytest.mark.timeout(900)
async def test_kill9_of_rank_1_restarts_the_whole_trainer_and_trains_every_step_once(tmp_path):
    config = shortened(tmp_path, "llm_quickstart_fsdp.yaml", steps=STEPS)
    data = yaml.safe_load(config.read_text())
    data["trainer"]["save_interval"] = 1  # every reported step is saved first: a restart repeats none
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        agent = job.current("trainer")
        await job.wait_for(lambda recs: len(trainer_steps(recs)) >= 2, timeout=400, what="trainer step 2")
        first = _rank_pid(agent.pid, 1)
        assert first is not None, job.log_tail("trainer")
        os.kill(first, signal.SIGKILL)
        steps_at_kill = len(trainer_steps(job.records))
        assert steps_at_kill < STEPS
        # the agent restarts both ranks: a new rank 1, and the trainer joins again as a new incarnation
        await job.wait_until(lambda: (_rank_pid(agent.pid, 1) or first) != first, timeout=60,
                             what="a new rank 1")
        assert await job.wait_exit("trainer", 600) == 0, job.log_tail("trainer", 60)
        for explorer in job.cfg.explorer_ids():
            assert await job.wait_exit(explorer, 120) == 0, job.log_tail(explorer)
        await job.stream_caught_up()
        await job.wait_for(lambda recs: not decision_problems(recs), timeout=30,
                           what="every due decision recorded")
        job.interrupt("sync-0")
        assert await job.wait_exit("sync-0", 30) == 0
        await job.stream_caught_up()
        records = job.records
        assert "trainer_ranks_restarting" in job.log_tail("trainer", 10_000)
        joins = of_kind(records, MemberJoined, role=Role.TRAINER)
        assert len(joins) == 2 and joins[1].event.member.incarnation > joins[0].event.member.incarnation
        assert trainer_steps(records) == list(range(1, STEPS + 1)), trainer_steps(records)
        assert_decisions_replay(records)
        summary = summarize(records, job=job.cfg.job)
        assert summary["complete"], summary["end_reason"]
        # each step trained one batch (8 tasks x 8 responses), none twice; the explorers' extra step
        # (sync_offset 1 needs it) is still in the stream, unacked: nothing lost
        assert summary["experiences_trained"] == STEPS * 8 * 8, summary
        left = await stream_experiences(job)
        assert summary["experiences_produced"] == (
            summary["experiences_trained"] + summary["experiences_dropped_stale"] + left), (summary, left)
        events = tmp_path / "events.jsonl"
        write_export(records, events, job=job.cfg.job)
        check = subprocess.run([sys.executable, "-m", "rolectl", "replay", "--file", str(events), "--check"],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
