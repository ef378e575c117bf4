"""Shared fixtures: a real nats-server per test session (never a mock), unique job names."""

from __future__ import annotations

import itertools
import os

import pytest

from rolectl.bus.server import NatsServer, free_port

_counter = itertools.count()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory) -> NatsServer:
    """One real nats-server with JetStream for the whole session; tests isolate by job name."""
    store = tmp_path_factory.mktemp("nats-store")
    server = NatsServer(store_dir=str(store), log_file=str(store / "nats.log"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_server(tmp_path) -> NatsServer:
    """A private nats-server on a fixed port and store, for tests that restart or kill it (a
    restart would disturb the session's shared one)."""
    server = NatsServer(store_dir=str(tmp_path / "store"), port=free_port(), log_file=str(tmp_path / "nats.log"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
async def nc(nats_url):
    """A plain nats-py client of the session's server."""
    import nats

    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest.fixture
def job_name(request) -> str:
    """A job name unique to this test (stream and subject names derive from it)."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40].strip("-")
    return f"t{os.getpid() % 10000}-{next(_counter)}-{base}"


@pytest.fixture(autouse=True)
def _fresh_structlog():
    """structlog's configuration is process-global: a test that points it at a captured stream
    must not leave later tests writing to that (closed) stream."""
    from rolectl.bus.logging import setup_logging

    setup_logging("info")  # stderr, one JSON line per event, as the roles log
    yield
    setup_logging("info")
