"""`rolectl bench`: evaluate saved versions of a job on its eval set, one row per version.

The versions a finished job still has on disk: the base model (version 0, built from the config,
as every member builds it) and the trainer's checkpoints (`<job dir>/trainer/step-N`, version N; the
trainer keeps its last two). Each is loaded into a trainer engine, its weights copied into one
rollout engine, and evaluated exactly as the explorer evaluates during a run (`eval:`; greedy by
default). The job directory is `<run_dir>/<job>`, or under the newest `rolectl up` run of the job
(`<run_dir>/<job>-<stamp>-<pid>/`), or the one `--run-dir` names.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rolectl.roles.config import JobConfig

__all__ = ["BenchError", "BenchRow", "saved_versions", "find_job_dir", "run_bench", "print_bench"]


class BenchError(ValueError):
    """Nothing to bench: no eval set, no job directory, or a version that is not kept."""


@dataclass(frozen=True, slots=True)
class BenchRow:
    version: int
    step: int
    rewards: dict[str, float]
    tasks: int
    responses: int
    seconds: float
    source: str


def find_job_dir(cfg: JobConfig, run_dir: str | None) -> Path:
    """Where the job's files are: `<run_dir>/<job>`, else under the newest `up` run of the job."""
    base = Path(run_dir or cfg.run_dir)
    candidates = [base / cfg.job]
    ups = sorted((p for p in base.glob(f"{cfg.job}-*-*") if (p / cfg.job).is_dir()), key=lambda p: p.stat().st_mtime)
    candidates += [p / cfg.job for p in reversed(ups)]
    for job_dir in candidates:
        if (job_dir / "trainer").is_dir():
            return job_dir
    raise BenchError(f"no saved versions of job {cfg.job!r} under {base} (looked for {base / cfg.job}/trainer and "
                     f"{base / (cfg.job + '-*')}/{cfg.job}/trainer); pass --run-dir, the run directory `rolectl up` "
                     "printed")


def saved_versions(job_dir: Path) -> dict[int, Path | None]:
    """Version -> checkpoint directory (None: the base model, built from the config)."""
    found: dict[int, Path | None] = {0: None}
    for path in (job_dir / "trainer").glob("step-*"):
        tail = path.name.split("-", 1)[1]
        if path.is_dir() and tail.isdigit() and any(path.iterdir()):
            found[int(tail)] = path
    return dict(sorted(found.items()))


def run_bench(cfg: JobConfig, *, run_dir: str | None = None, versions: list[int] | None = None) -> list[BenchRow]:
    """Evaluate each kept version (or those of `versions`) on the eval set, oldest first."""
    from rolectl.roles.engines import make_eval_tasks, make_rollout_engine, make_train_engine
    from rolectl.roles.engines.evaluation import evaluate

    if not cfg.eval.has_source:
        raise BenchError("the config has no eval set: set eval.path or eval.dataset (or pass --eval PATH)")
    kept = saved_versions(find_job_dir(cfg, run_dir))
    if versions:
        missing = sorted(set(versions) - set(kept))
        if missing:
            raise BenchError(f"version(s) {missing} are not kept; kept: {sorted(kept)}")
        kept = {v: kept[v] for v in sorted(set(versions))}
    tasks = make_eval_tasks(cfg)
    engine = make_rollout_engine(cfg, "bench")
    base = {k: v.clone() for k, v in engine.weight_buffers().items()}
    rows = []
    for version, path in kept.items():
        if path is None:
            engine.load_weights(base, 0)
        else:
            trainer = make_train_engine(cfg)
            trainer.load_checkpoint(path)
            engine.load_weights(trainer.weights(), version)
            del trainer
        result = evaluate(engine, tasks, cfg, seed=version)
        rows.append(BenchRow(version=version, step=version, rewards=result.rewards, tasks=result.tasks,
                             responses=result.responses, seconds=round(result.seconds, 3),
                             source="base model" if path is None else str(path)))
    return rows


def print_bench(rows: list[BenchRow], *, as_json: bool, out: Any = None) -> None:
    out = out or sys.stdout
    if as_json:
        json.dump([asdict(r) for r in rows], out, indent=2)
        out.write("\n")
        return
    from rich.console import Console
    from rich.table import Table

    names = list(rows[0].rewards) if rows else []
    table = Table(title=f"bench: {rows[0].tasks if rows else 0} eval tasks per version")
    for column in ("version", "step", *names, "seconds"):
        table.add_column(column, justify="right")
    table.add_column("from")
    for r in rows:
        table.add_row(str(r.version), str(r.step), *(f"{r.rewards[n]:.4f}" for n in names), f"{r.seconds:.2f}",
                      r.source)
    Console(file=out).print(table)
