"""A trainer of N ranks: one member on the job's stream, rank 0 speaking for all, the others following.

`rolectl start trainer` with `trainer.world_size > 1` is a small agent (as torchrun's): it starts
this host's ranks as child processes (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ... in their environment)
and watches them. They live and die together: when one exits, the agent kills the others; after a
crash it starts them all again (up to `trainer.max_restarts` times, one host) and every rank resumes
from the last checkpoint, never a partial trainer.

- Rank 0 runs the ordinary `Trainer` loop (NATS, experiences, syncs) with its engine wrapped in
  `RankLeader`: each call that needs every rank (a train step, a checkpoint save or load, the weight
  stream, a Hugging Face export, the end) first broadcasts a command to the other ranks.
- Ranks > 0 run `follow`: receive a command, make the same engine call, repeat until `stop`.

Commands are small JSON objects sent as uint8 tensors over their own gloo group, whose timeout is
long: rank 0 may wait on the bus for experiences far longer than a collective should take. The
engine's own collectives keep `model.fsdp.timeout_s`, so a dead peer fails a step in that time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog

from rolectl.bus.server import free_port
from rolectl.roles.config import EnvSettings, JobConfig, env_settings
from rolectl.roles.exit_codes import ExitCode

__all__ = ["RANK_ENV", "RankLeader", "follow", "run_trainer", "RankLayout", "supervise_ranks"]

RANK_ENV = EnvSettings.variable("trainer_rank")
"""Set by the agent in each rank's environment: this process is that rank, not an agent."""

# Rank 0 waits on the bus between commands for as long as the job takes; a dead peer is the agent's
# to notice (it kills every rank), not this timeout's.
_COMMAND_TIMEOUT = timedelta(days=7)
# Codes with which rank 0 ends the trainer for good: nothing a restart would change.
_FINAL_CODES = {ExitCode.OK, ExitCode.USAGE, ExitCode.INCOMPLETE, ExitCode.INTERRUPTED}
_POLL_S = 0.2  # how often the agent looks at its ranks


class _Commands:
    """Rank 0's commands to the other ranks: JSON bytes broadcast over a dedicated gloo group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo", timeout=_COMMAND_TIMEOUT)

    def send(self, op: str, **args: Any) -> None:
        import torch

        payload = json.dumps({"op": op, **args}).encode()
        self._dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=self.group)
        self._dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> dict[str, Any]:
        import torch

        size = torch.zeros(1, dtype=torch.int64)
        self._dist.broadcast(size, src=0, group=self.group)
        buffer = torch.empty(int(size), dtype=torch.uint8)
        self._dist.broadcast(buffer, src=0, group=self.group)
        return json.loads(buffer.numpy().tobytes())


class RankLeader:
    """Rank 0's engine, as the `Trainer` sees it: each collective call is announced to the other
    ranks first, so they make the same call; everything else is the wrapped engine's."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._commands = _Commands()
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def train_step(self, experiences: Sequence[Any], *, current_version: int) -> dict[str, float]:
        self._commands.send("train", current_version=current_version)
        return self._engine.train_step(self._engine.share_batch(experiences), current_version=current_version)

    def save_checkpoint(self, path: Path, *, extra: dict[str, Any] | None = None) -> None:
        self._commands.send("save", path=str(path))
        self._engine.save_checkpoint(path, extra=extra)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        self._commands.send("load", path=str(path))
        return self._engine.load_checkpoint(path)

    def iter_weight_buckets(self, bucket_bytes: int | None = None) -> Iterator[Any]:
        """The weight stream (rank 0 gets the tensors); every rank gathers with us to the end."""
        size = bucket_bytes or self._engine.config.fsdp.weight_bucket_bytes
        self._commands.send("weights", bucket_bytes=size)
        yield from self._engine.iter_weight_buckets(size)

    def weights(self) -> dict[str, Any]:
        return {name: tensor for bucket in self.iter_weight_buckets() for name, tensor in bucket}

    def save_hf_model(self, path: Path) -> None:
        self._commands.send("export", path=str(path))
        self._engine.save_hf_model(path, bucket_bytes=self._engine.config.fsdp.weight_bucket_bytes)

    # a trainer-only stage (roles.stage): every rank builds the stage's loss from the job itself
    def set_lr_schedule(self, schedule: str, **settings: Any) -> None:
        self._commands.send("schedule", schedule=schedule, **settings)
        self._engine.set_lr_schedule(schedule, **settings)

    def train_batch(self, batch: Any, loss_fn: Any) -> dict[str, float]:
        self._commands.send("train_batch")
        return self._engine.train_batch(self._engine.share_train_batch(batch), loss_fn)

    def evaluate_batch(self, batch: Any, loss_fn: Any) -> dict[str, float]:
        self._commands.send("evaluate_batch")
        return self._engine.evaluate_batch(self._engine.share_train_batch(batch), loss_fn)

    def stop(self) -> None:
        """The other ranks leave their loop (safe twice)."""
        if not self._stopped:
            self._stopped = True
            self._commands.send("stop")


