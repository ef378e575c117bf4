"""The exit codes of every rolectl command, in one table (the CLI's help and the docs print it)."""

from __future__ import annotations

import enum

__all__ = ["ExitCode", "exit_code_markdown", "exit_code_table"]


class ExitCode(enum.IntEnum):
    """How a rolectl command ended; `meaning` says it in one line."""

    OK = 0
    ERROR = 1
    USAGE = 2
    INCOMPLETE = 3
    INTERRUPTED = 130

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    ExitCode.OK: "done: the job (or the command) finished its work; a synchronizer that saw every member "
                 "finish; a stopped synchronizer or server",
    ExitCode.ERROR: "failed: a role crashed or was replaced by a newer incarnation, the server could not be "
                    "reached, `replay --check` found a difference",
    ExitCode.USAGE: "did not start: bad flag (a malformed --nats URL too), config or input file, a busy port, "
                    "saved state of another run, a member that is already running",
    ExitCode.INCOMPLETE: "ended short: the job stopped before its last step (a peer never came back, "
                         "experiences ran out)",
    ExitCode.INTERRUPTED: "interrupted: Ctrl-C / SIGTERM before the work was done (`rolectl up --resume RUN_DIR`, "
                          "or a start of the same role, resumes it)",
}


def exit_code_table() -> str:
    """The table as plain text, one code a line."""
    return "\n".join(f"{int(code):>4}  {code.meaning}" for code in ExitCode)


def exit_code_markdown() -> str:
    """The table as the docs show it (docs/operations.md; a test keeps the two equal)."""
    rows = [f"| `{int(code)}` | {code.meaning} |" for code in ExitCode]
    return "\n".join(["| code | meaning |", "| --- | --- |", *rows])
