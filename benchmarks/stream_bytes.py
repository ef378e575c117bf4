"""Bytes a job leaves in its streams per trainer step: what the default stream limits are sized from.

    python -m benchmarks.stream_bytes [--config examples/quickstart.yaml] [--timeout 300]

Runs the job's roles as real processes (synchronizer, trainer, explorers) against a fresh nats-server,
waits for the trainer to finish, then reads the event stream's size from the server and the size of
one experience batch as the explorers send it (re-encoded from a real rollout of the job's engine).
The last line is JSON: event bytes and messages per trainer step, the largest event, and the bytes
of one explorer batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rolectl.bus.connection import connect
from rolectl.bus.events import read_all
from rolectl.bus.experiences import ExperienceBatch, encode_batch
from rolectl.bus.server import NatsServer
from rolectl.roles.config import load_config
from rolectl.roles.engines import make_rollout_engine, make_taskset
from rolectl.sync_protocol import encode

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]


async def _measure(url: str, cfg) -> dict:
    async with connect(url, job=cfg.job, role="observer", member="bench") as conn:
        info = await conn.js.stream_info(conn.names.event_stream)
        records = await read_all(conn)
    steps = max(cfg.trainer.total_steps, 1)
    largest = max(len(encode(r.event)) for r in records)
    engine = make_rollout_engine(cfg.model, "explorer-0")
    tasks = make_taskset(cfg.model, seed=0, batch_size=cfg.buffer.batch_size)
    batch = ExperienceBatch(member="explorer-0", explore_step=1, model_version=0,
                            experiences=tuple(engine.rollout(tasks.next_batch(), explore_step=1)))
    return {
        "config": cfg.job,
        "explorers": cfg.explorers.count,
        "trainer_steps": steps,
        "event_bytes": info.state.bytes,
        "event_messages": info.state.messages,
        "event_bytes_per_step": round(info.state.bytes / steps),
        "event_messages_per_step": round(info.state.messages / steps, 1),
        "largest_event_bytes": largest,
        "experience_batch_bytes": len(encode_batch(batch)),
        "experiences_per_batch": len(batch.experiences),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(store_dir=str(Path(tmp) / "nats"))
        server.start()
        procs = []
        try:
            cfg = load_config(args.config)
            raw = Path(args.config).read_text().replace("run_dir: runs", f"run_dir: {tmp}/runs")
            config = Path(tmp) / "job.yaml"
            config.write_text(raw)
            members = [("sync", "sync-0"), ("trainer", "trainer")]
            members += [("explorer", m) for m in cfg.explorer_ids()]
            for role, member in members:
                log = open(Path(tmp) / f"{member}.log", "wb")
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "rolectl", "start", role, "--config", str(config),
                     "--nats", server.url, "--id", member],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1")))
            started = time.monotonic()
            trainer = procs[1]
            rc = trainer.wait(timeout=args.timeout)
            if rc != 0:
                raise SystemExit(f"trainer exited {rc}; see {tmp}/trainer.log")
            for p in procs[2:]:  # explorers end by themselves; the synchronizer runs until told
                p.wait(timeout=60)
            procs[0].send_signal(signal.SIGINT)
            procs[0].wait(timeout=60)
            result = asyncio.run(_measure(server.url, cfg))
            result["wall_s"] = round(time.monotonic() - started, 1)
        finally:
            for p in procs:  # only the processes started here, by PID
                if p.poll() is None:
                    p.kill()
                    p.wait()
            server.stop()
    for key, value in result.items():
        print(f"{key:>26}: {value}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
