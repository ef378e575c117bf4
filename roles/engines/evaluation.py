"""Evaluation on a held-out task set: the `eval:` rows as tasks, every response scored by reward name.

The rows are read like `data:`'s (`data.open_table`: files, a saved directory, a cached dataset id,
and a split); each engine turns its rows into tasks
(the tiny engine reads each prompt's digits, the `hf` / `vllm` engines tokenize the prompt as they do
their training tasks). An eval samples `eval.samples` responses per task with the weights the engine
holds (greedy at temperature 0), scores each with every reward, and returns each reward's mean; it
makes no experiences. The explorer records the result as an `EvalFinished` event; `rolectl bench`
runs the same on saved versions.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .base import Task
from .sections import TASK_FILES
from .task import make_reverse_task

if TYPE_CHECKING:
    from .data import TaskRow

__all__ = [
    "EVAL_FORMATS",
    "EvalResult",
    "Generates",
    "eval_config_problems",
    "eval_reward_names",
    "load_eval_rows",
    "tiny_eval_tasks",
    "evaluate",
]

EVAL_FORMATS = tuple(TASK_FILES)
_TINY_REWARDS = ("positional_match", "exact_match")


@runtime_checkable
class Generates(Protocol):
    """A rollout engine that can evaluate: plain sampling, as text, nothing recorded."""

    def generate(self, tasks: Sequence[Task], *, temperature: float, samples: int, seed: int) -> list[list[str]]:
        """`samples` decoded responses per task, in task order; greedy at temperature 0."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalResult:
    """Each reward's mean over `responses` responses to `tasks` tasks, and how long it took."""

    rewards: dict[str, float] = field(default_factory=dict)
    tasks: int = 0
    responses: int = 0
    seconds: float = 0.0


def eval_reward_names(job: Any) -> tuple[str, ...]:
    """The rewards an eval reports: `eval.rewards`, else those of `data.rewards`, else the tiny task's."""
    if job.eval.rewards:
        return tuple(job.eval.rewards)
    if job.data is not None and "rewards" in job.data.model_fields_set:
        from .rewards import parse_reward_specs

        return tuple(r.name for r in parse_reward_specs(job.data.rewards))
    return _TINY_REWARDS


def load_eval_rows(job: Any) -> list[TaskRow]:
    """The eval set's rows (the first `eval.max_tasks`); ValueError names the source."""
    from .data import load_rows

    section = job.eval
    rows = load_rows(section, section="eval")
    return rows[:section.max_tasks] if section.max_tasks else rows


def tiny_eval_tasks(rows: Sequence[TaskRow], *, task_length: int, path: str) -> list[Task]:
    """The tiny engine's tasks from text rows: the prompt's digits are the string to reverse (its
    prompt unpadded, as the trained prompts are, long tasks or not)."""
    tasks = []
    for i, row in enumerate(rows):
        digits = [int(d) for d in re.findall(r"\d", row.prompt)]
        if len(digits) != task_length:
            raise ValueError(f"{path} row {i}: the tiny engine reverses {task_length} digits (model.task_length), "
                             f"this prompt has {len(digits)}: {row.prompt!r}")
        target = tuple(int(d) for d in re.findall(r"\d", row.answer))
        prompt = make_reverse_task(f"eval-row{i}", digits).prompt
        tasks.append(Task(id=f"eval-row{i}", prompt=prompt, target=target, answer=row.answer,
                          prompt_text=row.prompt, row=row.columns))
    return tasks


def eval_config_problems(job: Any) -> list[tuple[str, str]]:
    """Every problem with `eval:` that needs the file system or the engines: the source (exists,
    reads, has the split and the columns), the reward names, and whether the explorers' engine can
    evaluate."""
    from .rewards import resolve_reward

    section = job.eval
    problems = []
    for i, name in enumerate(eval_reward_names(job) if section.rewards else ()):
        try:
            resolve_reward(name)
        except ValueError as exc:
            problems.append((f"eval.rewards[{i}]", str(exc)))
    try:
        import datasets  # noqa: F401
    except ImportError as exc:
        return problems + [("eval.path", f"eval sets are read with `datasets` ({exc}); pip install -e '.[hf]'")]
    from .data import SourceError, describe_source

    try:
        rows = load_eval_rows(job)
        if job.model.engine == "tiny":
            tiny_eval_tasks(rows, task_length=job.model.task_length, path=describe_source(section))
    except SourceError as exc:
        problems.append((f"eval.{exc.field}", exc.why))
    except ValueError as exc:
        problems.append(("eval.dataset" if section.dataset is not None else "eval.path", str(exc)))
    return problems


def evaluate(engine: Any, tasks: Sequence[Task], job: Any, *, seed: int = 0, batch: int = 64) -> EvalResult:
    """Run every task `eval.samples` times with the engine's current weights; each reward's mean."""
    from .rewards import parse_reward_specs, score_all

    if not isinstance(engine, Generates):
        raise TypeError(f"the rollout engine {type(engine).__name__} cannot evaluate (it has no `generate`)")
    section = job.eval
    names = eval_reward_names(job)
    rewards = parse_reward_specs(list(names))
    started = time.monotonic()
    totals = dict.fromkeys(names, 0.0)
    responses = 0
    for start in range(0, len(tasks), batch):
        chunk = tasks[start:start + batch]
        texts = engine.generate(chunk, temperature=section.temperature, samples=section.samples, seed=seed + start)
        for task, answers in zip(chunk, texts):
            for text in answers:
                responses += 1
                for name, score in score_all(rewards, text, task)[1].items():
                    totals[name] += score
    means = {name: total / max(responses, 1) for name, total in totals.items()}
    return EvalResult(rewards=means, tasks=len(tasks), responses=responses, seconds=time.monotonic() - started)
