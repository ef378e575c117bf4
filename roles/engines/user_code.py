"""The user's own code a job names as `module:name` (a reward function, an environment class), found
the same way under the `rolectl` script and `python -m rolectl`.

Two forms:

- `package.module:name`: imported from the working directory, then the Python path. `python -m`
  puts the working directory first on `sys.path` and a console script does not (its own `bin/`
  directory is there instead), so a module beside the job would import under one and not the
  other; the first resolve puts the working directory first, as `python -m` does.
- `path/to/file.py:name`: that file, relative to the working directory like every path in a job
  (`data.path`), loaded once per process whatever the Python path.

Every process that uses the object imports it itself (an explorer its rewards): start each where
the code is, or put its directory on PYTHONPATH.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
import zlib
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["resolve_object"]


def _working_directory_first() -> None:
    """Put the working directory first on `sys.path` unless it is there already (as `''` or itself):
    what `python -m` does before it runs anything."""
    cwd = os.getcwd()
    if not any(entry in ("", ".", cwd) for entry in sys.path):
        sys.path.insert(0, cwd)


def resolve_object(spec: str, *, what: str, kind: str = "function", builtins: Mapping[str, Any] | None = None) -> Any:
    """The object `spec` names: a name in `builtins`, `package.module:name` or `path/to/file.py:name`.

    `what` is what the caller calls it in messages ("reward", "environment"), `kind` what it is
    ("function", "class"). Raises ValueError
    saying what was looked for, where, and what to write instead; checking what the object is
    (callable, a class) is the caller's.
    """
    builtins = builtins or {}
    if spec in builtins:
        return builtins[spec]
    module_name, colon, attr = spec.rpartition(":")
    if not colon or not module_name or not attr:
        known = f"built-ins: {sorted(builtins)}, or " if builtins else ""
        raise ValueError(f"unknown {what} {spec!r}; {known}give your own as 'module:{kind}' (imported "
                         f"from the working directory or the Python path) or 'path/to/file.py:{kind}'")
    module = _load_file(spec, module_name, what) if module_name.endswith(".py") else _import(spec, module_name, what)
    if not hasattr(module, attr):
        raise ValueError(f"{what} {spec!r}: {module_name} ({module.__file__}) has no {kind} {attr!r}")
    return getattr(module, attr)


def _import(spec: str, module_name: str, what: str) -> ModuleType:
    _working_directory_first()
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(
                f"{what} {spec!r}: cannot import module {module_name!r}: no {module_name.replace('.', '/')}.py "
                f"(or package) in the working directory {os.getcwd()} or on the Python path; run rolectl "
                "where it is (every explorer imports it), add its directory to PYTHONPATH, or name the file: "
                f"'path/to/{module_name.rpartition('.')[2]}.py:{spec.rpartition(':')[2]}'") from None
        raise ValueError(f"{what} {spec!r}: importing {module_name!r} failed: {_last_line(exc)}") from None
    except Exception as exc:  # the user's module raised while it was imported: say where
        raise ValueError(f"{what} {spec!r}: importing {module_name!r} failed: {_last_line(exc)}") from None


def _load_file(spec: str, file_name: str, what: str) -> ModuleType:
    path = Path(file_name).resolve()
    if not path.is_file():
        raise ValueError(f"{what} {spec!r}: no such file {file_name} (relative paths are from the working "
                         f"directory {os.getcwd()})")
    # one module per file, under a name no import can clash with: loading it again is the same module
    name = f"_rolectl_user_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None  # a .py file always has one
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickling look their module up
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{what} {spec!r}: running {file_name} failed: {_last_line(exc)}") from None
    return module


def _last_line(exc: BaseException) -> str:
    """The exception as Python prints its last line, with where it was raised in the user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return " ".join("".join(traceback.format_exception_only(type(exc), exc)).split()) + where
