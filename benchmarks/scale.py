"""A fleet of explorers against the real synchronizer: decision latency, cost and herds at N = 64 ... 1,024.

    python -m benchmarks.scale [--explorers 64,256,1024] [--method memory,nccl] [--rounds 10]
                               [--procs P] [--nice 10] [--cluster] [--no-herd] [--json F]
                               [--record benchmarks/results/scale.json]

What is real: a nats-server (or, with `--cluster`, a local 3-node cluster, every stream R3), the
synchronizer as its own process (`rolectl start sync --keep-running`, see `benchmarks.sync_latency`,
whose helpers this reuses), and members built from the real `MemberSession` code (`join`,
`set_status`, `publish`, `wait_decision`, heartbeats and the rejoin watch included).
What is simulated: the explorers run many to a process — P worker processes (`--procs`, 1 to 4 by
default, printed and recorded), each with one connection and one `MemberView` that its members
share: the scope of those explorers (their own records, the trainer's, the synchronizer's and the
decisions), as each explorer's own view reads it; they run at `--nice` 10, standing in for a fleet
of machines of its own that does not take the synchronizer's CPU — and their engines do nothing.
The trainer is a `MemberSession` of this (the controller) process, with the trainer's `JobView` of
the whole job. Clocks: `time.monotonic()` is the machine's CLOCK_MONOTONIC, the same in every
process, so a member's latency can start in another process.

Per N and method, after 2 warm-up rounds:
- `member_ms` p50/p99: from the moment the member whose input caused a decision began publishing
  it (an explorer's own REQUIRE_SYNC, the trainer's VersionPublished that released waiting
  explorers, the last REQUIRE_SYNC a rendezvous needed) to the moment a member's view found the
  decision for it (stamped in `wait_decision`'s match, as `benchmarks.sync_latency` does).
  `memory` (a pull method, decision only: the version's location is a name, no bytes move): half
  the explorers ask before the trainer publishes the round's version and wait, the other half ask
  once it exists and are answered at once. `nccl` (a rendezvous, decision only: no process group
  is formed): the trainer and every explorer ask; the last arrival makes the `RendezvousReady`.
- `stream_ms` p50/p99: the decision's server timestamp minus its cause's: the synchronizer's and
  the server's part, without the members' own CPU.
- `member_path_ms` p50/p99: where a member's wait goes, per sample: from the cause's publish to
  the cause recorded (the publishing member's process and the server), from there to the first
  decision for it recorded (the synchronizer and the server), from there to the member's view
  finding it (delivery and the member's own process).
- the synchronizer's CPU (user + system, /proc) per round, per recorded decision (also net of its
  heartbeat handling, at the rate measured while every explorer waits) and per explorer answered,
  its RSS at the end and its peak (VmHWM); the server's CPU per round; event-stream bytes per
  trainer step (one round is one trainer step: the stream's bytes after minus before, over the
  rounds; the jobs take no snapshot, so nothing is trimmed meanwhile).
- experience intake (`memory` runs): every explorer publishes one batch at the same moment and the
  trainer (an `ExperienceReader`, fetching and acking as the trainer does) takes them all: MB/s
  and experiences/s from the go signal to the last ack.
- herd (`memory` runs, one node; `--no-herd` skips): the server is stopped and started again on
  the same port and store while every member is connected and half of them wait in a round; the
  trainer publishes the next version as soon as it can. Seconds from the server's return (ready)
  to the first decision recorded after it, and to the last explorer released and loaded.

The last line printed is JSON: `{"config": ..., "results": [{"explorers", "method",
"member_p99_ms", "sync_ms_per_decision", "sync_rss_mb", "bytes_per_step", ...}]}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from benchmarks.sync_latency import (
    ROOT,
    _cpu_seconds,
    _job_yaml,
    _pct,
    _start_synchronizer,
    _stop,
    _stream_latencies,
    _TimedReader,
    _Timestamps,
)
from rolectl.bus.connection import connect
from rolectl.bus.events import EventPublisher
from rolectl.bus.experiences import ExperiencePublisher, ExperienceReader, encode_batch
from rolectl.bus.logging import setup_logging
from rolectl.bus.server import NatsCluster, NatsServer
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import load_config
from rolectl.roles.session import JobView, MemberSession, MemberView, stop_task
from rolectl.sync_protocol import (
    Decision,
    MemberReleased,
    RendezvousReady,
    Role,
    RunningStatus,
    SyncMethod,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
)
from rolectl.sync_protocol.experience import Experience, ExperienceBatch

WARMUP_ROUNDS = 2
ROUND_TIMEOUT_S = float(os.environ.get("SCALE_ROUND_TIMEOUT_S", "300"))  # a bound on "hung"
EXPERIENCES_PER_BATCH = 8
TOKENS = 128  # prompt and response tokens of one experience (64 each)
IDLE_WINDOWS = 5
TRAINER_KEY = "trainer/trainer"  # the controller's trainer member


def _control(job: str, what: str) -> str:
    """A core-NATS subject the controller and its workers coordinate on (not the job's subjects)."""
    return f"_bench.{job}.{what}"


def _rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of process `pid` in MB, from /proc (0.0 where unreadable)."""
    out = {"VmRSS": 0.0, "VmHWM": 0.0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return round(out["VmRSS"], 1), round(out["VmHWM"], 1)


def _session(cfg, conn, view: JobView | MemberView, role: Role, member_id: str, version: int) -> MemberSession:
    s = MemberSession(cfg, role, member_id)
    s.conn, s.view, s.log = conn, view, structlog.get_logger().bind(member=member_id)
    s.publisher = EventPublisher(conn, s.me)
    s.version = version
    return s


# ==================================================================================================
# worker processes: many explorers each


async def _explorer_rounds(s: MemberSession, stamps: _Timestamps, method: str, early: bool, rounds: int) -> None:
    me = s.me
    for r in range(1, rounds + 1):
        if method == "memory":
            if not early:  # ask once the round's version exists: answered at once
                await s.view.wait_for(lambda v, r=r: v.latest.version >= r, timeout=ROUND_TIMEOUT_S,
                                      what=f"version {r}", announce=False, wake_on=TRAINER_KEY)
            seq = await stamps.timed(s.set_status(RunningStatus.REQUIRE_SYNC))
            d = await stamps.wait(s, seq, lambda d: isinstance(d, MemberReleased) and d.released == me)
        else:
            seq = await stamps.timed(s.set_status(RunningStatus.REQUIRE_SYNC))
            d = await stamps.wait(s, seq, lambda d: isinstance(d, RendezvousReady) and d.assignment_of(me) is not None)
        s.status = RunningStatus.RUNNING
        s.version, s.step = d.version, r
        await s.publish(WeightsLoaded(member=me, version=d.version, round=d.round, nbytes=0, seconds=0.0))


def _batch(member: str, step: int, version: int) -> ExperienceBatch:
    half = TOKENS // 2
    return ExperienceBatch(member=member, explore_step=step, model_version=version, experiences=tuple(
        Experience(id=f"{member}-{step}-{i}", group=f"{member}-{step}", prompt=tuple(range(half)),
                   response=tuple(range(half)), logprobs=tuple(-0.5 for _ in range(half)), reward=1.0,
                   model_version=version)
        for i in range(EXPERIENCES_PER_BATCH)))


async def _worker(spec: dict) -> dict:
    """One worker process: `spec["members"]` explorers, their rounds, then one experience batch each
    at the go signal; reports its stamps on stdout."""
    cfg = load_config(spec["config"])
    job, method, rounds = cfg.job, spec["method"], spec["rounds"]
    async with connect(cfg.nats_url, job=job, role="explorer", member=f"bench-worker-{spec['index']}") as conn:
        # one view for this process's explorers: their scope (their own records, the trainer's, the
        # synchronizer's, every decision), as each explorer's own MemberView reads it
        view = MemberView(conn, spec["members"])
        await view.start()
        stamps = _Timestamps(clock=time.monotonic)
        sessions = [_session(cfg, conn, view, Role.EXPLORER, m, 0) for m in spec["members"]]
        go_experiences, stop = await _on_signal(conn, job, "experiences"), await _on_signal(conn, job, "stop")
        await asyncio.gather(*(s.join(step=0, version=0) for s in sessions))
        await conn.nc.publish(_control(job, f"joined.{spec['index']}"), b"")
        early = set(spec["early"])
        await asyncio.gather(*(_explorer_rounds(s, stamps, method, s.member_id in early, rounds) for s in sessions))
        await conn.nc.publish(_control(job, f"done.{spec['index']}"), b"")
        if method == "memory":
            await asyncio.wait_for(go_experiences.wait(), ROUND_TIMEOUT_S)
            publishers = [ExperiencePublisher(conn, s.me) for s in sessions]
            await asyncio.gather(*(p.publish(_batch(s.member_id, rounds + 1, s.version))
                                   for p, s in zip(publishers, sessions)))
        await asyncio.wait_for(stop.wait(), ROUND_TIMEOUT_S)
        for s in sessions:
            for task in (s._heartbeat_task, s._rejoin_task):
                if task is not None:
                    await stop_task(task)
        await view.aclose()
    return {"samples": stamps.samples, "sent_at": stamps.sent_at, "cpu_s": _cpu_seconds(os.getpid())}


async def _on_signal(conn, job: str, what: str) -> asyncio.Event:
    """An event set when the controller says `what`."""
    said = asyncio.Event()

    async def note(_msg) -> None:
        said.set()

    await conn.nc.subscribe(_control(job, what), cb=note)
    return said


def _worker_main(spec_json: str) -> None:
    setup_logging("warning")
    spec = json.loads(spec_json)
    os.nice(spec["nice"])  # the fleet stands in for machines of its own: it yields the CPU first
    profile = os.environ.get("SCALE_PROFILE_WORKERS")  # a directory: one cProfile per worker there
    if profile:
        import cProfile

        with cProfile.Profile() as prof:
            out = asyncio.run(_worker(spec))
        prof.dump_stats(str(Path(profile) / f"worker{spec['index']}.prof"))
    else:
        out = asyncio.run(_worker(spec))
    print("RESULT " + json.dumps(out), flush=True)


# ==================================================================================================
# the controller: server, synchronizer, trainer, workers


class _Server:
    """One nats-server, or a local 3-node cluster: its URL, processes and a restart (one node)."""

    def __init__(self, workdir: Path, cluster: bool):
        self.cluster = cluster
        if cluster:
            self.impl: NatsServer | NatsCluster = NatsCluster(store_dir=str(workdir / "store"),
                                                               log_dir=str(workdir / "nats"))
        else:
            self.impl = NatsServer(store_dir=str(workdir / "store"), log_file=str(workdir / "nats.log"))

    def start(self) -> None:
        self.impl.start()

    def stop(self) -> None:
        self.impl.stop()

    @property
    def url(self) -> str:
        return self.impl.url

    @property
    def pids(self) -> list[int]:
        nodes = self.impl.nodes if isinstance(self.impl, NatsCluster) else [self.impl]
        return [n.pid for n in nodes if n.pid is not None]

    def restart(self) -> None:
        assert isinstance(self.impl, NatsServer)
        self.impl.stop()
        self.impl.start()


async def _wait_for(view: JobView, predicate, what: str):
    return await view.wait_for(predicate, timeout=ROUND_TIMEOUT_S, what=what, announce=False)


async def _watched(aw, workers: list[subprocess.Popen], sync: subprocess.Popen, workdir: Path, what: str):
    """Await `aw` (bounded), failing at once, with where to look, if a worker or the synchronizer exits."""
    task = asyncio.ensure_future(aw)
    deadline = time.monotonic() + ROUND_TIMEOUT_S
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        dead = [f"worker {i} ({w.returncode})" for i, w in enumerate(workers) if w.poll() not in (None, 0)]
        if sync.poll() is not None:
            dead.append(f"the synchronizer ({sync.returncode})")
        if dead or time.monotonic() > deadline:
            task.cancel()
            why = f"{', '.join(dead)} exited" if dead else f"not done after {ROUND_TIMEOUT_S} s"
            raise RuntimeError(f"{what}: {why}; logs in {workdir}")
    return task.result()


async def _idle_cpu(view: JobView, pid: int, method: str, explorers: int, early: int) -> float:
    """CPU seconds a second the synchronizer spends with nothing to decide (every member's
    heartbeats), measured once every explorer waits for the trainer and the requests are folded."""
    def waiting(v: JobView) -> bool:
        if method == "memory":
            return len(v.state.rounds) >= early
        return any(len(rnd.waiting) >= explorers for rnd in v.state.rounds.values())

    await _wait_for(view, waiting, "every explorer waiting for the trainer")
    # The synchronizer may still be folding the last requests (a starved one, seconds after the
    # view): the quietest one-second windows are the heartbeats alone. CPU time comes in 10 ms
    # ticks, so three of them are summed.
    windows = []
    for _ in range(IDLE_WINDOWS):
        started, cpu = time.monotonic(), _cpu_seconds(pid)
        await asyncio.sleep(1.0)  # a measuring window, not a synchronisation
        windows.append((_cpu_seconds(pid) - cpu, time.monotonic() - started))
    quietest = sorted(windows)[:3]
    return sum(c for c, _ in quietest) / sum(s for _, s in quietest)


async def _stream_bytes(conn) -> int:
    info = await conn.js.stream_info(conn.names.event_stream)
    return info.state.bytes


def _decisions_seen(view: JobView) -> int:
    return view._decisions_base + len(view.decisions)


async def _pull_trainer_round(trainer: MemberSession, stamps: _Timestamps, r: int, early: int) -> None:
    """Publish version `r` once every early explorer waits for it (the others hold `r - 1`: the
    previous round ended once each did); return once every explorer reported it loaded `r`."""
    view = trainer.view
    await _wait_for(view, lambda v: len(v.state.rounds) >= early, f"the early requests of round {r}")
    trainer.version = trainer.step = r
    await stamps.timed(trainer.publish(VersionPublished(
        member=trainer.me, version=r, step=r, method=SyncMethod.MEMORY, location=f"weights/v{r}", nbytes=0,
        digest=f"sha256:{r:064x}")))
    await _every_explorer_holds(view, r)


async def _every_explorer_holds(view: JobView, version: int) -> None:
    """Until every explorer reported holding `version`: one wait per explorer, each woken by its own
    records (`wake_on`). One check of the whole fleet after every burst cost this process O(N) a
    burst: at 1,024 a quarter of its CPU, taken from the processes measured."""
    keys = [m.ref.key for m in view.state.explorers()]

    async def holds(key: str) -> None:
        await view.wait_for(lambda v: v.state.members[key].version >= version, timeout=ROUND_TIMEOUT_S,
                            what=f"{key} holding version {version}", announce=False, wake_on=key)

    await asyncio.gather(*(holds(key) for key in keys))


async def _rendezvous_trainer_round(trainer: MemberSession, stamps: _Timestamps, r: int) -> None:
    trainer.version = trainer.step = r
    seq = await stamps.timed(trainer.set_status(RunningStatus.REQUIRE_SYNC, rendezvous="127.0.0.1:29500"))
    d = await stamps.wait(trainer, seq, lambda d: isinstance(d, RendezvousReady))
    trainer.status = RunningStatus.RUNNING
    await trainer.publish(WeightsBroadcast(member=trainer.me, version=d.version, round=d.round, nbytes=0,
                                           seconds=0.0))


def _spawn_workers(config: Path, method: str, explorers: int, procs: int, rounds: int, workdir: Path,
                   job: str, nice: int) -> list[subprocess.Popen]:
    ids = [f"explorer-{i:04d}" for i in range(explorers)]
    early = ids[0::2] if explorers > 1 else ids
    out = []
    for index in range(procs):
        spec = {"index": index, "config": str(config), "method": method, "rounds": rounds, "nice": nice,
                "members": ids[index::procs], "early": [m for m in early if int(m[-4:]) % procs == index]}
        out.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale", "--worker", json.dumps(spec)], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=open(workdir / f"{job}.worker{index}.log", "ab"), text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    return out


async def _signals(conn, job: str, what: str, count: int) -> asyncio.Event:
    """An event set once `count` workers said `what` (subscribed before they can say it)."""
    seen: set[str] = set()
    done = asyncio.Event()

    async def note(msg) -> None:
        seen.add(msg.subject)
        if len(seen) >= count:
            done.set()

    await conn.nc.subscribe(_control(job, f"{what}.*"), cb=note)
    return done


async def _experience_intake(conn, job: str, explorers: int) -> dict:
    """Tell every worker to publish its explorers' batches at once; take them all as the trainer does."""
    reader = ExperienceReader(conn)
    received = experiences = batch_bytes = 0
    await reader.fetch(1, timeout=0.05)  # the durable consumer exists before anything is published
    started = time.monotonic()
    await conn.nc.publish(_control(job, "experiences"), b"")
    deadline = started + ROUND_TIMEOUT_S
    while received < explorers and time.monotonic() < deadline:
        for got in await reader.fetch(256, timeout=1.0):
            received += 1
            experiences += len(got.batch.experiences)
            batch_bytes = batch_bytes or len(encode_batch(got.batch))  # every batch has the same shape
            await got.ack()
    seconds = time.monotonic() - started
    await reader.aclose()
    return {"batches": received, "seconds": round(seconds, 3),
            "mb_per_s": round(received * batch_bytes / 1e6 / seconds, 2),
            "records_per_s": round(experiences / seconds, 1), "batch_bytes": batch_bytes}


async def _herd(server: _Server, trainer: MemberSession, stamps: _Timestamps, r: int, early: int) -> dict:
    """Stop and start the server while half the explorers wait in round `r`; the trainer publishes
    `r` as soon as it can. Seconds from the server's return to the first decision after it, and
    to every explorer holding `r`."""
    view = trainer.view
    await _wait_for(view, lambda v: len(v.state.rounds) >= early, f"the early requests of round {r}")
    await asyncio.to_thread(server.restart)
    back = time.monotonic()
    trainer.version = trainer.step = r
    seq = await trainer.publish(VersionPublished(  # retried until the server takes it
        member=trainer.me, version=r, step=r, method=SyncMethod.MEMORY, location=f"weights/v{r}", nbytes=0,
        digest=f"sha256:{r:064x}"))
    await _wait_for(view, view.first_decision(seq - 1, lambda d: d.cause_seq == seq), "the version's first release")
    first = time.monotonic() - back
    await _every_explorer_holds(view, r)
    everyone = time.monotonic() - back
    return {"first_decision_s": round(first, 2), "all_explorers_s": round(everyone, 2),
            "expired": sum(not m.alive for m in view.state.explorers(alive_only=False))}


async def _member_path(url: str, job: str, samples: list[tuple[int, float]], sent_at: dict[int, float],
                       wall_minus_monotonic: float) -> dict:
    """Where a member's wait goes, per sample (p50 / p99 ms): from its cause's publish to the cause
    recorded (the publishing member's process and the server), from there to the first decision
    for it recorded (the synchronizer and the server), and from there to the member's view finding
    it (delivery and the member's process). Server times are the records' own; a member's monotonic
    stamps are put on the same wall clock (one machine)."""
    async with connect(url, job=job, role="observer", member="bench-path") as conn:
        reader = _TimedReader(conn, from_seq=1, include_decisions=True, stop_at_end=True)
        async with reader:
            records = [rec async for rec in reader]
    recorded_at = {seq: ns / 1e9 for seq, ns in reader.time_ns.items()}
    decided_at: dict[int, float] = {}
    for rec in records:
        if isinstance(rec.event, Decision):
            decided_at.setdefault(rec.event.cause_seq, recorded_at[rec.seq])
    legs: dict[str, list[float]] = {"publish_to_recorded": [], "recorded_to_decided": [], "decided_to_member": []}
    for cause, got in samples:
        if cause not in recorded_at or cause not in decided_at:
            continue
        legs["publish_to_recorded"].append(1000 * (recorded_at[cause] - sent_at[cause] - wall_minus_monotonic))
        legs["recorded_to_decided"].append(1000 * (decided_at[cause] - recorded_at[cause]))
        legs["decided_to_member"].append(1000 * (got + wall_minus_monotonic - decided_at[cause]))
    return {leg: {k: v for k, v in _pct(values).items() if k in ("p50", "p99")} for leg, values in legs.items()}


async def measure(server: _Server, workdir: Path, *, method: str, explorers: int, rounds: int, procs: int,
                  herd: bool, nice: int = 0) -> dict:
    job = f"scale-{method}-{explorers}-{os.getpid()}-{time.time_ns() % 10**6}"
    # no snapshot (nor the trim after it) during the run: the stream's growth is the bytes per step
    config = _job_yaml(workdir / f"{job}.yaml", job=job, url=server.url, method=method, explorers=explorers,
                       snapshot_every=10**8)
    if server.cluster:  # every stream R3, as a job on a cluster runs
        config.write_text(config.read_text() + "nats:\n  replicas: 3\n")
    cfg = load_config(config)
    total_rounds = WARMUP_ROUNDS + rounds + (1 if herd else 0)
    sync = _start_synchronizer(config, server.url, workdir / f"{job}.sync.log")
    workers: list[subprocess.Popen] = []
    stamps = _Timestamps(clock=time.monotonic)  # the machine's CLOCK_MONOTONIC: the same in every process
    wall_minus_monotonic = time.time() - time.monotonic()  # to put members' stamps beside the server's
    early = explorers // 2 if explorers > 1 else 1
    try:
        async with connect(server.url, job=job, role="trainer", member="bench-controller") as conn:
            await ensure_event_stream(conn.js, conn.names, replicas=cfg.nats.replicas)
            await ensure_experience_stream(conn.js, conn.names, replicas=cfg.nats.replicas)
            view = JobView(conn)
            await view.start()
            trainer = _session(cfg, conn, view, Role.TRAINER, "trainer", 0)
            await trainer.join(step=0, version=0)
            joined = await _signals(conn, job, "joined", procs)
            done = await _signals(conn, job, "done", procs)
            workers = _spawn_workers(config, method, explorers, procs, total_rounds, workdir, job, nice)
            await _watched(joined.wait(), workers, sync, workdir, "the workers joining")
            await _watched(_wait_for(view, lambda v: len(v.state.explorers()) >= explorers
                                     and any(m.ref.role is Role.SYNCHRONIZER and m.alive
                                             for m in v.state.members.values()),
                                     "every explorer and the synchronizer to join"), workers, sync, workdir, "joining")
            figures: dict = {}
            for r in range(1, total_rounds + 1):
                if r == WARMUP_ROUNDS + 1:
                    idle_rate = await _watched(_idle_cpu(view, sync.pid, method, explorers, early), workers, sync,
                                               workdir, "the synchronizer's idle CPU")
                    stamps.samples.clear()
                    cpu_before = [_cpu_seconds(sync.pid), sum(_cpu_seconds(p) for p in server.pids),
                                  sum(_cpu_seconds(w.pid) for w in workers), _cpu_seconds(os.getpid())]
                    bytes_before, decisions_before = await _stream_bytes(conn), _decisions_seen(view)
                    first_counted_seq = view.last_seq + 1
                    counted_from = time.monotonic()
                if r == WARMUP_ROUNDS + rounds + 1:  # the herd round, after the counted ones
                    figures["herd"] = await _watched(_herd(server, trainer, stamps, r, early),
                                                     workers, sync, workdir, "the server restart")
                    break
                if method == "memory":
                    step = _pull_trainer_round(trainer, stamps, r, early)
                else:
                    step = _rendezvous_trainer_round(trainer, stamps, r)
                await _watched(step, workers, sync, workdir, f"{method} N={explorers} round {r}")
                if r == WARMUP_ROUNDS + rounds:
                    counted_s = time.monotonic() - counted_from
                    sync_cpu = _cpu_seconds(sync.pid) - cpu_before[0]
                    server_cpu = sum(_cpu_seconds(p) for p in server.pids) - cpu_before[1]
                    workers_cpu = sum(_cpu_seconds(w.pid) for w in workers) - cpu_before[2]
                    controller_cpu = _cpu_seconds(os.getpid()) - cpu_before[3]
                    stream_bytes = await _stream_bytes(conn) - bytes_before
                    decisions = _decisions_seen(view) - decisions_before
                    rss, peak = _rss_mb(sync.pid)
                    last_counted_seq = view.last_seq
            if method == "nccl":
                await _every_explorer_holds(view, rounds + WARMUP_ROUNDS)
            await _watched(done.wait(), workers, sync, workdir, "the workers' last rounds")
            if method == "memory":
                figures["intake"] = await _experience_intake(conn, job, explorers)
            await conn.nc.publish(_control(job, "stop"), b"")
            reports = []
            for w in workers:
                out, _ = await asyncio.to_thread(w.communicate, timeout=ROUND_TIMEOUT_S)
                line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise RuntimeError(f"worker exited {w.returncode} without a result; see {workdir}")
                reports.append(json.loads(line[len("RESULT "):]))
            for task in (trainer._heartbeat_task, trainer._rejoin_task):
                if task is not None:
                    await stop_task(task)
            await view.aclose()
        # decision recorded minus cause recorded (server time): the path through the synchronizer
        # and the server, without the members' own CPU
        stream_ms = [ms for seq, ms in await _stream_latencies(server.url, job, first_counted_seq, with_seq=True)
                     if seq <= last_counted_seq]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        code = _stop(sync)
    sent_at = dict(stamps.sent_at)
    samples = list(stamps.samples)
    for rep in reports:
        sent_at.update({int(k): v for k, v in rep["sent_at"].items()})
        samples += [tuple(s) for s in rep["samples"]]
    counted = [(cause, got) for cause, got in samples
               if cause in sent_at and counted_from <= sent_at[cause] <= counted_from + counted_s]
    member_ms = [(got - sent_at[cause]) * 1000 for cause, got in counted]
    path = await _member_path(server.url, job, counted, sent_at, wall_minus_monotonic)
    pct, stream = _pct(member_ms), _pct(stream_ms)
    result = {
        "explorers": explorers, "method": method, "procs": procs, "worker_nice": nice, "rounds": rounds,
        "member_p50_ms": pct["p50"], "member_p99_ms": pct["p99"], "member_max_ms": pct["max"],
        "samples": len(member_ms), "decisions": decisions, "member_path_ms": path,
        "stream_p50_ms": stream["p50"], "stream_p99_ms": stream["p99"],
        "sync_ms_per_decision": round(1000 * sync_cpu / max(1, decisions), 3),
        # net of the heartbeats it handles anyway, at the rate measured while idle
        "sync_ms_per_decision_net": round(1000 * max(0.0, sync_cpu - idle_rate * counted_s) / max(1, decisions), 3),
        "sync_idle_cpu_pct": round(100 * idle_rate, 1),
        "sync_ms_per_round": round(1000 * sync_cpu / rounds, 1),
        "sync_ms_per_member": round(1000 * sync_cpu / rounds / explorers, 3),  # per explorer answered
        "sync_rss_mb": rss, "sync_peak_rss_mb": peak,
        "server_ms_per_round": round(1000 * server_cpu / rounds, 1),
        # the simulated fleet's processes and this one (the trainer's session and its view of the job)
        "workers_ms_per_round": round(1000 * workers_cpu / rounds, 1),
        "controller_ms_per_round": round(1000 * controller_cpu / rounds, 1),
        # every process's CPU over what the machine's cores had in the counted rounds: near 1, the
        # rounds wait for CPU, and the latencies measure the machine as much as the code
        "machine_busy": round((sync_cpu + server_cpu + workers_cpu + controller_cpu)
                              / ((os.cpu_count() or 1) * counted_s), 2),
        "bytes_per_step": int(stream_bytes / rounds),
        "round_ms": round(1000 * counted_s / rounds, 1),
        "workers_cpu_s": round(sum(rep["cpu_s"] for rep in reports), 1),
        "sync_exit_code": code, "loadavg": round(os.getloadavg()[0], 1),
        **figures,
    }
    return result


def _print(res: dict) -> None:
    line = (f"{res['method']:>6} N={res['explorers']:<5} ({res['procs']} worker processes) member ms "
            f"p50 {res['member_p50_ms']} p99 {res['member_p99_ms']} max {res['member_max_ms']} (stream p50 "
            f"{res['stream_p50_ms']} p99 {res['stream_p99_ms']}) | synchronizer "
            f"{res['sync_ms_per_decision']} ms CPU/decision ({res['sync_ms_per_decision_net']} net of heartbeats; "
            f"{res['sync_idle_cpu_pct']} % CPU idle), {res['sync_ms_per_round']} ms/round, RSS "
            f"{res['sync_rss_mb']} MB (peak {res['sync_peak_rss_mb']}) | server {res['server_ms_per_round']} ms "
            f"CPU/round | {res['bytes_per_step']} stream bytes/step | round {res['round_ms']} ms | load "
            f"{res['loadavg']}")
    line += (f"\n{'':>14}CPU ms per round: synchronizer {res['sync_ms_per_round']}, server "
             f"{res['server_ms_per_round']}, fleet {res['workers_ms_per_round']}, trainer "
             f"{res['controller_ms_per_round']}; the machine busy {res['machine_busy']} of its cores")
    print(line, flush=True)
    print(f"{'':>14}member path p50 / p99 ms: {_path_text(res['member_path_ms'])}", flush=True)
    if "intake" in res:
        i = res["intake"]
        print(f"{'':>14}experience intake: {i['batches']} batches of {i['batch_bytes']} B in {i['seconds']} s: "
              f"{i['mb_per_s']} MB/s, {i['records_per_s']} experiences/s", flush=True)
    if "herd" in res:
        h = res["herd"]
        print(f"{'':>14}server restart: first decision {h['first_decision_s']} s after its return, every "
              f"explorer released and loaded after {h['all_explorers_s']} s ({h['expired']} expired)", flush=True)


def _path_text(path: dict) -> str:
    return " | ".join(f"{leg.replace('_', ' ')} {v['p50']:.0f} / {v['p99']:.0f}" for leg, v in path.items())


_COLUMNS = ["N", "method", "worker processes", "member p50 / p99 ms", "stream p50 / p99 ms",
            "member path p50 / p99 ms: publish to recorded, to decided, to the member's view",
            "sync ms per decision (net of heartbeats)", "sync ms per explorer answered", "sync CPU ms per round",
            "sync RSS MB (peak)", "server CPU ms per round",
            "fleet / trainer CPU ms per round, machine busy", "stream bytes per step (per explorer)",
            "intake MB/s, experiences/s", "server restart: first decision / every explorer (s)", "load"]


def _row(res: dict) -> list[str]:
    intake = res.get("intake")
    herd = res.get("herd")
    return [str(res["explorers"]), res["method"], str(res["procs"]),
            f"{res['member_p50_ms']:.0f} / {res['member_p99_ms']:.0f}",
            f"{res['stream_p50_ms']:.1f} / {res['stream_p99_ms']:.1f}",
            ", ".join(f"{v['p50']:.0f} / {v['p99']:.0f}" for v in res["member_path_ms"].values()),
            f"{res['sync_ms_per_decision']:.3f} ({res['sync_ms_per_decision_net']:.3f})",
            f"{res['sync_ms_per_member']:.3f}", f"{res['sync_ms_per_round']:.0f}",
            f"{res['sync_rss_mb']:.0f} ({res['sync_peak_rss_mb']:.0f})", f"{res['server_ms_per_round']:.0f}",
            f"{res['workers_ms_per_round']:.0f} / {res['controller_ms_per_round']:.0f}, {res['machine_busy']:.2f}",
            f"{res['bytes_per_step']} ({res['bytes_per_step'] // res['explorers']})",
            f"{intake['mb_per_s']}, {intake['records_per_s']:.0f}" if intake else "—",
            f"{herd['first_decision_s']} / {herd['all_explorers_s']}" if herd else "—",
            str(res["loadavg"])]


def record_run(out: dict, path: Path, command: str) -> None:
    """Add this run to a results file (docs/gen_benchmarks.py's format), with the scaling plot."""
    data = json.loads(path.read_text())
    results = out["results"]
    cluster = out["config"]["cluster"]
    plot = {"file": f"scale_curve{'_cluster' if cluster else ''}.svg",
            "title": f"synchronizer CPU per round against explorers ({'3-node cluster' if cluster else 'one node'})",
            "x_label": "explorers", "y_label": "synchronizer CPU ms per round",
            "series": [{"name": f"{method} ({'pull' if method == 'memory' else 'rendezvous'})",
                        "points": [[r["explorers"], r["sync_ms_per_round"]] for r in results if r["method"] == method]}
                       for method in dict.fromkeys(r["method"] for r in results)]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    loads = [r["loadavg"] for r in results]
    data["runs"].append({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
        "machine": f"{os.cpu_count()}-core x86 VM, no GPU",
        "conditions": (f"{'a local 3-node cluster, streams R3' if cluster else 'one nats-server'}; shared with other "
                       f"work: load {out['config']['loadavg_at_start'][0]} at the start, {min(loads)}-{max(loads)} "
                       f"during; {out['config']['rounds']} counted rounds after {WARMUP_ROUNDS} warm-up"),
        "command": command, "columns": _COLUMNS, "rows": [_row(r) for r in results], "plot": plot})
    path.write_text(json.dumps(data, indent=2) + "\n")


def _default_procs(explorers: int) -> int:
    # each reads its explorers' scope and every decision once for them: few, enough for their waits
    return max(1, min(4, explorers // 128))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explorers", default="64,256,1024", help="comma-separated explorer counts")
    parser.add_argument("--method", default="memory,nccl", help="memory (pull) and/or nccl (rendezvous)")
    parser.add_argument("--rounds", type=int, default=10, help="counted rounds per run (after 2 warm-up rounds)")
    parser.add_argument("--procs", type=int, default=0, help="worker processes (default: N/128, 1 to 4)")
    parser.add_argument("--nice", type=int, default=10, help="niceness of the worker processes (default 10: "
                        "the simulated fleet yields the CPU to the synchronizer and the server)")
    parser.add_argument("--cluster", action="store_true", help="a local 3-node cluster (streams R3), not one node")
    parser.add_argument("--no-herd", dest="herd", action="store_false", help="skip the server-restart herd")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the JSON result here")
    parser.add_argument("--record", default=None, metavar="RESULTS_JSON",
                        help="add the run to this results file (benchmarks/results/scale.json)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker_main(args.worker)
        return {}
    try:
        counts = [int(x) for x in args.explorers.split(",") if x.strip()]
    except ValueError as exc:
        parser.error(f"--explorers takes comma-separated integers: {exc}")
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    for m in methods:
        if m not in ("memory", "nccl"):
            parser.error(f"--method {m!r}: use memory (pull) or nccl (rendezvous)")
    if any(n < 1 for n in counts) or args.rounds < 1 or args.procs < 0:
        parser.error("--explorers, --rounds need positive numbers and --procs a non-negative one")
    setup_logging("warning")
    out: dict = {"config": {"cluster": args.cluster, "rounds": args.rounds, "warmup_rounds": WARMUP_ROUNDS,
                            "cpus": os.cpu_count(), "loadavg_at_start": [round(x, 1) for x in os.getloadavg()]},
                 "results": []}
    keep = os.environ.get("SCALE_WORKDIR")  # keep the logs (synchronizer, workers, server) there
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        workdir = Path(keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        server = _Server(workdir, args.cluster)
        server.start()
        try:
            for method in methods:
                for n in counts:
                    procs = args.procs or _default_procs(n)
                    herd = args.herd and method == "memory" and not args.cluster
                    res = asyncio.run(measure(server, workdir, method=method, explorers=n, rounds=args.rounds,
                                              procs=min(procs, n), herd=herd, nice=args.nice))
                    out["results"].append(res)
                    _print(res)
        finally:
            server.stop()
    print(json.dumps(out))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2))
    if args.record:
        given = sys.argv[1:] if argv is None else argv
        record_run(out, Path(args.record), "python -m benchmarks.scale " + " ".join(given))
    return out


if __name__ == "__main__":
    main()
