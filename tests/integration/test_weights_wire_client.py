"""The NATS data connection (`bus.weights._wire_client`) against a real nats-server: connect,
publish, fetch, errors, closing twice, cancellation, and TLS + nkeys on a server from `rolectl auth init`."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import threading
import urllib.request

import nats
import pytest
import torch
from nats.js.api import StorageType

from rolectl.bus.auth import init_auth_dir, parse_nkeys
from rolectl.bus.errors import TransferError
from rolectl.bus.server import NatsServer, free_port
from rolectl.bus.subjects import JobNames
from rolectl.bus.weights._natspy_plane import NatsPyPlane
from rolectl.bus.weights._wire_client import (
    ConnectionLost,
    DataConnection,
    Endpoint,
    NoDataConnection,
    Transient,
    data_endpoint,
    parse_headers,
)
from rolectl.bus.weights.data_plane import run_in_thread
from rolectl.bus.weights.object_store import ObjectStoreTransport
from tests.support.wait import wait_until


def open_to(nc, *, timeout: float = 10.0) -> DataConnection:
    endpoint = data_endpoint(nc)
    assert endpoint is not None
    conn = DataConnection(endpoint, timeout=timeout)
    conn.open()
    return conn


# connect ----------------------------------------------------------------------------------------------


async def test_data_endpoint_of_a_plain_client_is_its_server_without_credentials(nc, nats_server):
    endpoint = data_endpoint(nc)
    assert (endpoint.host, endpoint.port, dict(endpoint.auth)) == ("127.0.0.1", nats_server.port, {})
    assert (endpoint.tls, endpoint.sign_nonce, endpoint.public_nkey) == (None, None, None)


async def test_open_connects_and_a_message_to_itself_comes_back(nc):
    with open_to(nc) as conn:
        assert conn.is_open
        inbox = nc.new_inbox()
        conn.subscribe(inbox)  # the server handles one connection's lines in order: SUB before PUB
        await asyncio.to_thread(conn.publish, inbox, "", [b"to myself"])
        msg = await asyncio.to_thread(conn.next_message)
        assert (msg.subject, msg.size) == (inbox, 9)
        assert await asyncio.to_thread(conn.read_payload, msg.size) == b"to myself"
    assert not conn.is_open


async def test_credentials_are_copied_from_the_nats_py_client(tmp_path):
    server = NatsServer(store_dir=str(tmp_path / "store"), port=free_port(), log_file=str(tmp_path / "nats.log"),
                        extra_config='authorization { user: "weights", password: "s3cret" }\n')
    server.start()
    try:
        client = await nats.connect(server.url, user="weights", password="s3cret")
        try:
            endpoint = data_endpoint(client)
            assert endpoint.auth == {"user": "weights", "pass": "s3cret"}
            with DataConnection(endpoint, timeout=10) as conn:
                await asyncio.to_thread(conn.open)
                assert conn.is_open
            wrong = dataclasses.replace(endpoint, auth={"user": "weights", "pass": "wrong"})
            with DataConnection(wrong, timeout=10) as conn:
                with pytest.raises(NoDataConnection, match="refused"):
                    await asyncio.to_thread(conn.open)
        finally:
            await client.close()
    finally:
        await asyncio.to_thread(server.stop)


# publish ----------------------------------------------------------------------------------------------


async def test_publish_sends_the_parts_as_one_payload_with_its_reply_subject(nc):
    got: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg):
        got.put_nowait(msg)

    await nc.subscribe("wire.publish", cb=on_msg)
    await nc.flush()
    parts = [b"head-", memoryview(bytearray(b"middle-")), memoryview(b"xxtailxx")[2:6]]
    with open_to(nc) as conn:
        await asyncio.to_thread(conn.publish, "wire.publish", "wire.reply", parts)
        msg = await asyncio.wait_for(got.get(), 10)
    assert (msg.data, msg.reply) == (b"head-middle-tail", "wire.reply")


async def test_a_jetstream_publish_is_acknowledged_on_the_reply_subject(nc, job_name):
    js = nc.jetstream()
    await js.add_stream(name=job_name, subjects=[f"{job_name}.>"], storage=StorageType.MEMORY)
    try:
        with open_to(nc) as conn:
            inbox = nc.new_inbox()
            conn.subscribe(f"{inbox}.*")
            await asyncio.to_thread(conn.publish, f"{job_name}.chunk", f"{inbox}.7", [b"x" * 1000])
            msg = await asyncio.to_thread(conn.next_message)
            ack = json.loads(await asyncio.to_thread(conn.read_payload, msg.size))
        assert msg.subject == f"{inbox}.7"
        assert ack == {"stream": job_name, "seq": 1}
    finally:
        await js.delete_stream(job_name)


# fetch ------------------------------------------------------------------------------------------------


async def test_a_direct_get_lands_in_the_target_hashed_on_the_way(nc, job_name):
    js = nc.jetstream()
    await js.add_stream(name=job_name, subjects=[f"{job_name}.>"], storage=StorageType.MEMORY, allow_direct=True)
    payload = bytes(range(256)) * 4096  # 1 MiB: more than the read buffer, read from the socket
    try:
        await js.publish(f"{job_name}.c.0", payload)
        with open_to(nc) as conn:
            inbox = nc.new_inbox()
            conn.subscribe(inbox)
            body = json.dumps({"seq": 1}).encode()
            await asyncio.to_thread(conn.publish, f"$JS.API.DIRECT.GET.{job_name}", inbox, [body])
            msg = await asyncio.to_thread(conn.next_message)
            assert msg.status is None and msg.size == len(payload)
            assert (msg.headers["Nats-Sequence"], msg.headers["Nats-Subject"]) == ("1", f"{job_name}.c.0")
            target = memoryview(bytearray(msg.size))
            hasher = hashlib.sha256()
            assert await asyncio.to_thread(conn.read_payload, msg.size, target, hasher) == b""
            assert bytes(target) == payload
            assert hasher.digest() == hashlib.sha256(payload).digest()

            # A sequence that is not there: a status message, no payload to speak of.
            await asyncio.to_thread(conn.publish, f"$JS.API.DIRECT.GET.{job_name}", inbox,
                                    [json.dumps({"seq": 99}).encode()])
            missing = await asyncio.to_thread(conn.next_message)
            await asyncio.to_thread(conn.read_payload, missing.size)
            assert missing.status == "404" and missing.headers["Status"] == "404"
    finally:
        await js.delete_stream(job_name)


def test_parse_headers_reads_status_and_fields():
    assert parse_headers(b"NATS/1.0 404 Message Not Found\r\n\r\n") == ("404", {"Status": "404"})
    status, headers = parse_headers(b"NATS/1.0\r\nNats-Sequence: 5\r\nNats-Subject: a.b\r\n\r\n")
    assert status is None and headers == {"Nats-Sequence": "5", "Nats-Subject": "a.b"}


# errors -----------------------------------------------------------------------------------------------


def test_nothing_listening_is_transient():
    conn = DataConnection(Endpoint("127.0.0.1", free_port()), timeout=5)
    with pytest.raises(Transient, match="cannot open a data connection"):
        conn.open()
    assert not conn.is_open


async def test_a_protocol_error_is_a_transfer_error_naming_the_server_error(nc):
    with open_to(nc) as conn:
        conn.send([b"BOGUS\r\n"])
        with pytest.raises(TransferError, match="server error on the data connection"):
            await asyncio.to_thread(conn.next_message)


async def test_silence_past_the_timeout_is_transient(nc):
    with open_to(nc, timeout=0.5) as conn:
        conn.subscribe(nc.new_inbox())  # nobody publishes there
        with pytest.raises(Transient, match="no bytes for 0.5 s"):
            await asyncio.to_thread(conn.next_message)


async def test_a_server_that_goes_away_mid_read_is_connection_lost(own_server):
    client = await nats.connect(own_server.url, max_reconnect_attempts=0)
    try:
        conn = open_to(client, timeout=30)
    finally:
        await client.close()
    with conn:
        reading = asyncio.ensure_future(asyncio.to_thread(conn.next_message))
        await asyncio.to_thread(own_server.stop)
        with pytest.raises(Transient) as caught:
            await asyncio.wait_for(reading, 30)
    assert isinstance(caught.value, ConnectionLost) or "failed" in str(caught.value)


def test_a_connection_never_opened_refuses_to_send():
    conn = DataConnection(Endpoint("127.0.0.1", free_port()), timeout=5)
    with pytest.raises(TransferError, match="not open"):
        conn.send([b"PING\r\n"])


# closing ----------------------------------------------------------------------------------------------


async def test_close_is_safe_twice_and_after_the_context(nc):
    conn = open_to(nc)
    with conn:
        pass
    assert not conn.is_open
    conn.close()
    conn.close()
    conn.abort()  # nothing to abort: no error either
    with pytest.raises(TransferError, match="not open"):
        conn.next_message()


# cancellation -----------------------------------------------------------------------------------------


async def test_cancelling_run_in_thread_aborts_the_blocked_read_and_closes(nc):
    conn = DataConnection(data_endpoint(nc), timeout=300)  # only the abort can end the read in time
    blocked = threading.Event()

    def work(c: DataConnection) -> None:
        c.subscribe(nc.new_inbox())
        blocked.set()
        c.next_message()  # nothing was asked for: blocks until the socket is aborted

    task = asyncio.create_task(run_in_thread(conn, work))
    assert await asyncio.to_thread(blocked.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)  # a hang here fails the test instead of the suite
    assert not conn.is_open  # the thread finished and closed it before the cancel returned


async def test_an_abort_before_open_makes_open_fail(nc):
    conn = DataConnection(data_endpoint(nc), timeout=10)
    conn.abort()
    with pytest.raises(Transient, match="aborted"):
        conn.open()
    assert not conn.is_open


async def test_run_in_thread_returns_the_work_result_and_closes(nc):
    conn = DataConnection(data_endpoint(nc), timeout=10)
    assert await run_in_thread(conn, lambda c: c.is_open) is True
    assert not conn.is_open


async def test_cancelling_a_nats_py_plane_aborts_its_wait_and_drops_its_subscription(nc):
    """The fallback plane blocks its worker thread on a queue, not a socket: the abort must end
    that wait too, and closing unsubscribes on the client's loop."""
    plane = NatsPyPlane(nc, asyncio.get_running_loop(), timeout=300, waiting_for="test")
    inbox = nc.new_inbox()
    blocked = threading.Event()

    def work(p: NatsPyPlane) -> None:
        p.subscribe(inbox)
        blocked.set()
        p.next_message()  # nothing was asked for: blocks until the plane is aborted

    task = asyncio.create_task(run_in_thread(plane, work))
    assert await asyncio.to_thread(blocked.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)  # a hang here fails the test instead of the suite
    with pytest.raises(nats.errors.NoRespondersError):  # nobody listens on the inbox any more
        await nc.request(inbox, b"", timeout=5)


