"""A command run as a person runs it in a terminal: the foreground job of a pseudo-terminal.

`pty.fork()` makes the child a session leader with the pty as its controlling terminal, so the
child (and every process it starts in its own process group) is the terminal's foreground process
group. `ctrl_c()` writes the interrupt character to the terminal: the kernel's line discipline
then sends SIGINT to that whole group, exactly what pressing Ctrl-C does, not a signal to one pid.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import sys
import termios
import threading
from pathlib import Path

from tests.support.e2e import ROOT, _descendants
from tests.support.wait import wait_until_sync

__all__ = ["TerminalJob"]


class TerminalJob:
    """`python -m rolectl ARGS` in a pseudo-terminal of `columns` x 50; what it writes goes to
    `out_path`. Use as a context manager: leaving it kills what is still running (by PID)."""

    def __init__(self, args: list[str], out_path: Path, *, columns: int = 160) -> None:
        self.out_path = out_path
        self._out = open(out_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        pid, fd = pty.fork()
        if pid == 0:  # the child: the terminal's session leader and foreground job
            try:
                os.chdir(ROOT)
                os.execve(sys.executable, [sys.executable, "-m", "rolectl", *args], env)
            finally:
                os._exit(127)
        self.pid, self._fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
        self.returncode: int | None = None
        self._pump = threading.Thread(target=self._copy_output, name="pty-output", daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:  # the terminal closed: every process that held it is gone
                return
            if not chunk:
                return
            self._out.write(chunk)
            self._out.flush()

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def ctrl_c(self) -> None:
        """Press Ctrl-C: the terminal sends SIGINT to its whole foreground process group."""
        os.write(self._fd, termios.tcgetattr(self._fd)[6][termios.VINTR])

    def signal(self, sig: int) -> None:
        """`kill -SIG` of the command's own process (as a service manager stops it)."""
        os.kill(self.pid, sig)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """The exit code, within `timeout` s (a bound on "hung")."""
        wait_until_sync(lambda: self.poll() is not None, timeout=timeout, poll=0.05,
                        what=f"pid {self.pid} to exit", details=lambda: self.output()[-4000:])
        return self.returncode

    def wait_for_output(self, text: str, timeout: float) -> None:
        def written() -> bool:
            assert self.poll() is None, f"exited {self.returncode}\n{self.output()[-4000:]}"
            return text in self.output()

        wait_until_sync(written, timeout=timeout, poll=0.2, what=f"{text!r} on the terminal")

    def __enter__(self) -> TerminalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.poll() is None:
            for pid in [*reversed(_descendants(self.pid)), self.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)  # by PID: only what this test started
                except ProcessLookupError:
                    pass
            os.waitpid(self.pid, 0)
        self._pump.join(timeout=5)
        os.close(self._fd)
        self._out.close()
