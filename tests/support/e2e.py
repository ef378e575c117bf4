"""Helpers of the end-to-end tests: job configs, `rolectl up` as a subprocess, a job whose roles the
test starts and kills itself, and the decision check (recorded decisions = fold of recorded inputs).

Everything is real: a real nats-server, every role its own OS process (`python -m rolectl ...`).
Nothing sleeps to synchronise: the tests wait for events in the job's stream, or poll a condition
with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rolectl.bus.connection import connect
from rolectl.bus.events import read_events
from rolectl.bus.server import NatsServer
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import JobConfig, load_config
from rolectl.roles.observe.replay import check_decisions, load_export
from rolectl.sync_protocol import Decision, Event, Recorded, Role
from rolectl.sync_protocol.groups import GroupBinder, bind_groups
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "e2e" / "configs"

__all__ = [
    "sft_example_base",
    "ROOT",
    "CONFIGS",
    "job_config",
    "UpRun",
    "run_up",
    "decision_problems",
    "assert_decisions_replay",
    "LiveJob",
    "of_kind",
    "trainer_steps",
    "last_trainer_step",
    "stream_experiences",
    "shortened",
]


# -- configs ---------------------------------------------------------------------------------------

def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def job_config(tmp_path: Path, base: str = "small.yaml", *, job: str | None = None, **sections: Any) -> Path:
    """Write `configs/<base>` with `sections` merged in (e.g. synchronizer={"sync_style": ...}) as
    `<tmp_path>/job.yaml`, its run_dir under `tmp_path`. Returns the path."""
    data = yaml.safe_load((CONFIGS / base).read_text())
    data = _merge(data, sections)
    data["run_dir"] = str(tmp_path / "runs")
    if job is not None:
        data["job"] = job
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_config(path)  # fail here, with the config's own message, rather than in a role
    return path


# -- rolectl up ------------------------------------------------------------------------------------

@dataclass
class UpRun:
    rc: int
    wall_s: float
    summary: dict
    records: list[Recorded]
    output: str

    def role_logs(self, lines: int = 25) -> str:
        """The last lines of every role's log (for assertion messages)."""
        run_dir = self.summary.get("run_dir")
        if not run_dir:
            return self.output[-4000:]
        out = []
        for log in sorted((Path(run_dir) / "logs").glob("*.log")):
            with open(log, "rb") as fh:
                tail = b"".join(deque(fh, maxlen=lines)).decode(errors="replace")
            out.append(f"--- {log.name}\n{tail}")
        return "\n".join(out)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            pass
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process we started and every process it started (found by PID under /proc)."""
    for pid in reversed(_descendants(proc.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def run_up(config_path: Path, tmp_path: Path, *, timeout: float = 150.0, extra: tuple[str, ...] = ()) -> UpRun:
    """`python -m rolectl up --config ... --summary ... --no-dashboard` to its end (or `timeout`)."""
    summary_path = tmp_path / "summary.json"
    out_path = tmp_path / "up.out"
    started = time.monotonic()
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rolectl", "up", "--config", str(config_path),
             "--summary", str(summary_path), "--no-dashboard", *extra],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # `up` stops its roles in order and writes the summary
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            _kill_tree(proc)
            rc = -1
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    wall = time.monotonic() - started
    output = out_path.read_text(errors="replace")
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    # rendezvous decisions bound to the group they name, as a member's view reads them
    records = bind_groups(load_export(summary["events_file"])) if summary.get("events_file") else []
    if rc == -1:
        raise AssertionError(f"rolectl up did not finish within {timeout} s\n{output[-4000:]}")
    return UpRun(rc=rc, wall_s=wall, summary=summary, records=records, output=output)


# -- the decision check ----------------------------------------------------------------------------

def decision_problems(records: list[Recorded], *, allow_cut: bool = False) -> list[str]:
    """Differences between the recorded decisions and those a fold of the recorded inputs computes
    (`roles.observe.replay.check_decisions`: identity (kind, round, cause_seq, released) and full content,
    duplicates, order, missing). With `allow_cut`, a decision caused by the very last inputs and
    not recorded (the recording ended first) is not a problem."""
    return [m.describe() for m in check_decisions(records) if not (allow_cut and m.warning)]


def assert_decisions_replay(records: list[Recorded], *, allow_cut: bool = False) -> None:
    decisions = [r for r in records if isinstance(r.event, Decision)]
    assert decisions, "no decision was recorded at all"
    problems = decision_problems(records, allow_cut=allow_cut)
    assert not problems, "recorded decisions differ from the fold of the recorded inputs:\n" + "\n".join(problems)


def of_kind(records: list[Recorded], cls: type, *, role: Role | None = None,
            member: str | None = None) -> list[Recorded]:
    out = []
    for rec in records:
        ev = rec.event
        if not isinstance(ev, cls):
            continue
        if isinstance(ev, Event) and ((role is not None and ev.member.role is not role)
                                      or (member is not None and ev.member.id != member)):
            continue
        out.append(rec)
    return out


def trainer_steps(records: list[Recorded]) -> list[int]:
    from rolectl.sync_protocol import StepFinished

    return [r.event.step for r in of_kind(records, StepFinished, role=Role.TRAINER)]


def last_trainer_step(records: list[Recorded]) -> int:
    steps = trainer_steps(records)
    return steps[-1] if steps else 0


async def stream_experiences(job: LiveJob) -> int:
    """Experiences still stored in the job's experience stream (not acked by the trainer)."""
    from rolectl.bus.experiences import decode_batch

    js = job.conn.js
    name = job.conn.names.experience_stream
    info = await js.stream_info(name)
    total = 0
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(name, seq)
        except Exception:  # acked (deleted) or never there
            continue
        total += len(decode_batch(msg.data).experiences)
    return total


