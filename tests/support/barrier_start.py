"""`python -m tests.support.barrier_start BARRIER_DIR <rolectl arguments>`: rolectl, held at the point
where a start claims its member's identity until the test releases BARRIER_DIR, so that starts
released together claim at the same instant (two supervisors, or a supervisor and a person, starting
one member back to back).

Only a wait is added, nothing is replaced: before `MemberSession.refuse_if_live` (a trainer or an
explorer: the live check and the claim) and before `Synchronizer._load_snapshot` (a synchronizer: its
claim follows), the process writes `BARRIER_DIR/<pid>.arrived` and opens the FIFO `BARRIER_DIR/go`
for reading. That open returns in every waiting process at once when the test opens the FIFO for
writing (`release`); each then writes `<pid>.passed`.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from tests.support.wait import wait_until

__all__ = ["make_barrier", "release", "RUNNER"]

RUNNER = ("-m", "tests.support.barrier_start")  # what LiveJob.start runs instead of `-m rolectl`


def make_barrier(path: Path) -> Path:
    path.mkdir(parents=True)
    os.mkfifo(path / "go")
    return path


async def release(path: Path, count: int, *, timeout: float, details=None) -> None:
    """Once `count` processes wait at the barrier `path`, let them all go at once."""
    await wait_until(lambda: len(list(path.glob("*.arrived"))) >= count, timeout=timeout,
                     what=f"{count} starts to reach the barrier {path.name}", poll=0.05, details=details)

    def open_for_writing() -> int | None:
        try:  # non-blocking: fails (ENXIO) while no reader has the FIFO open yet
            return os.open(path / "go", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return None

    fd = await wait_until(open_for_writing, timeout=30, what=f"a reader of {path.name}/go", poll=0.01)
    try:  # held open until every waiting process is through: a late reader's open returns at once
        await wait_until(lambda: len(list(path.glob("*.passed"))) >= count, timeout=30,
                         what=f"{count} starts to pass the barrier {path.name}", poll=0.01, details=details)
    finally:
        os.close(fd)


def _hold(barrier: Path, original):
    async def held(self, *args, **kwargs):
        if not getattr(_hold, "passed", False):
            _hold.passed = True
            (barrier / f"{os.getpid()}.arrived").touch()
            fd = await asyncio.to_thread(os.open, barrier / "go", os.O_RDONLY)  # until the test opens it
            os.close(fd)
            (barrier / f"{os.getpid()}.passed").touch()
        return await original(self, *args, **kwargs)

    return held


def main() -> None:
    barrier, *argv = sys.argv[1:]
    from rolectl.roles.cli import main as rolectl
    from rolectl.roles.session import MemberSession
    from rolectl.roles.synchronizer import Synchronizer

    MemberSession.refuse_if_live = _hold(Path(barrier), MemberSession.refuse_if_live)
    Synchronizer._load_snapshot = _hold(Path(barrier), Synchronizer._load_snapshot)
    sys.argv = ["rolectl", *argv]
    rolectl()


if __name__ == "__main__":
    main()
