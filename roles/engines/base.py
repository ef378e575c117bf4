"""The engine interfaces the trainer and explorer roles drive: `TrainEngine`, `RolloutEngine`, `TaskSet`.

Roles own the loops, the bus and the weight transports; an engine owns a model. The contract between
them is small on purpose, so that the pure-PyTorch reference engines (`roles.engines.tiny`) and later
HF / vLLM / verl engines are interchangeable:

- versions are trainer steps: the base model is version 0, the weights after train step N are version
  N. A rollout engine tags every experience with the version it sampled with, so the trainer can
  measure (and bound) staleness.
- weights travel as a flat `{name: tensor}` mapping whose names, shapes and dtypes are the same on
  both sides: `TrainEngine.weights()` is what a transport ships, `RolloutEngine.weight_buffers()` is
  what an in-place receive (torch.distributed, CUDA IPC) writes into; `TrainEngine.iter_weight_buckets()`
  yields the same tensors a bucket at a time, for models no one process holds whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rolectl.sync_protocol.experience import Experience, ExperienceLimits

if TYPE_CHECKING:
    from torch import Tensor  # annotations only: the engine contract loads without torch

    from .streaming import NamedTensors

__all__ = ["PausePoint", "Task", "TaskSet", "TrainEngine", "RolloutEngine", "WeightsMismatch"]


class WeightsMismatch(ValueError):
    """Received tensors do not match the engine's parameters (names, shapes or dtypes).

    Raised before anything is copied, so the engine keeps the version it had.
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One prompt to answer, with what the verifier needs to score a response.

    Token-level tasks (the tiny engine) score against `target` ids; text tasks (data files) against
    the `answer` text, decoded responses being scored by reward functions (`roles.engines.rewards`),
    which may also take the prompt's text and the task's whole data row.
    """

    id: str
    prompt: tuple[int, ...]
    target: tuple[int, ...] = ()
    answer: str = ""
    prompt_text: str = ""
    """The prompt as the data row gives it, before tokenizing or any chat template."""
    row: Mapping[str, Any] | None = None
    """The task's data row, every column by name, as `datasets` reads it (JSON values: text,
    numbers, lists, mappings, null); None for a task made by an engine rather than read from data."""


@runtime_checkable
class TaskSet(Protocol):
    """A deterministic (given its seed) stream of task batches, one batch per explore step."""

    def next_batch(self) -> list[Task] | None:
        """The next batch of tasks, or None once the set is exhausted."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position, so a restarted explorer resumes where it stopped."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position returned by `state_dict()` (the seed must match)."""


@runtime_checkable
class TrainEngine(Protocol):
    """The trainer's model: consumes experiences, produces new weight versions and checkpoints."""

    step: int
    """Completed train steps; equals the version of the weights `weights()` returns."""

    group_size: int
    """Responses sampled per task; the trainer sizes its batches as tasks x group_size."""

    experience_limits: ExperienceLimits
    """What `train_step` can take (vocabulary, prompt and response lengths, group size): the trainer
    refuses any batch from the wire that does not fit, before it reaches the engine."""

    def train_step(self, experiences: Sequence[Experience], *, current_version: int) -> dict[str, float]:
        """One optimizer step on `experiences`; returns metrics (at least `loss` and `reward_mean`).

        An update whose loss or gradient is not finite is skipped (the weights stay as they were)
        and counted in the metric `updates_skipped_nonfinite`; the step still counts.

        `current_version` is the version the trainer holds before this step; experiences tagged with
        older versions are off-policy by `current_version - model_version` steps.
        """

    def weights(self) -> dict[str, Tensor]:
        """A detached, contiguous snapshot of the tensors explorers need, by parameter name."""

    def iter_weight_buckets(self, bucket_bytes: int = ...) -> Iterator[NamedTensors]:
        """The same tensors as `weights()`, in order, as lists of (name, tensor) of about `bucket_bytes`
        each (a larger tensor alone; by default the engine's own size), made one bucket at a time: a
        consumer that drops each bucket once sent never holds the whole model. A sharded engine's
        stream is a collective: every rank drives it to the end, and ranks other than 0 get empty
        buckets."""

    def save_checkpoint(self, path: Path) -> None:
        """Write model, optimizer, step and RNG state under directory `path` (no pickle)."""

    def load_checkpoint(self, path: Path) -> None:
        """Restore exactly what `save_checkpoint(path)` wrote; the next step is bit-identical."""


@runtime_checkable
class PausePoint(Protocol):
    """Where a rollout lets a weight update in (partial rollouts, `explorers.partial_rollout`).

    An engine given one (`rollout(..., pause_point=...)`) asks `pending()` between two tokens; when
    a newer version waits, it pauses its generations there, calls `load()` (which loads that version
    into it through `load_weights`, on the rollout's own thread) and continues each generation from
    the tokens it already has. Every token keeps the version that sampled it (`token_versions`).
    """

    def pending(self) -> bool:
        """A newer version is waiting to be loaded."""

    def load(self) -> None:
        """Load the waiting version into the explorer's engines (nothing if it is no newer)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """An explorer's model: samples groups of responses with the weights it was last sent."""

    version: int
    """Version of the weights currently loaded (0 = base model)."""

    group_size: int
    """Responses sampled per task by `rollout`."""

    rollout_metrics: dict[str, float]
    """Metrics of the last `rollout` beyond the mean reward (e.g. each reward function's mean)."""

    def weight_buffers(self) -> dict[str, Tensor]:
        """The live parameter tensors, by name, for transports that receive in place."""

    def load_weights(self, tensors: Mapping[str, Tensor], version: int) -> None:
        """Copy `tensors` into the live parameters and set `version`.

        Raises `WeightsMismatch` naming every missing, unexpected or mis-shaped tensor, before
        copying anything. Passing `weight_buffers()` itself (after an in-place receive) only sets
        the version.
        """

    def rollout(self, tasks: Sequence[Task], *, explore_step: int) -> list[Experience]:
        """Sample `group_size` responses per task with the current weights and score them.

        Every experience is tagged with `self.version`; ids are
        `f"{member}-{explore_step}-{task_idx}-{k}"` and `group` is `f"{member}-{explore_step}-{task_idx}"`,
        so a replayed explore step produces the same ids (the trainer deduplicates on them).

        The engines that support partial rollouts (tiny, hf, vllm) take a keyword `pause_point`
        (`PausePoint`); an experience whose tokens two versions sampled records them in
        `token_versions`, and its `model_version` is the oldest.
        """
