"""The GPU suite cannot rot on CPU: its dry run resolves the carry lists, collects every CUDA test it
names, parses every benchmark flag it passes, validates its jobs' configs, proves the two-part transfer
and the time budget; each check names what is wrong. The whole job's figures come from its stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_carry, gpu_job, gpu_suite

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_of_the_one_command_finds_nothing_wrong():
    proc = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=500, check=False, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["problems"] == []
    assert report["steps"] == [s.name for s in gpu_suite.STEPS]
    assert report["steps"][0] == "e2e_job"  # by value: the whole job on a GPU has never run


def test_a_carry_list_that_does_not_resolve_says_which_line_and_what_to_run(tmp_path):
    listed = gpu_carry.carry_requirements()
    wrong = [line if not line.startswith("msgpack==") else "msgpack==0.0.1" for line in listed]
    wrong = [line for line in wrong if not line.startswith("structlog==")] + ["blake3", "no-such-dist==1.0"]
    path = tmp_path / "requirements.txt"
    path.write_text("\n".join(wrong) + "\n")
    problems = "\n".join(gpu_carry.check_requirements(path))
    assert "msgpack" not in problems  # an older or newer pin is fine: the carry pins this venv's
    assert "structlog (needed by rolectl or a listed distribution) is not listed" in problems
    assert "'blake3' is not pinned as name==version" in problems
    assert "no-such-dist is not installed" in problems
    assert "run benchmarks/gpu_carry.sh" in problems


def test_the_committed_carry_lists_are_the_ones_this_venv_computes():
    assert gpu_carry.check_requirements() == []
    assert gpu_carry.carry_requirements()  # torch and numpy are never carried
    assert not any(line.startswith(("torch==", "numpy==")) for line in gpu_carry.carry_requirements())
    assert gpu_carry.check_requirements(gpu_carry.ENGINE_REQUIREMENTS_FILE, engines=True) == []
    engines = {line.partition("==")[0] for line in gpu_carry.engine_requirements()}
    assert {"ray", "verl", "datasets", "dill", "multiprocess"} <= engines  # what the first run lacked
    # the GPU image's builds stay: neither list replaces torch's, nor the engine list the image's packages
    assert not engines & (gpu_carry.machine_packages() | {"torch", "numpy"})


def test_an_engine_list_that_would_replace_the_machines_packages_says_so(tmp_path):
    path = tmp_path / "engine_requirements.txt"
    path.write_text("\n".join([*gpu_carry.engine_requirements(), "pyarrow==99.0"]) + "\n")
    problems = "\n".join(gpu_carry.check_requirements(path, engines=True))
    assert "pyarrow is in the GPU machine's image (gpu_machine_packages.txt)" in problems
    path.write_text("\n".join(line for line in gpu_carry.engine_requirements() if not line.startswith("ray==")))
    assert "ray (needed by rolectl or a listed distribution) is not listed" in "\n".join(
        gpu_carry.check_requirements(path, engines=True))


def test_a_flag_the_benchmark_does_not_take_is_named():
    argv = [sys.executable, "-m", "benchmarks.weights", "--size-mb", "1", "--no-such-flag", "2"]
    step = gpu_suite.Step("bogus", argv, 1, module="benchmarks.weights")
    assert gpu_suite._check_flags(step, {}) == ["bogus: python -m benchmarks.weights has no option --no-such-flag"]


def test_a_gpu_test_left_out_or_gone_is_named(monkeypatch):
    monkeypatch.setattr(gpu_suite, "GPU_TESTS", ["tests/integration/test_weights_pull.py::test_no_such_test"])
    problems = "\n".join(gpu_suite._check_tests())
    assert "tests/integration/test_weights_cuda_ipc.py asks for a GPU but is not in" in problems
    assert "tests/integration/test_weights_pull.py::test_no_such_test: no test collected" in problems


def test_the_goals_compare_the_measured_figures_and_leave_unmeasured_ones_open():
    steps = {
        "weights_1g": {"result": {"transports": {
            "cuda_ipc": {"ratio_to_limit": 0.6},
            "object_store": {"fanout_by_explorers": {"4": {"ratio": 1.7}}},
        }}},
        "weights_4g": {"result": {"transports": {"cuda_ipc": {"seconds": 0.4}}}},
        "secured_1g": {"result": {"transports": {
            "object_store": {"gbps": 2.0, "median_gbps": 1.8},
            "object_store_secure": {"gbps": 1.8, "median_gbps": 1.2},
        }}},
    }
    goals = gpu_suite._goals(steps)
    assert goals["secured_slowdown_1g_best"] == {"value": 2.0 / 1.8, "goal": "<= 1.2", "met": True}
    assert goals["secured_slowdown_1g_median"]["met"] is False  # 1.5x
    assert goals["cuda_ipc_of_d2d_1g"]["met"] is True
    assert goals["object_store_fanout_4_over_one"]["met"] is False
    assert goals["cuda_ipc_7b_shaped_4g_seconds"]["met"] is True
    assert goals["checkpoint_fanout_4_over_one"] == {"value": None, "goal": "<= 1.5", "met": None}
    assert goals["object_store_into_cuda_7b_shaped_4g_seconds"]["met"] is None


def test_the_jobs_train_one_fsdp_rank_in_bf16_beside_two_explorers_by_ipc_then_object_store(tmp_path):
    data = gpu_job.job_config(tmp_path)
    model = data["model"]
    assert (model["engine"], model["rollout_engine"], data["trainer"]["world_size"]) == ("fsdp", "hf", 1)
    assert (model["device"], model["dtype"], model["fsdp"]["param_dtype"]) == ("cuda", "bfloat16", "bfloat16")
    assert model["gradient_checkpointing"] is True
    assert (data["synchronizer"]["sync_method"], data["explorers"]["count"]) == ("cuda_ipc", 2)
    assert data["trainer"]["train_batch_tasks"] == 2 * data["buffer"]["batch_size"]
    methods = [dict(zip(s.argv[3::2], s.argv[4::2]))["--sync-method"] for s in gpu_suite.STEPS
               if s.module == "benchmarks.gpu_job"]
    assert methods == ["cuda_ipc", "memory"]
    assert gpu_suite._check_job_configs(tmp_path) == []
    with pytest.raises(ValueError, match="cuda_ipc needs --device cuda"):
        gpu_job.job_config(tmp_path, device="cpu")


def test_the_default_steps_fit_the_suites_minutes_and_a_step_too_long_is_named(monkeypatch):
    assert gpu_suite._check_budget() == []
    assert sum(s.timeout_s for s in gpu_suite.STEPS) + gpu_suite.SETUP_S <= gpu_suite.SUITE_S <= 8 * 60
    long = gpu_suite.Step("long", ["true"], gpu_suite.SUITE_S)
    monkeypatch.setattr(gpu_suite, "STEPS", [*gpu_suite.STEPS, long])
    assert "over the suite's 480 s; shorten a step or move it to EXTRA_STEPS" in "\n".join(gpu_suite._check_budget())


def _two_part(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_two_part.sh"), *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_a_file_split_in_two_parts_is_checked_and_joined_to_its_digest(tmp_path):
    source = tmp_path / "big.whl"
    source.write_bytes(os.urandom(250_000))
    call1, call2, joined = tmp_path / "call1", tmp_path / "call2", tmp_path / "joined"
    assert _two_part("split", str(source), "150000", str(call1), str(call2)).returncode == 0
    assert (call1 / "big.whl.part1").stat().st_size == 150_000 and (call2 / "big.whl.part2").stat().st_size == 100_000
    manifest = (call1 / "big.whl.parts.sha256").read_text()
    assert manifest == (call2 / "big.whl.parts.sha256").read_text()
    assert [line.split()[1] for line in manifest.splitlines()] == ["big.whl.part1", "big.whl.part2", "big.whl"]
    assert _two_part("check", str(call1)).returncode == 0
    assert _two_part("join", str(call1), str(call2), str(joined)).returncode == 0
    assert (joined / "big.whl").read_bytes() == source.read_bytes()
    # part 2 changed on the way: the join names it and joins nothing
    damaged = bytearray((call2 / "big.whl.part2").read_bytes())
    damaged[7] ^= 1
    (call2 / "big.whl.part2").write_bytes(bytes(damaged))
    proc = _two_part("join", str(call1), str(call2), str(tmp_path / "again"))
    assert proc.returncode == 2 and "call2/big.whl.part2 has sha256" in proc.stderr
    assert not (tmp_path / "again" / "big.whl").exists()
    # the machine went back between the calls: part 1 is gone, and the message says what to do
    (call1 / "big.whl.part1").unlink()
    proc = _two_part("check", str(call1))
    assert proc.returncode == 2 and "make call 1 again, then call 2 at once" in proc.stderr


def test_the_dry_run_checks_a_built_carry_and_its_lists(tmp_path):
    carry = tmp_path / "device_carry"
    source = tmp_path / "ray-0-py3-none-any.whl"
    source.write_bytes(os.urandom(100_000))
    assert _two_part("split", str(source), "60000", str(carry / "call1"), str(carry / "call2")).returncode == 0
    (carry / "call2" / "requirements.txt").write_text(gpu_carry.REQUIREMENTS_FILE.read_text())
    (carry / "call2" / "engine_requirements.txt").write_text(gpu_carry.ENGINE_REQUIREMENTS_FILE.read_text())
    assert gpu_suite._check_two_part(tmp_path / "work1", carry) == []
    (carry / "call2" / "engine_requirements.txt").write_text("ray==1.0\n")
    (carry / "call1" / source.with_suffix(".whl.part1").name).write_bytes(b"short")
    problems = "\n".join(gpu_suite._check_two_part(tmp_path / "work2", carry))
    assert "call1: gpu_two_part.sh check exited 2" in problems and "part1 has sha256" in problems
    assert "engine_requirements.txt is not benchmarks/gpu_suite_engine_requirements.txt" in problems
    # no carry built (CI): the scripts' round trip on a generated file
    assert gpu_suite._check_two_part(tmp_path / "work3", tmp_path / "none") == []


def test_the_whole_jobs_figures_come_from_its_stream():
    from rolectl.sync_protocol import MemberRef, Recorded, Role, StepFinished, WeightsBroadcast, WeightsLoaded

    trainer = MemberRef(role=Role.TRAINER, id="trainer", incarnation=0)
    explorer = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=0)
    events = [StepFinished(member=explorer, step=1, version=0, metrics={"gpu_peak_memory_bytes": 9e9})]
    for step, peak in ((1, 100e6), (2, 120e6), (3, 110e6)):
        events += [StepFinished(member=trainer, step=step, version=step,
                                metrics={"gpu_peak_memory_bytes": peak, "model_parameters": 1e6}),
                   WeightsBroadcast(member=trainer, version=step, round=step, seconds=0.01 * step),
                   WeightsLoaded(member=explorer, version=step, seconds=0.1 * step)]
    records = [Recorded(seq=i + 1, time_ms=10_000 + 1000 * i, event=e) for i, e in enumerate(events)]
    summary = {"complete": True, "reward_first": 0.06, "reward_last": 0.4, "trainer_steps": 3}
    got = gpu_job.figures(summary, records)
    assert got["reward_rose"] and got["complete"] and got["trainer_steps"] == 3
    assert got["steps_per_s"] == pytest.approx(2 / 6.0)  # 3 trainer steps 3 records apart, 1 s each
    assert got["first_step_after_s"] == 1.0
    assert got["trainer_peak_gpu_memory_bytes"] == 120e6  # the trainer's, not an explorer's
    assert got["model_optimizer_estimate_bytes"] == 16e6 and got["peak_over_estimate"] == pytest.approx(7.5)
    assert got["weights_loaded_s"]["count"] == 3 and got["weights_loaded_s"]["max"] == pytest.approx(0.3)
    assert got["weights_sent_s"]["median"] == pytest.approx(0.02)
    assert not gpu_job.figures({**summary, "reward_last": 0.05}, records)["reward_rose"]


def test_a_trainer_that_never_used_cuda_reports_no_gpu_memory():
    from rolectl.roles.trainer import gpu_memory_metrics

    assert not torch.cuda.is_initialized()
    assert gpu_memory_metrics() == {}


def test_the_pinned_spare_figures_compare_the_fetches_after_the_first():
    rounds = {"object_store": [3.0, 1.0, 1.2, 0.8], "object_store_fresh": [3.0, 2.0, 2.2]}
    result = {"transports": {name: {"rounds": [{"fetch_s": s} for s in times]} for name, times in rounds.items()}}
    figures = gpu_suite._figures({"pinned_4g": {"result": result}})
    assert figures["pinned_4g_later_fetches_s"] == {"spare": 1.0, "fresh": 2.1,
                                                    "fresh_over_spare": pytest.approx(2.1)}
    assert figures["pinned_1g_later_fetches_s"] == {"spare": None, "fresh": None, "fresh_over_spare": None}


def test_a_step_records_its_figures_its_failure_its_timeout_and_what_it_lacks(tmp_path):
    write = "import json, sys; json.dump({'gbps': 1.5}, open(sys.argv[1], 'w'))"
    row = gpu_suite._run_step(gpu_suite.Step("ok", [sys.executable, "-c", write, "{work}/ok.json"], 60,
                                             json_out="ok.json"), tmp_path)
    assert row["ok"] and row["rc"] == 0 and row["result"] == {"gbps": 1.5}
    row = gpu_suite._run_step(gpu_suite.Step("bad", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                                             60), tmp_path)
    assert not row["ok"] and row["rc"] == 3 and "boom" in row["output_tail"]
    # the step runs past its bound: it is killed (with its process group), not waited for
    row = gpu_suite._run_step(gpu_suite.Step("slow", [sys.executable, "-c", "import time; time.sleep(120)"], 1),
                              tmp_path)
    assert not row["ok"] and row["rc"] == "timed out after 1 s" and row["seconds"] < 60
    row = gpu_suite._run_step(gpu_suite.Step("lacks", [sys.executable, "-c", "pass"], 60,
                                             requires=("no_such_module",), install_hint="pip install it"), tmp_path)
    assert not row["ok"] and "No module named 'no_such_module'" in row["not_run"] and "pip install it" in row["not_run"]
