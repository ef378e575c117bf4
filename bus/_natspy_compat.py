"""The one place rolectl reads nats-py internals: each accessor names what it needs and why.

nats-py exposes no public handle for these; they are plain attributes of its client, subscription
and JetStream context. `tests/unit/test_natspy_compat.py` checks every accessor against the
installed nats-py, so an upgrade that moves one fails there, not deep inside a transfer.

Checked with the nats-py releases in `CHECKED_VERSIONS`; the test fails on any other installed
release until someone runs it and adds that release.
"""

from __future__ import annotations

from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.nuid import NUID

__all__ = [
    "CHECKED_VERSIONS",
    "api_prefix",
    "callbackless_subscriptions",
    "client_of",
    "inbox_prefix",
    "nonce_credentials",
    "signs_server_nonce",
    "unique_name",
]

# nats-py releases these accessors were read against (see the test).
CHECKED_VERSIONS = ("2.16.0",)

_names = NUID()  # our own generator: never shared with a client's, so never raced from its tasks


def unique_name() -> str:
    """A fresh NUID (22 characters, URL- and subject-safe), as nats-py names its own inboxes."""
    return _names.next().decode()


def callbackless_subscriptions(nc: Client) -> list[Subscription]:
    """The client's subscriptions that have no callback (pull and `next_msg()` subscriptions): a
    drain waits on their queues until it times out, so they are dropped before draining."""
    return [sub for sub in list(nc._subs.values()) if sub._cb is None]


def client_of(js: JetStreamContext) -> Client:
    """The core client a JetStream context sends through (for its `last_error`)."""
    nc: Client = js._nc
    return nc


def api_prefix(js: JetStreamContext) -> str:
    """The JetStream API subject prefix of the context ("$JS.API", or a domain's), for requests
    nats-py has no call for (the reader's own pull requests)."""
    prefix: str = js._prefix
    return prefix


def signs_server_nonce(nc: Client) -> bool:
    """Whether the client authenticates with nkeys or a JWT: it signs the server's nonce through a
    callback at connect, which a second, plain connection cannot copy."""
    return nc._signature_cb is not None or nc._user_jwt_cb is not None


def nonce_credentials(
    nc: Client,
) -> tuple[Callable[[str], bytes] | None, Callable[[], bytes | bytearray] | None, str | None]:
    """The client's nonce signer, JWT callback and public nkey (each None if unused), so a second
    connection (the weights' data connection) can authenticate as the same nkey / JWT identity."""
    return nc._signature_cb, nc._user_jwt_cb, nc._public_nkey


def inbox_prefix(nc: Client) -> str:
    """The prefix of the client's reply inboxes (set per identity so permissions can scope them)."""
    return bytes(nc._inbox_prefix).decode()
