"""What the async sync styles buy over synchronous RL: the same job run back to back in each mode.

    python -m benchmarks.async_speedup [--steps 30] [--batch-size 16] [--json F]

One tiny-engine job (trainer, two explorers, synchronizer, embedded nats-server, each its own process
under `rolectl up`), the same in every mode but for how weights move:

- `sync`: explorers wait at every sync (`fixed`, `sync_interval: 1`, `sync_offset: 0`);
- `one_step_off`: `fixed` with `sync_offset: 1` (explorers sample step s+1 while the trainer trains s);
- `fully_async`: explorers never wait, versions are fetched in the background and loaded between steps;
- `fully_async_partial`: the same, with `explorers.partial_rollout` (versions loaded between tokens).

Every mode samples and trains the same experiences' worth (`--steps` x 2 explorers x `--batch-size`
tasks x group size: each explorer explores exactly `--steps` steps, nothing is dropped:
`max_staleness: null`), with torch at one thread per process (`ROLECTL_TORCH_THREADS`, the default)
and the same CPUs. Without a bound on how far explorers run ahead (another change of #42), the async
modes train on older experiences (`mean_staleness`); the reward at equal samples shows what it costs.
Figures per mode:
- `seconds_per_step` / `samples_per_s`: from the start of the first explore step (processes'
  start-up excluded) to the trainer's last `StepFinished`, as recorded: the time to sample and train
  it all; `speedup_vs_sync`: samples per second over the `sync` mode's;
- `reward_last` (the summary's: the last 5 train steps) and `reward_gap_vs_sync` (this minus sync's),
  at equal trained samples; `seconds_to_reward`: first step to the first step whose reward reaches
  `--reward-threshold` (None if none did);
- `trainer_busy_fraction`: the trainer process's CPU seconds (psutil, polled) over the same span, a
  proxy for the time it computes (one torch thread); `explorer_busy_fraction`: the explorers' step
  seconds (the `seconds` of their `StepFinished` within the span: rollout and pauses, wall time) over
  the span, averaged over the two;
- `partial_rollout_pauses`: weight loads inside rollouts (the partial mode only).
The last line printed is the JSON written to `--json`.

Not yet here (issue #42): long-tailed response lengths (the tiny task's responses are all about the
same length), off-policy correction and the explorers' staleness bound (another change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]

MODES: dict[str, dict[str, Any]] = {
    "sync": {"synchronizer": {"sync_style": "fixed", "sync_interval": 1, "sync_offset": 0}},
    "one_step_off": {"synchronizer": {"sync_style": "fixed", "sync_interval": 1, "sync_offset": 1}},
    "fully_async": {"synchronizer": {"sync_style": "fully_async"}},
    "fully_async_partial": {"synchronizer": {"sync_style": "fully_async"}, "explorers": {"partial_rollout": True}},
}


def job_config(work: Path, mode: str, *, steps: int, batch_size: int, group_size: int, task_length: int) -> dict:
    """The benchmark's job in `mode`: everything but the sync settings is the same in every mode."""
    data: dict[str, Any] = {
        "job": f"speedup-{mode.replace('_', '-')}",
        "run_dir": str(work / "runs"),
        "log_level": "info",
        "synchronizer": {"sync_method": "memory", "sync_timeout": 600, "heartbeat_period": 0.5,
                         "heartbeat_expiry": 5, "max_staleness": None},
        "trainer": {"total_steps": steps, "save_interval": 0, "train_batch_tasks": 2 * batch_size},
        # each explorer explores exactly what the trainer trains: the same samples in every mode
        "explorers": {"count": 2, "total_steps": steps, "stop_with_trainer": True},
        "buffer": {"batch_size": batch_size},
        "model": {"engine": "tiny", "seed": 0, "group_size": group_size, "task_length": task_length},
    }
    for section, values in MODES[mode].items():
        data[section] = {**data[section], **values}
    return data