def follow(engine: Any, log: Any, *, stage_loss: Any = None) -> None:
    """A rank > 0: make rank 0's engine calls, in its order, until it says stop. `stage_loss`: the
    loss of a trainer-only stage's batches, as rank 0 built it from the job."""
    commands = _Commands()
    while True:
        command = commands.receive()
        op = command.pop("op")
        if op in _STAGE_OPS:
            _STAGE_OPS[op](engine, command, stage_loss)
        elif op == "train":
            engine.train_step(engine.share_batch(None), current_version=command["current_version"])
        elif op == "save":
            engine.save_checkpoint(Path(command["path"]))
        elif op == "load":
            engine.load_checkpoint(Path(command["path"]))
        elif op == "weights":
            for _ in engine.iter_weight_buckets(command["bucket_bytes"]):
                pass
        elif op == "export":
            engine.save_hf_model(Path(command["path"]), bucket_bytes=engine.config.fsdp.weight_bucket_bytes)
        elif op == "stop":
            log.info("rank_stopped", step=engine.step)
            return
        else:
            raise ValueError(f"rank 0 sent an unknown command {op!r}: ranks of different rolectl versions?")


_STAGE_OPS = {
    "schedule": lambda engine, args, _: engine.set_lr_schedule(args.pop("schedule"), **args),
    "train_batch": lambda engine, _, loss: engine.train_batch(engine.share_train_batch(None), loss),
    "evaluate_batch": lambda engine, _, loss: engine.evaluate_batch(engine.share_train_batch(None), loss),
}


# -- one rank ------------------------------------------------------------------------------------------

def _run_rank(cfg: JobConfig, member_id: str | None, *, start_mode: Any, log_json: bool) -> int:
    import torch

    from rolectl.bus.errors import describe
    from rolectl.bus.logging import setup_logging
    from rolectl.roles.engines import make_train_engine
    from rolectl.roles.runner import run_role

    settings = env_settings()
    rank = settings.trainer_rank
    torch.set_num_threads(settings.torch_threads)
    setup_logging(cfg.log_level, json=log_json)
    log = structlog.get_logger().bind(job=cfg.job, role="trainer", member=member_id or "trainer", rank=rank)
    if rank > 0:
        # Stopping is rank 0's word (`stop`) or the agent's SIGKILL, never a signal of our own.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = make_train_engine(cfg)
    log.info("rank_ready", world_size=engine.world_size, step=engine.step)
    if rank > 0:
        try:
            follow(engine, log, stage_loss=_stage_loss(cfg))
        except Exception as exc:
            log.error("rank_failed", error=describe(exc))
            return ExitCode.ERROR
        engine.close()
        return ExitCode.OK
    leader = RankLeader(engine)
    try:
        return run_role("trainer", cfg, member_id, start_mode=start_mode, log_json=log_json, engine=leader)
    finally:
        try:
            leader.stop()
            engine.close()
        except Exception as exc:  # a peer already gone: the agent ends them all anyway
            log.warning("ranks_not_stopped", error=describe(exc))


def _stage_loss(cfg: JobConfig) -> Any:
    """A trainer-only stage's loss (None for RL), built from the job on every rank."""
    if not cfg.trainer_only:
        return None
    from rolectl.roles.stage import stage_loss

    return stage_loss(cfg)


# -- the agent -----------------------------------------------------------------------------------------