# secured: TLS + nkeys, as `rolectl auth init` sets a job up ------------------------------------------

SECURE_JOB = "wiresec"


def _secured_server(base, *, handshake_first: bool = False):
    """(AuthDir, started NatsServer) from `rolectl auth init`'s files; `handshake_first` makes the
    server expect TLS before its INFO."""
    auth = init_auth_dir(base / "auth", job=SECURE_JOB, explorers=1, port=free_port(), http_port=free_port(),
                         store_dir=str(base / "store"))
    conf = auth.server_conf
    if handshake_first:
        text = conf.read_text()
        assert "  timeout: 5\n" in text
        conf = base / "handshake_first.conf"
        conf.write_text(text.replace("  timeout: 5\n", "  timeout: 5\n  handshake_first: true\n"))
    server = NatsServer(config_file=str(conf), port=auth.port, http_port=auth.http_port,
                        log_file=str(base / "nats.log"))
    server.start()
    return auth, server


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    auth, server = _secured_server(tmp_path_factory.mktemp("wire-secured"))
    yield auth, server
    server.stop()


def _data_connections(server: NatsServer, state: str = "open") -> list[dict]:
    url = f"{server.monitor_url}/connz?auth=true&state={state}&limit=1000"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return [c for c in json.load(resp)["connections"] if c.get("name") == "rolectl-weights-data"]


