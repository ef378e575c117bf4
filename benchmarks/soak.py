"""A chaos soak: a long tiny-engine job (a trainer, N explorers, two synchronizer replicas, each its
own process, one nats-server) under seeded faults, checked continuously and at the end.

    .venv/bin/python -m benchmarks.soak --minutes 60 --explorers 16 --fault-every 8 --seed 1 \
        --spare explorer-0,sync-0 --json F

Faults, one every `--fault-every` s, picked by the seed: kill -9 of a role (trainer, an explorer, a
synchronizer replica), restarted at once; SIGSTOP of a role for longer than the heartbeat expiry,
then SIGCONT; kill -9 of the nats-server, restarted on the same port and store. With `--cluster` the
job runs on a local 3-node cluster (`nats.replicas: 3`) and the server fault is a node lost instead:
kill -9 of one node (half the time the event stream's leader), started again after the heartbeat
expiry; the next node fault waits until every stream of the job has its 3 copies current again
(what an operator's rolling restart waits for: with two nodes away a 3-node cluster has no quorum).

Checked: every trainer step trained once (no step reported twice, none missing); experiences
produced = trained + dropped as stale + left untrained, where "left untrained" is compared with what
the experience stream really holds at the end (less: lost; more: trained twice); `replay --check`
over archive + tail; hangs (the trainer without a new step for longer than `--hang-s`); roles that
end by themselves (restarted, counted); every process's RSS against the trainer's step (slope per
1,000 steps, per process; the max is reported; `--spare` members are never killed or stopped, so
their slope spans the whole run);
the event stream's bytes over time (archived and trimmed after each snapshot). Prints a table and
writes JSON with at least faults_injected, experiences_lost, experiences_duplicated, hangs,
rss_slope_mb_per_1k_steps, event_stream_bytes_max, minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from rolectl.bus.connection import connect
from rolectl.bus.events import read_events
from rolectl.bus.experiences import decode_batch
from rolectl.bus.logging import setup_logging
from rolectl.bus.server import NatsCluster, NatsServer
from rolectl.roles.config import load_config
from rolectl.roles.launch.local import summarize
from rolectl.roles.observe.check import check_decisions
from rolectl.roles.observe.export import read_history
from rolectl.sync_protocol import Role, StepFinished
from rolectl.sync_protocol.reducer import fold_lenient

JOB = "soak"
EXPIRY_S = 4.0
SETTLE_S = 120.0  # a node back must have caught up within this long before the next node fault
# a restarted server recovers its store before it serves: on a loaded machine that took over 20 s
# (the roles wait for it meanwhile; only a server that never comes back ends the soak)
SERVER_READY_S = 180.0


def _config(root: Path, explorers: int, replicas: int = 1) -> Path:
    data = {
        "job": JOB, "run_dir": str(root / "runs"), "log_level": "warning",
        "synchronizer": {"sync_method": "memory", "sync_style": "fixed", "sync_interval": 1, "sync_timeout": 60,
                         "heartbeat_period": 0.5, "heartbeat_expiry": EXPIRY_S, "snapshot_every": 300},
        "trainer": {"total_steps": 1_000_000, "save_interval": 1, "train_batch_tasks": 4 * explorers},
        "explorers": {"count": explorers, "total_steps": 1_000_000, "engine_num": 1, "step_delay_s": [0.0],
                      "trainer_grace_s": 900},
        "buffer": {"batch_size": 4, "ack_wait_s": 30},
        "model": {"engine": "tiny", "group_size": 4},
        "nats": {"replicas": replicas},
    }
    path = root / "soak.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_config(path)
    return path


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        # kept after the run: the roles' logs, the archive and the server's store, for a post-mortem
        self.root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rolectl-soak-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = _config(self.root, args.explorers, replicas=3 if args.cluster else 1)
        self.cfg = load_config(self.config)
        (self.root / "logs").mkdir()
        self.server: NatsServer | NatsCluster
        if args.cluster:
            self.server = NatsCluster(size=3, store_dir=str(self.root / "nats"), log_dir=str(self.root / "logs"),
                                      ready_timeout=SERVER_READY_S)
        else:
            self.server = NatsServer(store_dir=str(self.root / "nats"), log_file=str(self.root / "logs" / "nats.log"),
                                     ready_timeout=SERVER_READY_S)
        self.unsettled = 0  # node faults skipped because the cluster had not caught up within SETTLE_S
        self.procs: dict[str, subprocess.Popen] = {}
        self.roles = {"sync-0": "sync", "sync-1": "sync", "trainer": "trainer",
                      **{f"explorer-{i}": "explorer" for i in range(args.explorers)}}
        self.faults: dict[str, int] = {}
        self.spared = set(args.spare)  # members no kill or stop targets: their one process's RSS spans the run
        self.exits: list[str] = []  # a role that ended by itself (refused, gave up, crashed): restarted, counted
        self.trainer_step = 0
        self.progress_at = time.monotonic()
        self.longest_gap_s = 0.0
        self.hangs = 0
        self.rss: dict[str, list[tuple[int, float]]] = {}  # "member#pid" -> (trainer step, MB)
        self.stream_bytes: list[tuple[float, int]] = []
        self.load: list[float] = []  # the machine's 1-minute load average, sampled with the RSS

    def start(self, member: str) -> None:
        log = open(self.root / "logs" / f"{member}.log", "ab")
        self.procs[member] = subprocess.Popen(
            [sys.executable, "-m", "rolectl", "start", self.roles[member], "--config", str(self.config),
             "--nats", self.url, "--id", member],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", ROLECTL_ADVERTISE_HOST="127.0.0.1"))
        log.close()

    @property
    def url(self) -> str:
        return self.server.url  # a cluster's is the comma-separated list of its nodes

    # -- faults ------------------------------------------------------------------------------------
    async def fault(self) -> None:
        server_fault = "node" if self.args.cluster else "server"
        kind = self.rng.choices(["kill9", "sigstop", server_fault], weights=[6, 3, 1])[0]
        member = self.rng.choice(sorted(set(self.procs) - self.spared))
        proc = self.procs[member]
        if kind == "server":
            await asyncio.to_thread(self.server.kill)
            await asyncio.to_thread(self.server.start)
        elif kind == "node":
            member = await self.lose_node()
            if member is None:
                return
        elif self.restart_if_exited(member):
            return  # not a fault: it had ended by itself
        elif kind == "kill9":
            os.kill(proc.pid, signal.SIGKILL)  # a process this soak started, by its PID
            proc.wait()
            self.start(member)
        else:
            os.kill(proc.pid, signal.SIGSTOP)
            await asyncio.sleep(EXPIRY_S + 1.0)  # past the heartbeat expiry: the member is expired
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
        self.faults[kind] = self.faults.get(kind, 0) + 1
        print(f"[{time.strftime('%H:%M:%S')}] fault {kind} {'' if kind == 'server' else member} "
              f"(trainer step {self.trainer_step})", flush=True)

    def restart_if_exited(self, member: str) -> bool:
        """A role that ended by itself is restarted (as a supervisor would) and counted: in a soak
        nothing ends a role but the soak, so each is a finding (see its log)."""
        code = self.procs[member].poll()
        if code is None:
            return False
        self.exits.append(f"{member} exit {code} at trainer step {self.trainer_step}")
        print(f"[{time.strftime('%H:%M:%S')}] EXIT: {self.exits[-1]}; restarted", flush=True)
        self.start(member)
        return True

    async def lose_node(self) -> str | None:
        """kill -9 one node of the cluster (half the time the event stream's leader), start it again
        after the heartbeat expiry; None (no fault) while the last one back has not caught up."""
        cluster = self.server
        assert isinstance(cluster, NatsCluster)
        if not await self._settled():
            self.unsettled += 1
            print(f"[{time.strftime('%H:%M:%S')}] node fault skipped: the cluster has not caught up "
                  f"within {SETTLE_S:.0f} s", flush=True)
            return None
        names = [node.server_name for node in cluster.nodes]
        leader = await asyncio.to_thread(cluster.stream_leader, f"RFT_{JOB.upper()}_EVENTS")
        name = leader if leader in names and self.rng.random() < 0.5 else self.rng.choice(names)
        index = names.index(name)
        await asyncio.to_thread(cluster.kill_node, index)
        await asyncio.sleep(EXPIRY_S + 1.0)  # away longer than the heartbeat expiry
        await asyncio.to_thread(cluster.start_node, index)
        return f"{name}{' (leader)' if name == leader else ''}"

    async def _settled(self) -> bool:
        """Every stream of the job (events, experiences, weights, buckets) can lose a node now."""
        cluster = self.server
        assert isinstance(cluster, NatsCluster)
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            if await asyncio.to_thread(cluster.unsettled_streams, JOB, min_replicas=3) == {}:
                return True
            await asyncio.sleep(1.0)  # polling the monitoring endpoints: they push nothing
        return False

    # -- watching ----------------------------------------------------------------------------------
    async def follow(self) -> None:
        """Trainer steps from the stream (its StepFinished), across server restarts."""
        seq = 0
        while True:
            try:
                async with connect(self.url, job=JOB, role="observer", member="soak") as conn:
                    async with read_events(conn, from_seq=seq + 1, include_decisions=False) as reader:
                        async for rec in reader:
                            seq = rec.seq
                            ev = rec.event
                            if isinstance(ev, StepFinished) and ev.member.role is Role.TRAINER \
                                    and ev.step > self.trainer_step:
                                self.trainer_step = ev.step
                                self.progress_at = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(1.0)  # the server is away: read again once it is back

    async def sample(self) -> None:
        while True:
            gap = time.monotonic() - self.progress_at
            self.longest_gap_s = max(self.longest_gap_s, gap)
            if gap > self.args.hang_s:
                self.hangs += 1
                self.progress_at = time.monotonic()  # count each silence once
                print(f"HANG: no trainer step for {gap:.0f} s", flush=True)
            self.load.append(os.getloadavg()[0])
            for member in list(self.procs):
                self.restart_if_exited(member)
            for member, proc in self.procs.items():
                mb = _rss_mb(proc.pid)
                if mb is not None:
                    self.rss.setdefault(f"{member}#{proc.pid}", []).append((self.trainer_step, mb))
            try:
                async with connect(self.url, job=JOB, role="observer", member="soak-bytes",
                                   connect_timeout=2.0) as conn:
                    info = await conn.js.stream_info(conn.names.event_stream)
                    self.stream_bytes.append((time.monotonic(), info.state.bytes))
            except Exception:
                pass
            await asyncio.sleep(2.0)

    # -- the run -----------------------------------------------------------------------------------
    async def run(self) -> dict:
        started = time.monotonic()
        await asyncio.to_thread(self.server.start)
        for member in self.roles:
            self.start(member)
        watchers = [asyncio.create_task(self.follow()), asyncio.create_task(self.sample())]
        try:
            end = started + 60 * self.args.minutes
            while time.monotonic() + self.args.fault_every < end:
                await asyncio.sleep(self.args.fault_every * self.rng.uniform(0.5, 1.5))
                await self.fault()
            await asyncio.sleep(max(0.0, end - time.monotonic()))
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            await self.stop_roles()
        result = await self.check()
        result["minutes"] = round((time.monotonic() - started) / 60, 2)
        await asyncio.to_thread(self.server.stop)
        return result

    async def stop_roles(self) -> None:
        """Ctrl-C every role (explorers and trainer first, the synchronizers last), then wait."""
        members = [m for m in self.procs if not m.startswith("sync")]
        for group in (members, ["sync-0", "sync-1"]):
            for member in group:
                proc = self.procs[member]
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGCONT)  # one stopped by a fault must hear the SIGINT
                    proc.send_signal(signal.SIGINT)
            for member in group:
                _wait(self.procs[member], 60)

    async def check(self) -> dict:
        async with connect(self.url, job=JOB, role="observer", member="soak-check") as conn:
            records = await read_history(conn, self.cfg.event_archive_dir)
            left_in_stream = await _left_in_stream(conn, self.cfg)
        # a step counts once the fold took it: a StepFinished refused (an expired incarnation's)
        # is counted nowhere in the summary either
        _, _, refused = fold_lenient(records)
        refused_seqs = {e.seq for e in refused}
        steps = [r.event.step for r in records if isinstance(r.event, StepFinished)
                 and r.event.member.role is Role.TRAINER and r.seq not in refused_seqs]
        summary = summarize(records, job=JOB)
        left = summary["experiences_left_untrained"]
        mismatches = [m for m in check_decisions(records) if not m.warning]
        seqs = {r.seq for r in records}
        gaps = len(set(range(1, max(seqs, default=0) + 1)) - seqs)
        slopes = {key: _slope_per_1k(points) for key, points in self.rss.items()}
        slopes = {k: v for k, v in slopes.items() if v is not None}
        per_process: dict[str, float] = {}
        for key, value in slopes.items():
            member = key.split("#")[0]
            per_process[member] = max(per_process.get(member, value), value)
        return {
            "faults_injected": sum(self.faults.values()),
            "faults": dict(sorted(self.faults.items())),
            "cluster": bool(self.args.cluster),
            "node_faults_skipped_unsettled": self.unsettled,
            "trainer_steps": max(steps, default=0),
            "trainer_steps_reported_twice": len(steps) - len(set(steps)),
            "trainer_steps_missing": len(set(range(1, max(steps, default=0) + 1)) - set(steps)),
            "experiences_produced": summary["experiences_produced"],
            "experiences_trained": summary["experiences_trained"],
            "experiences_dropped_stale": summary["experiences_dropped_stale"],
            "experiences_left_untrained": left,
            "experiences_left_in_stream": left_in_stream,
            "experiences_lost": max(0, left - left_in_stream),
            "experiences_duplicated": max(0, left_in_stream - left),
            "replay_check_mismatches": len(mismatches),
            "replay_check_first": [m.describe() for m in mismatches[:3]],
            "history_missing_seqs": gaps,
            "hangs": self.hangs,
            "unexpected_exits": len(self.exits),
            "unexpected_exits_first": self.exits[:5],
            "longest_trainer_gap_s": round(self.longest_gap_s, 1),
            "rss_slope_mb_per_1k_steps": per_process,
            "rss_slope_mb_per_1k_steps_max": max(per_process.values(), default=None),
            # the spared members' one process each, over the whole run: the long-lived figure
            "rss_slope_mb_per_1k_steps_spared": {m: v for m, v in per_process.items() if m in self.spared},
            "rss_mb_spared_first_last": {m: [round(points[0][1], 1), round(points[-1][1], 1)]
                                         for key, points in self.rss.items()
                                         if (m := key.split("#")[0]) in self.spared},
            "event_stream_bytes_max": max((b for _, b in self.stream_bytes), default=0),
            "event_stream_bytes_last": self.stream_bytes[-1][1] if self.stream_bytes else 0,
            "records": len(records),
            # the machine's load while it ran (it is shared): 1-minute load average, min/mean/max
            "load_avg_1m": {"min": round(min(self.load), 1), "mean": round(sum(self.load) / len(self.load), 1),
                            "max": round(max(self.load), 1), "cpus": os.cpu_count()} if self.load else None,
            "workdir": str(self.root),
        }


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # a process this soak started
        proc.wait()


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _slope_per_1k(points: list[tuple[int, float]]) -> float | None:
    """Least-squares MB per 1,000 trainer steps, over the second half of a process's life (its
    imports and first steps are warm-up); None when it saw fewer than 50 steps."""
    points = points[len(points) // 2:]
    if len(points) < 5 or points[-1][0] - points[0][0] < 50:
        return None
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(m for _, m in points) / n
    var = sum((s - mx) ** 2 for s, _ in points)
    if var == 0:
        return None
    return round(1000 * sum((s - mx) * (m - my) for s, m in points) / var, 3)


async def experiences_left_in_stream(conn, trainer_state: dict) -> int:
    """Experiences the experience stream still holds untrained, read with the trainer's checkpoint
    (`trainer_state.json`): less the trained part of batches it holds partly trained (`partial`),
    less batches it trained whose ack was not confirmed (`acked_seqs`: a trainer acks them untrained)."""
    return len(await experience_ids_left_in_stream(conn, trainer_state))


async def experience_ids_left_in_stream(conn, trainer_state: dict) -> list[str]:
    """The ids of the experiences `experiences_left_in_stream` counts."""
    partial = trainer_state.get("partial", {})
    trained = set(trainer_state.get("acked_seqs", ()))
    js, name = conn.js, conn.names.experience_stream
    info = await js.stream_info(name)
    ids: list[str] = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if seq in trained:
            continue
        try:
            msg = await js.get_msg(name, seq)
        except Exception:  # acked (deleted)
            continue
        experiences = decode_batch(msg.data).experiences
        ids += [experiences[i].id for i in partial.get(str(seq), range(len(experiences)))]
    return ids


async def _left_in_stream(conn, cfg) -> int:
    """What the soak's job left in its experience stream, read with the trainer's last checkpoint."""
    state_file = cfg.trainer_checkpoint_dir / "trainer_state.json"
    return await experiences_left_in_stream(conn, json.loads(state_file.read_text()) if state_file.exists() else {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--explorers", type=int, default=16)
    parser.add_argument("--fault-every", type=float, default=12.0, help="seconds between faults (mean)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cluster", action="store_true",
                        help="a local 3-node cluster (nats.replicas 3); the server fault loses one node")
    parser.add_argument("--hang-s", type=float, default=120.0, help="a trainer silent this long is a hang")
    parser.add_argument("--spare", type=lambda text: [m for m in text.split(",") if m], default=[],
                        help="members (e.g. explorer-0,sync-0) no kill or stop targets: their RSS slope spans the "
                             "whole run (a process killed every few minutes never shows slow growth)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where logs, archive and store go (default: a new temp dir)")
    args = parser.parse_args(argv)
    setup_logging("warning")  # the soak's own lines; every role logs to its file under workdir
    result = asyncio.run(Soak(args).run())
    result["command"] = "python -m benchmarks.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = (result["experiences_lost"] == 0 and result["experiences_duplicated"] == 0 and result["hangs"] == 0
          and result["unexpected_exits"] == 0
          and result["replay_check_mismatches"] == 0 and result["trainer_steps_reported_twice"] == 0
          and result["trainer_steps_missing"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
