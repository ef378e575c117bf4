"""Experiment trackers (TensorBoard, MLflow, Weights & Biases) fed from the job's stream, with their own libraries.

One fold of the records, like every other view: the trainer's `StepFinished` metrics are logged by
train step (`trainer/<name>`), each explorer's by explore step (`explorer/<id>/<name>`), evals by
explore step (`eval/<reward>`, `eval/version`), a trainer's rollback to a checkpoint
(`trainer/rolled_back_from_step` at the step it resumed from: the steps after it are logged again,
and trackers keep every point they are given), sync rounds by round id (`sync/duration_s` when a
round closes, `sync/bytes` and `sync/load_s` when its weights are loaded), and the job's config as
hyper-parameters. `rolectl up` runs it beside its progress view, so the roles need none of these
packages. A tracker that raises is logged once, counted (`failures`), and the job goes on.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rolectl.roles.config import TRACKERS, JobConfig
from rolectl.sync_protocol import (
    EvalFinished,
    Recorded,
    Role,
    RoundClosed,
    StepFinished,
    StepsRolledBack,
    WeightsLoaded,
)

__all__ = ["Tracker", "Trackers", "make_tracker", "flat_params", "mlflow_local_uri"]


class Tracker(Protocol):
    """One tracker: hyper-parameters once, then scalars by (series, step)."""

    name: str

    def log_params(self, params: dict[str, str]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], *, step: int, axis: str) -> None:
        """`metrics` at `step` of `axis` (`trainer/step`, `explore/step` or `sync/round`)."""

    def close(self) -> None: ...


def flat_params(cfg: JobConfig) -> dict[str, str]:
    """The job's config as flat `section.field` strings (every tracker takes strings)."""
    data = cfg.model_dump(mode="json", exclude={"synchronizer", "source"})
    data["synchronizer"] = cfg.synchronizer.to_mapping()
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            out[prefix] = str(value.value if hasattr(value, "value") else value)

    walk("", data)
    return out


class TensorBoardTracker:
    """Event files under `<dir>/tensorboard`, written by TensorBoard's own writer (through torch)."""

    name = "tensorboard"

    def __init__(self, directory: Path, run: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory / "tensorboard" / run))

    def log_params(self, params: dict[str, str]) -> None:
        table = "| field | value |\n| --- | --- |\n" + "".join(f"| {k} | {v} |\n" for k, v in sorted(params.items()))
        self.writer.add_text("config", table, global_step=0)

    def log_metrics(self, metrics: dict[str, float], *, step: int, axis: str) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def mlflow_local_uri(directory: Path) -> str:
    """The tracking URI of the local MLflow store under `directory` (what `mlflow ui
    --backend-store-uri` takes)."""
    return f"sqlite:///{(directory / 'mlflow' / 'mlflow.db').resolve()}"


class MLflowTracker:
    """A run in an MLflow experiment: by default a local store under `<dir>/mlflow` (SQLite, since
    MLflow's plain-file store is in maintenance mode and refused by default), artifacts beside it."""

    name = "mlflow"

    def __init__(self, directory: Path, run: str, *, experiment: str, tracking_uri: str | None) -> None:
        from mlflow.tracking import MlflowClient

        local = (directory / "mlflow").resolve()
        local.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=tracking_uri or mlflow_local_uri(directory))
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=(local / "artifacts").as_uri())
        self.run_id = self.client.create_run(experiment_id, run_name=run).info.run_id

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def log_metrics(self, metrics: dict[str, float], *, step: int, axis: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """A W&B run (offline by default: `<dir>/wandb/offline-run-*`, for `wandb sync` later). Each series
    is plotted against its own step metric, since train steps, explore steps and rounds interleave."""

    name = "wandb"
    _AXES = {"trainer/*": "trainer/step", "explorer/*": "explore/step", "eval/*": "explore/step",
             "sync/*": "sync/round"}

    def __init__(self, directory: Path, run: str, *, project: str, mode: str) -> None:
        import wandb

        (directory / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run, dir=str(directory), mode=mode, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))
        for pattern, axis in self._AXES.items():
            self.run.define_metric(axis)
            self.run.define_metric(pattern, step_metric=axis)

    def log_params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], *, step: int, axis: str) -> None:
        self.run.log({**metrics, axis: step})

    def close(self) -> None:
        self.run.finish()