async def accounted_summary(job: LiveJob) -> dict:
    """The finished job's run summary, its experience books checked: every experience produced is
    trained, dropped as stale, filtered by dynamic sampling (never published) or left untrained, and
    what is left is what the stream really holds."""
    from benchmarks.soak import experiences_left_in_stream
    from rolectl.roles.launch.local import summarize

    await job.stream_caught_up()
    summary = summarize(job.records, job=job.cfg.job)
    state = json.loads((job.cfg.trainer_checkpoint_dir / "trainer_state.json").read_text())
    left = await experiences_left_in_stream(job.conn, state)
    produced, trained = summary["experiences_produced"], summary["experiences_trained"]
    dropped = summary["experiences_dropped_stale"] + summary["experiences_filtered"]
    untrained = summary["experiences_left_untrained"]
    assert produced == trained + dropped + untrained, summary
    assert untrained == left, f"the summary says {untrained} left untrained, the stream holds {left}: {summary}"
    return summary


# -- a job whose processes the test starts and kills -----------------------------------------------

@dataclass
class _Proc:
    member_id: str
    role: str
    popen: subprocess.Popen
    log_path: Path


@dataclass
class LiveJob:
    """A real nats-server (store under `tmp_path`) and role processes the test starts, kills (-9)
    and restarts by PID, plus a live copy of the job's stream in `records`.

    `async with LiveJob(tmp_path, config_path) as job:` — leaving the block kills every process it
    started that is still running and stops the server, whatever happened in the test.

    With `auth` (what `rolectl auth init` wrote) the server runs from its config (TLS, one nkey
    identity per member), `admin` provisions the streams, the test follows the stream as
    `observer`, and every role connects as its own identity (files passed in the environment).
    """

    tmp_path: Path
    config_path: Path
    auth: Any = None  # bus.auth.AuthDir
    cfg: JobConfig = field(init=False)
    records: list[Recorded] = field(default_factory=list)
    procs: dict[str, list[_Proc]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cfg = load_config(self.config_path)
        self.logs = self.tmp_path / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        if self.auth is None:
            self.server = NatsServer(store_dir=str(self.tmp_path / "nats"),
                                     log_file=str(self.logs / "nats-server.log"))
        else:
            conf = self.tmp_path / "nats-server.conf"
            conf.write_text(self.auth.server_conf_with_store(self.tmp_path / "nats"))
            self.server = NatsServer(config_file=str(conf), port=self.auth.port, http_port=self.auth.http_port,
                                     log_file=str(self.logs / "nats-server.log"))
        self._changed: asyncio.Condition | None = None
        self._follower: asyncio.Task | None = None
        self._conn_cm = None
        self.conn = None

    @property
    def url(self) -> str:
        return self.server.url if self.auth is None else self.auth.url

    def security(self, identity: str):
        """`identity`'s client settings (None without auth)."""
        return None if self.auth is None else self.auth.security(identity)

    async def __aenter__(self) -> LiveJob:
        self._changed = asyncio.Condition()
        await asyncio.to_thread(self.server.start)
        try:
            if self.auth is not None:
                from rolectl.roles.provision import provision_job

                await provision_job(self.cfg, security=self.security("admin"), url=self.url)
            self._conn_cm = connect(self.url, job=self.cfg.job, role="observer", member="e2e-test",
                                    security=self.security("observer"))
            self.conn = await self._conn_cm.__aenter__()
            await ensure_event_stream(self.conn.js, self.conn.names)
            await ensure_experience_stream(self.conn.js, self.conn.names)
            self._follower = asyncio.create_task(self._follow(), name="e2e-follow")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        for incarnations in self.procs.values():
            for p in incarnations:
                if p.popen.poll() is None:
                    p.popen.kill()  # by PID: only processes this job started
                    p.popen.wait()
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        if self.records:  # for the post-mortem: `rolectl replay --file <tmp>/events.jsonl`
            from rolectl.roles.observe.replay import write_export

            write_export(self.records, self.tmp_path / "events.jsonl", job=self.cfg.job)
        if self._conn_cm is not None:
            try:
                await self._conn_cm.__aexit__(None, None, None)
            except Exception:
                pass
        await asyncio.to_thread(self.server.stop)

    async def _follow(self) -> None:
        bind = GroupBinder()  # rendezvous decisions bound to their group, as a member's view does
        async with read_events(self.conn, from_seq=1, include_decisions=True) as reader:
            async for rec in reader:
                async with self._changed:
                    self.records.append(bind(rec))
                    self._changed.notify_all()

    # -- processes ---------------------------------------------------------------------------------
    def start(self, role: str, member_id: str, *, runner: tuple[str, ...] = ("-m", "rolectl")) -> subprocess.Popen:
        """`python -m rolectl start ROLE --config ... --nats URL --id MEMBER_ID` as a new process
        (`runner` in place of `-m rolectl`: e.g. `tests.support.barrier_start`'s)."""
        n = len(self.procs.get(member_id, []))
        log_path = self.logs / f"{member_id}.{n}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", ROLECTL_ADVERTISE_HOST="127.0.0.1")
        if self.auth is not None:
            env.update(self.auth.security(member_id).as_env())
        with open(log_path, "ab") as out:
            popen = subprocess.Popen(
                [sys.executable, *runner, "start", role, "--config", str(self.config_path),
                 "--nats", self.url, "--id", member_id],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        self.procs.setdefault(member_id, []).append(_Proc(member_id, role, popen, log_path))
        return popen

    def start_all(self) -> None:
        self.start("sync", "sync-0")
        self.start("trainer", "trainer")
        for member_id in self.cfg.explorer_ids():
            self.start("explorer", member_id)

    def current(self, member_id: str) -> subprocess.Popen:
        return self.procs[member_id][-1].popen

    def kill9(self, member_id: str) -> float:
        """SIGKILL the current process of `member_id`; returns the wall-clock time (epoch ms)."""
        popen = self.current(member_id)
        assert popen.poll() is None, f"{member_id} already exited with {popen.returncode}\n{self.log_tail(member_id)}"
        popen.send_signal(signal.SIGKILL)
        popen.wait()
        return time.time() * 1000

    def interrupt(self, member_id: str) -> None:
        popen = self.current(member_id)
        if popen.poll() is None:
            popen.send_signal(signal.SIGINT)

    async def wait_exit(self, member_id: str, timeout: float) -> int:
        """The exit code of `member_id`'s current process, polled until `timeout` s."""
        popen = self.current(member_id)
        await wait_until(lambda: popen.poll() is not None, timeout=timeout, what=f"{member_id} to exit",
                         details=self.all_logs)
        return popen.returncode

    async def wait_exits(self, member_ids: list[str], timeout: float) -> dict[str, int]:
        """The exit codes of `member_ids`' current processes, once every one has exited."""
        await wait_until(lambda: all(self.current(m).poll() is not None for m in member_ids), timeout=timeout,
                         what=f"{', '.join(member_ids)} to exit", details=self.all_logs)
        return {m: self.current(m).returncode for m in member_ids}

    async def all_exit_zero(self, member_ids: list[str], timeout: float) -> None:
        codes = await self.wait_exits(member_ids, timeout)
        assert all(code == 0 for code in codes.values()), f"exit codes {codes}\n{self.all_logs()}"

    def log_tail(self, member_id: str, lines: int = 30) -> str:
        out = []
        for p in self.procs.get(member_id, []):
            with open(p.log_path, "rb") as fh:
                out.append(f"--- {p.log_path.name}\n" + b"".join(deque(fh, maxlen=lines)).decode(errors="replace"))
        return "\n".join(out)

    def all_logs(self, lines: int = 20) -> str:
        return "\n".join(self.log_tail(m, lines) for m in self.procs)

    # -- the stream --------------------------------------------------------------------------------
    async def wait_for(self, predicate: Callable[[list[Recorded]], Any], *, timeout: float, what: str) -> Any:
        """Wait until `predicate(records)` is truthy (re-checked on every new record); return it."""
        return await wait_until(lambda: predicate(self.records), timeout=timeout, what=what,
                                changed=self._changed, details=self.all_logs)

    async def wait_until(self, condition: Callable[[], Any], *, timeout: float, what: str, poll: float = 0.2) -> Any:
        """Poll `condition()` (not tied to the stream, e.g. the server's view) until truthy."""
        return await wait_until(condition, timeout=timeout, what=what, poll=poll, details=self.all_logs)

    async def stream_caught_up(self, timeout: float = 10.0) -> None:
        """Wait until `records` holds everything the stream has right now."""
        from rolectl.bus.events import last_sequence

        end = await last_sequence(self.conn)
        await self.wait_for(lambda recs: recs and recs[-1].seq >= end, timeout=timeout,
                            what=f"the stream up to seq {end}")


def shortened(example: str, tmp_path: Path, steps: int = 6) -> Path:
    """`examples/<example>` with `steps` trainer steps and as many more explorer steps, in proportion, as
    it ships with (an offset, a margin for stale drops), its run dir under `tmp_path`."""
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    trainer, explorers = data["trainer"], data["explorers"]
    ratio = explorers["total_steps"] / trainer["total_steps"]
    trainer["total_steps"] = steps
    trainer["save_interval"] = min(trainer.get("save_interval", 1), steps)
    explorers["total_steps"] = math.ceil(steps * ratio)
    data["run_dir"] = str(tmp_path / "runs")
    path = tmp_path / example
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def sft_example_base(tmp_path: Path, *, steps: int) -> Path:
    """examples/sft_base.yaml, shortened to `steps` and without evals, run by `rolectl up` to its end:
    the base a later stage's example starts from, exported where its `trainer.export_dir` says
    (under `tmp_path`, as runs/bases/digits-sft is under the repository)."""
    data = yaml.safe_load((ROOT / "examples" / "sft_base.yaml").read_text())
    export = tmp_path / "bases" / "digits-sft"
    data["run_dir"] = str(tmp_path / "sft-runs")
    data["trainer"].update(export_dir=str(export), save_interval=2)
    data["model"]["path"] = str(tmp_path / "models" / "sft-base-gpt2")  # built on first use, as shipped
    data["sft"].update(max_steps=steps, eval_interval=0, eval_path=None)
    path = tmp_path / "sft_base.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "sft").mkdir()  # its summary and output, apart from the next stage's
    run = run_up(path, tmp_path / "sft", timeout=300, extra=("--run-dir", str(tmp_path / "sft-runs")))
    assert run.rc == 0 and run.summary["complete"], f"exit {run.rc}\n{run.output[-2000:]}\n{run.role_logs()}"
    assert run.summary["trainer_steps"] == steps and run.summary["stage"]["name"] == "sft", run.summary
    return export
