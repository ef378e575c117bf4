"""Engines: the model side of the roles. Interfaces in `base`, the pure-PyTorch reference in `tiny`.

The roles build engines from the `model:` section of the job YAML through the factories below;
`engine: tiny` (the default) is the only engine so far, the rest of the section fills `TinyConfig`.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping

from .base import RolloutEngine, Task, TaskSet, TrainEngine, WeightsMismatch
from .task import ReverseDigitsTaskSet, score_response
from .tiny import (
    TinyConfig,
    TinyRolloutEngine,
    TinyTrainEngine,
    build_task_set,
    tiny_config_from_mapping,
    tiny_config_problems,
)

__all__ = [
    "RolloutEngine",
    "Task",
    "TaskSet",
    "TrainEngine",
    "WeightsMismatch",
    "ReverseDigitsTaskSet",
    "score_response",
    "TinyConfig",
    "TinyRolloutEngine",
    "TinyTrainEngine",
    "build_task_set",
    "model_config_problems",
    "make_train_engine",
    "make_rollout_engine",
    "make_taskset",
]

_ENGINES = ("tiny",)


def model_config_problems(model: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every problem with the job's `model:` section, as (dotted path, reason); empty when valid."""
    if not isinstance(model, Mapping):
        return [("model", f"must be a mapping, got {type(model).__name__}")]
    engine = model.get("engine", "tiny")
    if engine not in _ENGINES:
        return [("model.engine", f"unknown engine {engine!r}; known: {list(_ENGINES)}")]
    settings = {k: v for k, v in model.items() if k != "engine"}
    return [(f"model.{name}", why) for name, why in tiny_config_problems(settings)]


def _tiny_config(model: Mapping[str, Any]) -> TinyConfig:
    problems = model_config_problems(model)
    if problems:
        raise ValueError("invalid model config: " + "; ".join(f"{path}: {why}" for path, why in problems))
    return tiny_config_from_mapping({k: v for k, v in model.items() if k != "engine"})


def make_train_engine(model: Mapping[str, Any]) -> TinyTrainEngine:
    return TinyTrainEngine(_tiny_config(model))


def make_rollout_engine(model: Mapping[str, Any], member: str) -> TinyRolloutEngine:
    """An explorer's engine; its sampling seed derives from the member name, so explorers differ
    from each other but a restarted explorer samples exactly as before."""
    config = _tiny_config(model)
    return TinyRolloutEngine(config, member=member, sampling_seed=zlib.crc32(f"{config.seed}/{member}".encode()))


def make_taskset(
    model: Mapping[str, Any], *, seed: int, total_batches: int | None = None, batch_size: int | None = None
) -> ReverseDigitsTaskSet:
    """Explorer `seed`'s task stream: `batch_size` tasks per explore step (default `tasks_per_step`),
    `total_batches` steps (default unbounded)."""
    config = _tiny_config(model)
    if batch_size is not None:
        config = dataclasses.replace(config, tasks_per_step=batch_size)
    return build_task_set(config, seed=config.seed * 1000 + seed, num_batches=total_batches)

