"""The trainer against a real nats-server: a step that fails is never acked as trained (the final
save in `_cleanup` used to ack the failed step's batches, dropping them), and a schema-valid batch
that does not fit the engine never reaches it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from rolectl.bus.connection import connect
from rolectl.bus.experiences import ExperienceBatch, ExperiencePublisher
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import load_config
from rolectl.roles.engines import make_rollout_engine, make_taskset
from rolectl.roles.trainer import Trainer

SMALL = Path(__file__).resolve().parents[1] / "e2e" / "configs" / "small.yaml"


def _config(tmp_path: Path, job: str, nats_url: str):
    data = yaml.safe_load(SMALL.read_text())
    data.update(job=job, nats_url=nats_url, run_dir=str(tmp_path / "runs"))
    data["synchronizer"]["sync_method"] = "memory"
    data["trainer"].update(total_steps=3, save_interval=1)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


async def _publish_rollouts(conn, cfg, steps: int, member: str = "explorer-0") -> list[ExperienceBatch]:
    """Real rollouts of the tiny engine (what an explorer sends), 8 tasks x group 4 a batch."""
    engine = make_rollout_engine(cfg.model, member)
    tasks = make_taskset(cfg.model, seed=0, batch_size=cfg.trainer.train_batch_tasks)
    pub = ExperiencePublisher(conn, member)
    out = []
    for step in range(1, steps + 1):
        batch = ExperienceBatch(member=member, explore_step=step, model_version=0,
                                experiences=tuple(engine.rollout(tasks.next_batch(), explore_step=step)))
        await pub.publish(batch)
        out.append(batch)
    return out


async def _stream_state(conn) -> tuple[int, int]:
    info = await conn.js.stream_info(conn.names.experience_stream)
    consumer = await conn.js.consumer_info(conn.names.experience_stream, conn.names.trainer_experience_durable)
    return info.state.messages, consumer.num_ack_pending


async def test_a_failed_step_is_not_acked_by_the_final_save(tmp_path, nats_url, job_name):
    cfg = _config(tmp_path, job_name, nats_url)
    async with connect(nats_url, job=job_name, role="observer", member="test") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await ensure_experience_stream(conn.js, conn.names)
        await _publish_rollouts(conn, cfg, steps=3)

        trainer = Trainer(cfg)
        train_step = trainer.engine.train_step

        def fail_the_second_step(experiences, *, current_version):
            if trainer.engine.step == 1:
                raise RuntimeError("engine failed in step 2")
            return train_step(experiences, current_version=current_version)

        trainer.engine.train_step = fail_the_second_step
        with pytest.raises(RuntimeError, match="step 2"):
            await asyncio.wait_for(trainer.run(), 120)

        # Step 1's batch was trained and acked (gone from the work queue); step 2's (the failed
        # one) and step 3's are still in the stream for the next trainer.
        messages, _ = await _stream_state(conn)
        assert messages == 2
        state = json.loads((cfg.trainer_checkpoint_dir / "trainer_state.json").read_text())
        assert state["step"] == 1
        # The failed step's message (and the next one, fetched early) are recorded as untrained in full.
        assert [len(v) for v in state["partial"].values()] == [32, 32]


async def test_a_batch_that_does_not_fit_the_engine_is_refused_and_counted(tmp_path, nats_url, job_name):
    cfg = _config(tmp_path, job_name, nats_url)
    async with connect(nats_url, job=job_name, role="observer", member="test") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await ensure_experience_stream(conn.js, conn.names)
        [good] = await _publish_rollouts(conn, cfg, steps=1)
        poisoned = [dataclasses.replace(e, response=(99,) + e.response[1:]) for e in good.experiences]
        await ExperiencePublisher(conn, "explorer-0").publish(
            dataclasses.replace(good, explore_step=2, experiences=tuple(poisoned)))
        await _publish_rollouts(conn, cfg, steps=2, member="explorer-1")

        trainer = Trainer(cfg)
        await asyncio.wait_for(trainer.run(), 120)  # no explorer is alive: it trains what there is

        assert trainer.engine.step == 3  # the three good batches, one a step
        assert trainer.last_metrics["experiences_rejected"] == 1.0
        assert await _stream_state(conn) == (0, 0)  # the poisoned batch was terminated, not kept


async def test_a_restart_forgets_acked_seqs_the_server_has_confirmed(tmp_path, nats_url, job_name):
    """A trainer killed after its acks went through leaves them in its checkpoint's `acked_seqs`;
    the next one drops those below the consumer's ack floor instead of carrying them for ever."""
    from rolectl.roles.resume import StartMode

    cfg = _config(tmp_path, job_name, nats_url)
    async with connect(nats_url, job=job_name, role="observer", member="test") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await ensure_experience_stream(conn.js, conn.names)
        await _publish_rollouts(conn, cfg, steps=2)
        first = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"total_steps": 2})})
        await asyncio.wait_for(Trainer(first).run(), 120)
        state_file = cfg.trainer_checkpoint_dir / "trainer_state.json"
        state = json.loads(state_file.read_text())
        assert state["step"] == 2 and await _stream_state(conn) == (0, 0)  # both trained and acked
        state["acked_seqs"] = [1, 2]  # as if killed between its save and its confirmed acks
        state_file.write_text(json.dumps(state))

        await _publish_rollouts(conn, cfg, steps=1, member="explorer-1")
        restarted = Trainer(cfg, start_mode=StartMode.RESUME)  # one more step than the first ran
        await asyncio.wait_for(restarted.run(), 120)
        assert restarted.engine.step == 3
        assert json.loads(state_file.read_text())["acked_seqs"] == []  # 3 acked and confirmed; 1, 2 forgotten


