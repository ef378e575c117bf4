"""The protocol core stays pure: importing it pulls in no I/O, clock, randomness or GPU library."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sync_protocol"
FORBIDDEN = ("asyncio", "nats", "torch", "aiohttp", "time", "random", "socket", "threading",
             "subprocess", "datetime", "os", "rolectl.bus", "rolectl.roles", "structlog", "logging")


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def test_importing_the_core_loads_no_io_modules():
    # a fresh interpreter, so modules imported by pytest or other tests cannot hide a leak; `time`
    # is loaded by every interpreter at start-up, so it is checked statically below instead
    code = (
        "import sys; before = set(sys.modules); import rolectl.sync_protocol, rolectl.sync_protocol.reducer; "
        "import json; print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent.parent, capture_output=True,
                         text=True, check=True).stdout
    loaded = json.loads(out.splitlines()[-1])
    # msgpack itself imports datetime (for its Timestamp type); the core never does (checked below)
    leaked = sorted(m for m in loaded if _forbidden(m) and m != "datetime")
    assert leaked == []


def test_core_source_imports_nothing_forbidden():
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if _forbidden(n)]
    assert offenders == []
