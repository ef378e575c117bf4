"""What `rolectl up` shows on its console: the progress line and table while the job runs, the
run summary's table at its end, and its own log lines (above the live table, as text for people)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from rolectl.roles.launch.base import RoleHandle
from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.observe.views import SUMMARY_MEANINGS, progress_text, version_text
from rolectl.sync_protocol import Role

__all__ = ["PIPE_LINE_S", "Progress", "progress_view", "summary_table", "SUMMARY_SHOWN", "ConsoleLog"]


class ConsoleLog:
    """A text stream that prints each complete line through `console`: log lines written to it
    appear above a live display instead of over it (structlog and logging write whole lines)."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._partial = ""

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self._console.print(line, markup=False, highlight=False, soft_wrap=True, style="dim")
        return len(text)

    def flush(self) -> None:
        pass


PIPE_LINE_S = 10.0  # how often `up` in a pipe prints a progress line


class Progress:
    """Trainer steps against the total, the rate since the first step, and the time left."""

    def __init__(self, total: int):
        self.total = total
        self.steps = 0
        self._first: tuple[int, float] | None = None  # (steps, monotonic time) when steps were first seen
        self.rate: float | None = None  # steps per second

    def update(self, steps: int, now: float) -> None:
        self.steps = steps
        if steps and self._first is None:
            self._first = (steps, now)
        elif self._first is not None and steps > self._first[0] and now > self._first[1]:
            self.rate = (steps - self._first[0]) / (now - self._first[1])

    @property
    def left_s(self) -> float | None:
        return (self.total - self.steps) / self.rate if self.rate else None

    def line(self) -> str:
        pct = f"{self.steps / self.total:.0%}" if self.total else "?"
        rate = f"{self.rate:.2f} steps/s" if self.rate else "rate: waiting for steps"
        left = f"~{_duration(self.left_s)} left" if self.left_s is not None else "time left: unknown yet"
        return f"trainer step {self.steps}/{self.total} ({pct}) · {rate} · {left}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else (
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s")


def progress_view(cfg, view: JobObserver, processes: list[RoleHandle], progress: Progress):
    from rich.console import Group
    from rich.progress_bar import ProgressBar

    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=progress.total, completed=progress.steps, width=40), progress.line())
    return Group(bar, _progress_table(cfg, view, processes))


def _progress_table(cfg, view: JobObserver, processes: list[RoleHandle]) -> Table:
    table = Table(title=f"job {cfg.job} · latest version {view.latest()['version']}", expand=False)
    for col in ("member", "status", "step", "version", "reward", "process"):
        table.add_column(col)
    procs = {p.member_id: p for p in processes}
    for row in view.members():
        proc = procs.get(row["id"]) or procs.get("sync-0" if row["role"] == Role.SYNCHRONIZER.value else "")
        reward = row["metrics"].get("reward_mean")
        table.add_row(row["key"], row["status"], progress_text(row), version_text(row),
                      f"{reward:.3f}" if reward is not None else "",
                      "running" if proc and proc.poll() is None else (f"exit {proc.returncode}" if proc else ""))
    return table


SUMMARY_SHOWN = ("job", "complete", "end_reason", "engines", "trainer_world_size", "hf_model_dir", "model_parameters",
                 "trainable_parameters",
                 "trainer_steps", "explorer_steps",
                 "syncs", "rounds", "weight_loads", "final_version", "reward_first", "reward_last",
                 "experiences_produced", "experiences_trained", "experiences_dropped_stale",
                 "experiences_corrected_stale", "experiences_filtered", "groups_filtered",
                 "experiences_left_untrained", "explorer_pauses", "mismatch_alarms", "agent",
                 "weights_bytes_moved", "weights_bytes_per_sync", "sync_wait_ms", "wall_s", "run_dir")


# a trainer of ranks; an engine that exports; a LoRA adapter; an agent job
_SHOWN_WHEN_SET = ("trainer_world_size", "hf_model_dir", "trainable_parameters", "agent")
# what only a job that paces its explorers (synchronizer.max_ahead) or measures the rollout/trainer
# gap (algorithm.rollout_correction), keeps stale experiences (staleness_policy: correct) or filters
# groups (algorithm.dynamic_sampling) counts
_SHOWN_WHEN_NONZERO = ("explorer_pauses", "mismatch_alarms", "experiences_corrected_stale",
                       "experiences_filtered", "groups_filtered")


def summary_table(summary: dict) -> Table:
    """The summary's figures, each beside what it counts (a sync, a load and a wait are not one thing)."""
    table = Table(title="run summary", show_header=False)
    table.add_column("figure", no_wrap=True)
    table.add_column("value", overflow="fold", ratio=1)
    table.add_column("what it counts", style="dim", no_wrap=True)
    served = ("served_requests", "rewarded", "expired") if "served_requests" in summary else ()
    for key in (*SUMMARY_SHOWN, *served):
        if key in _SHOWN_WHEN_SET and key not in summary:
            continue
        if key in _SHOWN_WHEN_NONZERO and not summary.get(key):
            continue
        table.add_row(key, json.dumps(summary.get(key)), SUMMARY_MEANINGS.get(key, ""))
    return table
