"""The launcher seam of `rolectl up`: what a supervisor needs from whatever runs the roles (local
processes, Ray actors): start a role, watch it, stop everyone, read its exit code and its log.

The supervisor (`roles.launch.local.supervise`) is written against these two protocols only, so every
launcher gets the same progress table, the same teardown order and the same summary.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["RoleHandle", "Launcher", "ROLE_ORDER"]

# The order `up` starts roles in (and the order of `Launcher.start` calls): the synchronizer first,
# so it is there to fold the first joins; then the trainer; then every explorer.
ROLE_ORDER = ("sync", "trainer", "explorer")


@runtime_checkable
class RoleHandle(Protocol):
    """One role of the job as its launcher runs it."""

    role: str  # "sync", "trainer" or "explorer" (the `rolectl start` argument)
    member_id: str

    @property
    def name(self) -> str:
        """How the summary and the progress table name it (its member id)."""
        ...

    def poll(self) -> int | None:
        """Its final exit code, or None while it runs (or is being restarted by its launcher).
        Never blocks."""
        ...

    @property
    def returncode(self) -> int | None:
        """The code `poll()` last returned (None while running)."""
        ...

    @property
    def restarts(self) -> int:
        """How many times the launcher started it again after a crash (0 for a launcher that does not)."""
        ...

    def tail(self, lines: int = 15) -> str:
        """The last lines of its log (for a failure message)."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Starts the roles of one job, all reading the same job file and NATS URL, and stops them."""

    name: str  # "local", "ray": recorded in the summary as `launcher`

    def start(self, role: str, member_id: str) -> RoleHandle:
        """Start `rolectl start ROLE --id MEMBER_ID` against the job's config and NATS URL."""
        ...

    async def stop_all(self, handles: list[RoleHandle], grace_s: float = 15.0) -> None:
        """SIGINT every running role (roles publish STOPPED), SIGKILL what is left after `grace_s`.
        Idempotent: a second call after everyone exited returns at once."""
        ...
