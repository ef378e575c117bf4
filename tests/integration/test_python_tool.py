"""The `python` tool's child process, for real: each limit stops hostile code, the network is out of
reach, nothing the code starts outlives it, and the tool environment counts each end."""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

import pytest

from rolectl.roles.engines.agent.python_tool import (
    IsolationUnavailable,
    PythonLimits,
    PythonRunner,
    network_isolation,
)
from rolectl.roles.engines.agent.tools import ToolEnvironment
from rolectl.roles.engines.base import Task

# generous walls: the machine running the tests may be busy, and CPU seconds take longer than wall ones then
LIMITS = PythonLimits(cpu_s=1, memory_mb=256, wall_s=60, max_output_chars=300, max_file_mb=1)


@pytest.fixture(scope="module")
def runner() -> PythonRunner:
    return PythonRunner(LIMITS)


def test_code_runs_in_a_fresh_scratch_directory_with_a_minimal_environment(runner):
    result = runner.run("import os, json\nopen('note', 'w').write('x')\n"
                        "print(json.dumps({'cwd': os.getcwd(), 'env': sorted(os.environ), 'files': os.listdir('.')}))")
    assert result.exit_code == 0 and result.limit is None
    seen = json.loads(result.stdout)
    assert seen["env"] == ["HOME", "LANG", "LC_ALL", "PATH", "TMPDIR"]
    assert Path(seen["cwd"]).name.startswith("rolectl-python-") and "main.py" in seen["files"]
    assert not Path(seen["cwd"]).exists()  # removed after the run
    assert runner.run("import os; print(os.listdir('.'))").stdout.strip() != str(seen["files"])  # a new one


def test_a_cpu_loop_is_killed_at_its_cpu_limit(runner):
    started = time.monotonic()
    result = runner.run("while True:\n    pass")
    assert result.limit == "cpu" and result.exit_code < 0
    assert result.cpu_s >= 0.9
    assert time.monotonic() - started < LIMITS.wall_s


def test_a_memory_bomb_is_refused_its_memory(runner):
    result = runner.run("blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))")
    assert result.limit == "memory" and result.exit_code == 1
    assert result.stderr.rstrip().endswith("MemoryError")


def test_sleeping_code_is_killed_at_the_wall_limit():
    runner = PythonRunner(PythonLimits(wall_s=1.5, cpu_s=5))
    started = time.monotonic()
    result = runner.run("import time\ntime.sleep(60)")
    assert result.limit == "wall"
    assert time.monotonic() - started < 20


def test_output_is_bounded_and_cut_for_the_model(runner):
    result = runner.run("import sys\nprint('o' * 5000)\nsys.stderr.write('e' * 5000 + 'END')\nraise SystemExit(3)")
    assert result.exit_code == 3
    assert result.stdout.startswith("o" * 300) and "cut]" in result.stdout and len(result.stdout) < 400
    assert result.stderr.endswith("eeeEND")  # the tail: where a traceback says what went wrong
    big = runner.run("open('big', 'wb').write(b'x' * (2 << 20))")  # past max_file_mb
    assert big.exit_code == 1 and "File too large" in big.stderr


def test_nothing_the_code_starts_outlives_it(runner):
    token = uuid.uuid4().hex
    result = runner.run(f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
                        f"'import time; time.sleep(300)', '{token}'], start_new_session=True)\nprint('started')")
    assert result.stdout.strip() == "started"

    def alive() -> bool:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if token.encode() in cmdline.read_bytes():
                    return True
            except OSError:
                pass
        return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:  # a killed process is reaped by its parent's exit
        time.sleep(0.05)
    assert not alive()


def test_the_network_is_out_of_reach_or_the_tool_refuses_to_start():
    """A listener on this host's loopback: reachable from here, not from the code."""
    if network_isolation() is None:  # this host may not create namespaces: isolated code cannot run here
        with pytest.raises(IsolationUnavailable, match="python.network: allowed"):
            PythonRunner(PythonLimits())
        return
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # reachable from the host
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('reached')"
        isolated = PythonRunner(LIMITS).run(code)
        assert "reached" not in isolated.stdout and isolated.exit_code == 1
        assert "ConnectionRefusedError" in isolated.stderr or "Network is unreachable" in isolated.stderr
        allowed = PythonRunner(PythonLimits(network="allowed", wall_s=60)).run(code)
        assert allowed.stdout.strip() == "reached"


def test_the_tool_environment_counts_each_way_the_code_ends():
    env = ToolEnvironment(tools=["python"], tool_timeout_s=30,
                          tool_options={"python": {"cpu_s": 1, "memory_mb": 256}})
    env.reset(Task(id="row0", prompt=(1,), prompt_text="compute"))

    def call(code: str):
        return env.step(f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>")

    ok = call("print(sum(range(10)))")
    assert ok.info == {"tool_calls/python/ok": 1.0} and ok.observation[0].content.strip() == "45"
    raised = call("raise ValueError('boom')")
    assert raised.info == {"tool_calls/python/error": 1.0}
    assert raised.observation[0].content.startswith("error: exit code 1")
    assert raised.observation[0].content.endswith("ValueError: boom")
    spun = call("while True: pass")
    assert spun.info == {"tool_calls/python/timeout": 1.0}
    assert "cpu time limit of 1 s" in spun.observation[0].content
    assert call("pass").observation[0].content == "(no output)"
