"""How long each of a job's replicated streams takes to elect a new leader when the node that leads
all of them is killed (SIGKILL): a standalone reproduction of a cluster node-loss stall
(docs/fault-tolerance.md, "Clusters"; figures in docs/benchmarks.md).

On a local 3-node `NatsCluster` it creates the streams exactly as a job does (`bus.streams`,
`bus.lease`, `bus.snapshots`' bucket, the object store's `weights_stream_config`, all R3), moves
the leader of every one onto one node (a leader step-down naming that node as preferred), keeps a
job-like load going (weight versions of `--chunks` x max_payload written and pruned, the lease
renewed every second, events appended), kills that node and reads the survivors' `/jsz` every
0.25 s until each stream has a new leader, or `--timeout` s pass.

    .venv/bin/python -m benchmarks.cluster_failover --runs 5 --seed 1
    .venv/bin/python -m benchmarks.cluster_failover --runs 3 --debug --keep-logs runs/failover

Prints one line per stream per run (seconds to a new leader, or "NO LEADER") and the survivors'
raft lines about the streams that did not elect. Exits 1 if any stream did not elect.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nats
from nats.js.api import KeyValueConfig, StorageType

from rolectl.bus.lease import ensure_lease_bucket
from rolectl.bus.server import NatsCluster
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream, weights_stream_config
from rolectl.bus.subjects import JobNames

JOB = "failover"


def _jsz(node) -> list[dict]:
    url = f"{node.monitor_url}/jsz?accounts=true&streams=true&config=true&acc=$G"
    with urllib.request.urlopen(url, timeout=2.0) as resp:
        data = json.load(resp)
    return [d for acc in data.get("account_details") or [] for d in acc.get("stream_detail") or []]


def leaders(cluster: NatsCluster, streams: list[str]) -> dict[str, str | None]:
    """stream -> leader name as any live node reports it (None: no live node knows one)."""
    out: dict[str, str | None] = {name: None for name in streams}
    for node in cluster.nodes:
        if not node.running:
            continue
        try:
            details = _jsz(node)
        except Exception:
            continue
        for d in details:
            leader = (d.get("cluster") or {}).get("leader")
            if d.get("name") in out and leader and out[d["name"]] is None:
                out[d["name"]] = leader
    return out


async def _wait(what: str, predicate, timeout: float, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:g} s")


async def create_job_streams(nc, names: JobNames, storage: StorageType) -> list[str]:
    js = nc.jetstream(timeout=10)
    await ensure_event_stream(js, names, replicas=3)
    await ensure_experience_stream(js, names, replicas=3)
    await js.add_stream(weights_stream_config(names, storage=storage, replicas=3, max_msg_size=nc.max_payload))
    await ensure_lease_bucket(_Conn(js), names.lease_bucket, ttl_s=3.0, replicas=3)
    await js.create_key_value(KeyValueConfig(bucket=names.snapshot_bucket, history=2,
                                             storage=StorageType.FILE, replicas=3))
    return [names.event_stream, names.experience_stream, names.weights_stream,
            f"KV_{names.lease_bucket}", f"KV_{names.snapshot_bucket}"]


class _Conn:  # what ensure_lease_bucket reads of a BusConnection
    def __init__(self, js):
        self.js = js


async def move_leaders(nc, cluster: NatsCluster, streams: list[str], target: str, timeout: float) -> None:
    """Step every stream's leader down, naming `target` as preferred, until all are led by it."""
    async def all_there():
        now = await asyncio.to_thread(leaders, cluster, streams)
        away = [s for s, leader in now.items() if leader != target]
        for name in away:
            if now[name] is None:
                continue
            try:
                await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{name}",
                                 json.dumps({"placement": {"preferred": target}}).encode(), timeout=5)
            except Exception:
                pass
        return not away

    await _wait(f"every stream led by {target}", all_there, timeout, every=1.0)


async def job_load(nc, names: JobNames, *, chunks: int, stop: asyncio.Event, counts: dict) -> None:
    """Write like a job: weight versions (chunks, manifest, prune the version before last), the
    lease renewed each second, an event per step. Errors (during the fail-over) are counted."""
    js = nc.jetstream(timeout=5)
    payload = random.randbytes(nc.max_payload - 1024)
    kv = await js.key_value(names.lease_bucket)
    revision = None
    version = 0
    last_lease = 0.0
    while not stop.is_set():
        version += 1
        try:
            for i in range(chunks):
                await js.publish(names.weights_chunk(version, i), payload, stream=names.weights_stream)
            await js.publish(names.weights_manifest(version), b"{}", stream=names.weights_stream)
            if version > 2:
                await js.purge_stream(names.weights_stream, subject=names.weights_version(version - 2))
            await js.publish(names.event("trainer", "trainer", "step"), json.dumps({"v": version}).encode(),
                             stream=names.event_stream)
            counts["ok"] += 1
        except Exception as exc:  # noqa: BLE001 - counted, the fail-over is what is measured
            counts["errors"] += 1
            counts["last_error"] = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)
        if time.monotonic() - last_lease > 1.0:
            last_lease = time.monotonic()
            try:
                revision = (await kv.update("synchronizer", b"sync-0", last=revision) if revision
                            else await kv.put("synchronizer", b"sync-0"))
            except Exception:
                revision = None
        await asyncio.sleep(0)


