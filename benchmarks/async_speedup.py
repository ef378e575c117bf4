"""What the async sync styles buy over synchronous RL: the same job run back to back in each mode.

    python -m benchmarks.async_speedup [--steps 80] [--batch-size 16] [--quick] [--repeat N] [--json F]

One tiny-engine job (trainer, two explorers, synchronizer, embedded nats-server, each its own process
under `rolectl up`) on a task with long-tailed lengths: `--long-task-fraction` (10 %) of the tasks are
`--long-task-length` digits (20), the rest `--task-length` (2), so most responses are 3 tokens and a
few 21 (`model.long_task_length`, `model.long_task_fraction`). The tiny engine generates as an
inference server does (a KV cache, each prompt its own length, a finished row leaving the batch at
once: `roles.engines.tiny_generation`), so a step's cost is its prefill and one decode pass per
token of its longest response, and the trainer scores rows in length buckets (no padding). In a
synchronous step the longest response holds everyone; streaming lets the short ones go.
The job is the same in every mode but for how weights move:

- `sync`: explorers wait at every sync (`fixed`, `sync_interval: 1`, `sync_offset: 0`);
- `one_step_off`: `fixed` with `sync_offset: 1` (explorers sample step s+1 while the trainer trains s);
- `fully_async`: explorers never wait, versions are fetched in the background and loaded between steps;
- `fully_async_partial`: the same, with `explorers.partial_rollout` (a version that lands mid-generation
  is loaded between tokens, the generation goes on), `explorers.streaming` (generations run on across
  steps: a step publishes the first `--batch-size` groups to finish, a long one is published by a
  later step, as a continuously batched server streams), the staleness bound `synchronizer.max_ahead`
  (`--max-ahead`, 2: explorers pause past two train steps' worth of tasks beyond the trainer's next;
  at 1 the pause and its resume, a round trip through the synchronizer, left the trainer and the
  explorers each idle about half the time),
  and the off-policy correction `algorithm.rollout_correction` (decoupled PPO with token-level
  truncated importance sampling capped at 2, verl's `rollout_is: token`).

Every mode samples and trains the same experiences (`--steps` x 2 explorers x `--batch-size` tasks x
group size: each explorer explores exactly `--steps` steps, nothing is dropped: `max_staleness:
null`). CPUs (`--pin`): `split` (the default) pins the trainer process, every thread of it, to the
first CPU this benchmark may use and everything else (`rolectl up`, synchronizer, explorers,
nats-server, this script) to the second, with `os.sched_setaffinity` on each thread, re-applied every
poll so threads started later are pinned too; `shared` pins them all to both. Torch runs one thread
per process (`ROLECTL_TORCH_THREADS`, the default). Figures per mode:
- `seconds_per_step` / `samples_per_s`: from the start of the first explore step (processes'
  start-up excluded) to the trainer's last `StepFinished`, as recorded: the time to sample and train
  it all; `speedup_vs_sync`: samples per second over the `sync` mode's;
- `reward_last`: the mean train reward of the last 5 train steps (the summary's), at equal trained
  samples, measured the same way in every mode (no greedy eval); `reward_gap_vs_sync` is it minus
  sync's; `seconds_to_reward`: first explore step to the first train step whose mean reward reaches
  `--reward-threshold` (None if none did);
- `trainer_busy_fraction`: the trainer process's CPU seconds (psutil, polled) over the same span (it
  computes on one torch thread: 1.0 is a core's worth); `explorer_busy_fraction`: the explorers' step
  seconds (the `seconds` of their `StepFinished` in the span: rollout and pauses, wall time) over the
  span, averaged over the two;
- `partial_rollout_pauses`: weight loads inside rollouts; `explorer_pauses`: `max_ahead` pauses.
`--repeat N` runs the modes N rounds back to back; a mode's figures are its median-throughput round's,
with every round's samples/s in `samples_per_s_rounds`. The last line printed is the JSON written to
`--json`.
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
    "fully_async_partial": {"synchronizer": {"sync_style": "fully_async"},
                            "explorers": {"partial_rollout": True, "streaming": True},
                            "algorithm": {"rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0}}},
}
BOUNDED = "fully_async_partial"
"""The mode that also takes the staleness bound (`--max-ahead`)."""


def job_config(work: Path, mode: str, args: argparse.Namespace) -> dict:
    """The benchmark's job in `mode`: everything but the sync settings is the same in every mode."""
    data: dict[str, Any] = {
        "job": f"speedup-{mode.replace('_', '-')}",
        "run_dir": str(work / "runs"),
        "log_level": "info",
        "synchronizer": {"sync_method": "memory", "sync_timeout": 600, "heartbeat_period": 0.5,
                         "heartbeat_expiry": 5, "max_staleness": None},
        "trainer": {"total_steps": args.steps, "save_interval": 0, "train_batch_tasks": 2 * args.batch_size},
        # each explorer explores exactly what the trainer trains: the same samples in every mode
        "explorers": {"count": 2, "total_steps": args.steps, "stop_with_trainer": True},
        "buffer": {"batch_size": args.batch_size},
        "model": {"engine": "tiny", "seed": 0, "group_size": args.group_size, "task_length": args.task_length,
                  "long_task_length": args.long_task_length, "long_task_fraction": args.long_task_fraction},
    }
    for section, values in MODES[mode].items():
        data[section] = {**data.get(section, {}), **values}
    if mode == BOUNDED:
        data["synchronizer"]["max_ahead"] = args.max_ahead
    return data


