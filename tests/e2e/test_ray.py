"""`rolectl up --launcher ray` on a real local Ray head (one per module, explicit CPUs, usage stats
off): the quickstart submitted with `ray job submit` learns as it does locally; kill -9 of the
trainer's role process mid-job makes Ray restart its actor and the job completes with every step
trained once; `up` of a job that is already on the cluster is refused; a job secured by `rolectl
auth init` runs with each actor connected as its own identity, holding no other identity's seed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from rolectl.bus.auth import init_auth_dir
from rolectl.bus.server import free_port
from rolectl.roles.observe.replay import load_export
from rolectl.sync_protocol import MemberJoined
from tests.support.e2e import (
    ROOT,
    LiveJob,
    assert_decisions_replay,
    job_config,
    last_trainer_step,
    of_kind,
    trainer_steps,
)
from tests.support.wait import wait_until_sync

# one Ray head per module: with `-n 3 --dist loadgroup` its tests stay on one worker (one head)
# The first test also pays for the head's start, which may be tried again (ray_head): more than the
# default 600 s bound on "hung".
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("ray"), pytest.mark.timeout(900)]

RAY_CLI = str(Path(sys.executable).with_name("ray"))
# Usage stats off; token auth off (Ray 2.60 turns it on; this head listens on loopback only); and the
# raylet waits longer for its agents to report their ports than its 15 s default, which a loaded
# 2-core machine exceeds.
RAY_ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1",
               RAY_agent_register_timeout_ms="300000", RAY_raylet_start_wait_time_s="120",
               # the CLI's own GCS requests (node info at start) may wait longer than their 60 s default
               RAY_gcs_server_request_timeout_seconds="300")
RAY_SYSTEM_CONFIG = {"raylet_start_wait_time_s": 120, "agent_register_timeout_ms": 300_000}


class RayHead:
    """`ray start --head --block` as our own process group: torn down by its PID, never `ray stop`
    (which would stop every Ray on the machine)."""

    def __init__(self, tmp: Path) -> None:
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.log = tmp / "ray-head.log"
        # Ray's session dir holds unix sockets (107-byte paths at most): a short one, not pytest's tmp.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rolectl-ray-", dir="/tmp"))
        args = [RAY_CLI, "start", "--head", "--block", "--num-cpus", "4", "--num-gpus", "0",
                "--node-ip-address", "127.0.0.1", "--port", str(self.gcs_port),
                "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                "--dashboard-port", str(self.dashboard_port),
                # every port explicit: no clash with another Ray on this machine, and the raylet
                # does not wait (and time out, on a loaded machine) for its agents to report theirs
                *(arg for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                                   "--runtime-env-agent-port", "--ray-client-server-port", "--metrics-export-port",
                                   "--node-manager-port", "--object-manager-port")
                  for arg in (flag, str(free_port()))),
                "--disable-usage-stats", "--system-config", json.dumps(RAY_SYSTEM_CONFIG),
                "--temp-dir", str(self.temp_dir)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=RAY_ENV,
                                         start_new_session=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def wait_ready(self, timeout: float = 240) -> None:
        """`ray start` said the node is up (GCS and raylet registered) and the job server answers."""
        def ready() -> bool:
            assert self.proc.poll() is None, f"ray start exited {self.proc.returncode}\n{self.log.read_text()[-3000:]}"
            if "Ray runtime started" not in self.log.read_text(errors="replace"):
                return False  # polling a log line
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/jobs/", timeout=5) as resp:
                    return resp.status == 200
            except OSError:
                return False  # an HTTP endpoint that is not up yet

        wait_until_sync(ready, timeout=timeout, poll=0.5, what="the Ray head to be ready",
                        details=lambda: self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own session: raylet, workers, role processes
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


RAY_HEAD_STARTS = 2


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A started Ray head. `ray start` itself can fail on a loaded 2-core host (its own GCS RPC
    deadlines: "Failed to get node info: RPC error: Deadline Exceeded" after 2 minutes at load 7-9):
    that is Ray's start-up, not what these tests test, so a failed start is stopped by its PID and
    tried again, on fresh ports, up to RAY_HEAD_STARTS times; each failure's log tail is kept for the
    error if every start fails."""
    failures = []
    for attempt in range(1, RAY_HEAD_STARTS + 1):
        head = RayHead(tmp_path_factory.mktemp(f"rayhead{attempt}"))
        try:
            head.wait_ready()
        except AssertionError as exc:
            head.stop()
            failures.append(f"start {attempt}: {exc}")
            continue
        try:
            yield head
        finally:
            head.stop()
        return
    pytest.fail(f"`ray start --head` failed {RAY_HEAD_STARTS} times:\n" + "\n\n".join(failures))


