"""The `python` tool: runs model-written code in a child process with CPU, memory, file-size and
wall-clock limits, no network, a fresh scratch directory and a minimal environment.

How (docs/security.md says exactly what this does and does not isolate):

- the child is `unshare --net --pid --fork --kill-child --mount-proc` (util-linux) when this process
  may create namespaces (as root, or through an unprivileged user namespace, `--map-root-user`): no
  network interface but loopback, its own process tree (every process it starts dies with it; `/proc`
  shows only them). Without namespaces a job that asked for `network: isolated` (the default) refuses
  to start the tool; `network: allowed` runs it without (the code can then reach the network).
- inside, a small supervisor (the job's own interpreter, `python -I`) forks the code's process, which
  first sets its limits (`RLIMIT_CPU`, `RLIMIT_AS`, `RLIMIT_FSIZE`, `RLIMIT_NOFILE`, no core files),
  then runs the code; the supervisor reports how it ended (exit code or signal, CPU seconds) on a
  pipe the code cannot reach.
- the wall-clock limit is the parent's: past it the whole process group is killed.
- stdout and stderr go to files bounded by `RLIMIT_FSIZE`; what the model sees is truncated to
  `max_output_chars` (the head of stdout, the tail of stderr, where a traceback's last line is).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rolectl.roles.config_base import PositiveInt, PositiveNumber, Section

from .tool_calls import ToolError, ToolTimeout

__all__ = ["PythonLimits", "PythonRunner", "RunResult", "python_tool", "network_isolation", "IsolationUnavailable"]

# Runs in the child: fork the code's process, which limits itself and runs main.py; report its end.
_SUPERVISOR = r"""
import json, os, resource, sys
cpu_s, memory, fsize, nofile, status_fd = (int(a) for a in sys.argv[1:6])
pid = os.fork()
if pid == 0:
    os.close(status_fd)
    for what, soft, hard in ((resource.RLIMIT_CPU, cpu_s, cpu_s + 1), (resource.RLIMIT_AS, memory, memory),
                             (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
                             (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(what, (soft, hard))
    sys.argv = ["main.py"]
    code = compile(open("main.py", encoding="utf-8").read(), "main.py", "exec")
    del json, os, resource, cpu_s, memory, fsize, nofile, status_fd, pid
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    raise SystemExit(0)
_, status, usage = os.wait4(pid, 0)
end = {"exit": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}
os.write(status_fd, json.dumps(end).encode())
"""

_SUPERVISOR_FRAME = re.compile(r'  File "<string>", line \d+, in <module>\n')  # a traceback's first frame
_NAMESPACES = ("--net", "--pid", "--fork", "--kill-child", "--mount-proc")


class IsolationUnavailable(RuntimeError):
    """Network isolation was asked for and this process cannot create a network namespace."""


class PythonLimits(Section):
    """The `python` tool's limits (the agent section's `tool_options: {python: {...}}`)."""

    cpu_s: PositiveInt = 5
    """CPU seconds the code may use (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later)."""
    memory_mb: PositiveInt = 512
    """Address space of the code's process (RLIMIT_AS): an allocation past it fails (MemoryError)."""
    wall_s: PositiveNumber = 10.0
    """Wall-clock seconds before the whole process group is killed (sleeping code uses no CPU)."""
    max_file_mb: PositiveInt = 16
    """Largest file the code may write, stdout and stderr included (RLIMIT_FSIZE)."""
    max_open_files: PositiveInt = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_output_chars: PositiveInt = 2000
    """What the model sees of stdout and of stderr, each."""
    network: Literal["isolated", "allowed"] = "isolated"
    """isolated: run in a new network namespace or not at all; allowed: without one."""


DEFAULT_LIMITS = PythonLimits()


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """How one run ended: exit code (negative: the signal that killed it), the limit it hit if any
    (`cpu`, `wall`, `memory`), CPU seconds, and stdout/stderr as the model sees them."""

    exit_code: int
    limit: str | None
    cpu_s: float
    stdout: str
    stderr: str


@functools.cache
def network_isolation() -> tuple[str, ...] | None:
    """The `unshare` prefix that gives a child no network and its own process tree, or None when
    this process may not create the namespaces (tried once per process: as is, then through a user
    namespace)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ((unshare, *_NAMESPACES), (unshare, "--map-root-user", *_NAMESPACES)):
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix
    return None


class PythonRunner:
    """Runs code under `limits`; `run(code)` never raises for anything the code does."""

    def __init__(self, limits: PythonLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        prefix = network_isolation()
        if prefix is None and limits.network == "isolated":
            raise IsolationUnavailable(
                "the python tool runs code without network, and this process cannot create a network namespace "
                "(`unshare --net` failed, also through a user namespace): run the explorer where it may (as root, "
                "or with unprivileged user namespaces enabled), or set the tool option python.network: allowed "
                "to run code WITH network access (docs/security.md)")
        # network allowed: the same namespaces but the network's (its own process tree still)
        self.prefix: tuple[str, ...] = tuple(a for a in prefix or () if a != "--net" or limits.network == "isolated")

    def run(self, code: str) -> RunResult:
        scratch = Path(tempfile.mkdtemp(prefix="rolectl-python-"))
        try:
            (scratch / "main.py").write_text(code, encoding="utf-8")
            return self._run_in(scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _run_in(self, scratch: Path) -> RunResult:
        limits = self.limits
        read_end, write_end = os.pipe()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch),
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        argv = [*self.prefix, sys.executable, "-I", "-c", _SUPERVISOR, str(limits.cpu_s),
                str(limits.memory_mb << 20), str(limits.max_file_mb << 20), str(limits.max_open_files), str(write_end)]
        with open(scratch / ".stdout", "wb") as out, open(scratch / ".stderr", "wb") as err:
            try:
                proc = subprocess.Popen(argv, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, pass_fds=(write_end,), start_new_session=True)
            finally:
                os.close(write_end)
            try:
                proc.wait(timeout=limits.wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)  # whatever the code left running dies with it
        with os.fdopen(read_end, "rb") as status_pipe:
            status = _status(status_pipe.read())
        exit_code = int(status.get("exit", proc.returncode if proc.returncode is not None else -signal.SIGKILL))
        cpu_s = float(status.get("cpu_s", 0.0))
        stderr = _SUPERVISOR_FRAME.sub("", _read(scratch / ".stderr", limits.max_output_chars, tail=True))
        # SIGXCPU at the soft CPU limit, SIGKILL a second later at the hard one
        out_of_cpu = exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_s >= limits.cpu_s - 0.1)
        limit = "wall" if timed_out else "cpu" if out_of_cpu else \
            "memory" if exit_code != 0 and "MemoryError" in stderr else None
        return RunResult(exit_code=exit_code, limit=limit, cpu_s=cpu_s, stderr=stderr,
                         stdout=_read(scratch / ".stdout", limits.max_output_chars, tail=False))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _status(raw: bytes) -> dict:
    try:
        status = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}


def _read(path: Path, max_chars: int, *, tail: bool) -> str:
    """At most `max_chars` of a file written by the code (its head, or its tail), marked when cut."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if tail and size > 4 * max_chars:
            f.seek(size - 4 * max_chars)  # a UTF-8 character is at most 4 bytes
        text = f.read(4 * max_chars + 4).decode("utf-8", errors="replace")
    if len(text) <= max_chars and size <= 4 * max_chars:
        return text
    cut = f"[... {size} bytes in all, cut]"
    return f"{cut}\n{text[-max_chars:]}" if tail else f"{text[:max_chars]}\n{cut}"


def python_tool(limits: PythonLimits = DEFAULT_LIMITS) -> Callable[[str], str]:
    """The `python` tool as a function the tool environment declares (its schema from the docstring)."""
    runner = PythonRunner(limits)

    def python(code: str) -> str:
        """Run Python code in a fresh process and return what it prints (stdout, then stderr).

        Args:
            code: A Python program; print the values you need.
        """
        result = runner.run(code)
        if result.limit in ("wall", "cpu"):
            seconds = limits.wall_s if result.limit == "wall" else limits.cpu_s
            raise ToolTimeout(f"the code ran past its {result.limit} time limit of {seconds:g} s and was killed")
        if result.exit_code != 0:
            how = f"exit code {result.exit_code}" if result.exit_code > 0 else \
                f"killed by {signal.Signals(-result.exit_code).name}"
            raise ToolError(f"{how}\n{result.stderr}".rstrip())
        text = result.stdout if not result.stderr else f"{result.stdout}\n[stderr]\n{result.stderr}"
        return text if text.strip() else "(no output)"

    python.runner = runner  # type: ignore[attr-defined]
    return python