async def test_a_version_upload_an_outage_cuts_starts_again_from_a_fresh_weight_stream(
        tmp_path, nats_url, job_name, monkeypatch):
    """A server restart mid-upload (found by CI: the trainer exited with "one-shot bucket stream
    ... cannot start again"): the trainer hands the transport a maker of weight streams, so the
    upload starts again from a fresh stream, after the cut one was read to its end (a sharded
    engine's stream is a collective every rank finishes)."""
    import rolectl.roles.trainer as trainer_module
    from rolectl.bus.weights import _wire_client
    from rolectl.bus.weights.object_store import ObjectStoreTransport

    cfg = _config(tmp_path, job_name, nats_url)
    outages: list[str] = []

    def flaky_transport(cfg, conn):
        # the transport the trainer makes, chunked small and on the nats-py path, whose first chunk
        # publish meets an outage (the same transient error a server restart gives)
        real_publish = conn.nc.publish

        async def publish(subject, payload=b"", *args, **kw):
            if ".c." in subject and not outages:
                outages.append(subject)
                raise _wire_client.Transient("simulated outage")
            await real_publish(subject, payload, *args, **kw)

        conn.nc.publish = publish
        return ObjectStoreTransport(conn.nc, cfg.job, chunk_size=4096, data_connection=False,
                                    reconnected=conn.reconnect_signal)

    monkeypatch.setattr(trainer_module, "make_pull_transport", flaky_transport)
    async with connect(nats_url, job=job_name, role="observer", member="test") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await ensure_experience_stream(conn.js, conn.names)
        await _publish_rollouts(conn, cfg, steps=3)

        trainer = Trainer(cfg)
        streams: list[int] = []  # buckets read from each weight stream the engine made
        iter_weight_buckets = trainer.engine.iter_weight_buckets

        def counted(*args, **kwargs):
            streams.append(0)
            for bucket in iter_weight_buckets(*args, **kwargs):
                streams[-1] += 1
                yield bucket

        trainer.engine.iter_weight_buckets = counted
        await asyncio.wait_for(trainer.run(), 120)

        assert outages, "no upload met the outage: the test tested nothing"
        assert trainer.version == 3
        assert len(streams) == 4 and len(set(streams)) == 1, streams  # 3 versions, one started again
        reader = ObjectStoreTransport(conn.nc, cfg.job, data_connection=False)
        ref = await reader.latest()
        assert ref is not None and ref.version == 3
        fetched, trained = await reader.fetch(ref), trainer.engine.weights()
        assert set(fetched) == set(trained) and all(torch.equal(fetched[n], trained[n]) for n in trained)
