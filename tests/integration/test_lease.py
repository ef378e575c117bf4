"""The synchronizers' lease on a real nats-server: a standby takes over a holder that stopped
renewing without waiting for the server's expiry, never takes over one that renews, a bucket's
shorter ttl is the lease, and a synchronizer whose lease loop fails stops instead of deciding
nothing while it looks alive."""

from __future__ import annotations

import asyncio
import time

import nats.js.errors
import pytest

from rolectl.bus.connection import connect
from rolectl.bus.errors import describe
from rolectl.bus.lease import SAFETY, Lease, ensure_lease_bucket
from rolectl.roles.config import parse_config
from rolectl.roles.synchronizer import Synchronizer
from tests.support.wait import wait_until

TTL_S = 1.2


def _lease(conn, holder: str, ttl_s: float = TTL_S) -> Lease:
    return Lease(conn, bucket=conn.names.lease_bucket, key="synchronizer", holder=holder, ttl_s=ttl_s)


async def test_a_standby_takes_over_a_silent_holder_the_server_has_not_expired(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="synchronizer", member="t") as conn:
        # provisioned with a ttl far longer than ours: the server keeps the dead holder's key a minute
        await ensure_lease_bucket(conn, conn.names.lease_bucket, ttl_s=60)
        first, second = _lease(conn, "sync-a#1"), _lease(conn, "sync-b#2")
        await first.open()
        await second.open()
        assert first.ttl_s == second.ttl_s == TTL_S
        assert await first.acquire_or_renew()
        last_renewal = time.monotonic()
        assert not await second.acquire_or_renew()
        assert second.current_holder == "sync-a#1"

        # `first` stops renewing (killed): `second` holds it after one ttl of silence, not sixty
        # polled every renewal period, as the synchronizer does
        await wait_until(second.acquire_or_renew, timeout=10, poll=second.renew_every_s,
                         what="the standby to take the lease")
        took_at = time.monotonic()
        assert took_at - last_renewal >= TTL_S
        assert not first.held  # it stopped trusting itself before the takeover
        assert time.monotonic() - first.renewed_at >= TTL_S * SAFETY
        entry = await (await conn.js.key_value(conn.names.lease_bucket)).get("synchronizer")
        assert entry.value == b"sync-b#2"

        # `first` comes back (it was paused, not dead): its compare-and-set fails, it stands by
        assert not await first.acquire_or_renew()
        assert first.current_holder == "sync-b#2"
        assert await second.acquire_or_renew()


async def test_a_standby_never_takes_a_lease_that_is_renewed(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="synchronizer", member="t") as conn:
        holder, standby = _lease(conn, "sync-a#1"), _lease(conn, "sync-b#2")
        await holder.open()
        assert await holder.acquire_or_renew()
        until = time.monotonic() + 3 * TTL_S

        async def renewed_for_three_ttls() -> bool:
            # every renewal period: the holder renews, the standby is refused and names the holder
            assert await holder.acquire_or_renew()
            assert not await standby.acquire_or_renew()
            assert standby.current_holder == "sync-a#1"
            return time.monotonic() >= until

        await wait_until(renewed_for_three_ttls, timeout=3 * TTL_S + 60, poll=holder.renew_every_s,
                         what="three ttls of renewals")


async def test_a_released_lease_is_taken_at_once(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="synchronizer", member="t") as conn:
        holder, standby = _lease(conn, "sync-a#1"), _lease(conn, "sync-b#2")
        assert await holder.acquire_or_renew()
        assert not await standby.acquire_or_renew()
        await holder.release()
        assert await standby.acquire_or_renew()  # the first try after the release, no ttl to wait


async def test_a_bucket_with_a_shorter_ttl_is_the_lease(nats_url, job_name):
    """The server removes the key after the bucket's ttl: a holder trusting a longer one of its own
    would publish beside whoever takes the key next."""
    async with connect(nats_url, job=job_name, role="synchronizer", member="t") as conn:
        await ensure_lease_bucket(conn, conn.names.lease_bucket, ttl_s=1.5)
        lease = _lease(conn, "sync-a#1", ttl_s=30)
        await lease.open()
        assert lease.ttl_s == pytest.approx(1.5)
        assert lease.renew_every_s == pytest.approx(0.5)


def test_a_bare_key_not_found_error_is_described():
    """nats-py raises KeyNotFoundError without the server's fields (create's re-read of a key that
    expired meanwhile): describing it must not raise, or the lease loop dies on it."""
    assert describe(nats.js.errors.KeyNotFoundError()) == "nats: key not found"
    error = nats.js.errors.BadRequestError(code=400, description="wrong last sequence: 3",
                                           err_code=10071)
    assert describe(error) == "wrong last sequence: 3 (code 400, err_code 10071)"


async def test_a_synchronizer_whose_lease_loop_fails_stops_with_the_error(nats_url, job_name, monkeypatch):
    async def broken(self):
        raise RuntimeError("lease bucket on fire")

    monkeypatch.setattr(Lease, "acquire_or_renew", broken)
    cfg = parse_config({"job": job_name, "nats_url": nats_url, "synchronizer": {"sync_method": "memory"}})
    with pytest.raises(RuntimeError, match="lease bucket on fire"):
        await asyncio.wait_for(Synchronizer(cfg, "sync-a").run(), timeout=30)
