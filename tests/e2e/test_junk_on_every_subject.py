"""Junk on every subject of a running job (seeded, bounded): random bytes and schema-valid-but-bad
messages on the event, decision, heartbeat, experience and weight subjects. No role crashes or
hangs, every trainer step is trained once, nothing bad is trained on, each refusal is counted, and
the recorded decisions are still a fold of the recorded inputs."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from rolectl.bus.events import Heartbeat, encode_heartbeat, read_events
from rolectl.bus.experiences import ExperienceBatch, encode_batch
from rolectl.roles.engines import make_rollout_engine, make_taskset
from rolectl.sync_protocol import (
    INPUT_KINDS,
    MemberExpired,
    MemberRef,
    MemberReleased,
    ReleaseReason,
    Role,
    RoundClosed,
    RoundOutcome,
    RunningStatus,
    StepFinished,
    SyncMethod,
    VersionPublished,
    encode,
)
from tests.support.e2e import LiveJob, assert_decisions_replay, job_config, of_kind, trainer_steps

pytestmark = pytest.mark.e2e

TOTAL_STEPS = 6
SEED = 20261123
TRAINER = MemberRef(role=Role.TRAINER, id="trainer", incarnation=1)
EXPLORER_0 = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1)
MEMBERS = [("trainer", "trainer"), ("explorer", "explorer-0"), ("explorer", "explorer-1"),
           ("synchronizer", "sync-0")]


@dataclasses.dataclass
class Injected:
    malformed_events: int = 0  # random bytes on .evt. and .sync. subjects
    forged_events: int = 0  # well-formed, on a subject that does not vouch for them
    bad_batches: int = 0  # experience messages the trainer must refuse


def _bad_batches(cfg, names) -> list[tuple[str, bytes, str]]:
    """(subject, payload, why) of experience messages that must never reach the model."""
    engine = make_rollout_engine(cfg.model, "explorer-0")
    tasks = make_taskset(cfg.model, seed=99, batch_size=cfg.buffer.batch_size)
    good = ExperienceBatch(member="explorer-0", explore_step=10_000, model_version=0,
                           experiences=tuple(engine.rollout(tasks.next_batch(), explore_step=10_000)))

    def variant(step: int, **change) -> bytes:
        exps = list(good.experiences)
        exps[0] = dataclasses.replace(exps[0], **change)
        return encode_batch(dataclasses.replace(good, explore_step=step, experiences=tuple(exps)))

    own = names.experiences("explorer-0")
    first = good.experiences[0]
    return [
        (own, b"\x92\xc1 junk", "not msgpack"),
        (own, variant(10_001, reward=float("nan")), "NaN reward"),
        (own, variant(10_002, response=(99,) + first.response[1:]), "token outside the vocabulary"),
        (own, variant(10_003, prompt=first.prompt + (1,)), "wrong prompt length"),
        (own, variant(10_004, logprobs=first.logprobs[:-1]), "logprobs of the wrong length"),
        (own, variant(10_005, logprobs=(float("-inf"),) + first.logprobs[1:]), "infinite logprob"),
        (own, variant(10_006, group="a lone group"), "wrong group size"),
        (names.experiences("explorer-1"), encode_batch(good), "explorer-0's batch on explorer-1's subject"),
    ]


async def _inject_bad_batches(job: LiveJob, count: Injected) -> None:
    """Experiences that do not fit the engine or come from another member's subject. Published
    before the explorers' first batch, so the trainer meets every one of them in stream order
    before it can finish, however fast the explorers are (published after its first step, they
    could sit behind enough good batches to finish the job, and went unread)."""
    for subject, payload, _ in _bad_batches(job.cfg, job.conn.names):
        await job.conn.js.publish(subject, payload)
        count.bad_batches += 1


async def _inject(job: LiveJob, rng: random.Random, *, on_live_rounds: bool, count: Injected) -> Injected:
    names, js, nc = job.conn.names, job.conn.js, job.conn.nc
    # Random bytes on every event subject of every member, and on decision subjects.
    for role, member in MEMBERS:
        for kind in INPUT_KINDS:
            await js.publish(names.event(role, member, kind), rng.randbytes(rng.randint(1, 300)))
            count.malformed_events += 1
    # ... and on decision subjects: the decision log itself (the synchronizer chains every batch
    # with Nats-Expected-Last-Subject-Sequence on it: junk there must not make it drop real
    # decisions), and the subjects older builds used per round, of the rounds to come or of rounds
    # that never happen.
    rounds = range(1, 31) if on_live_rounds else range(10_001, 10_004)
    for subject in [*(names.decision(r) for r in rounds), *([names.decision_log] * 3 if on_live_rounds else [])]:
        await js.publish(subject, rng.randbytes(rng.randint(1, 300)))
        count.malformed_events += 1
    # Well-formed events whose subject does not vouch for them.
    forged = [
        # an explorer announcing a trainer version (the attack of issue #10)
        (names.event("explorer", "explorer-0", "version_published"),
         VersionPublished(member=TRAINER, version=1_000_000, step=1_000_000, method=SyncMethod.MEMORY,
                          location="junk", nbytes=1, digest="junk")),
        # an explorer reporting the trainer stopped / finished steps
        (names.event("explorer", "explorer-1", "step_finished"),
         StepFinished(member=TRAINER, step=1_000, version=0)),
        # a decision on an event subject, an input on a decision subject
        (names.event("explorer", "explorer-0", "member_released"),
         MemberReleased(round=1, cause_seq=1, released=EXPLORER_0, reason=ReleaseReason.TRAINER_STOPPED,
                        version=0, reload=False)),
        (names.event("explorer", "explorer-0", "round_closed"),
         RoundClosed(round=2, cause_seq=1, outcome=RoundOutcome.TIMED_OUT)),
        (names.decision(10_500), StepFinished(member=EXPLORER_0, step=7, version=0)),
    ]
    for subject, event in forged:
        await js.publish(subject, encode(event))
        count.forged_events += 1
    # Heartbeats: random bytes, and one claiming to be the trainer on explorer-0's subject.
    for role, member in MEMBERS:
        await nc.publish(names.heartbeat(role, member), rng.randbytes(rng.randint(1, 100)))
    await nc.publish(names.heartbeat("explorer", "explorer-0"), encode_heartbeat(
        Heartbeat(member=TRAINER, step=999, version=999, status=RunningStatus.STOPPED, host="junk")))
    # Weights: junk manifests and chunks with high version numbers.
    for version in (1_000_000, 1_000_001):
        await js.publish(names.weights_manifest(version), rng.randbytes(200))
        await js.publish(names.weights_chunk(version, 0), rng.randbytes(200))
    await js.publish(names.weights_manifest(1_000_002), json.dumps({"format": "rolectl-weights/1"}).encode())
    await nc.flush()
    return count


@pytest.mark.parametrize("on_live_rounds", [
    False,
    # Junk on the decision log (and on the per-round subjects of older builds for the rounds to
    # come): the synchronizer's next publish meets "wrong last sequence", re-reads the log, finds
    # no decision there and publishes after the junk (it once took junk for another replica's
    # decision and dropped its own).
    True,
], ids=["decision-junk-elsewhere", "decision-junk-on-live-rounds"])
async def test_junk_on_every_subject_of_a_running_job(tmp_path, on_live_rounds):
    config = job_config(tmp_path, job="fuzz", synchronizer={"sync_method": "memory"},
                        trainer={"total_steps": TOTAL_STEPS, "save_interval": 1})
    async with LiveJob(tmp_path, config) as job:
        injected = Injected()
        await _inject_bad_batches(job, injected)
        job.start_all()
        # The other junk arrives while the job runs: after the trainer's first step, long before its
        # last, and once version 1 is announced (its weights are stored, so the weights stream that
        # the junk manifests go to exists however fast the trainer got there).
        await job.wait_for(lambda recs: 1 in trainer_steps(recs) and of_kind(recs, VersionPublished),
                           timeout=90, what="trainer step 1 and version 1")
        await _inject(job, random.Random(SEED), on_live_rounds=on_live_rounds, count=injected)

        codes = await job.wait_exits(["trainer", "explorer-0", "explorer-1"], timeout=150)
        assert codes == {"trainer": 0, "explorer-0": 0, "explorer-1": 0}, f"{codes}\n{job.all_logs()}"
        job.interrupt("sync-0")
        assert await job.wait_exit("sync-0", timeout=30) == 0, job.log_tail("sync-0")
        await job.stream_caught_up()

        # Every step trained exactly once, none on bad data.
        assert trainer_steps(job.records) == list(range(1, TOTAL_STEPS + 1)), job.all_logs()
        last = of_kind(job.records, StepFinished, role=Role.TRAINER)[-1].event.metrics
        assert last["experiences_rejected"] == injected.bad_batches, (last, job.log_tail("trainer"))
        assert last.get("updates_skipped_nonfinite", 0.0) == 0.0  # nothing non-finite got that far
        assert all(v.event.version <= TOTAL_STEPS for v in of_kind(job.records, VersionPublished))
        assert not of_kind(job.records, MemberExpired), "a member missed its heartbeats while junk was read"
        assert_decisions_replay(job.records)

        # Readers skipped exactly what was injected, each kind counted on its own.
        reader = read_events(job.conn, from_seq=1, stop_at_end=True)
        async with reader:
            verified = [rec async for rec in reader]
        assert (reader.malformed, reader.rejected) == (injected.malformed_events, injected.forged_events)
        assert [r.seq for r in verified] == [r.seq for r in job.records]

        # The synchronizer dropped the heartbeat that claimed to be the trainer.
        assert "bus.heartbeat_forged" in job.log_tail("sync-0", lines=10_000)

        # The trainer's pruning removed every junk version: only announced versions are stored.
        info = await job.conn.js.stream_info(job.conn.names.weights_stream,
                                             subjects_filter=job.conn.names.all_weights)
        stored = {int(subject.split(".")[3]) for subject in info.state.subjects or {}}
        announced = {r.event.version for r in of_kind(job.records, VersionPublished)}
        assert stored and stored <= announced, (stored, announced)