def _run_up(config: Path, summary: Path, log: Path, timeout_s: float) -> tuple[int, list[tuple[float, float]]]:
    """`rolectl up`, its exit code, and the trainer's CPU seconds over time: (unix time, CPU seconds
    of its process so far), polled every `_POLL_S`."""
    argv = [sys.executable, "-m", "rolectl", "up", "--config", str(config), "--summary", str(summary),
            "--no-dashboard"]
    samples: list[tuple[float, float]] = []
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        up = psutil.Process(proc.pid)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()  # by pid: the process this benchmark started; its roles see it go
                proc.wait()
                raise RuntimeError(f"rolectl up ran past {timeout_s:.0f} s: {log}")
            seconds = _trainer_cpu_s(up)
            if seconds is not None:
                samples.append((time.time(), seconds))
            time.sleep(_POLL_S)  # a sampling period, not a synchronisation
    return proc.returncode, samples


_POLL_S = 0.2


def _trainer_cpu_s(up: psutil.Process) -> float | None:
    """User + system CPU seconds of the trainer process under `up` (None before it starts)."""
    try:
        children = up.children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        try:
            cmdline = child.cmdline()
            if "start" in cmdline and cmdline[cmdline.index("start") + 1:][:1] == ["trainer"]:
                times = child.cpu_times()
                return times.user + times.system
        except psutil.Error:
            continue
    return None


def _cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU seconds used between two unix times, from the samples nearest them."""
    def at(t: float) -> float:
        return min(samples, key=lambda sample: abs(sample[0] - t))[1]
    return at(end) - at(start)


def figures(summary: dict, records: list, trainer_cpu: list[tuple[float, float]], *, samples_per_step: int,
            threshold: float) -> dict[str, Any]:
    """One mode's figures from its summary and recorded stream."""
    from rolectl.sync_protocol import Role, StepFinished

    trainer = [(r.time_ms / 1000, r.event.metrics) for r in records
               if isinstance(r.event, StepFinished) and r.event.member.role is Role.TRAINER]
    # from the start of the first explore step to the last train step: sampling and training it all
    # (an async explorer may sample while the trainer still starts up: that counts, as it would)
    start = min(r.time_ms / 1000 - r.event.metrics.get("seconds", 0.0) for r in records
                if isinstance(r.event, StepFinished) and r.event.member.role is Role.EXPLORER)
    span = trainer[-1][0] - start
    explorer = [r.event.metrics for r in records if isinstance(r.event, StepFinished)
                and r.event.member.role is Role.EXPLORER and start <= r.time_ms / 1000 <= trainer[-1][0]]
    steps = len(trainer)
    reached = next((t for t, m in trainer if m.get("reward_mean", 0.0) >= threshold), None)
    rollout_s = sum(m.get("seconds", 0.0) for m in explorer)
    return {
        "complete": summary.get("complete"),
        "trainer_steps": len(trainer),
        "wall_s": summary.get("wall_s"),
        "seconds_per_step": round(span / steps, 3),
        "samples_per_s": round(steps * samples_per_step / span, 2),
        "reward_first": summary.get("reward_first"),
        "reward_last": summary.get("reward_last"),
        "seconds_to_reward": None if reached is None else round(reached - start, 2),
        "trainer_busy_fraction": round(_cpu_between(trainer_cpu, start, trainer[-1][0]) / span, 3),
        "explorer_busy_fraction": round(rollout_s / 2 / span, 3),
        "experiences_produced": summary.get("experiences_produced"),
        "experiences_trained": summary.get("experiences_trained"),
        "experiences_dropped_stale": summary.get("experiences_dropped_stale"),
        "partial_rollout_pauses": int(sum(m.get("partial_rollout_pauses", 0) for m in explorer)),
        "mean_staleness": round(statistics.fmean(m.get("mean_staleness", 0.0) for _, m in trainer), 3),
    }