async def _connect_as(auth, identity: str, **extra):
    return await nats.connect(auth.url, **auth.security(identity).connect_options(SECURE_JOB), **extra)


async def test_a_secured_client_s_data_connection_is_tls_signed_with_its_nkey(secured):
    auth, server = secured
    client = await _connect_as(auth, "trainer")
    try:
        endpoint = data_endpoint(client)
        assert endpoint.tls is not None and endpoint.sign_nonce is not None
        with DataConnection(endpoint, timeout=10) as conn:
            await asyncio.to_thread(conn.open)
            inbox = client.new_inbox()  # the only inboxes this identity may subscribe to
            conn.subscribe(inbox)
            # A weights subject the trainer may publish on; no stream listens yet, so the server
            # answers "no responders" on the reply inbox: a big and a small part went out, one came back.
            chunk = JobNames(SECURE_JOB).weights_chunk(99, 0)
            await asyncio.to_thread(conn.publish, chunk, inbox, [b"x" * 100_000, b"-tail"])
            msg = await asyncio.to_thread(conn.next_message)
            await asyncio.to_thread(conn.read_payload, msg.size)
            assert (msg.subject, msg.status) == (inbox, "503")
            (seen,) = _data_connections(server)
        assert seen.get("tls_version"), seen
        assert seen["authorized_user"] == endpoint.public_nkey == parse_nkeys(auth.server_conf.read_text())["trainer"]
    finally:
        await client.close()


