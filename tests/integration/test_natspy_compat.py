"""Each accessor of `bus._natspy_compat` against the installed nats-py and a real nats-server: an
upgrade of nats-py that moves one of its internals fails here."""

from __future__ import annotations

import base64
import importlib.metadata

import nats
import pytest

from rolectl.bus import _natspy_compat as compat


@pytest.fixture
async def nc(nats_url):
    client = await nats.connect(nats_url, inbox_prefix="_INBOX.compat.me")
    yield client
    await client.close()


def test_the_installed_nats_py_is_one_the_accessors_were_checked_with():
    installed = importlib.metadata.version("nats-py")
    assert installed in compat.CHECKED_VERSIONS, (
        f"nats-py {installed} is installed but bus/_natspy_compat.py was checked with "
        f"{compat.CHECKED_VERSIONS}: run this file, then add {installed} to CHECKED_VERSIONS"
    )


def test_unique_names_are_fresh_subject_safe_nuids():
    names = {compat.unique_name() for _ in range(1000)}
    assert len(names) == 1000
    assert all(len(n) == 22 and n.isalnum() for n in names)


async def test_callbackless_subscriptions_are_those_without_a_callback(nc):
    async def cb(msg):
        pass

    with_cb = await nc.subscribe("compat.a", cb=cb)
    without = await nc.subscribe("compat.b")
    assert compat.callbackless_subscriptions(nc) == [without]
    await without.unsubscribe()
    assert compat.callbackless_subscriptions(nc) == []
    await with_cb.unsubscribe()


async def test_client_of_a_jetstream_context_is_its_client(nc):
    assert compat.client_of(nc.jetstream()) is nc


async def test_api_prefix_is_the_jetstream_api_the_context_addresses(nc):
    assert compat.api_prefix(nc.jetstream()) == "$JS.API"
    assert compat.api_prefix(nc.jetstream(domain="hub")) == "$JS.hub.API"
    # The prefix the reader builds its pull requests on answers on this server.
    info = await nc.request(f"{compat.api_prefix(nc.jetstream())}.INFO", b"", timeout=5)
    assert b"io.nats.jetstream.api.v1.account_info_response" in info.data


async def test_a_plain_client_does_not_sign_the_server_nonce(nc):
    assert compat.signs_server_nonce(nc) is False


@pytest.mark.parametrize("callback", ["signature_cb", "user_jwt_cb"])
async def test_a_client_with_a_signing_callback_signs_the_server_nonce(nats_url, callback):
    # The server asks for no nonce, so the callback is kept but never called.
    client = await nats.connect(nats_url, **{callback: lambda *args: b""})
    try:
        assert compat.signs_server_nonce(client) is True
    finally:
        await client.close()


async def test_a_plain_client_has_no_nonce_credentials(nc):
    assert compat.nonce_credentials(nc) == (None, None, None)


async def test_an_nkey_client_s_nonce_credentials_sign_as_its_public_key(nats_url, tmp_path):
    import nkeys

    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(nkeys.encode_seed(bytes(32), nkeys.PREFIX_BYTE_USER))
    # The server asks for no nonce, so the client keeps its callbacks without using them.
    client = await nats.connect(nats_url, nkeys_seed=str(seed_file))
    try:
        sign, user_jwt, public_nkey = compat.nonce_credentials(client)
        key = nkeys.from_seed(seed_file.read_bytes())
        assert user_jwt is None and public_nkey == key.public_key.decode()
        assert key.verify(b"nonce", base64.urlsafe_b64decode(sign("nonce") + b"=="))
    finally:
        await client.close()


async def test_inbox_prefix_is_the_one_connected_with(nc):
    assert compat.inbox_prefix(nc) == "_INBOX.compat.me"
    assert nc.new_inbox().startswith("_INBOX.compat.me.")
