"""Fault tests with real processes: the test starts a nats-server and every role itself, kills one
with SIGKILL at a chosen point of the job (found by reading the job's stream), and checks the job
still finishes and its recorded decisions are exactly a fold of its recorded inputs."""

from __future__ import annotations

import signal

import pytest

from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.observe.replay import check_decisions
from rolectl.sync_protocol import (
    Decision,
    MemberExpired,
    MemberJoined,
    RendezvousReady,
    Role,
    RoundClosed,
    RoundTimedOut,
    RunningStatus,
    StatusChanged,
    StepFinished,
    StepsRolledBack,
    SyncFailed,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
)
from tests.support.e2e import (
    LiveJob,
    assert_decisions_replay,
    decision_problems,
    job_config,
    last_trainer_step,
    of_kind,
    stream_experiences,
    trainer_steps,
)

pytestmark = pytest.mark.e2e

EXPLORERS = ["explorer-0", "explorer-1"]






async def _replay_clean(job: LiveJob) -> None:
    """Stop the synchronizer once it published every decision the fold computes; then compare."""
    await job.stream_caught_up()
    await job.wait_for(lambda recs: not decision_problems(recs), timeout=20,
                       what="the synchronizer to publish every decision a fold of the inputs computes")
    job.interrupt("sync-0")
    assert await job.wait_exit("sync-0", 20) == 0
    await job.stream_caught_up()
    assert_decisions_replay(job.records)


# -- the synchronizer ------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["nccl", "memory"])
async def test_synchronizer_kill9_and_restart(tmp_path, method):
    """kill -9 the synchronizer mid-run while a decision is due; a new one replays the stream,
    publishes what is due once (no duplicate, none missing) and the job finishes."""
    total = 8
    config = job_config(
        tmp_path, job=f"e2e-sync-kill-{method}",
        synchronizer={"sync_method": method, "sync_style": "fixed", "sync_timeout": 300,
                      "heartbeat_expiry": 5},
        trainer={"total_steps": total, "save_interval": 1},
        explorers={"total_steps": total, "step_delay_s": [0.0, 0.1]},
    )
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        # Mid-run: the trainer has trained a few steps.
        await job.wait_for(lambda recs: last_trainer_step(recs) >= 2, timeout=90, what="trainer step 2")
        job.kill9("sync-0")

        # Without a synchronizer the job stalls on a decision the fold says is due.
        def due(recs):
            return [m for m in check_decisions(recs) if m.kind == "missing"]
        pending = await job.wait_for(due, timeout=60, what="a decision to fall due while no synchronizer runs")

        job.start("sync", "sync-0")
        restarted_at = len(job.records)
        await job.all_exit_zero(["trainer", *EXPLORERS], timeout=120)
        assert last_trainer_step(job.records) == total
        assert trainer_steps(job.records) == list(range(1, total + 1))
        # the restarted synchronizer published the decision that was due, and the job went on
        later = [r for r in job.records[restarted_at:] if isinstance(r.event, Decision)]
        assert later, f"the restarted synchronizer published nothing (due: {pending})"
        await _replay_clean(job)
        # exactly one synchronizer member per incarnation joined: the killed one and its successor
        syncs = [r.event.member for r in of_kind(job.records, MemberJoined, role=Role.SYNCHRONIZER)]
        assert len(syncs) == 2 and syncs[0].incarnation < syncs[1].incarnation, syncs


