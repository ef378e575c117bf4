"""The run directory of `rolectl up`: made for a new run, opened again by `up --resume`, and the
command that resumes a run that ended short.

A run directory holds one run of a job on this machine: `job.yaml` (the effective config every role
read), `nats/` (the embedded server's store: the job's record and its experiences), `logs/`, the
roles' checkpoints and saved state under `<job>/`, and at the end `events.jsonl` and `summary.json`.
`up --resume` starts a server on the same store and the same roles on the same config; each role
finds its saved state and its previous incarnation in the record, and resumes (`roles.resume`).
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Any

import yaml

from rolectl.roles.config import ENGINE_SECTIONS, JobConfig, load_config
from rolectl.roles.observe.run_store import RUN_CONFIG  # the effective config of a run, in its directory

__all__ = ["RUN_CONFIG", "ResumeError", "config_mapping", "write_config", "new_run_path", "open_for_resume",
           "config_differences", "resume_command"]


# What a --config given to `up --resume` may change: where things are and how much is logged. Any
# other field changes the job its record is of (steps, data, model, sync, members).
_MAY_DIFFER = ("nats_url", "run_dir", "archive_dir", "log_level", "monitor")


class ResumeError(ValueError):
    """A run directory cannot be resumed as asked; the message says why and what to do."""


def config_mapping(cfg: JobConfig) -> dict[str, Any]:
    """The effective config as `job.yaml` holds it (the nats URL and run dir filled in)."""
    return {
        "job": cfg.job,
        "nats_url": cfg.nats_url,
        "run_dir": cfg.run_dir,
        "archive_dir": str(cfg.event_archive_dir),  # where `up` reads the history back at the end
        "log_level": cfg.log_level,
        "synchronizer": cfg.synchronizer.to_mapping(),
        "trainer": cfg.trainer.model_dump(mode="json"),
        "explorers": cfg.explorers.model_dump(mode="json"),
        "buffer": cfg.buffer.model_dump(mode="json"),
        "transport": cfg.transport.model_dump(mode="json"),
        # stream replicas; credentials reach each role through its environment, never this file
        "nats": {"replicas": cfg.nats.replicas},
        "eval": cfg.eval.model_dump(mode="json"),
        "monitor": cfg.monitor.model_dump(mode="json"),
        "serve": cfg.serve.model_dump(mode="json"),
        "stage": cfg.stage,
        # the engine's sections (and the stages') as the file wrote them (what it left out stays a default)
        **{name: section if section is None else section.model_dump(mode="json", exclude_unset=True)
           for name, section in ((name, getattr(cfg, name)) for name in (*ENGINE_SECTIONS, "agent"))},
    }


def write_config(cfg: JobConfig, path: Path) -> None:
    """The effective config every role of this run reads (nats URL and run dir filled in)."""
    path.write_text(yaml.safe_dump(config_mapping(cfg), sort_keys=False))


def new_run_path(cfg: JobConfig, run_dir: str | None) -> Path:
    """A fresh run directory, `<run_dir>/<job>-<time>-<pid>`, with its `logs/`."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(run_dir or cfg.run_dir).resolve() / f"{cfg.job}-{stamp}-{os.getpid()}"
    (path / "logs").mkdir(parents=True, exist_ok=True)
    return path


def open_for_resume(run_dir: str | Path, given: JobConfig | None) -> tuple[Path, JobConfig]:
    """The run directory `run_dir` and the config its run was recorded with. A `given` config
    (`--config`) must agree with it in every field that makes the job (`_MAY_DIFFER` aside)."""
    path = Path(run_dir).resolve()
    config = path / RUN_CONFIG
    if not config.is_file():
        raise ResumeError(f"{path} is not a run directory of `rolectl up` (it has no {RUN_CONFIG}); give the "
                          "directory `rolectl up` printed as its run dir")
    if not (path / "nats").is_dir():
        raise ResumeError(f"{path} has no nats/ store, so the job's record is gone and nothing can resume it; "
                          "start a new run with `rolectl up --config FILE`")
    recorded = load_config(config)
    if given is not None:
        differs = config_differences(recorded, given)
        if differs:
            raise ResumeError(
                f"--config {given.source} differs from the config the run was recorded with ({config}) in "
                f"{', '.join(differs)}: a resumed job keeps its config. Drop --config to resume with the run's "
                "own, or start a new run with --config")
    (path / "logs").mkdir(exist_ok=True)
    return path, recorded


def config_differences(recorded: JobConfig, given: JobConfig) -> list[str]:
    """The dotted fields in which `given` differs from `recorded`, leaving out what may differ."""
    ours, theirs = _flat(config_mapping(recorded)), _flat(config_mapping(given))
    return sorted(key for key in ours.keys() | theirs.keys()
                  if key.split(".")[0] not in _MAY_DIFFER and ours.get(key) != theirs.get(key))


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resume_command(run_path: Path) -> str:
    """The command that continues the run in `run_path`."""
    return f"rolectl up --resume {shlex.quote(str(run_path))}"