def run_mode(work: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from rolectl.roles.observe.export import load_export

    data = job_config(work, mode, steps=args.steps, batch_size=args.batch_size, group_size=args.group_size,
                      task_length=args.task_length)
    config, summary_path, log = work / f"{mode}.yaml", work / f"{mode}.summary.json", work / f"{mode}.log"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    rc, trainer_cpu = _run_up(config, summary_path, log, args.timeout_s)
    if rc != 0 or not summary_path.exists():
        raise RuntimeError(f"mode {mode}: rolectl up exited {rc}; its log: {log}")
    summary = json.loads(summary_path.read_text())
    return figures(summary, load_export(summary["events_file"]), trainer_cpu,
                   samples_per_step=2 * args.batch_size * args.group_size, threshold=args.reward_threshold)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode of `args.modes`, back to back, and each one's gap to `sync` (run first)."""
    with tempfile.TemporaryDirectory(prefix="async-speedup-") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        modes: dict[str, dict[str, Any]] = {}
        for mode in args.modes:
            started = time.monotonic()
            modes[mode] = run_mode(work, mode, args)
            print(f"{mode:>20}: {modes[mode]['seconds_per_step']:.3f} s/step, "
                  f"{modes[mode]['samples_per_s']:.1f} samples/s, reward {modes[mode]['reward_last']}, "
                  f"trainer busy {modes[mode]['trainer_busy_fraction']:.2f} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    base = modes.get("sync")
    for figures_ in modes.values():
        figures_["speedup_vs_sync"] = round(figures_["samples_per_s"] / base["samples_per_s"], 3) if base else None
        figures_["reward_gap_vs_sync"] = (round(figures_["reward_last"] - base["reward_last"], 4)
                                          if base and figures_["reward_last"] is not None else None)
    return {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")}, "modes": modes}


RESULTS = ROOT / "benchmarks" / "results" / "async_speedup.json"
_COLUMNS = ["mode", "s / train step", "samples / s", "speedup vs sync", "reward last 5 steps (gap vs sync)",
            "mean staleness", "trainer busy", "explorer busy", "pauses"]


def record(result: dict[str, Any], *, conditions: str, argv: list[str]) -> None:
    """Append `result` as a run of the results file the benchmarks page is rendered from."""
    import datetime
    import platform

    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {
        "order": 15, "title": "Async styles against synchronous RL",
        "command": "python -m benchmarks.async_speedup --json F",
        "what": "One tiny-engine job (rolectl up: trainer, 2 explorers, synchronizer, nats-server) run back to "
                "back in each sync mode with the same samples sampled and trained; time per train step from "
                "the first explore step to the last train step. See the script's docstring for each figure.",
        "runs": []}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    rows = [[mode, f"{m['seconds_per_step']:.3f}", f"{m['samples_per_s']:.0f}", f"{m['speedup_vs_sync']:.2f}x",
             f"{m['reward_last']} ({m['reward_gap_vs_sync']:+.3f})", f"{m['mean_staleness']:.2f}",
             f"{m['trainer_busy_fraction']:.2f}", f"{m['explorer_busy_fraction']:.2f}",
             str(m["partial_rollout_pauses"])] for mode, m in result["modes"].items()]
    data["runs"].append({
        "date": datetime.date.today().isoformat(), "commit": commit.stdout.strip() or "unknown",
        "commit_note": "the commit the figures were measured at",
        "machine": f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, no GPU",
        "conditions": conditions, "command": "python -m benchmarks.async_speedup " + " ".join(argv),
        "columns": _COLUMNS, "rows": rows, "modes": result["modes"]})
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.async_speedup", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="trainer steps per mode")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="tasks per explore step (x2 explorers per train step)")
    parser.add_argument("--group-size", type=int, default=8, help="responses per task")
    parser.add_argument("--task-length", type=int, default=4, help="digits to reverse (the response is one longer)")
    parser.add_argument("--reward-threshold", type=float, default=0.3, help="for seconds_to_reward")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                        help=f"comma-separated, run in this order (sync first for the ratios): {','.join(MODES)}")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per mode")
    parser.add_argument("--workdir", help="keep configs, logs and run directories here (default: a temp dir)")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--record", metavar="CONDITIONS",
                        help="append this run to benchmarks/results/async_speedup.json (docs/benchmarks.md), "
                             "CONDITIONS saying what else ran on the machine")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; known: {list(MODES)}")
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.record:
        record(result, conditions=args.record, argv=sys.argv[1:] if argv is None else argv)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