def _up_args(config: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rolectl", "up", "--launcher", "ray", "--config", str(config),
            "--summary", str(tmp_path / "summary.json"), "--no-dashboard", "--run-dir", str(tmp_path / "runs"),
            *extra]


def test_ray_job_submit_runs_the_quickstart_and_it_learns(ray_head, tmp_path, record_property):
    """`ray job submit -- <venv python> -m rolectl up --launcher ray ...`: the entrypoint finds the
    cluster through RAY_ADDRESS, as a user's would."""
    started = time.monotonic()
    result = subprocess.run(
        [RAY_CLI, "job", "submit", "--address", ray_head.dashboard, "--",
         *_up_args(ROOT / "examples" / "quickstart.yaml", tmp_path)],
        capture_output=True, text=True, env=RAY_ENV, timeout=480, cwd=ROOT)
    wall = time.monotonic() - started
    output = result.stdout + result.stderr
    summary_file = tmp_path / "summary.json"
    assert summary_file.exists(), f"no summary (exit {result.returncode})\n{output[-5000:]}"
    s = json.loads(summary_file.read_text())
    figures = {k: s.get(k) for k in ("wall_s", "trainer_steps", "explorer_steps", "final_version",
                                      "reward_first", "reward_last", "sync_wait_ms")}
    for key, value in {**figures, "submit_wall_s": round(wall, 1)}.items():
        record_property(key, value)
    print(f"quickstart via ray job submit: submit wall {wall:.1f} s, {figures}")
    assert result.returncode == 0 and "succeeded" in output, output[-5000:]
    assert s["launcher"] == "ray" and s["complete"], s
    assert set(s["exit_codes"].values()) == {0}, s["exit_codes"]
    assert s["trainer_steps"] == 50 and s["final_version"] == 50, figures
    assert s["explorer_steps"] == {"explorer-0": 50, "explorer-1": 50}, figures
    assert s["reward_last"] >= s["reward_first"] + 0.3, figures
    assert_decisions_replay(load_export(s["events_file"]))


async def test_kill9_of_a_role_process_ray_restarts_it_and_the_job_completes(ray_head, tmp_path):
    total = 12
    config = job_config(
        tmp_path, job="e2e-ray-kill",
        synchronizer={"sync_method": "memory", "sync_style": "fixed", "sync_timeout": 300,
                      "heartbeat_period": 0.4, "heartbeat_expiry": 2.0},
        trainer={"total_steps": total, "save_interval": 1, "train_batch_tasks": 8},
        explorers={"total_steps": total, "step_delay_s": [0.0, 0.1], "trainer_grace_s": 120},
        buffer={"ack_wait_s": 60},  # longer than the test: the killed trainer's batches come back by nak
    )
    async with LiveJob(tmp_path, config) as job:  # our nats-server (`--nats`), its stream followed live
        with open(tmp_path / "up.out", "wb") as out:
            up = subprocess.Popen(_up_args(config, tmp_path, "--ray-address", ray_head.address, "--nats", job.url),
                                  stdout=out, stderr=subprocess.STDOUT, env=RAY_ENV, cwd=ROOT)
        try:
            # The role process's pid is in its MemberJoined record. Killed as soon as the stream shows
            # step 1 of 12: only the follower's lag lies between seeing the step and the kill. (Asking
            # the actor through Ray instead took seconds under load, long enough for the trainer to
            # finish all its steps first.)
            await job.wait_for(lambda recs: last_trainer_step(recs) >= 1, timeout=240, what="trainer step 1")
            pid = of_kind(job.records, MemberJoined, member="trainer")[0].event.pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                raise AssertionError(f"the trainer (pid {pid}) was gone before the kill: it ended at step "
                                     f"{last_trainer_step(job.records)} of {total}") from None
            rc = await asyncio.to_thread(up.wait, 400)
        finally:
            if up.poll() is None:
                up.send_signal(signal.SIGINT)  # `up` tears down its actors
                await asyncio.to_thread(up.wait, 60)
        output = (tmp_path / "up.out").read_text(errors="replace")
        assert rc == 0, output[-5000:]
        s = json.loads((tmp_path / "summary.json").read_text())
        assert s["launcher"] == "ray" and s["complete"], s
        assert s["restarts"] == {"trainer": 1}, s["restarts"]
        assert set(s["exit_codes"].values()) == {0}, s["exit_codes"]  # the synchronizer stopped by SIGINT too
        records = load_export(s["events_file"])
        assert trainer_steps(records) == list(range(1, total + 1)), trainer_steps(records)
        assert_decisions_replay(records)
        trainer_log = (Path(s["run_dir"]) / "logs" / "trainer.log").read_text(errors="replace")
        assert "trainer incarnation 1" in trainer_log and f"exited with code -{int(signal.SIGKILL)}" in trainer_log


