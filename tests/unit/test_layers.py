"""Imports point one way: `sync_protocol` ← `bus` ← `roles.engines` ← role loops ← `roles.observe` ←
`roles.launch` ← `roles.cli`. Every import counts, those inside functions too (a lazy import is still
an edge: it only hides it)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sync_protocol", "bus", "roles")

# lowest first; a module may import its own layer and those below it
LAYERS = (
    "rolectl.sync_protocol",
    "rolectl.bus",
    "rolectl.roles.engines",
    "role loops",  # roles.session, trainer, explorer, synchronizer, transports, config, runner, provision
    "rolectl.roles.observe",
    "rolectl.roles.launch",
    "rolectl.roles.cli",
)


def layer_of(module: str) -> int:
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    if module == "rolectl.roles" or module.startswith("rolectl.roles."):
        return LAYERS.index("role loops")
    raise AssertionError(f"{module} is in no layer")


def _module_name(path: Path) -> str:
    parts = ["rolectl", *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return [(line, name) for line, name in out if name.split(".")[:2][-1] in PACKAGES and name.startswith("rolectl.")]


def _edges():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_name(path)
            for line, imported in _imports(path, module):
                yield path, line, module, imported


def test_every_import_points_down_the_layers():
    upward = [f"{path.relative_to(ROOT)}:{line}: {module} ({LAYERS[layer_of(module)]}) imports {imported} "
              f"({LAYERS[layer_of(imported)]})"
              for path, line, module, imported in _edges() if layer_of(imported) > layer_of(module)]
    assert upward == []


def test_the_engine_contract_does_not_need_the_nats_layer():
    # experiences are data (sync_protocol.experience): importing the engines loads no NATS client
    code = ("import sys, json; import rolectl.roles.engines, rolectl.roles.engines.base, rolectl.roles.engines.tiny; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'nats' "
            "or m in ('rolectl.bus.connection', 'rolectl.bus.experiences', 'rolectl.bus.events'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_the_layering_sees_lazy_imports():
    # the test is only as good as its reading of the source: a function-level import is an edge
    edges = {(module, imported) for _, _, module, imported in _edges()}
    assert ("rolectl.roles.cli", "rolectl.roles.launch.local") in edges  # imported inside `rolectl up`
    assert layer_of("rolectl.roles.observe.status") > layer_of("rolectl.roles.session") > layer_of("rolectl.roles.engines.base")