# -- an explorer -----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["nccl", "memory"])
async def test_explorer_kill9_trainer_goes_on(tmp_path, method):
    """kill -9 one explorer: it is expired within heartbeat_expiry (not sync_timeout), the trainer
    goes on with the other one, and for nccl the survivors form a new group at a new epoch."""
    total, expiry = 8, 2.5
    config = job_config(
        tmp_path, job=f"e2e-explorer-kill-{method}",
        synchronizer={"sync_method": method, "sync_style": "fixed", "sync_timeout": 300,
                      "heartbeat_period": 0.5, "heartbeat_expiry": expiry},
        # one explorer's batch is one train step, so the survivor alone can feed the trainer
        trainer={"total_steps": total, "save_interval": 4, "train_batch_tasks": 4},
        explorers={"total_steps": total, "step_delay_s": [0.0, 0.1]},
    )
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        victim, survivor = "explorer-1", "explorer-0"

        if method == "nccl":
            # kill it between rounds, after it took part in a completed broadcast (so it is a
            # member of the current group)
            def took_part(recs):
                readies = {r.event.round: r.event for r in of_kind(recs, RendezvousReady)
                           if victim in {p.member.id for p in r.event.participants}}
                return any(isinstance(r.event, RoundClosed) and r.event.round in readies
                           and r.event.outcome.value == "completed" for r in recs)
            await job.wait_for(took_part, timeout=90, what=f"a completed broadcast to {victim}")
        else:
            await job.wait_for(lambda recs: any(r.event.step >= 2 for r in of_kind(recs, StepFinished, member=victim)),
                               timeout=90, what=f"{victim} step 2")
        killed_ms = job.kill9(victim)
        seq_at_kill = job.records[-1].seq

        expired = await job.wait_for(
            lambda recs: [r for r in of_kind(recs, MemberExpired) if r.event.expired.id == victim],
            timeout=expiry + 15, what=f"MemberExpired for {victim}")
        # expired on the heartbeat clock, not by sync_timeout (300 s): the bound leaves room for a
        # loaded machine (the timer's tick, our own heartbeat's round trip, process scheduling)
        assert expired[0].time_ms - killed_ms < (4 * expiry + 10) * 1000, expired[0].time_ms - killed_ms

        await job.all_exit_zero(["trainer", survivor], timeout=120)
        assert trainer_steps(job.records) == list(range(1, total + 1))
        assert job.current(victim).returncode == -signal.SIGKILL
        records = job.records
        assert not of_kind(records, RoundTimedOut), "a round waited for sync_timeout"
        # the trainer went on with the survivor's experiences after the kill
        after = [r for r in of_kind(records, StepFinished, role=Role.TRAINER) if r.seq > seq_at_kill]
        assert after, "the trainer trained nothing after the explorer died"
        if method == "nccl":
            readies = [r.event for r in of_kind(records, RendezvousReady)]
            before = [d for d in readies if victim in {p.member.id for p in d.participants}]
            later = [r.event for r in of_kind(records, RendezvousReady) if r.seq > expired[0].seq]
            assert later, "no rendezvous after the explorer expired"
            assert all([p.member.id for p in d.participants] == [survivor] for d in later), later
            assert all(d.world_size == 2 for d in later)
            assert later[0].epoch > max(d.epoch for d in before), (later[0].epoch, [d.epoch for d in before])
            broadcasts = [r.event for r in of_kind(records, WeightsBroadcast) if r.seq > expired[0].seq]
            assert broadcasts, "no broadcast to the survivor after the expiry"
        else:
            versions = [r.event.version for r in of_kind(records, VersionPublished)]
            assert versions == sorted(set(versions)) and versions[-1] == total, versions
        await _replay_clean(job)


