"""The GPU suite cannot rot on CPU: its dry run resolves the carry list, collects every CUDA test it
names, parses every benchmark flag it passes and validates its job config; each check names what is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_suite

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_of_the_one_command_finds_nothing_wrong():
    proc = subprocess.run(["bash", "benchmarks/gpu_suite.sh", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=500, check=False, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["problems"] == []
    assert report["steps"] == [s.name for s in gpu_suite.STEPS]


def test_a_carry_list_that_does_not_resolve_says_which_line_and_what_to_run(tmp_path):
    listed = gpu_suite.carry_requirements()
    wrong = [line if not line.startswith("msgpack==") else "msgpack==0.0.1" for line in listed]
    wrong = [line for line in wrong if not line.startswith("structlog==")] + ["blake3", "no-such-dist==1.0"]
    path = tmp_path / "requirements.txt"
    path.write_text("\n".join(wrong) + "\n")
    problems = "\n".join(gpu_suite.check_requirements(path))
    assert "msgpack" not in problems  # an older or newer pin is fine: the carry pins this venv's
    assert "structlog (needed by rolectl or a listed distribution) is not listed" in problems
    assert "'blake3' is not pinned as name==version" in problems
    assert "no-such-dist is not installed" in problems
    assert "run benchmarks/gpu_carry.sh" in problems


def test_the_committed_carry_list_is_the_one_this_venv_computes():
    assert gpu_suite.check_requirements() == []
    assert gpu_suite.carry_requirements()  # torch and numpy are never carried
    assert not any(line.startswith(("torch==", "numpy==")) for line in gpu_suite.carry_requirements())


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


def test_the_job_config_asks_for_one_gpu_bf16_and_cuda_ipc(tmp_path):
    data = gpu_suite.gpu_job_config(tmp_path)
    assert data["synchronizer"]["sync_method"] == "cuda_ipc"
    assert (data["model"]["device"], data["model"]["dtype"], data["explorers"]["count"]) == ("cuda", "bfloat16", 1)
    assert gpu_suite._check_job_config(tmp_path) == []


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