def cpu_layout(pin: str) -> tuple[set[int], set[int]]:
    """(the trainer's CPUs, everything else's) for `--pin`, from the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    if pin == "shared":
        return set(cpus), set(cpus)
    if len(cpus) < 2:
        raise SystemExit(f"--pin split needs 2 CPUs, this process may use {cpus}: use --pin shared")
    return {cpus[0]}, set(cpus[1:])


def _pin_threads(process: psutil.Process, cpus: set[int]) -> None:
    """Every thread of `process` onto `cpus` (sched_setaffinity on a pid sets one thread only)."""
    try:
        for thread in process.threads():
            os.sched_setaffinity(thread.id, cpus)
    except (psutil.Error, ProcessLookupError, PermissionError):
        pass  # the process or a thread ended meanwhile


def _is_trainer(process: psutil.Process) -> bool:
    cmdline = process.cmdline()
    return "start" in cmdline and cmdline[cmdline.index("start") + 1:][:1] == ["trainer"]


def _run_up(config: Path, summary: Path, log: Path, timeout_s: float,
            layout: tuple[set[int], set[int]]) -> tuple[int, list[tuple[float, float]]]:
    """`rolectl up` with its processes pinned to `layout`, its exit code, and the trainer's CPU
    seconds over time: (unix time, CPU seconds of its process so far), polled every `_POLL_S`."""
    argv = [sys.executable, "-m", "rolectl", "up", "--config", str(config), "--summary", str(summary),
            "--no-dashboard"]
    trainer_cpus, other_cpus = layout  # `up` and its children start on run()'s CPUs (other_cpus)
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
            seconds = _pin_and_measure(up, trainer_cpus, other_cpus)
            if seconds is not None:
                samples.append((time.time(), seconds))
            time.sleep(_POLL_S)  # a sampling period, not a synchronisation
    return proc.returncode, samples


_POLL_S = 0.2


def _pin_and_measure(up: psutil.Process, trainer_cpus: set[int], other_cpus: set[int]) -> float | None:
    """Pin every process under `up` (the trainer to `trainer_cpus`, the rest to `other_cpus`) and
    return the trainer's user + system CPU seconds (None before it starts)."""
    try:
        children = up.children(recursive=True)
    except psutil.Error:
        return None
    seconds = None
    for child in children:
        try:
            trainer = _is_trainer(child)
            _pin_threads(child, trainer_cpus if trainer else other_cpus)
            if trainer:
                times = child.cpu_times()
                seconds = times.user + times.system
        except psutil.Error:
            continue
    return seconds


def _cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU seconds used between two unix times, from the samples nearest them."""
    def at(t: float) -> float:
        return min(samples, key=lambda sample: abs(sample[0] - t))[1]
    return at(end) - at(start)


def figures(summary: dict, records: list, trainer_cpu: list[tuple[float, float]], *, samples_per_step: int,
            threshold: float) -> dict[str, Any]:
    """One mode's figures from its summary and recorded stream."""
    from rolectl.sync_protocol import ExplorerPaused, Role, StepFinished

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
        "explorer_pauses": sum(isinstance(r.event, ExplorerPaused) for r in records),
        "mean_staleness": round(statistics.fmean(m.get("mean_staleness", 0.0) for _, m in trainer), 3),
    }