# -- the trainer -----------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["nccl", "memory"])
async def test_trainer_kill9_and_restart(tmp_path, method):
    """kill -9 the trainer right after it finished a step, start it again: it resumes from its
    checkpoint, steps and versions continue with no gap or repeat, and no experience is lost."""
    total = 10
    config = job_config(
        tmp_path, job=f"e2e-trainer-kill-{method}",
        synchronizer={"sync_method": method, "sync_style": "fixed", "sync_timeout": 300,
                      # longer than a trainer restart: the explorers wait for it rather than stop
                      "heartbeat_expiry": 15},
        trainer={"total_steps": total, "save_interval": 1, "train_batch_tasks": 4},
        explorers={"total_steps": total, "step_delay_s": [0.0, 0.1]},
        buffer={"ack_wait_s": 3},
        # explorers caught in a broadcast from the killed trainer give up after this
        transport={"group_timeout_s": 5},
    )
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.wait_for(lambda recs: last_trainer_step(recs) >= 3, timeout=90, what="trainer step 3")
        job.kill9("trainer")
        job.start("trainer", "trainer")
        await job.all_exit_zero(["trainer", *EXPLORERS], timeout=150)
        records = job.records
        incarnations = [r.event.member.incarnation for r in of_kind(records, MemberJoined, role=Role.TRAINER)]
        assert len(incarnations) == 2 and incarnations[0] < incarnations[1], incarnations
        steps = of_kind(records, StepFinished, role=Role.TRAINER)
        first = [r.event.step for r in steps if r.event.member.incarnation == incarnations[0]]
        second = [r.event.step for r in steps if r.event.member.incarnation == incarnations[1]]
        assert first and second, (first, second)
        assert first + second == list(range(1, total + 1)), f"steps: first {first}, restarted {second}"
        if method == "nccl":
            versions = [r.event.version for r in of_kind(records, WeightsBroadcast)]
        else:
            versions = [r.event.version for r in of_kind(records, VersionPublished)]
        assert versions and versions == sorted(set(versions)), f"versions {versions}"
        # no experience lost: what explorers produced was trained on, or is still in the stream
        produced = sum(int(r.event.metrics["experiences"]) for r in of_kind(records, StepFinished, role=Role.EXPLORER))
        trained = sum(int(r.event.metrics["num_experiences"]) for r in steps)
        left = await stream_experiences(job)
        assert produced == trained + left, f"produced {produced}, trained {trained}, left in the stream {left}"
        await _replay_clean(job)




async def test_trainer_kill9_between_checkpoints_records_the_rollback(tmp_path):
    """kill -9 the trainer after it reported steps it never saved: the restart trains them again
    and records StepsRolledBack first, so every fold counts each step once, by its new training."""
    total = 8
    config = job_config(
        tmp_path, job="e2e-trainer-rollback",
        synchronizer={"sync_method": "memory", "sync_style": "fixed", "sync_timeout": 300, "heartbeat_expiry": 15},
        trainer={"total_steps": total, "save_interval": 0, "train_batch_tasks": 4},  # no checkpoint mid-job
        explorers={"total_steps": 2 * total, "step_delay_s": [0.2, 0.2]},
        buffer={"ack_wait_s": 3},
    )
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.wait_for(lambda recs: last_trainer_step(recs) >= 2, timeout=90, what="trainer step 2")
        job.kill9("trainer")
        await job.stream_caught_up()
        reported = last_trainer_step(job.records)
        job.start("trainer", "trainer")
        await job.all_exit_zero(["trainer", *EXPLORERS], timeout=150)
        await job.stream_caught_up()
        records = job.records
        rolled = of_kind(records, StepsRolledBack)
        assert [(r.event.from_step, r.event.to_step) for r in rolled] == [(reported, 0)], rolled
        again = of_kind(records, MemberJoined, role=Role.TRAINER)[-1]
        first_retrained = next(r for r in of_kind(records, StepFinished, role=Role.TRAINER)
                               if r.event.member == again.event.member)
        assert again.seq < rolled[0].seq < first_retrained.seq  # said before the steps come again
        assert trainer_steps(records) == [*range(1, reported + 1), *range(1, total + 1)]
        view = JobObserver().extend(records)
        assert [step for step, _, _ in view.reward] == list(range(1, total + 1))  # each step once
        trained = sum(int(r.event.metrics["num_experiences"]) for r in of_kind(records, StepFinished, role=Role.TRAINER)
                      if r.event.member == again.event.member)
        summary = view.summary(job=job.cfg.job)
        assert summary["trainer_steps"] == total and summary["experiences_trained"] == trained, summary
        await _replay_clean(job)


# -- a peer dies mid-broadcast ---------------------------------------------------------------------

