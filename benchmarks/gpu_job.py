"""The GPU suite's whole job: the LLM quickstart on one GPU, run by `rolectl up`, with its figures.

    python -m benchmarks.gpu_job [--sync-method cuda_ipc|memory] [--steps 40] [--explorers 2]
        [--device cuda] [--workdir DIR] [--timeout-s 105] [--json PATH]

The job is examples/llm_quickstart_fsdp.yaml's task and model (the 416k-parameter GPT-2 built into
the work directory, reverse_digits.jsonl, GRPO) with, on CUDA:

- the trainer: the `fsdp` engine on ONE rank (FSDP2 over a mesh of one GPU; NCCL between ranks needs
  a second GPU), fp32 master weights and optimizer with bf16 compute (`model.fsdp.param_dtype:
  bfloat16`: FSDP2's MixedPrecisionPolicy gathers the fp32 shards as bf16 and reduces gradients in
  fp32), gradient checkpointing on;
- `--explorers` `hf` explorers on the same GPU, loading bf16 weights (`model.dtype`);
- weights by `--sync-method`: `cuda_ipc` (the trainer's GPU buckets mapped by each explorer) or
  `memory` (the object store, fetched into CUDA through the pinned spare buffer).

`--device cpu` runs the same job in fp32 on CPU (`memory` only): a check of the config and the
figures on a machine without a GPU, not a measurement.

The JSON: the summary's figures (complete, reward first / last, sync waits, bytes moved, wall
time), the trainer's steps per second between its first and last reported step, the weight syncs'
seconds (each explorer's load, and for `cuda_ipc` the trainer's send), and the trainer's peak GPU
memory (the `gpu_peak_memory_bytes` its StepFinished metrics report) against the model + optimizer
estimate (fp32 weights, fp32 gradients and AdamW's two fp32 moments: 16 bytes a parameter).
Exit status 0 only when the job completed, the reward rose, and on CUDA the trainer reported its
peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["MODEL_OPTIMIZER_BYTES_PER_PARAMETER", "figures", "job_config", "main"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llm_quickstart_fsdp.yaml"
TASKS_PER_EXPLORER = 16  # the quickstart's buffer.batch_size
# fp32 master weights (4) + fp32 gradients (4) + AdamW's exp_avg and exp_avg_sq in fp32 (8)
MODEL_OPTIMIZER_BYTES_PER_PARAMETER = 16


def job_config(work: Path, *, sync_method: str = "cuda_ipc", steps: int = 40, explorers: int = 2,
               device: str = "cuda") -> dict[str, Any]:
    """The job `rolectl up` runs: the fsdp quickstart on one trainer rank, explorers on the same device."""
    import yaml

    cuda = device.startswith("cuda")
    if not cuda and sync_method == "cuda_ipc":
        raise ValueError("cuda_ipc needs --device cuda; on CPU use --sync-method memory")
    data = yaml.safe_load(EXAMPLE.read_text())
    data["job"] = f"gpu-job-{sync_method.replace('_', '-')}"
    data["run_dir"] = str(work / "runs")
    data["synchronizer"]["sync_method"] = sync_method
    # one checkpoint (the last step) and the final Hugging Face export: both read the CUDA shards
    data["trainer"].update(total_steps=steps, save_interval=steps, world_size=1,
                           train_batch_tasks=explorers * TASKS_PER_EXPLORER, hf_save_interval=0)
    data["explorers"].update(count=explorers, total_steps=steps + 1)
    data["buffer"]["batch_size"] = TASKS_PER_EXPLORER
    data["model"].update(path=str(work / "model"), device=device, dtype="bfloat16" if cuda else "float32",
                         gradient_checkpointing=True)
    data["model"]["fsdp"]["param_dtype"] = "bfloat16" if cuda else "float32"
    return data


def _run_up(config: Path, summary: Path, log: Path, timeout_s: float) -> tuple[int | str, float]:
    """`rolectl up` as its own process group; past `timeout_s` it is interrupted (Ctrl-C: it stops
    the roles and still writes its summary), then killed 20 s later."""
    argv = [sys.executable, "-m", "rolectl", "up", "--config", str(config), "--summary", str(summary),
            "--no-dashboard"]
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rc: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = f"interrupted after {timeout_s:.0f} s"
    return rc, time.monotonic() - started


def _spread(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {"count": len(values), "median": statistics.median(values), "max": max(values), "sum": sum(values)}


def figures(summary: dict[str, Any], records: list[Any]) -> dict[str, Any]:
    """The job's figures from its summary and its recorded stream (`load_export` of its events file)."""
    from rolectl.sync_protocol import Role, StepFinished, WeightsBroadcast, WeightsLoaded

    steps = [(r.time_ms, r.event.metrics) for r in records
             if isinstance(r.event, StepFinished) and r.event.member.role is Role.TRAINER]
    out: dict[str, Any] = {key: summary.get(key) for key in (
        "complete", "end_reason", "trainer_steps", "explorer_steps", "syncs", "reward_first", "reward_last",
        "sync_wait_ms", "weights_bytes_moved", "weights_bytes_per_sync", "engines", "model_parameters",
        "trainer_world_size", "wall_s", "hf_model_dir")}
    first, last = summary.get("reward_first"), summary.get("reward_last")
    out["reward_rose"] = first is not None and last is not None and last > first
    if len(steps) > 1:
        span_s = (steps[-1][0] - steps[0][0]) / 1000
        out["steps_per_s"] = (len(steps) - 1) / span_s if span_s > 0 else None
        out["first_step_after_s"] = (steps[0][0] - records[0].time_ms) / 1000  # start-up: processes, models, CUDA
    out["weights_loaded_s"] = _spread([r.event.seconds for r in records if isinstance(r.event, WeightsLoaded)])
    out["weights_sent_s"] = _spread([r.event.seconds for r in records if isinstance(r.event, WeightsBroadcast)])
    peaks = [m["gpu_peak_memory_bytes"] for _, m in steps if "gpu_peak_memory_bytes" in m]
    parameters = next((m["model_parameters"] for _, m in reversed(steps) if "model_parameters" in m), None)
    out["trainer_peak_gpu_memory_bytes"] = max(peaks) if peaks else None
    if parameters:
        estimate = parameters * MODEL_OPTIMIZER_BYTES_PER_PARAMETER
        out["model_optimizer_estimate_bytes"] = estimate
        out["peak_over_estimate"] = max(peaks) / estimate if peaks else None
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    from rolectl.roles.observe.export import ExportError, load_export

    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    config = work / "job.yaml"
    data = job_config(work, sync_method=args.sync_method, steps=args.steps, explorers=args.explorers,
                      device=args.device)
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    summary_path, log = work / "summary.json", work / "up.log"
    rc, seconds = _run_up(config, summary_path, log, args.timeout_s)
    result: dict[str, Any] = {"config": data, "rc": rc, "seconds": round(seconds, 1), "problems": []}
    if not summary_path.exists():
        result["problems"].append(f"rolectl up wrote no summary (exit {rc}); its log: {log}")
        result["log_tail"] = log.read_text(errors="replace")[-4000:]
        return result
    summary = json.loads(summary_path.read_text())
    try:
        records = load_export(summary["events_file"])
    except (KeyError, ExportError) as exc:
        result["problems"].append(f"the job's events cannot be read: {exc}")
        records = []
    result.update(figures(summary, records) if records else {"complete": summary.get("complete")})
    if rc != 0 or not result.get("complete"):
        result["problems"].append(f"the job did not complete (exit {rc}): {summary.get('end_reason')}")
        result["log_tail"] = log.read_text(errors="replace")[-4000:]
    if not result.get("reward_rose"):
        result["problems"].append(f"the reward did not rise: {summary.get('reward_first')} -> "
                                  f"{summary.get('reward_last')}")
    if args.device.startswith("cuda") and result.get("trainer_peak_gpu_memory_bytes") is None:
        result["problems"].append("the trainer reported no gpu_peak_memory_bytes in its StepFinished metrics")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_job", description=__doc__.splitlines()[0])
    parser.add_argument("--sync-method", choices=("cuda_ipc", "memory"), default="cuda_ipc",
                        help="weights by CUDA IPC, or by the object store")
    parser.add_argument("--steps", type=int, default=40, help="trainer steps (the quickstart runs 120)")
    parser.add_argument("--explorers", type=int, default=2, help="hf explorers, on the trainer's device")
    parser.add_argument("--device", default="cuda", help="cuda (bf16) or cpu (fp32: a check, not a figure)")
    parser.add_argument("--workdir", default="runs/gpu-job", help="the model, the run directory, the job's log")
    parser.add_argument("--timeout-s", type=float, default=105.0,
                        help="interrupt the job after this long (it still writes its summary)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.explorers < 1 or args.timeout_s <= 0:
        parser.error("--steps must be at least 2, --explorers at least 1, --timeout-s positive")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device!r}: use cuda[:N] or cpu")
    if args.device == "cpu" and args.sync_method == "cuda_ipc":
        parser.error("--sync-method cuda_ipc needs --device cuda; on CPU use --sync-method memory")
    result = run(args)
    text = json.dumps(result, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    for problem in result["problems"]:
        print(f"benchmarks.gpu_job: {problem}", file=sys.stderr)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
