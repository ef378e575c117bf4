"""bus.connection and bus.streams against a real nats-server: naming, failing fast, closing, ack
deadlines, stream checks."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from nats.js.api import RetentionPolicy, StorageType

from rolectl.bus.connection import connect
from rolectl.bus.errors import BusClosed, BusUnavailable, PublishFailed, StreamMismatch
from rolectl.bus.server import free_port
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.sync_protocol import Role


def _connz(monitor_url: str) -> dict:
    with urllib.request.urlopen(f"{monitor_url}/connz", timeout=5) as resp:
        return json.load(resp)


async def test_connection_name_is_job_role_member_in_connz(nats_server, job_name):
    async with connect(nats_server.url, job=job_name, role="explorer", member="e7") as conn:
        assert conn.name == f"{job_name}/explorer/e7"
        connz = await asyncio.to_thread(_connz, nats_server.monitor_url)
    names = {c.get("name") for c in connz["connections"]}
    assert f"{job_name}/explorer/e7" in names


async def test_unreachable_server_raises_bus_unavailable_quickly_with_advice():
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BusUnavailable) as info:
        async with connect(url, job="j", role="trainer", member="t0", connect_timeout=1.0):
            pass
    elapsed = time.monotonic() - started
    # refused at once, not after nats-py's reconnect attempts (minutes); the bound is on that
    # waiting, with room for a loaded machine, not on speed
    assert elapsed < 20, elapsed
    message = str(info.value)
    assert url in message and "refused" in message and "rolectl server" in message and "--nats" in message


async def test_await_form_and_aclose_twice(nats_url, job_name):
    conn = await connect(nats_url, job=job_name, role="trainer", member="t0")
    assert conn.is_connected
    await conn.aclose()
    await conn.aclose()
    assert conn.is_closed
    with pytest.raises(BusClosed):
        await conn.publish_acked(conn.names.event("trainer", "t0", "x"), b"")


async def test_aclose_completes_when_the_closer_is_cancelled(nats_url, job_name):
    conn = await connect(nats_url, job=job_name, role="trainer", member="t0")
    closer = asyncio.create_task(conn.aclose())
    await asyncio.sleep(0)  # let the close start, then cancel the task waiting on it
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    await asyncio.wait_for(conn.aclose(), 10)  # the shielded close finishes; a second call waits for it
    assert conn.is_closed


async def test_bad_member_name_is_rejected_before_connecting(nats_url):
    with pytest.raises(ValueError, match="member id"):
        await connect(nats_url, job="j", role="trainer", member="has.dot")


async def test_streams_are_created_then_verified(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="synchronizer", member="s0") as conn:
        events = await ensure_event_stream(conn.js, conn.names)
        exp = await ensure_experience_stream(conn.js, conn.names)
        again = await ensure_event_stream(conn.js, conn.names)

    assert events.config.storage == StorageType.FILE and events.config.retention == RetentionPolicy.LIMITS
    assert sorted(events.config.subjects) == sorted([f"rft.{job_name}.evt.>", f"rft.{job_name}.sync.>"])
    assert events.config.max_age == pytest.approx(7 * 24 * 3600)
    assert events.config.duplicate_window == pytest.approx(120)
    assert exp.config.storage == StorageType.FILE and exp.config.retention == RetentionPolicy.WORK_QUEUE
    assert exp.config.subjects == [f"rft.{job_name}.exp.>"]
    assert again.config.name == events.config.name


async def test_stream_mismatch_names_the_field_and_both_values(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="synchronizer", member="s0") as conn:
        await ensure_event_stream(conn.js, conn.names, max_age_s=3600)
        with pytest.raises(StreamMismatch) as info:
            await ensure_event_stream(conn.js, conn.names)
    err = info.value
    assert err.stream == conn.names.event_stream
    assert [d[0] for d in err.differences] == ["max_age (s)"]
    assert "max_age" in str(err) and "604800" in str(err) and "3600" in str(err)
    assert "nats stream rm" in str(err)


async def test_an_unacknowledged_publish_fails_at_its_own_deadline_while_a_longer_one_waits(nats_url, job_name):
    """Acks expire by deadline, one timer for the connection: a publish nobody acknowledges fails
    with PublishFailed after its ack_timeout (and retries) even while an earlier publish with a far
    later deadline still waits, and the connection's next publishes are acked as usual."""
    async with connect(nats_url, job=job_name, role="trainer", member="t0") as conn:
        await ensure_event_stream(conn.js, conn.names)
        silent = f"{job_name}.silent"  # a plain subscriber takes these and never answers
        listener = await conn.nc.subscribe(silent)
        patient = asyncio.ensure_future(conn.publish_acked(silent, b"first", ack_timeout=600, retry_for=600))
        await listener.next_msg(timeout=10)  # sent: its deadline, ten minutes away, is armed
        started = time.monotonic()
        with pytest.raises(PublishFailed, match="no acknowledgement"):
            await conn.publish_acked(silent, b"second", ack_timeout=0.2, retry_for=0.5)
        assert time.monotonic() - started < 60  # its own deadline, not the patient one's
        assert not patient.done()
        subject = conn.names.event(Role.TRAINER, "t0", "step_finished")
        ack = await conn.publish_acked(subject, b"recorded", ack_timeout=10)
        assert ack.seq >= 1 and ack.stream == conn.names.event_stream
        patient.cancel()
        with pytest.raises(asyncio.CancelledError):
            await patient
