"""Every shipped example config runs to completion, shortened: loaded as shipped, its step counts
scaled down (keeping the explorers' margin over the trainer), run as real processes — `rolectl up`,
or for the cluster example a local 3-node cluster and `rolectl start` per role as its header says —
and it must exit 0 with `complete: true`. A new example without a run here fails the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rolectl.bus.server import NatsCluster
from tests.support.e2e import ROOT, job_config, run_up, shortened

pytestmark = pytest.mark.e2e

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
STEPS = 6  # trainer steps of a shortened run (`shortened`'s default)
# The LLM examples (hf/vLLM, a model to build; own_model.yaml and fully_async_partial_hf.yaml too) run
# shortened in test_llm_quickstart.py, the 2-rank fsdp one in test_trainer_ranks.py, the served one (its
# agent beside it) below, the LoRA one with a kill -9 of its trainer in test_lora_quickstart.py (from the
# base the SFT stage example makes there), the multi-turn agent one in test_agent_example.py, the tool
# example (its calls counted) below.
RUN_ELSEWHERE = {"llm_quickstart.yaml": "test_llm_quickstart.py", "llm_quickstart_hf.yaml": "test_llm_quickstart.py",
                 "llm_quickstart_fsdp.yaml": "test_trainer_ranks.py", "serve_quickstart.yaml": "test_examples_run.py",
                 "lora_quickstart.yaml": "test_lora_quickstart.py", "own_model.yaml": "test_llm_quickstart.py",
                 "agent_multiturn.yaml": "test_agent_example.py", "agent_tools.yaml": "test_examples_run.py",
                 "sft_base.yaml": "test_lora_quickstart.py", "dpo_quickstart.yaml": "test_dpo_quickstart.py",
                 "fully_async_partial_hf.yaml": "test_llm_quickstart.py"}
ON_A_CLUSTER = {"cluster.yaml"}


def test_every_example_is_run_somewhere():
    for example in EXAMPLES:
        if example in RUN_ELSEWHERE:
            text = (Path(__file__).parent / RUN_ELSEWHERE[example]).read_text()
            assert f'"{example}"' in text, f"{example} is not run by {RUN_ELSEWHERE[example]}"
    assert "quickstart.yaml" in EXAMPLES and len(EXAMPLES) >= 5, EXAMPLES


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e not in RUN_ELSEWHERE and e not in ON_A_CLUSTER])
def test_example_runs_to_completion(example, tmp_path):
    run = run_up(shortened(example, tmp_path), tmp_path, timeout=300, extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0, f"{example}: exit {run.rc}: {s.get('exit_codes')}\n{run.output[-2000:]}\n{run.role_logs()}"
    assert s["complete"] is True and s["trainer_steps"] == STEPS, s
    # in a pipe `up` prints a plain progress line at intervals and at the end
    assert f"trainer step {STEPS}/{STEPS} (100%) · " in run.output, run.output[-2000:]
    # and at the end, where to look now that its server and dashboard are gone
    assert f"rolectl replay --file {s['events_file']}" in run.output, run.output[-2000:]
    assert f"summary: {s['run_dir']}/summary.json" in run.output, run.output[-2000:]


@pytest.mark.parametrize("example", sorted(ON_A_CLUSTER))
def test_cluster_example_runs_to_completion(example, tmp_path):
    config = shortened(example, tmp_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1", ROLECTL_ADVERTISE_HOST="127.0.0.1")
    data = yaml.safe_load(config.read_text())
    members = [("sync", "sync-0"), ("trainer", "trainer"),
               *(("explorer", f"explorer-{i}") for i in range(data["explorers"]["count"]))]
    procs = {}
    with NatsCluster(size=3, store_dir=str(tmp_path / "cluster"), log_dir=str(tmp_path / "logs")) as cluster:
        try:
            for role, member in members:
                log = open(tmp_path / f"{member}.log", "wb")
                procs[member] = subprocess.Popen(
                    [sys.executable, "-m", "rolectl", "start", role, "--config", str(config),
                     "--nats", cluster.url, "--id", member, "--log-format", "json"],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
                log.close()
            codes = {m: p.wait(timeout=300) for m, p in procs.items()}  # a bound on "hung"
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()  # by PID: only processes this test started
                    p.wait()
    logs = "\n".join(f"--- {m}\n{(tmp_path / f'{m}.log').read_text(errors='replace')[-1500:]}" for m in procs)
    assert set(codes.values()) == {0}, f"{codes}\n{logs}"
    assert '"trainer_finished"' in (tmp_path / "trainer.log").read_text(), logs


def test_a_job_short_of_experiences_by_stale_drops_says_so(tmp_path):
    """Explorers produce exactly what the trainer needs and max_staleness 0 drops what the fast
    explorers made before each new version: the job ends short (exit 3) and `up` blames the drops,
    not the task arithmetic (which is exactly enough)."""
    from tests.support.e2e import job_config

    config = job_config(tmp_path, job="e2e-stale-short",
                        synchronizer={"sync_method": "memory", "sync_style": "fully_async", "max_staleness": 0},
                        trainer={"total_steps": 6, "save_interval": 3, "train_batch_tasks": 8},
                        explorers={"total_steps": 6, "step_delay_s": [0.0, 0.0]})
    run = run_up(config, tmp_path, timeout=300, extra=("--run-dir", str(tmp_path / "runs")))
    assert run.rc == 3, run.output[-3000:]
    said = " ".join(run.output.split())  # the console wraps long lines
    assert "trainer: no more experiences after step" in said, run.output[-3000:]
    assert "were dropped as stale (older than synchronizer.max_staleness = 0" in said, run.output[-3000:]
    assert "are fewer than" not in said, run.output[-3000:]


def test_eval_and_tracking_ends_with_the_eval_curve_and_tracker_files(tmp_path):
    config = shortened("eval_and_tracking.yaml", tmp_path, steps=10)
    run = run_up(config, tmp_path, timeout=300, extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0 and s["complete"] is True, f"exit {run.rc}\n{run.output[-2000:]}\n{run.role_logs()}"
    # on start-up (the base model, version 0) and after explore step 10, before its sync
    assert [(e["version"], e["step"]) for e in s["eval"]] == [(0, 0), (9, 10)], s["eval"]
    for e in s["eval"]:
        assert e["tasks"] == 64 and set(e["rewards"]) == {"positional_match", "exact_match"}
    assert s["eval"][1]["rewards"]["positional_match"] > s["eval"][0]["rewards"]["positional_match"], s["eval"]
    # TensorBoard's own reader finds the trainer's figures by train step and the evals by explore step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert s["tracker_failures"] == {} and s["trackers"] == ["tensorboard", "mlflow"], s
    (logdir,) = {p.parent for p in Path(s["run_dir"]).glob("*/monitor/tensorboard/*/events.out.tfevents.*")}
    acc = EventAccumulator(str(logdir)).Reload()
    assert [x.step for x in acc.Scalars("trainer/loss")] == list(range(1, 11))
    assert [x.step for x in acc.Scalars("eval/positional_match")] == [0, 10]
    assert (Path(s["monitor_dir"]) / "mlflow" / "mlflow.db").is_file()
    # `rolectl bench` evaluates what the finished job kept: the base model and the trainer's checkpoints
    bench = subprocess.run([sys.executable, "-m", "rolectl", "bench", "--config", str(config),
                            "--run-dir", str(Path(s["run_dir"]).parent), "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr[-2000:]
    rows = json.loads(bench.stdout)
    assert [r["version"] for r in rows] == [0, 5, 10], rows
    rewards = [r["rewards"]["positional_match"] for r in rows]
    assert round(rewards[0], 4) == s["eval"][0]["rewards"]["positional_match"]  # the same eval as in the run
    assert rewards[-1] > rewards[0], rows


def test_over_rollout_steps_cut_their_tail_and_the_job_completes(tmp_path):
    # each explore step keeps ceil(0.75 x 4) = 3 of its 4 tasks; a train step takes one round's 6
    config = job_config(tmp_path, job="e2e-over-rollout", synchronizer={"sync_method": "memory"},
                        explorers={"over_rollout_ratio": 0.25}, trainer={"train_batch_tasks": 6})
    run = run_up(config, tmp_path, timeout=300)
    s = run.summary
    assert run.rc == 0 and s["complete"] is True, f"exit {run.rc}\n{run.output[-2000:]}\n{run.role_logs()}"
    steps = sum(s["explorer_steps"].values())
    # A step waits for 3 of its 4 tasks and cuts the 4th, unless that one finished in the same
    # instant (then it is kept): at most one cut per step, and at least one in the run.
    cut = s["over_rollout_tasks_cut"]
    assert 1 <= cut <= steps, s
    assert s["experiences_produced"] == (steps * 4 - cut) * 4, s  # group_size 4 per task kept


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_serve_quickstart_runs_its_agent_and_counts_the_traffic(tmp_path, engine):
    """The served explorer (on the example's `hf` engine, and on `vllm`, which batches the agent's
    concurrent sessions), its agent (examples/agent_digits.py with the openai client) and the trainer:
    `up` prints the endpoint, the job completes, and the summary counts the served traffic."""
    config = shortened("serve_quickstart.yaml", tmp_path)
    data = yaml.safe_load(config.read_text())
    data["model"]["path"] = str(tmp_path / "model")
    data["model"]["rollout_engine"] = engine
    # 4 groups of 8 sessions a train step, not the example's 32: the same roles, endpoint and agent
    # (8 sessions side by side per task, which vllm batches) on an eighth of the served turns
    data["buffer"]["batch_size"] = data["trainer"]["train_batch_tasks"] = 4
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    run = run_up(config, tmp_path, timeout=400, extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0, f"exit {run.rc}: {s.get('exit_codes')}\n{run.output[-2000:]}\n{run.role_logs()}"
    assert s["complete"] is True and s["trainer_steps"] == STEPS, s
    said = " ".join(run.output.split())
    assert "serving: explorer-0 http://127.0.0.1:" in said, run.output[-2000:]
    # every trained experience is a rewarded served turn: a session has 1 or 2 turns
    needed = STEPS * data["trainer"]["train_batch_tasks"] * data["model"]["group_size"]
    assert s["experiences_trained"] >= needed, s
    assert 2 * s["rewarded"] >= needed, s  # at most two turns per rewarded session
    # each trajectory (rewarded or expired) holds at least one served request
    assert s["expired"] >= 0 and s["served_requests"] >= s["rewarded"] + s["expired"], s
    for key in ("served_requests", "rewarded", "expired"):  # the summary table shows them
        assert key in said, run.output[-3000:]


def test_the_tool_example_plays_episodes_and_counts_its_calls(tmp_path):
    """examples/agent_tools.yaml shortened: the built model's chat template, the calculator tool and
    the hf engine's episodes run as real processes; the job completes and every explorer step counts
    the episodes and their calls by tool and outcome (a short run cannot show the learning: its
    figures are in docs/tools.md)."""
    from rolectl.sync_protocol import Role, StepFinished

    config = shortened("agent_tools.yaml", tmp_path)
    data = yaml.safe_load(config.read_text())
    data["model"]["path"] = str(tmp_path / "model")  # built by the roles on first use, as the example does
    data["buffer"]["batch_size"] = data["trainer"]["train_batch_tasks"] = 4  # 4 tasks x 4 episodes a step:
    data["model"]["group_size"] = 4  # the roles' work is the same, on an eighth of the episodes
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    run = run_up(config, tmp_path, timeout=400, extra=("--run-dir", str(tmp_path / "runs")))
    s = run.summary
    assert run.rc == 0, f"exit {run.rc}: {s.get('exit_codes')}\n{run.output[-2000:]}\n{run.role_logs()}"
    assert s["complete"] is True and s["trainer_steps"] == STEPS, s
    steps = [r.event.metrics for r in run.records
             if isinstance(r.event, StepFinished) and r.event.member.role is Role.EXPLORER]
    assert len(steps) >= STEPS
    episodes = data["buffer"]["batch_size"] * data["model"]["group_size"]
    assert all(m["agent/episodes"] == episodes and 1 <= m["agent/turns_mean"] <= 2 for m in steps), steps
    calls = {key: sum(m.get(key, 0) for m in steps) for m in steps for key in m if key.startswith("agent/tool_calls/")}
    assert sum(calls.values()) > 0, steps  # a random-init model writes <tool_call> now and then
    for key in calls:
        _, _, tool, outcome = key.split("/")
        assert tool in ("calculator", "_unknown") and outcome in ("ok", "malformed", "error", "timeout",
                                                                 "unknown_tool"), key
