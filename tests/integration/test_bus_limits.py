"""Bounded streams against a real nats-server: every stream caps one message and its total, and a
full stream is a clear error that names the stream and how to raise its limit."""

from __future__ import annotations

import pytest

from rolectl.bus.connection import connect
from rolectl.bus.errors import PayloadTooLarge
from rolectl.bus.events import EventPublisher
from rolectl.bus.experiences import Experience, ExperienceBatch, ExperiencePublisher
from rolectl.bus.streams import (
    DEFAULT_EVENT_MAX_MSG_SIZE,
    StreamFull,
    ensure_event_stream,
    ensure_experience_stream,
)
from rolectl.bus.weights.object_store import ObjectStoreTransport
from rolectl.sync_protocol import MemberRef, Role, StepFinished

EXPLORER = MemberRef(role=Role.EXPLORER, id="e0", incarnation=1)


async def test_every_stream_caps_message_size_and_the_job_streams_their_total(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="trainer", member="t") as conn:
        events = await ensure_event_stream(conn.js, conn.names)
        exps = await ensure_experience_stream(conn.js, conn.names)
        weights = ObjectStoreTransport(conn.nc, job_name)
        await weights._ensure_stream()
        w = await conn.js.stream_info(weights.stream)
    assert events.config.max_msg_size == DEFAULT_EVENT_MAX_MSG_SIZE
    assert events.config.max_bytes > 0 and exps.config.max_bytes > 0 and exps.config.max_msg_size > 0
    assert w.config.max_msg_size == conn.nc.max_payload
    # Full means refuse, never drop recorded history or unread rollouts.
    assert str(events.config.discard).endswith("new") and str(exps.config.discard).endswith("new")


async def test_a_full_event_stream_is_a_clear_error(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="explorer", member="e0") as conn:
        await ensure_event_stream(conn.js, conn.names, max_bytes=4096)
        pub = EventPublisher(conn, EXPLORER)
        with pytest.raises(StreamFull) as err:
            for step in range(1000):
                await pub.publish(StepFinished(member=EXPLORER, step=step, version=0))
    message = str(err.value)
    assert conn.names.event_stream in message and "is full" in message and "--max-bytes" in message
    assert step > 5  # it filled up, it did not refuse from the start


async def test_an_oversized_batch_is_a_clear_error(nats_url, job_name):
    """One group over the stream's message limit: the publisher, which splits a batch by group, says
    so before sending (a batch of several groups over it travels a group a message)."""
    async with connect(nats_url, job=job_name, role="explorer", member="e0") as conn:
        await ensure_experience_stream(conn.js, conn.names, max_msg_size=1024)
        big = ExperienceBatch(member="e0", explore_step=1, model_version=0, experiences=tuple(
            Experience(id=f"x{i}", group="g", prompt=(1,) * 50, response=(2,) * 50, logprobs=(-1.0,) * 50,
                       reward=0.0, model_version=0) for i in range(4)))
        with pytest.raises(PayloadTooLarge, match="max_msg_size"):
            await ExperiencePublisher(conn, "e0").publish(big)
