"""Delta weight sync end to end with real processes: bf16 on the wire, a keyframe every few versions,
and the trainer killed with SIGKILL mid-job; the job completes and explorers applied deltas."""

from __future__ import annotations

import json

import pytest

from rolectl.sync_protocol import MemberJoined, Role, StepFinished, VersionPublished
from tests.support.e2e import LiveJob, job_config, last_trainer_step, of_kind

pytestmark = pytest.mark.e2e

EXPLORERS = ["explorer-0", "explorer-1"]


def log_events(job: LiveJob, member_id: str, event: str, run: str = "*") -> list[dict]:
    """The JSON log lines named `event` of the processes `member_id` ran (`run`: "0" the first only)."""
    out = []
    for path in sorted(job.logs.glob(f"{member_id}.{run}.log")):
        for line in path.read_text(errors="replace").splitlines():
            if event not in line:
                continue
            try:
                record = json.loads(line[line.index("{"):])
            except ValueError:
                continue
            if record.get("event") == event:
                out.append(record)
    return out


@pytest.mark.parametrize("method", ["memory", "checkpoint"])
async def test_a_delta_job_survives_kill9_of_the_trainer_and_completes(tmp_path, method):
    total = 10
    config = job_config(
        tmp_path, job=f"e2e-delta-kill-{method}",
        synchronizer={"sync_method": method, "sync_style": "fixed", "sync_timeout": 300,
                      "heartbeat_expiry": 15},
        trainer={"total_steps": total, "save_interval": 1, "train_batch_tasks": 4},
        explorers={"total_steps": total, "step_delay_s": [0.0, 0.1]},
        buffer={"ack_wait_s": 3},
        transport={"wire_dtype": "bfloat16", "keyframe_interval": 3},
    )
    async with LiveJob(tmp_path, config) as job:
        job.start_all()
        await job.wait_for(lambda recs: last_trainer_step(recs) >= 4, timeout=120, what="trainer step 4")
        job.kill9("trainer")
        job.start("trainer", "trainer")
        await job.all_exit_zero(["trainer", *EXPLORERS], timeout=180)
        records = job.records
        incarnations = [r.event.member.incarnation for r in of_kind(records, MemberJoined, role=Role.TRAINER)]
        assert len(incarnations) == 2, incarnations
        steps = [r.event.step for r in of_kind(records, StepFinished, role=Role.TRAINER)]
        assert sorted(set(steps)) == list(range(1, total + 1)), steps
        versions = [r.event.version for r in of_kind(records, VersionPublished)]
        assert versions == sorted(set(versions)) and versions[-1] == total, versions

        published = log_events(job, "trainer", "version_published")
        kinds = [p.get("kind") for p in published]
        assert "delta" in kinds and "keyframe" in kinds, kinds
        # the restarted trainer holds no base: its first version is a keyframe
        restarted = log_events(job, "trainer", "version_published", run="1")
        assert restarted and restarted[0]["kind"] == "keyframe", restarted
        for p in published:
            if p["kind"] == "delta":
                assert p["stored_bytes"] < p["nbytes"], p
        # explorers applied deltas to what they held, and every fetch was verified (else it fails)
        routes = [f["route"] for m in EXPLORERS for f in log_events(job, m, "weights_fetched")]
        assert "delta" in routes, routes
