"""A real nats-server run from `rolectl auth init`'s config: every identity connects over TLS with
its nkey, strangers are refused with a message that says what to pass, only admin creates streams,
and a member that finds none says to run `rolectl provision`."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from rolectl.bus._natspy_compat import inbox_prefix
from rolectl.bus.auth import identities, init_auth_dir
from rolectl.bus.connection import connect
from rolectl.bus.errors import BusError, BusUnavailable
from rolectl.bus.security import ClientSecurity
from rolectl.bus.server import NatsServer, free_port
from rolectl.bus.streams import ensure_event_stream
from tests.support.wait import wait_until, wait_until_sync

ROOT = Path(__file__).resolve().parents[2]
JOB = "secure"
ROLE_OF = {"sync-0": "synchronizer", "observer": "observer", "admin": "observer"}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """(AuthDir, NatsServer) for job `secure`, 2 explorers, 1 synchronizer."""
    base = tmp_path_factory.mktemp("secured")
    auth = init_auth_dir(base / "auth", job=JOB, explorers=2, port=free_port(), http_port=free_port())
    server = NatsServer(config_file=str(auth.server_conf), port=auth.port, http_port=auth.http_port,
                        log_file=str(base / "nats.log"))
    server.start()
    yield auth, server
    server.stop()


async def test_every_identity_connects_over_tls_with_its_own_nkey(secured):
    auth, server = secured
    conns = []
    try:
        for identity, role in identities(auth.explorers, auth.synchronizers):
            role = {"admin": "observer"}.get(role, role)
            conn = await connect(auth.url, job=JOB, role=role, member=identity, security=auth.security(identity))
            conns.append(conn)
            assert inbox_prefix(conn.nc) == f"_INBOX.{JOB}.{identity}"
        with urllib.request.urlopen(f"{server.monitor_url}/connz?auth=true&limit=100", timeout=5) as resp:
            connz = json.load(resp)
        seen = {c["name"].rsplit("/", 1)[-1]: c for c in connz["connections"] if c.get("name", "").startswith(JOB)}
        assert sorted(seen) == sorted(i for i, _ in identities(auth.explorers, auth.synchronizers))
        for identity, c in seen.items():
            assert c.get("tls_version"), f"{identity} is not on TLS: {c}"
            assert c.get("authorized_user", "").startswith("U"), f"{identity} did not authenticate with an nkey: {c}"
    finally:
        for conn in conns:
            await conn.aclose()


async def test_a_client_without_the_ca_is_told_to_pass_it(secured):
    auth, _ = secured
    security = ClientSecurity(creds=str(auth.credential("trainer")))
    with pytest.raises(BusUnavailable) as info:
        await connect(auth.url, job=JOB, role="trainer", member="trainer", security=security, connect_timeout=3)
    assert "--tls-ca" in str(info.value)


async def test_a_client_without_credentials_is_refused_and_told_to_pass_them(secured):
    auth, _ = secured
    with pytest.raises(BusUnavailable) as info:
        await connect(auth.url, job=JOB, role="trainer", member="trainer",
                      security=ClientSecurity(tls_ca=str(auth.ca)), connect_timeout=3)
    assert "--creds" in str(info.value)


async def test_an_nkey_the_server_does_not_list_is_refused(secured, tmp_path):
    auth, _ = secured
    stranger = init_auth_dir(tmp_path / "other", job=JOB, explorers=1)  # same names, other keys
    security = ClientSecurity(creds=str(stranger.credential("trainer")), tls_ca=str(auth.ca))
    with pytest.raises(BusUnavailable, match="refused the credentials"):
        await connect(auth.url, job=JOB, role="trainer", member="trainer", security=security, connect_timeout=3)


async def test_members_cannot_create_streams_and_say_to_run_provision_which_admin_can(secured, tmp_path):
    auth, _ = secured
    async with connect(auth.url, job=JOB, role="explorer", member="explorer-0",
                       security=auth.security("explorer-0")) as conn:
        admin_names = conn.names
        with pytest.raises(BusError, match="rolectl provision"):
            await ensure_event_stream(conn.js, conn.names)
        assert conn.denied(f"$JS.API.STREAM.CREATE.{conn.names.event_stream}")

    config = tmp_path / "job.yaml"
    config.write_text(f"job: {JOB}\nsynchronizer: {{sync_method: memory}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "rolectl", "provision", "--config", str(config), "--nats", auth.url,
         "--creds", str(auth.credential("admin")), "--tls-ca", str(auth.ca)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert admin_names.weights_stream in result.stdout

    async with connect(auth.url, job=JOB, role="explorer", member="explorer-0",
                       security=auth.security("explorer-0")) as conn:
        info = await ensure_event_stream(conn.js, conn.names)  # exists now: only checked
        assert info.config.name == conn.names.event_stream


async def test_rolectl_server_runs_the_config_auth_init_wrote(tmp_path):
    auth = init_auth_dir(tmp_path / "auth", job=JOB, explorers=1, port=free_port(), http_port=free_port())
    proc = subprocess.Popen([sys.executable, "-m", "rolectl", "server", "--config", str(auth.server_conf)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{auth.monitor_url}/healthz", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                assert proc.poll() is None, f"rolectl server exited with {proc.returncode}"
                return False

        wait_until_sync(healthy, timeout=20, what="rolectl server --config to become healthy")
        async with connect(auth.url, job=JOB, role="observer", member="probe",
                           security=auth.security("observer")) as conn:
            assert (await conn.js.account_info()) is not None
    finally:
        proc.terminate()  # by PID: the nats-server rolectl exec'd into
        proc.wait(timeout=20)


async def test_the_dashboard_follows_a_secured_job_as_observer(secured, tmp_path):
    from rolectl.roles.config import load_config
    from rolectl.roles.observe.dashboard import start_dashboard
    from rolectl.roles.provision import provision_job

    auth, server = secured
    config = tmp_path / "job.yaml"
    config.write_text(f"job: {JOB}\nsynchronizer: {{sync_method: memory}}\n")
    await provision_job(load_config(config), security=auth.security("admin"), url=auth.url)  # idempotent
    handle = await start_dashboard(job=JOB, nats_url=auth.url, monitor_url=server.monitor_url,
                                   security=auth.security("observer"))
    try:
        dashboard = handle.dashboard
        await wait_until(lambda: dashboard.connection == "live", timeout=20, what="the dashboard to go live",
                         changed=lambda: dashboard.wait_change(dashboard.changes, 20),
                         details=lambda: f"dashboard: {dashboard.connection} {dashboard.error}")
    finally:
        await handle.aclose()
