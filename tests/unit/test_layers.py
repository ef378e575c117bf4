"""Imports point one way, checked by import-linter's layers contract in pyproject.toml:
`sync_protocol` ← `bus` ← `roles.config_base` ← `roles.engines` ← role loops ← `roles.observe` ←
`roles.launch` ← `roles.cli`.
grimp (import-linter's graph) counts imports inside functions too: a lazy import is still an edge."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
LAYER_FOLDERS = {"rolectl": "rolectl", "rolectl/sync_protocol": "sync_protocol", "rolectl/bus": "bus",
                 "rolectl/roles": "roles"}


def _contract() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return contract


def _installed_layout(tmp: Path) -> Path:
    # grimp walks one top-level package on disk; the repository maps three folders under rolectl
    # (pyproject's package-dir), so lay them out as a wheel would
    for target, source in LAYER_FOLDERS.items():
        shutil.copytree(ROOT / source, tmp / target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "dashboard_static"))
    return tmp


def test_import_linter_layers_contract_holds(tmp_path):
    layout = _installed_layout(tmp_path)
    # run from the layout: lint-imports puts its working directory first on sys.path
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache",
                          "--config", str(ROOT / "pyproject.toml")], cwd=layout,
                         env={"PYTHONPATH": str(layout), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


def test_every_roles_module_is_in_a_layer():
    # import-linter leaves a module outside every layer unchecked: a new module must be placed
    layers = [name.strip() for layer in _contract()["layers"] for name in layer.split(":")]
    modules = {"rolectl.roles." + ".".join(p.relative_to(ROOT / "roles").with_suffix("").parts)
               for p in (ROOT / "roles").rglob("*.py") if p.name != "__init__.py"}
    unplaced = sorted(m for m in modules if not any(m == layer or m.startswith(layer + ".") for layer in layers))
    assert unplaced == []


def test_the_engine_contract_does_not_need_the_nats_layer():
    # experiences are data (sync_protocol.experience): importing the engines loads no NATS client
    code = ("import sys, json; import rolectl.roles.engines, rolectl.roles.engines.base, "
            "rolectl.roles.engines.tiny; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'nats' "
            "or m in ('rolectl.bus.connection', 'rolectl.bus.experiences', 'rolectl.bus.events'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []
