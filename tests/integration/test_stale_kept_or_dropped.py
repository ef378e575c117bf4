"""The trainer against a real nats-server, given a stale batch (three versions behind, past
`max_staleness: 1`) and then a fresh one: with `staleness_policy: drop` it drops the stale batch
and trains the fresh one; with `correct` it trains the stale batch itself and counts it corrected;
either way the step's record lets `replay --check` recompute the verdict.

The tiny engine stands in for the trainer here (it has no `algorithm.rollout_correction`, so the
job is loaded without its engines' checks); what the correction does to a stale batch is
tests/unit/test_rollout_correction.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from rolectl.bus.connection import connect
from rolectl.bus.experiences import ExperienceBatch, ExperiencePublisher
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import load_config
from rolectl.roles.engines import make_rollout_engine, make_taskset
from rolectl.roles.observe.check import check_decisions
from rolectl.roles.observe.export import read_job
from rolectl.roles.trainer import Trainer
from rolectl.sync_protocol import StepFinished

SMALL = Path(__file__).resolve().parents[1] / "e2e" / "configs" / "small.yaml"
TRAINER_VERSION = 3  # the trainer holds this version; the stale batch was sampled by version 0


def _config(tmp_path: Path, job: str, nats_url: str, policy: str):
    data = yaml.safe_load(SMALL.read_text())
    data.update(job=job, nats_url=nats_url, run_dir=str(tmp_path / "runs"))
    data["synchronizer"].update(sync_method="memory", max_staleness=1, staleness_policy=policy)
    data["trainer"].update(total_steps=1, save_interval=1)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, check_engines=False)


async def _publish(conn, cfg, *, step: int, version: int) -> None:
    """A real rollout of the tiny engine, 8 tasks x group 4, tagged as sampled by `version`."""
    engine = make_rollout_engine(cfg.model, "explorer-0")
    tasks = make_taskset(cfg.model, seed=step, batch_size=cfg.trainer.train_batch_tasks)
    await ExperiencePublisher(conn, "explorer-0").publish(ExperienceBatch(
        member="explorer-0", explore_step=step, model_version=version,
        experiences=tuple(dataclasses.replace(e, model_version=version)
                          for e in engine.rollout(tasks.next_batch(), explore_step=step))))


@pytest.mark.parametrize(("policy", "trained_staleness", "dropped", "corrected", "left"), [
    ("drop", 0.0, 32, 0, 0),  # the stale batch dropped (acked), the fresh one trained
    ("correct", 3.0, 0, 32, 1),  # the stale batch trained; the fresh one left for a next step
])
async def test_a_stale_batch_is_dropped_or_trained_corrected(tmp_path, nats_url, job_name, policy,
                                                            trained_staleness, dropped, corrected, left):
    cfg = _config(tmp_path, job_name, nats_url, policy)
    async with connect(nats_url, job=job_name, role="observer", member="test") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await ensure_experience_stream(conn.js, conn.names)
        await _publish(conn, cfg, step=1, version=0)
        await _publish(conn, cfg, step=2, version=TRAINER_VERSION)

        trainer = Trainer(cfg)
        trainer.version = TRAINER_VERSION  # as if it had published version 3 already
        await asyncio.wait_for(trainer.run(), 120)  # no explorer is alive: it trains what there is

        assert trainer.engine.step == 1
        m = trainer.last_metrics
        assert m["mean_staleness"] == trained_staleness
        assert (m["dropped_stale_total"], m["corrected_stale"], m["corrected_stale_total"]) == (dropped, corrected,
                                                                                               corrected)
        state = json.loads((cfg.trainer_checkpoint_dir / "trainer_state.json").read_text())
        assert (state["dropped_stale"], state["corrected_stale"]) == (dropped, corrected)  # a restart goes on counting
        info = await conn.js.stream_info(conn.names.experience_stream)
        assert info.state.messages == left
    # the step's record carries the verdicts and the ages they follow from: replay recomputes them
    records = await read_job(job_name, nats_url)
    [tally] = [r.event.staleness for r in records if isinstance(r.event, StepFinished)]
    assert (tally.dropped, tally.corrected) == (dropped, corrected)
    assert dict(tally.ages)[TRAINER_VERSION] == 32  # the stale batch, three versions behind
    assert check_decisions(records) == []