async def test_peer_dies_mid_broadcast_nccl(tmp_path):
    """An explorer is frozen as it enters REQUIRE_SYNC and killed once the broadcast to it has
    started: the round fails (not hangs), the job finishes, and the next group is a new epoch."""
    total, expiry = 6, 2.5
    config = job_config(
        tmp_path, job="e2e-dead-peer",
        synchronizer={"sync_method": "nccl", "sync_style": "fixed", "sync_timeout": 300,
                      "heartbeat_period": 0.5, "heartbeat_expiry": expiry},
        trainer={"total_steps": total, "save_interval": 3, "train_batch_tasks": 4},
        explorers={"total_steps": total, "step_delay_s": [0.0, 0.1]},
        # weights of a few MB in 1 MB buckets: the broadcast is under way for a while
        transport={"bucket_size_mb": 1, "group_timeout_s": 5},
        model={"d_model": 192, "d_ff": 768},
    )
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        victim, survivor = "explorer-1", "explorer-0"

        def completed_rounds(recs):
            return [r for r in of_kind(recs, RoundClosed) if r.event.outcome.value == "completed"]

        def request_after(seq):
            def requested(recs):
                return [r for r in of_kind(recs, StatusChanged, member=victim)
                        if r.seq > seq and r.event.status is RunningStatus.REQUIRE_SYNC]
            return requested

        # After one completed round with everyone, freeze the victim at its next REQUIRE_SYNC. The
        # freeze follows the record: where the group forms at once and the transfer is quick, a
        # test process held off the CPU may freeze it only after it took part. Then the round
        # completed with it: let it go on and freeze it at its next request.
        first = await job.wait_for(completed_rounds, timeout=90, what="a completed round")
        after = first[0].seq
        for _ in range(3):
            request = (await job.wait_for(request_after(after), timeout=90,
                                          what=f"{victim} asking for a sync after seq {after}"))[0]
            job.current(victim).send_signal(signal.SIGSTOP)  # frozen: it cannot take part any more
            try:
                ready = await job.wait_for(
                    lambda recs, request=request: [r for r in of_kind(recs, RendezvousReady)
                                  if victim in {p.member.id for p in r.event.participants} and r.seq > request.seq],
                    timeout=60, what=f"a RendezvousReady with the frozen {victim}")
                await job.stream_caught_up()
                took_part = [r for r in of_kind(job.records, WeightsLoaded, member=victim)
                             if r.event.round == ready[0].event.round]
            except BaseException:
                job.kill9(victim)
                raise
            if not took_part:
                break
            job.current(victim).send_signal(signal.SIGCONT)  # too late: try its next request
            after = took_part[0].seq
        else:
            raise AssertionError(f"{victim} finished each of 3 rounds before it could be frozen")
        killed_ms = job.kill9(victim)
        doomed = ready[0].event
        closed = await job.wait_for(
            lambda recs: [r for r in of_kind(recs, RoundClosed) if r.event.round == doomed.round],
            timeout=30, what=f"round {doomed.round} to close")
        assert closed[0].event.outcome.value in ("failed", "timed_out"), closed[0].event
        # by the group timeout / expiry, not sync_timeout (300 s), even on a loaded machine
        assert closed[0].time_ms - killed_ms < 40_000, "the failed round was not detected promptly"

        await job.all_exit_zero(["trainer", survivor], timeout=120)
        records = job.records
        assert trainer_steps(records) == list(range(1, total + 1))
        failures = of_kind(records, SyncFailed)
        expired = [r for r in of_kind(records, MemberExpired) if r.event.expired.id == victim]
        assert failures or expired, "neither a SyncFailed nor the victim's expiry was recorded"
        later = [r.event for r in of_kind(records, RendezvousReady) if r.seq > closed[0].seq]
        assert later, "no rendezvous after the failed one"
        assert later[0].epoch > doomed.epoch, (later[0].epoch, doomed.epoch)
        assert all(victim not in {p.member.id for p in d.participants} for d in later
                   if d.round > doomed.round and expired and d.epoch > doomed.epoch)
        assert not of_kind(records, RoundTimedOut), "a round waited for sync_timeout"
        await _replay_clean(job)
