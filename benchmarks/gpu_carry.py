"""What the GPU suite carries to a GPU machine without internet, and how it travels in two calls.

    python -m benchmarks.gpu_carry --requirements          # the pinned base list, from this venv
    python -m benchmarks.gpu_carry --engine-requirements   # the pinned engine list, from this venv
    python -m benchmarks.gpu_carry --sizes                 # what each of the two calls carries (exit 1: too much)

Two lists, both `name==version` at the versions installed here (benchmarks/gpu_carry.sh writes them and
downloads their wheels; docs/gpu.md):

- the base list (gpu_suite_requirements.txt): rolectl's requirements with its test extra, and theirs,
  less torch and numpy with theirs (the machine's CUDA build must stay);
- the engine list (gpu_suite_engine_requirements.txt): what the `hf` and `fsdp` engines need beyond
  the base list (`.[hf]` and `.[verl-core]`, verl itself installed without its dependencies, as CI
  does), less what the GPU machine's image already has (gpu_machine_packages.txt): transformers,
  pyarrow, pandas, peft ... stay the image's.

The ray wheel is larger than one call may carry (64 MiB with the working tree), so gpu_carry.sh splits
it in two (benchmarks/gpu_two_part.sh): part 1 travels in call 1 (device_carry/call1), which leaves it
on the machine under the ignored device_carry/; part 2 and every other wheel in call 2
(device_carry/call2), which joins the parts, checks the whole against the manifest, installs and runs
the suite.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import subprocess
import sys
from pathlib import Path

__all__ = [
    "CALL_LIMIT_BYTES", "CARRY", "ENGINE_REQUIREMENTS_FILE", "REQUIREMENTS_FILE", "carry_requirements",
    "check_requirements", "engine_requirements", "machine_packages", "travel_sizes",
]

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS_FILE = ROOT / "benchmarks" / "gpu_suite_requirements.txt"
ENGINE_REQUIREMENTS_FILE = ROOT / "benchmarks" / "gpu_suite_engine_requirements.txt"
MACHINE_PACKAGES_FILE = ROOT / "benchmarks" / "gpu_machine_packages.txt"
CARRY = ROOT / "device_carry"  # ignored (.gitignore): call1/ and call2/ travel as `carry` paths
CALL_LIMIT_BYTES = 64 << 20  # the working tree plus the carried paths, per call (the device tool's limit)

# What the bare GPU machine brings (with their dependencies): never carried, so a pinned wheel cannot
# replace the build torch was made with. Everything else rolectl needs is carried, pinned.
PRESENT = ("torch", "numpy")
# Carried besides rolectl's own requirements: the config helpers' libraries, when installed here.
EXTRA_ROOTS = ("msgspec", "pydantic", "pydantic-settings")
# Carried even though torch brings one: the editable install of rolectl needs setuptools >= 68.
ALWAYS = ("setuptools",)
# rolectl's requirements that the suite does not need on the GPU machine (a browser, heavy extras).
NOT_CARRIED = ("playwright", "ruff", "mypy", "import-linter", "mkdocs", "mkdocs-material")
# The engines' extras (pyproject.toml) and what is installed without its dependencies (verl pins an
# older transformers than the machine's, as CI's install notes).
ENGINE_EXTRAS = ("hf", "verl-core")
NO_DEPS = ("verl",)


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


def _closure(roots: list[tuple[str, set[str]]], *, stop: set[str] = frozenset()) -> set[str]:
    """`roots` and their dependencies, not looking past the names in `stop`."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        if name in seen and not extras:
            continue
        seen.add(name)
        if name in stop:
            continue
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


def _present() -> set[str]:
    return _closure([(_norm(p), set()) for p in PRESENT]) - set(map(_norm, ALWAYS))


def _carried() -> set[str]:
    return _closure(_roots()) - _present() - {"rolectl"}


