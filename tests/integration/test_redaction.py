"""URL passwords never show: not in logs, CLI errors, the dashboard's /api/state, nor the summary."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from rolectl.bus.connection import connect
from rolectl.bus.errors import BusUnavailable
from rolectl.bus.server import NatsServer
from rolectl.roles.observe.dashboard import start_dashboard

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-sEcReT"


@pytest.fixture(scope="module")
def password_server(tmp_path_factory):
    store = tmp_path_factory.mktemp("pw")
    server = NatsServer(store_dir=str(store), extra_args=["--user", "alice", "--pass", SECRET])
    server.start()
    yield server
    server.stop()


def _url(server: NatsServer, password: str = SECRET) -> str:
    return f"nats://alice:{password}@{server.host}:{server.port}"


async def test_connection_logs_and_errors_hide_the_password(password_server):
    from rolectl.bus.logging import setup_logging

    logged = io.StringIO()
    setup_logging("debug", stream=logged)
    async with connect(_url(password_server), job="redact", role="observer", member="o") as conn:
        assert SECRET not in repr(conn) and "alice:***@" in conn.url
    with pytest.raises(BusUnavailable) as info:
        await connect(_url(password_server, "wrong-" + SECRET), job="redact", role="observer", member="o",
                      connect_timeout=2)
    assert SECRET not in str(info.value) and "alice:***@" in str(info.value)
    assert "--creds" in str(info.value)  # the server refused the credentials: say what to pass
    assert "bus.connected" in logged.getvalue()
    assert SECRET not in logged.getvalue()


def test_cli_errors_hide_the_password(password_server):
    result = subprocess.run(
        [sys.executable, "-m", "rolectl", "status", "--job", "no-such-job", "--nats", _url(password_server)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "no-such-job" in result.stderr  # it got as far as asking for the job's stream
    assert SECRET not in result.stdout + result.stderr


async def test_the_dashboard_api_hides_the_password(password_server):
    handle = await start_dashboard(job="redact", nats_url=_url(password_server), monitor_url=None)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(handle.url + "api/state") as resp:
                body = await resp.text()
    finally:
        await handle.aclose()
    state = json.loads(body)
    assert state["connection"]["nats_url"] == f"nats://alice:***@{password_server.host}:{password_server.port}"
    assert SECRET not in body