def test_up_of_a_job_already_on_the_cluster_is_refused(ray_head, tmp_path):
    """The job's name is held by its job actor for as long as its `up` runs: here this test holds it."""
    import ray

    from rolectl.roles.launch.ray import JobActor, actor_name

    config = job_config(tmp_path, job="e2e-ray-taken")
    ray.init(address=ray_head.address, namespace="rolectl", logging_level="ERROR", log_to_driver=False)
    try:
        holder = ray.remote(JobActor).options(name=actor_name("e2e-ray-taken", "job"), num_cpus=0).remote()
        ray.get(holder.stop_nats.remote(), timeout=120)  # created and answering
        result = subprocess.run(_up_args(config, tmp_path, "--ray-address", ray_head.address),
                                capture_output=True, text=True, env=RAY_ENV, timeout=180, cwd=ROOT)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "job 'e2e-ray-taken' is already running on this Ray cluster" in result.stderr, result.stderr
        assert not (tmp_path / "runs").exists()  # refused before it made anything
        ray.get(holder.stop_nats.remote(), timeout=30)  # and the holder was left alone
    finally:
        ray.shutdown()


def test_a_two_rank_fsdp_trainer_runs_in_its_ray_bundle(ray_head, tmp_path):
    """The trainer's actor runs the rank agent: both ranks share the trainer's bundle, the job
    completes with one trainer of world size 2 and its Hugging Face export."""
    from tests.e2e.test_llm_quickstart import shortened

    config = shortened(tmp_path, "llm_quickstart_fsdp.yaml", steps=2)
    result = subprocess.run(_up_args(config, tmp_path, "--ray-address", ray_head.address),
                            capture_output=True, text=True, env=RAY_ENV, timeout=600, cwd=ROOT)
    summary_file = tmp_path / "summary.json"
    assert summary_file.exists(), f"no summary (exit {result.returncode})\n{result.stderr[-5000:]}"
    s = json.loads(summary_file.read_text())
    assert result.returncode == 0 and s["launcher"] == "ray" and s["complete"], (s, result.stderr[-3000:])
    assert s["engines"]["trainer"] == "fsdp" and s["trainer_world_size"] == 2, s
    assert (Path(s["hf_model_dir"]) / "config.json").is_file(), s
    assert_decisions_replay(load_export(s["events_file"]))


def test_a_secured_job_on_ray_runs_each_actor_as_its_own_identity(ray_head, tmp_path):
    """`up --launcher ray --auth-dir`: the server runs TLS with one nkey identity per member (as an
    actor on the head), the driver provisions as admin, and every role connects as itself from
    the identity files its actor alone was handed; the job trains every step, nobody is refused
    anything it needs, and each actor's copy of its seed is gone once the job is."""
    job = "e2e-ray-secure"
    auth = init_auth_dir(tmp_path / "auth", job=job, explorers=2, synchronizers=1, port=free_port(),
                         http_port=free_port())
    config = job_config(tmp_path, job=job, trainer={"total_steps": 4}, explorers={"total_steps": 4})
    result = subprocess.run(_up_args(config, tmp_path, "--ray-address", ray_head.address, "--auth-dir", str(auth.path)),
                            capture_output=True, text=True, env=RAY_ENV, timeout=480, cwd=ROOT)
    summary_file = tmp_path / "summary.json"
    assert summary_file.exists(), f"no summary (exit {result.returncode})\n{result.stderr[-5000:]}"
    s = json.loads(summary_file.read_text())
    assert result.returncode == 0 and s["launcher"] == "ray" and s["complete"], (s, result.stderr[-3000:])
    assert s["secured"] is True and s["nats_url"].startswith("tls://"), s
    assert s["trainer_steps"] == 4 and set(s["exit_codes"].values()) == {0}, s
    assert_decisions_replay(load_export(s["events_file"]))
    logs = Path(s["run_dir"]) / "logs"
    for member in ("trainer", "explorer-0", "explorer-1", "sync-0"):
        log = (logs / f"{member}.log").read_text(errors="replace")
        # connected as its own identity, from a private copy of its seed (not the auth dir)
        assert f"identity={member}" in log or f'"identity": "{member}"' in log, log[-2000:]
        assert "permission_denied" not in log, log[-2000:]
        assert str(auth.path) not in log, "a role read the driver's auth dir"
    leftovers = [p for p in Path(tempfile.gettempdir()).glob("rolectl-*-*")
                 if p.is_dir() and any(p.glob("*.nk"))]
    assert not leftovers, f"identity copies left behind: {leftovers}"