def run_mode(work: Path, mode: str, args: argparse.Namespace, round_: int,
             layout: tuple[set[int], set[int]]) -> dict[str, Any]:
    from rolectl.roles.observe.export import load_export

    data = job_config(work / f"round-{round_}", mode, args)
    config, summary_path, log = (work / f"{mode}-{round_}.yaml", work / f"{mode}-{round_}.summary.json",
                                 work / f"{mode}-{round_}.log")
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    rc, trainer_cpu = _run_up(config, summary_path, log, args.timeout_s, layout)
    if rc != 0 or not summary_path.exists():
        raise RuntimeError(f"mode {mode}: rolectl up exited {rc}; its log: {log}")
    summary = json.loads(summary_path.read_text())
    return figures(summary, load_export(summary["events_file"]), trainer_cpu,
                   samples_per_step=2 * args.batch_size * args.group_size, threshold=args.reward_threshold)


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round of median throughput (the lower middle one of an even count), with every round's."""
    ordered = sorted(rounds, key=lambda r: r["samples_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "samples_per_s_rounds": [r["samples_per_s"] for r in rounds]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode of `args.modes`, back to back, `args.repeat` rounds, and each one's gap to `sync`."""
    trainer_cpus, other_cpus = layout = cpu_layout(args.pin)
    os.sched_setaffinity(0, other_cpus)  # this script polls beside the explorers
    with tempfile.TemporaryDirectory(prefix="async-speedup-") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
        for round_ in range(args.repeat):
            for mode in args.modes:
                started = time.monotonic()
                m = run_mode(work, mode, args, round_, layout)
                rounds[mode].append(m)
                print(f"{mode:>20} [{round_}]: {m['seconds_per_step']:.3f} s/step, {m['samples_per_s']:.1f} "
                      f"samples/s, reward {m['reward_last']}, trainer busy {m['trainer_busy_fraction']:.2f}, "
                      f"load {os.getloadavg()[0]:.1f} ({time.monotonic() - started:.0f} s)", flush=True)
    modes = {mode: _median_round(values) for mode, values in rounds.items()}
    base = modes.get("sync")
    for figures_ in modes.values():
        figures_["speedup_vs_sync"] = round(figures_["samples_per_s"] / base["samples_per_s"], 3) if base else None
        figures_["reward_gap_vs_sync"] = (round(figures_["reward_last"] - base["reward_last"], 4)
                                          if base and figures_["reward_last"] is not None else None)
    return {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir", "record")},
            "pinning": {"trainer": sorted(trainer_cpus), "others": sorted(other_cpus),
                        "processes": "rolectl up, nats-server, synchronizer, trainer, 2 explorers"},
            "load_average": [round(x, 2) for x in os.getloadavg()], "modes": modes}


RESULTS = ROOT / "benchmarks" / "results" / "async_speedup.json"
_COLUMNS = ["mode", "s / train step", "samples / s", "speedup vs sync", "reward last 5 steps (gap vs sync)",
            "s to reward", "mean staleness", "trainer busy", "explorer busy", "pauses (rollout / max_ahead)"]


def record(result: dict[str, Any], *, conditions: str, argv: list[str], notes: str | None) -> None:
    """Append `result` as a run of the results file the benchmarks page is rendered from."""
    import datetime
    import platform

    data = json.loads(RESULTS.read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    rows = [[mode, f"{m['seconds_per_step']:.3f}", f"{m['samples_per_s']:.0f}", f"{m['speedup_vs_sync']:.2f}x",
             f"{m['reward_last']} ({m['reward_gap_vs_sync']:+.3f})",
             "-" if m["seconds_to_reward"] is None else f"{m['seconds_to_reward']:.0f}",
             f"{m['mean_staleness']:.2f}", f"{m['trainer_busy_fraction']:.2f}", f"{m['explorer_busy_fraction']:.2f}",
             f"{m['partial_rollout_pauses']} / {m['explorer_pauses']}"] for mode, m in result["modes"].items()]
    run_ = {"date": datetime.date.today().isoformat(), "commit": commit.stdout.strip() or "unknown",
            "commit_note": "the commit the figures were measured at",
            "machine": f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, no GPU",
            "conditions": f"{conditions}; load average at the end {result['load_average']}",
            "command": "python -m benchmarks.async_speedup " + " ".join(argv),
            "columns": _COLUMNS, "rows": rows, "pinning": result["pinning"], "modes": result["modes"]}
    data["runs"].append({**run_, "notes": notes} if notes else run_)
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


_QUICK = {"steps": 6, "batch_size": 8}
"""`--quick`: a few small steps, to see the benchmark run (figures too short to compare)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.async_speedup", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="trainer steps per mode (80: the reward has moved)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="tasks per explore step (x2 explorers per train step)")
    parser.add_argument("--group-size", type=int, default=8, help="responses per task")
    parser.add_argument("--task-length", type=int, default=2, help="digits of a short task (its response: one more)")
    parser.add_argument("--long-task-length", type=int, default=20, help="digits of a long task")
    parser.add_argument("--long-task-fraction", type=float, default=0.1, help="the share of long tasks")
    parser.add_argument("--max-ahead", type=int, default=2, help=f"synchronizer.max_ahead of {BOUNDED}")
    parser.add_argument("--pin", choices=("split", "shared"), default="split",
                        help="split: the trainer on the first CPU, the rest on the others; shared: all on all")
    parser.add_argument("--reward-threshold", type=float, default=0.3, help="for seconds_to_reward")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                        help=f"comma-separated, run in this order (sync first for the ratios): {','.join(MODES)}")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every mode, back to back")
    parser.add_argument("--quick", action="store_true", help=f"a short run: {_QUICK}")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per mode")
    parser.add_argument("--workdir", help="keep configs, logs and run directories here (default: a temp dir)")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--record", metavar="CONDITIONS",
                        help="append this run to benchmarks/results/async_speedup.json (docs/benchmarks.md), "
                             "CONDITIONS saying what else ran on the machine")
    parser.add_argument("--notes", help="with --record: what the figures say")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; known: {list(MODES)}")
    if args.quick:
        vars(args).update(_QUICK)
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.record:
        record(result, conditions=args.record, argv=sys.argv[1:] if argv is None else argv, notes=args.notes)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