def make_tracker(name: str, cfg: JobConfig, run: str) -> Tracker:
    directory = cfg.monitor_dir
    directory.mkdir(parents=True, exist_ok=True)
    project = cfg.monitor.project or cfg.job
    if name == "tensorboard":
        return TensorBoardTracker(directory, run)
    if name == "mlflow":
        return MLflowTracker(directory, run, experiment=project, tracking_uri=cfg.monitor.mlflow_tracking_uri)
    if name == "wandb":
        return WandbTracker(directory, run, project=project, mode=cfg.monitor.wandb_mode)
    raise ValueError(f"unknown tracker {name!r}; known: {sorted(TRACKERS)}")


class Trackers:
    """The configured trackers, fed one record at a time; a failing tracker never stops the job."""

    def __init__(self, trackers: list[Tracker], *, warn: Callable[[str], None] = print) -> None:
        self.trackers = trackers
        self.failures: Counter[str] = Counter()
        self._warn = warn
        self._last_input_seq = 0
        self._closed_rounds: set[int] = set()

    @classmethod
    def start(cls, cfg: JobConfig, run: str, *, warn: Callable[[str], None] = print) -> Trackers:
        """Open every tracker of `cfg.monitor.backends` and log the config; a tracker that cannot
        start is a failure like any other (logged once, counted)."""
        self = cls([], warn=warn)
        for name in cfg.monitor.backends:
            try:
                self.trackers.append(make_tracker(name, cfg, run))
            except Exception as exc:
                self._failed(name, "start", exc)
        self._each(lambda t: t.log_params(flat_params(cfg)), "log the config")
        return self

    def _failed(self, name: str, what: str, exc: BaseException) -> None:
        self.failures[name] += 1
        if self.failures[name] == 1:  # once: a broken tracker would otherwise flood the console
            self._warn(f"tracker {name} failed to {what} ({type(exc).__name__}: {exc}); the job goes on "
                       "without it, further failures are only counted")

    def _each(self, call: Callable[[Tracker], None], what: str) -> None:
        for tracker in self.trackers:
            try:
                call(tracker)
            except Exception as exc:
                self._failed(tracker.name, what, exc)

    def _log(self, metrics: dict[str, float], *, step: int, axis: str) -> None:
        finite = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if finite:
            self._each(lambda t: t.log_metrics(finite, step=step, axis=axis), "log metrics")

    def apply(self, rec: Recorded) -> None:
        """Log what `rec` says, if anything (records already seen are skipped)."""
        event = rec.event
        if isinstance(event, RoundClosed):
            if event.round not in self._closed_rounds:
                self._closed_rounds.add(event.round)
                self._log({f"sync/outcome_{event.outcome.value}": 1.0}, step=event.round, axis="sync/round")
            return
        if (not isinstance(event, (StepFinished, EvalFinished, WeightsLoaded, StepsRolledBack))
                or rec.seq <= self._last_input_seq):
            return
        self._last_input_seq = rec.seq
        if isinstance(event, StepsRolledBack):
            self._log({"trainer/rolled_back_from_step": event.from_step}, step=event.to_step, axis="trainer/step")
        elif isinstance(event, StepFinished):
            if event.member.role is Role.TRAINER:
                self._log({f"trainer/{k}": v for k, v in event.metrics.items()} | {"trainer/version": event.version},
                          step=event.step, axis="trainer/step")
            elif event.member.role is Role.EXPLORER:
                prefix = f"explorer/{event.member.id}"
                self._log({f"{prefix}/{k}": v for k, v in event.metrics.items()} | {f"{prefix}/version": event.version},
                          step=event.step, axis="explore/step")
        elif isinstance(event, EvalFinished):
            self._log({f"eval/{k}": v for k, v in event.rewards.items()}
                      | {"eval/version": event.version, "eval/seconds": event.seconds},
                      step=event.step, axis="explore/step")
        elif event.round is not None and event.nbytes:
            self._log({"sync/bytes": event.nbytes, "sync/load_s": event.seconds}, step=event.round, axis="sync/round")

    def close(self) -> None:
        self._each(lambda t: t.close(), "close")