async def test_a_secured_data_connection_keeps_its_identity_s_permissions(secured):
    auth, _ = secured
    client = await _connect_as(auth, "explorer-0")
    try:
        with DataConnection(data_endpoint(client), timeout=10) as conn:
            await asyncio.to_thread(conn.open)
            conn.subscribe("_INBOX.someone-else.>")
            with pytest.raises(TransferError, match="Permissions Violation"):
                await asyncio.to_thread(conn.next_message)
    finally:
        await client.close()


async def test_a_data_connection_without_the_signature_is_refused(secured):
    auth, _ = secured
    client = await _connect_as(auth, "trainer")
    try:
        unsigned = dataclasses.replace(data_endpoint(client), sign_nonce=None)
        with DataConnection(unsigned, timeout=10) as conn, pytest.raises(NoDataConnection, match="refused"):
            await asyncio.to_thread(conn.open)
    finally:
        await client.close()


async def test_a_server_that_wants_the_tls_handshake_first_gets_it(tmp_path):
    auth, server = _secured_server(tmp_path, handshake_first=True)
    try:
        client = await _connect_as(auth, "trainer", tls_handshake_first=True)
        try:
            endpoint = data_endpoint(client)
            assert endpoint.tls_first
            with DataConnection(endpoint, timeout=10) as conn:
                await asyncio.to_thread(conn.open)
                assert _data_connections(server)[0].get("tls_version")
        finally:
            await client.close()
    finally:
        await asyncio.to_thread(server.stop)


async def test_a_secured_job_moves_weights_over_its_data_connections(tmp_path):
    auth, server = _secured_server(tmp_path)  # its own: the module's server must keep no weights stream
    weights = {"w": torch.arange(3 << 20, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
    admin, trainer, explorer = [await _connect_as(auth, i) for i in ("admin", "trainer", "explorer-0")]
    try:
        await ObjectStoreTransport(admin, SECURE_JOB).ensure_stream()
        ref = await ObjectStoreTransport(trainer, SECURE_JOB, chunk_size=1 << 20).publish(1, weights)
        got = await ObjectStoreTransport(explorer, SECURE_JOB).fetch(ref)
        assert all(torch.equal(got[k], weights[k]) for k in weights)
        nkeys = parse_nkeys(auth.server_conf.read_text())
        def closed_tls_users() -> list[str]:  # the server notes a closed connection a moment after the client
            return [c["authorized_user"] for c in _data_connections(server, "closed") if c.get("tls_version")]

        await wait_until(lambda: {nkeys["trainer"], nkeys["explorer-0"]} <= set(closed_tls_users()), timeout=10,
                         what="both ends' TLS data connections closed")  # both went over TLS data connections
        # striped: three TLS connections, each with the explorer's nkey, land one bit-exact version
        striped = ObjectStoreTransport(explorer, SECURE_JOB, fetch_connections=3)
        got = await striped.fetch(ref)
        assert all(torch.equal(got[k], weights[k]) for k in weights)
        assert striped.last_fetch["data_connections"] == 3
        await wait_until(lambda: closed_tls_users().count(nkeys["explorer-0"]) >= 4, timeout=10,
                         what="the explorer's 1 + 3 TLS data connections closed")
    finally:
        for nc in (admin, trainer, explorer):
            await nc.close()
        await asyncio.to_thread(server.stop)
