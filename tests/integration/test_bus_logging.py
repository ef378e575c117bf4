"""bus.logging: one JSON object per line, carrying the context bound to the logger and the task."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from rolectl.bus.connection import connect
from rolectl.bus.logging import bind_context, clear_context, get_logger, setup_logging


@pytest.fixture
def log_stream():
    stream = io.StringIO()
    setup_logging("debug", stream=stream)
    yield stream
    clear_context()
    structlog.reset_defaults()


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_one_json_event_per_line_with_bound_context(log_stream):
    bind_context(version=3)
    log = get_logger("rolectl.test", job="j", role="trainer", member="t0")
    log.info("step_done", step=1)
    log.bind(round=2).warning("waiting\nfor weights")

    first, second = _lines(log_stream)
    assert first["event"] == "step_done" and first["level"] == "info" and "ts" in first
    bound = (first["job"], first["role"], first["member"], first["version"], first["step"])
    assert bound == ("j", "trainer", "t0", 3, 1)
    assert second["round"] == 2 and second["event"] == "waiting\nfor weights"


def test_level_filters_events(log_stream):
    setup_logging("warning", stream=log_stream)
    get_logger().info("quiet")
    get_logger().warning("loud")
    assert [e["event"] for e in _lines(log_stream)] == ["loud"]


def test_unknown_level_is_rejected():
    with pytest.raises(ValueError, match="unknown log level"):
        setup_logging("chatty")


async def test_connection_events_carry_job_role_member(log_stream, nats_url, job_name):
    async with connect(nats_url, job=job_name, role="explorer", member="e1"):
        pass
    connected = [e for e in _lines(log_stream) if e["event"] == "bus.connected"]
    assert connected and connected[0]["job"] == job_name and connected[0]["member"] == "e1"
    assert connected[0]["url"] == nats_url
