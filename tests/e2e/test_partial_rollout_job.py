"""Partial rollouts in a real job: fully_async explorers pause their generations for each new version
and go on from their tokens; every experience produced is still counted once (trained, dropped as
stale, or left untrained in the stream), and the versions each loaded mid-step are recorded. The
same holds, by count and by experience id, when an explorer is killed (-9) with its generations
paused for a weight load and the trainer is killed (-9) and resumed from its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolectl.sync_protocol import MemberJoined, Role, StepFinished, WeightsLoaded
from tests.support.e2e import (
    LiveJob,
    accounted_summary,
    assert_decisions_replay,
    job_config,
    last_trainer_step,
    of_kind,
)

pytestmark = pytest.mark.e2e


async def test_nothing_is_lost_or_duplicated_across_pauses(tmp_path):
    # Explorers that never wait and keep exploring until the trainer is done (more steps than they
    # can run meanwhile: with the KV-cached sampler, 40 steps could end before a loaded machine's
    # trainer published its first version): new versions land while their (longer, heavier than the
    # default) generations are in flight.
    config = job_config(tmp_path, job="e2e-partial",
                        synchronizer={"sync_method": "memory", "sync_style": "fully_async", "max_staleness": 2},
                        trainer={"total_steps": 6, "save_interval": 0, "train_batch_tasks": 8},
                        explorers={"total_steps": 400, "partial_rollout": True, "step_delay_s": [0.0, 0.0]},
                        buffer={"batch_size": 8},
                        model={"task_length": 8, "d_model": 128, "d_ff": 512, "group_size": 4})
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.all_exit_zero(["trainer", "explorer-0", "explorer-1", "sync-0"], timeout=300)
        summary = await accounted_summary(job)  # produced = trained + dropped + left, left in the stream
        steps = of_kind(job.records, StepFinished, role=Role.EXPLORER)
        loads = of_kind(job.records, WeightsLoaded, role=Role.EXPLORER)

    pauses = sum(r.event.metrics.get("partial_rollout_pauses", 0) for r in steps)
    resumed = sum(r.event.metrics.get("partial_rollout_experiences", 0) for r in steps)
    assert pauses >= 1 and resumed >= 1, f"no generation was paused for new weights: {summary}"
    # every load inside a rollout is on the record, each version at most once per explorer
    for member in ("explorer-0", "explorer-1"):
        versions = [r.event.version for r in loads if r.event.member.id == member]
        assert versions == sorted(set(versions)), f"{member} loaded {versions}"


async def test_streaming_steps_publish_long_generations_later_and_keep_the_books(tmp_path):
    """`explorers.streaming` on long-tailed tasks: every step publishes exactly its batch's worth of
    groups, some of them admitted by an earlier step (long generations carried across steps and
    the versions loaded meanwhile), the books hold, and what was in flight at the stop is said."""
    config = job_config(tmp_path, job="e2e-streaming",
                        synchronizer={"sync_method": "memory", "sync_style": "fully_async"},
                        trainer={"total_steps": 6, "save_interval": 0, "train_batch_tasks": 8},
                        explorers={"total_steps": 40, "partial_rollout": True, "streaming": True,
                                   "step_delay_s": [0.0, 0.0]},
                        buffer={"batch_size": 4},
                        model={"task_length": 2, "long_task_length": 12, "long_task_fraction": 0.3,
                               "group_size": 4})
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.all_exit_zero(["trainer", "explorer-0", "explorer-1", "sync-0"], timeout=300)
        await accounted_summary(job)  # produced = trained + dropped + left, left in the stream
        steps = of_kind(job.records, StepFinished, role=Role.EXPLORER)
        logs = {m: job.procs[m][-1].log_path for m in ("explorer-0", "explorer-1")}

    assert steps and all(r.event.metrics["experiences"] == 4 * 4 for r in steps), [r.event.metrics for r in steps]
    carried = sum(r.event.metrics["streaming_carried_groups"] for r in steps)
    assert carried >= 1, "no step published a group an earlier step admitted"
    for member, path in logs.items():  # what the last step left in flight is what the stop dropped
        last = max((r for r in steps if r.event.member.id == member), key=lambda r: r.seq)
        (dropped,) = _logged(path, "streaming_groups_dropped")
        assert dropped["groups"] == last.event.metrics["streaming_in_flight_groups"], (member, dropped)


class _LogLines:
    """A role process's log (one JSON object a line) read as it grows: the lines of one event."""

    def __init__(self, path: Path):
        self.path, self._offset, self._rest = path, 0, b""

    def new(self, event: str) -> list[dict]:
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        self._offset += len(chunk)
        *lines, self._rest = (self._rest + chunk).split(b"\n")
        return [r for r in map(_json_line, lines) if r is not None and r.get("event") == event]


def _json_line(line: bytes) -> dict | None:
    try:
        return json.loads(line) if line.startswith(b"{") else None
    except json.JSONDecodeError:  # not a log event (a library's print)
        return None


def _logged(path: Path, event: str) -> list[dict]:
    return _LogLines(path).new(event)


