"""Two starts of one member released together, as real processes, many times: every time exactly one
proceeds and the other exits 2 naming it (host, pid). A job whose synchronizer and first explorer
start as such pairs, and whose trainer is started as a pair ROUNDS times (each winner stopped with
Ctrl-C after it trained, the next pair resuming from its checkpoint), trains every step once and
accounts for every experience. Before the record assigned incarnations, two such starts both joined
(the same millisecond: as one member, each taking half of every batch) or one replaced the other."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from rolectl.roles.exit_codes import ExitCode
from rolectl.roles.launch.local import summarize
from rolectl.sync_protocol import MemberJoined, Role
from tests.support.barrier_start import RUNNER, make_barrier, release
from tests.support.e2e import LiveJob, assert_decisions_replay, job_config, last_trainer_step, of_kind, trainer_steps

pytestmark = pytest.mark.e2e

ROUNDS = 10  # trainer pairs, one after the other
AHEAD = 2  # pairs started (importing, then waiting at their barrier) while the current one races
STEPS = 5 * ROUNDS  # each winner is stopped once it trained a step (two or three, by then); the last trains the rest


@dataclass
class _Race:
    """Two processes of one member, held at one barrier."""

    role: str
    member_id: str
    barrier: Path
    procs: tuple[subprocess.Popen, subprocess.Popen]

    @classmethod
    def start(cls, job: LiveJob, role: str, member_id: str, name: str) -> _Race:
        barrier = make_barrier(job.tmp_path / "barriers" / name)
        runner = (*RUNNER, str(barrier))
        return cls(role, member_id, barrier, (job.start(role, member_id, runner=runner),
                                              job.start(role, member_id, runner=runner)))

    async def release(self, job: LiveJob) -> None:
        await release(self.barrier, 2, timeout=300, details=job.all_logs)

    async def winner(self, job: LiveJob) -> subprocess.Popen:
        """The one of the two that joined (the record says which)."""
        pids = {p.pid: p for p in self.procs}
        joins = await job.wait_for(lambda recs: [r for r in of_kind(recs, MemberJoined, member=self.member_id)
                                                 if r.event.pid in pids], timeout=120,
                                   what=f"one of two starts of {self.member_id} ({self.barrier.name}) to join")
        return pids[joins[0].event.pid]

    async def check_refused(self, job: LiveJob, winner: subprocess.Popen) -> None:
        """The other one exited 2 naming the one that joined."""
        (loser,) = [p for p in self.procs if p is not winner]
        await job.wait_until(lambda: loser.poll() is not None, timeout=120,
                             what=f"the second start of {self.member_id} ({self.barrier.name}) to be refused")
        log = _log_of(job, self.member_id, loser)
        assert loser.returncode == ExitCode.USAGE, log
        assert f"{self.role_name} '{self.member_id}' of job '{job.cfg.job}' is already running" in log, log
        assert f"pid {winner.pid} on host" in log, log

    @property
    def role_name(self) -> str:
        return "synchronizer" if self.role == "sync" else self.role


def _log_of(job: LiveJob, member_id: str, popen: subprocess.Popen) -> str:
    (proc,) = [p for p in job.procs[member_id] if p.popen is popen]
    return proc.log_path.read_text(errors="replace")[-4000:]


async def test_two_starts_of_one_member_released_together_give_one_member_every_time(tmp_path):
    config = job_config(
        tmp_path, job="e2e-racing-starts",
        synchronizer={"sync_method": "memory", "sync_style": "fixed", "sync_timeout": 300,
                      "heartbeat_period": 0.5, "heartbeat_expiry": 30},
        trainer={"total_steps": STEPS, "save_interval": 1, "train_batch_tasks": 8},
        explorers={"total_steps": STEPS, "step_delay_s": [0.1, 0.2], "trainer_grace_s": 600},
        buffer={"ack_wait_s": 60},
    )
    async with LiveJob(tmp_path, config) as job:
        first = [_Race.start(job, "sync", "sync-0", "sync"), _Race.start(job, "explorer", "explorer-0", "explorer")]
        job.start("explorer", "explorer-1")
        trainers = [_Race.start(job, "trainer", "trainer", f"trainer-{r}") for r in range(AHEAD)]
        for race in first:
            await race.release(job)
        winners = {race.member_id: await race.winner(job) for race in first}
        for race in first:
            await race.check_refused(job, winners[race.member_id])
        trainer_pids = []
        for r in range(ROUNDS):
            race = trainers[r]
            await race.release(job)
            step = last_trainer_step(job.records)
            winner = await race.winner(job)
            trainer_pids.append(winner.pid)
            if r + AHEAD < ROUNDS:
                trainers.append(_Race.start(job, "trainer", "trainer", f"trainer-{r + AHEAD}"))
            if r == ROUNDS - 1:
                await race.check_refused(job, winner)
                break
            await job.wait_for(lambda recs, step=step: last_trainer_step(recs) > step, timeout=180,
                               what=f"round {r}: a step trained by the trainer that won")
            winner.send_signal(signal.SIGINT)
            await race.check_refused(job, winner)
            await job.wait_until(lambda w=winner: w.poll() is not None, timeout=120,
                                 what=f"round {r}: the winning trainer to stop")
            assert winner.returncode == ExitCode.INTERRUPTED, _log_of(job, "trainer", winner)

        codes = {}
        for member_id, proc in [("trainer", winner), ("explorer-0", winners["explorer-0"]),
                                ("explorer-1", job.current("explorer-1")), ("sync-0", winners["sync-0"])]:
            await job.wait_until(lambda p=proc: p.poll() is not None, timeout=300, what=f"{member_id} to finish")
            codes[member_id] = proc.returncode
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{job.all_logs()}"
        await job.stream_caught_up()
        records = job.records

    # every step trained once, by the trainers that won, each joined once as the next incarnation
    assert trainer_steps(records) == list(range(1, STEPS + 1)), trainer_steps(records)
    joins = [r.event for r in of_kind(records, MemberJoined, role=Role.TRAINER)]
    assert list(dict.fromkeys(j.pid for j in joins)) == trainer_pids, joins
    incarnations = [j.member.incarnation for j in joins]
    assert incarnations == list(range(1, len(joins) + 1)), incarnations
    for member_id, proc in (("sync-0", winners["sync-0"]), ("explorer-0", winners["explorer-0"])):
        assert {r.event.pid for r in of_kind(records, MemberJoined, member=member_id)} == {proc.pid}
    # every experience produced was trained or dropped as stale; the decisions replay
    assert_decisions_replay(records)
    summary = summarize(records, job="e2e-racing-starts")
    assert summary["complete"], summary["end_reason"]
    assert summary["experiences_produced"] == (
        summary["experiences_trained"] + summary["experiences_dropped_stale"]
        + summary["experiences_left_untrained"]), summary
    assert summary["experiences_left_untrained"] == 0, summary