async def one_run(run: int, args, rng: random.Random) -> dict[str, float | None]:
    store = Path(tempfile.mkdtemp(prefix="rolectl-failover-"))
    cluster = NatsCluster(size=3, store_dir=str(store / "nodes"), log_dir=str(store / "logs"),
                          debug_logs=args.debug)
    await asyncio.to_thread(cluster.start)
    names = JobNames(f"{JOB}-{run}")
    stop = asyncio.Event()
    counts = {"ok": 0, "errors": 0}
    result: dict[str, float | None] = {}
    try:
        async def quiet(exc):  # the kill makes nats-py report a lost connection: expected here
            pass

        nc = await nats.connect(cluster.url.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                error_cb=quiet)
        streams = await create_job_streams(nc, names, StorageType[args.storage.upper()])
        target = cluster.nodes[rng.randrange(3)].server_name
        load = asyncio.create_task(job_load(nc, names, chunks=args.chunks, stop=stop, counts=counts))
        await asyncio.sleep(args.warmup)
        await move_leaders(nc, cluster, streams, target, timeout=120)
        await asyncio.sleep(args.before_kill * rng.random())
        if args.lag:
            await _lag_followers(cluster, target, args.lag)
        before = dict(counts)
        cluster.kill_node(cluster.index_of(target))
        killed = time.monotonic()
        pending = set(streams)
        while pending and time.monotonic() - killed < args.timeout:
            now = await asyncio.to_thread(leaders, cluster, streams)
            for name in list(pending):
                if now[name] is not None and now[name] != target:
                    result[name] = time.monotonic() - killed
                    pending.discard(name)
            await asyncio.sleep(0.25)
        for name in pending:
            result[name] = None
        stop.set()
        await asyncio.wait_for(load, 30)
        print(f"run {run}: killed {target} after {before['ok']} load rounds; load ok {counts['ok']} "
              f"errors {counts['errors']} ({counts.get('last_error', '')[:120]})")
        for name in streams:
            took = result[name]
            print(f"  {name:28s} " + (f"new leader in {took:6.2f} s" if took is not None
                                      else f"NO LEADER after {args.timeout:g} s"))
        if pending and args.debug:
            _print_raft_lines(store / "logs", target, pending)
        await nc.close()
    finally:
        stop.set()
        await asyncio.to_thread(cluster.stop)
        if args.keep_logs:
            dest = Path(args.keep_logs) / f"run-{run}"
            shutil.copytree(store / "logs", dest, dirs_exist_ok=True)
        shutil.rmtree(store, ignore_errors=True)
    return result


async def _lag_followers(cluster: NatsCluster, leader: str, seconds: float) -> None:
    """Pause each follower in turn (SIGSTOP) for `seconds` while the leader and the other one go on
    writing and compacting, so both come back behind the leader's snapshot and must catch up
    from it: what a loaded host does to followers now and then."""
    followers = [n for n in cluster.nodes if n.server_name != leader and n.running]
    for node in followers:
        os.kill(node.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.kill(node.pid, signal.SIGCONT)


def _print_raft_lines(log_dir: Path, killed: str, streams: set[str]) -> None:
    for log in sorted(log_dir.glob("*.log")):
        if log.stem == killed:
            continue
        lines = log.read_text(errors="replace").splitlines()
        groups = _raft_groups(lines, streams)
        hits = [ln for ln in lines if any(s in ln for s in streams) or any(g in ln for g in groups)]
        print(f"  --- {log.name}: {len(hits)} lines about them, last 25:")
        for ln in hits[-25:]:
            print("   ", ln[:220])


def _raft_groups(lines: list[str], streams: set[str]) -> set[str]:
    """The raft group names (S-R3F-...) of `streams`, from lines like "... for '$G > NAME' [S-R3F-x]"."""
    groups = set()
    for ln in lines:
        m = re.search(r"'\$G > ([^'\s]+)'.*\[(S-R3[FM]-\w+)\]", ln)
        if m and m.group(1) in streams:
            groups.add(m.group(2))
    return groups


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=4, help="chunks (of max_payload) per weight version")
    parser.add_argument("--storage", choices=["file", "memory"], default="file", help="weights stream storage")
    parser.add_argument("--warmup", type=float, default=3.0, help="s of load before moving the leaders")
    parser.add_argument("--before-kill", type=float, default=2.0, help="up to this many s (seeded) before the kill")
    parser.add_argument("--timeout", type=float, default=60.0, help="s to wait for each new leader")
    parser.add_argument("--lag", type=float, default=0.0,
                        help="before the kill, SIGSTOP each follower in turn for this many s")
    parser.add_argument("--debug", action="store_true", help="nodes log at debug level; print raft lines")
    parser.add_argument("--keep-logs", default=None, help="copy each run's node logs here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)
    stalled = 0
    for run in range(args.runs):
        result = await one_run(run, args, rng)
        stalled += any(v is None for v in result.values())
    print(f"{stalled} of {args.runs} runs had a stream with no new leader after {args.timeout:g} s")
    return 1 if stalled else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