async def _kill_with_generations_paused(job: LiveJob, victim: str, tries: int = 3) -> tuple[int, int]:
    """kill -9 `victim` as soon as its log says its generations paused for a weight load (by PID,
    the log polled every 10 ms), and start it again. The kill must land before the paused step was
    recorded: its generations, part sampled by the old version, die in flight. If the step got out
    first, the restarted process is tried in turn, up to `tries` times. Returns the paused step and
    the incarnation killed."""
    for _ in range(tries):
        log = _LogLines(job.procs[victim][-1].log_path)
        paused = await job.wait_until(lambda log=log: log.new("generations_paused"), timeout=120, poll=0.01,
                                      what=f"{victim}'s generations to pause for a weight load")
        job.kill9(victim)
        step = paused[0]["step"]
        await job.stream_caught_up()
        killed = of_kind(job.records, MemberJoined, member=victim)[-1].event.member.incarnation
        recorded = [r for r in of_kind(job.records, StepFinished, member=victim)
                    if r.event.member.incarnation == killed and r.event.step >= step]
        job.start("explorer", victim)
        if not recorded:
            return step, killed
    raise AssertionError(f"{victim} recorded its paused step before each of {tries} kills landed")


def _trained_ids(job: LiveJob) -> dict[int, list[str]]:
    """Each trainer step's experience ids, as the step that stands trained them: a step trained again
    after a rollback (a later process's log) replaces the first training's."""
    steps: dict[int, list[str]] = {}
    for proc in job.procs["trainer"]:
        for record in _logged(proc.log_path, "step_experiences"):
            steps[record["step"]] = record["ids"]
    return steps


async def _left_ids(job: LiveJob) -> list[str]:
    """The ids of the experiences the stream still holds untrained (read with the trainer's checkpoint,
    as `accounted_summary` counts them)."""
    from benchmarks.soak import experience_ids_left_in_stream

    state = json.loads((job.cfg.trainer_checkpoint_dir / "trainer_state.json").read_text())
    return await experience_ids_left_in_stream(job.conn, state)


async def test_kill9_of_an_explorer_mid_pause_and_of_the_trainer_loses_nothing(tmp_path):
    """A partial-rollout job whose explorer is killed (-9) with its generations paused for a weight
    load and started again, then whose trainer is killed (-9) and resumed from its checkpoint: the
    job completes, every experience produced is trained, dropped or left exactly once (counted, and
    by id: none trained twice, none both trained and left), and every paused step is explored again
    by the restarted explorer."""
    total = 10
    config = job_config(tmp_path, job="e2e-partial-kills", log_level="debug",  # the trainer logs its ids
                        synchronizer={"sync_method": "memory", "sync_style": "fully_async", "max_staleness": 3,
                                      # bounded ahead: explorers cannot spend their steps before the
                                      # trainer (slow to start on a busy machine) publishes a version
                                      "max_ahead": 2, "sync_timeout": 300, "heartbeat_expiry": 15},
                        trainer={"total_steps": total, "save_interval": 2, "train_batch_tasks": 8},
                        explorers={"total_steps": 40, "partial_rollout": True, "step_delay_s": [0.0, 0.0],
                                   "trainer_grace_s": 120},
                        buffer={"batch_size": 8, "ack_wait_s": 3},
                        model={"task_length": 8, "d_model": 128, "d_ff": 512, "group_size": 4})
    victim = "explorer-1"
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        paused_step, killed = await _kill_with_generations_paused(job, victim)
        killed_at = last_trainer_step(job.records)
        await job.wait_for(lambda recs: last_trainer_step(recs) >= killed_at + 2, timeout=120,
                           what=f"trainer step {killed_at + 2} after {victim}'s restart")
        job.kill9("trainer")
        job.start("trainer", "trainer")
        await job.all_exit_zero(["trainer", "explorer-0", victim, "sync-0"], timeout=240)
        summary = await accounted_summary(job)  # produced = trained + dropped + left, left in the stream
        left = await _left_ids(job)
        records = job.records
        assert_decisions_replay(records)

    assert summary["complete"] and summary["trainer_steps"] == total, summary
    assert summary["partial_rollout_pauses"] >= 1, summary
    # the paused step died with its process and was explored again, by the restarted one
    again = [r.event.member.incarnation for r in of_kind(records, StepFinished, member=victim)
             if r.event.step == paused_step]
    assert again and killed not in again, (paused_step, killed, again)
    assert len(of_kind(records, MemberJoined, role=Role.TRAINER)) == 2
    # by id: each step that stands trained distinct experiences, none also left in the stream
    steps = _trained_ids(job)
    assert sorted(steps) == list(range(1, total + 1)), sorted(steps)
    trained = [i for ids in steps.values() for i in ids]
    duplicates = sorted({i for i in trained if trained.count(i) > 1})
    assert not duplicates, f"trained twice: {duplicates}"
    assert len(trained) == summary["experiences_trained"], (len(trained), summary)
    assert not set(trained) & set(left), sorted(set(trained) & set(left))
    assert len(left) == summary["experiences_left_untrained"], (len(left), summary)
    produced = {f"{r.event.member.id}-{r.event.step}-{t}-{k}"
                for r in of_kind(records, StepFinished, role=Role.EXPLORER)
                for t in range(int(r.event.metrics["experiences"]) // 4) for k in range(4)}
    assert set(trained) <= produced, sorted(set(trained) - produced)[:5]