class RankLayout:
    """Which ranks run on this host and where rank 0 listens (torchrun's flags)."""

    def __init__(self, world_size: int, *, nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                 master_port: int | None = None) -> None:
        if world_size % nnodes:
            raise ValueError(f"trainer.world_size = {world_size} ranks do not divide over --nnodes {nnodes} hosts")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank {node_rank} is not in 0..{nnodes - 1} (--nnodes {nnodes})")
        if nnodes > 1 and (master_addr is None or master_port is None):
            raise ValueError(f"--nnodes {nnodes}: give --master-addr and --master-port (rank 0's host and a free "
                             "port there), the same on every host")
        self.world_size, self.nnodes, self.node_rank = world_size, nnodes, node_rank
        self.nproc_per_node = world_size // nnodes
        self.master_addr = master_addr or "127.0.0.1"
        self.master_port = master_port

    def ranks(self) -> range:
        first = self.node_rank * self.nproc_per_node
        return range(first, first + self.nproc_per_node)

    def env(self, rank: int, port: int) -> dict[str, str]:
        return {RANK_ENV: str(rank), "RANK": str(rank), "LOCAL_RANK": str(rank % self.nproc_per_node),
                "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(port)}


def _die_with_parent() -> None:
    """In a rank, before exec: SIGKILL when the agent dies (Linux), so no rank outlives its trainer."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _start_ranks(layout: RankLayout, command: list[str], port: int) -> dict[int, subprocess.Popen]:
    procs = {}
    for rank in layout.ranks():
        env = {**os.environ, **layout.env(rank, port), "PYTHONUNBUFFERED": "1"}
        # Their own session: a terminal's Ctrl-C reaches the agent, which tells rank 0 once.
        procs[rank] = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    return procs


def _kill_all(procs: dict[int, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    for proc in procs.values():
        proc.wait()


def supervise_ranks(layout: RankLayout, command: list[str], *, max_restarts: int, log: Any) -> int:
    """Run `command` once per rank of this host (its rank in the environment) until rank 0 ends
    the trainer; a rank that dies ends them all, and they start again together while restarts are
    left (one host). Returns the trainer's exit code."""
    stopping: list[int] = []

    def on_signal(sig: int, _frame: Any) -> None:
        stopping.append(sig)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    restarts_left = max_restarts if layout.nnodes == 1 else 0
    while True:
        port = layout.master_port or free_port(layout.master_addr)
        procs = _start_ranks(layout, command, port)
        log.info("trainer_ranks_started", ranks={str(r): p.pid for r, p in procs.items()},
                 world_size=layout.world_size, master=f"{layout.master_addr}:{port}")
        told = False
        leader = procs.get(0)
        while True:
            if stopping and not told and leader is not None and leader.poll() is None:
                leader.send_signal(signal.SIGINT)  # rank 0 saves, says STOPPED, then stops the others
                told = True
            if stopping and leader is None:
                _kill_all(procs)  # a host without rank 0: its ranks end with the job's
                return ExitCode.INTERRUPTED
            exited = {rank: proc.returncode for rank, proc in procs.items() if proc.poll() is not None}
            if leader is not None and 0 in exited and exited[0] in _FINAL_CODES:
                code = exited[0]
                _wait_then_kill(procs, within_s=30.0)  # they got `stop`: they leave on their own
                log.info("trainer_ranks_exited", exit_code=code,
                         codes={str(r): p.returncode for r, p in procs.items()})
                return code
            # A follower exits 0 only after rank 0's `stop`: rank 0 is ending, wait for its code.
            failed = {rank: code for rank, code in exited.items() if code != 0}
            if failed or (leader is None and len(exited) == len(procs)):
                break
            time.sleep(_POLL_S)
        if not failed:  # a host without rank 0: every rank left when rank 0 said stop
            log.info("trainer_ranks_exited", exit_code=0)
            return ExitCode.OK
        # A rank died: the trainer is not whole any more.
        _kill_all(procs)
        log.error("trainer_rank_died", failed={str(r): c for r, c in failed.items()},
                  restarts_left=restarts_left, stopping=bool(stopping))
        if stopping or restarts_left == 0:
            return ExitCode.INTERRUPTED if stopping else ExitCode.ERROR
        restarts_left -= 1
        command = [a for a in command if a != "--fresh"]  # the restart resumes what this start began
        log.warning("trainer_ranks_restarting", hint="every rank resumes from the last checkpoint")


def _wait_then_kill(procs: dict[int, subprocess.Popen], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _kill_all(procs)


def run_trainer(cfg: JobConfig, member_id: str | None, *, start_mode: Any, log_json: bool, argv: list[str],
                nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                master_port: int | None = None) -> int:
    """`rolectl start trainer` of `trainer.world_size > 1` ranks: the agent, or (with `RANK_ENV`
    set by the agent) one rank. Returns the process exit code."""
    if RANK_ENV in os.environ:
        return _run_rank(cfg, member_id, start_mode=start_mode, log_json=log_json)
    from rolectl.bus.logging import setup_logging

    setup_logging(cfg.log_level, json=log_json)
    log = structlog.get_logger().bind(job=cfg.job, role="trainer", member=member_id or "trainer", agent=True)
    layout = RankLayout(cfg.trainer.world_size, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                        master_port=master_port)
    return supervise_ranks(layout, [sys.executable, "-m", "rolectl", *argv],
                           max_restarts=cfg.trainer.max_restarts, log=log)
