"""Whether a trainer or explorer that finds saved state on disk resumes from it.

A restart (the process crashed or was stopped, and the job goes on) must resume: the job's stream
records the member's previous incarnation, unfinished. A re-run of a job name on a fresh stream finds
the state of an earlier run instead; resuming from it silently made a second quickstart trainer
"finish" in 0.1 s. So, by default (`auto`):

| saved state | the stream records the member | start                                        |
|-------------|-------------------------------|----------------------------------------------|
| none        | any                           | fresh                                        |
| yes         | yes, not finished             | resume (a restart), said at warning level    |
| yes         | yes, finished                 | refused: its work is done, nothing to resume |
| yes         | no                            | refused: state of another run                |

`--resume` resumes from whatever is saved; `--fresh` discards it, and is refused while the stream
records the member (the stream's history would contradict a member starting over).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

__all__ = ["StartMode", "StartRefused", "SavedState", "decide_resume"]


class StartMode(enum.Enum):
    AUTO = "auto"
    RESUME = "resume"
    FRESH = "fresh"


class StartRefused(ValueError):
    """The member will not start from what it found; the message says why and which flag to pass."""


@dataclass(frozen=True)
class SavedState:
    """What a member found on disk: its state file and the step it holds (None: nothing saved)."""

    path: Path
    step: int | None


def decide_resume(mode: StartMode, saved: SavedState, recorded, *, job: str, member: str, where: str) -> bool:
    """True to resume from `saved`, False to start from step 0 (discarding `saved` is the caller's
    part); raise `StartRefused` when neither is what the user meant. `recorded` is the member's
    state in the job's stream (`sync_protocol.MemberState`, None if the stream never saw it); `where`
    names the stream (URL) for messages."""
    if saved.step is None:
        if mode is StartMode.RESUME:
            raise StartRefused(f"{member}: --resume, but there is nothing to resume from ({saved.path} does not "
                               "exist); drop --resume to start from step 0")
        return False
    seen = (f"the stream of job {job!r} on {where} records {member} at step {recorded.step}"
            if recorded is not None else f"the stream of job {job!r} on {where} has no record of {member}")
    if mode is StartMode.RESUME:
        return True
    if mode is StartMode.FRESH:
        if recorded is not None:
            raise StartRefused(f"{member}: --fresh, but {seen}: starting it over would contradict the job's "
                               "history. Use a job name this server has not seen (or a fresh server), or "
                               "drop --fresh to resume")
        return False
    if recorded is None:
        raise StartRefused(f"{member}: {saved.path} holds step {saved.step} of an earlier run, and {seen}, so "
                           f"this is not a restart. Pass --fresh to discard it and start from step 0, "
                           f"--resume to continue from step {saved.step}, or use another job name or run_dir")
    if recorded.finished:
        raise StartRefused(f"{member}: its work is done ({seen}, finished; saved state {saved.path} at step "
                           f"{saved.step}): there is nothing to resume. To train again use a new job name "
                           "(or a fresh server); --resume rejoins anyway")
    return True