def machine_packages(path: Path = MACHINE_PACKAGES_FILE) -> set[str]:
    """The GPU machine image's distributions (normalised names)."""
    return {_norm(line) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def _engine_carried() -> set[str]:
    base = {name for name, _ in _requires("rolectl")}
    roots = [r for r in _requires("rolectl", set(ENGINE_EXTRAS)) if r[0] not in base and r[0] != "rolectl"]
    roots += [(_norm(name), set()) for name in NO_DEPS]
    stop = _present() | _carried() | machine_packages() | set(map(_norm, NO_DEPS))
    return (_closure(roots, stop=stop) - (stop - set(map(_norm, NO_DEPS)))) - {"rolectl"}


def carry_requirements() -> list[str]:
    """`name==version` of every distribution to carry: rolectl's requirements (with its test extra)
    and theirs, less torch and numpy with theirs, at the versions installed here."""
    return [f"{name}=={md.version(name)}" for name in sorted(_carried())]


def engine_requirements() -> list[str]:
    """`name==version` of what the engines add: `.[hf,verl-core]` and verl, with their dependencies,
    less the base list and the GPU machine's image, at the versions installed here."""
    return [f"{name}=={md.version(name)}" for name in sorted(_engine_carried())]


def check_requirements(path: Path = REQUIREMENTS_FILE, *, engines: bool = False) -> list[str]:
    """Problems with the carry list at `path` (the engine list with `engines`), without network:
    each line pins an installed distribution, every dependency is listed (or is the base list's,
    torch's, or the machine's), and the engine list replaces nothing the machine has. A pin older
    or newer than the installed version is no problem: gpu_carry.sh pins what the venv that builds
    the carry has, so a dependency's new release never breaks CI."""
    flag = "--engine-requirements" if engines else "--requirements"
    if not path.exists():
        return [f"{path}: missing; write it with `python -m benchmarks.gpu_carry {flag} > {path}`"]
    problems, pinned = [], {}
    on_machine = machine_packages() if engines else set()
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version:
            problems.append(f"{path}:{lineno}: {line!r} is not pinned as name==version")
            continue
        pinned[_norm(name)] = version
        if _norm(name) in on_machine:
            problems.append(f"{path}:{lineno}: {name} is in the GPU machine's image (gpu_machine_packages.txt): "
                            "carrying it would replace the image's build")
        try:
            md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"{path}:{lineno}: {name} is not installed in this environment")
    for name in sorted(_engine_carried() if engines else _carried()):
        if name not in pinned:
            problems.append(f"{path}: {name} (needed by rolectl or a listed distribution) is not listed; "
                            "run benchmarks/gpu_carry.sh")
    return problems


# -- what travels -----------------------------------------------------------------------------------

def _tree_bytes(root: Path = ROOT) -> int:
    """The working tree as the device tool sends it: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True, timeout=60).stdout.split(b"\0")
    total = 0
    for name in filter(None, listed):
        path = root / name.decode()
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def travel_sizes(carry: Path = CARRY) -> dict[str, int | bool]:
    """Bytes each call sends: the working tree plus `call1/` (call 1) or `call2/` (call 2)."""
    tree = _tree_bytes()
    call1, call2 = tree + _dir_bytes(carry / "call1"), tree + _dir_bytes(carry / "call2")
    return {"tree": tree, "call1": call1, "call2": call2, "limit": CALL_LIMIT_BYTES,
            "fits": max(call1, call2) <= CALL_LIMIT_BYTES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_carry", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--requirements", action="store_true", help="print the pinned base list from this venv")
    what.add_argument("--engine-requirements", action="store_true", help="print the pinned engine list")
    what.add_argument("--sizes", action="store_true", help="bytes each call sends; exit 1 when one is over 64 MiB")
    args = parser.parse_args(argv)
    if args.sizes:
        sizes = travel_sizes()
        print(json.dumps(sizes))
        return 0 if sizes["fits"] else 1
    if args.requirements:
        print("# benchmarks/gpu_carry.sh writes this: rolectl's non-torch requirements, pinned")
        print("\n".join(carry_requirements()))
    else:
        print("# benchmarks/gpu_carry.sh writes this: what the hf and fsdp engines add (.[hf,verl-core], verl "
              "without its dependencies), less the base list and the GPU machine's image, pinned")
        print("\n".join(engine_requirements()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
