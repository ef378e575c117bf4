"""A lease in a JetStream key-value bucket: at most one holder at a time, lost when not renewed.

Synchronizer replicas use it to pick the one that publishes (active/standby): every replica folds
the stream and computes the same decisions, only the holder publishes them, so decisions are
recorded once and in the order the reducer computed them.

The holder rewrites the key (compare-and-set on its revision) every third of `ttl_s`. When it
stops, a standby takes the key over in one of two ways, whichever comes first: the server removes
the key `ttl_s` after its last write (the bucket's ttl) and the standby `create`s it; or the standby
has read the same revision for `ttl_s` by its own clock and rewrites it, compare-and-set on that
revision. The second does not wait on the server's expiry timer, which can run late, nor on a
bucket made with a longer ttl (`rolectl provision`, an earlier run).

A holder counts itself as holding only while its last renewal, timed from before the write, is
younger than `ttl_s * SAFETY`; a standby's clock for a revision starts after it read it, so after
the write. A holder that was paused (GC, SIGSTOP, a starved event loop) therefore steps down before
any standby can take over, and its next compare-and-set fails.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from .connection import BusConnection
from .errors import BusError, StreamMismatch, describe
from .streams import replica_shortfall

__all__ = ["Lease", "SAFETY", "ensure_lease_bucket", "lease_ttl_s"]

SAFETY = 0.7  # fraction of the ttl a holder trusts its last renewal for


def lease_ttl_s(heartbeat_period: float) -> float:
    """A job's lease ttl: three heartbeat periods (renewed every one), and at least the server's
    one-second expiry tick."""
    return max(1.0, 3 * heartbeat_period)


async def ensure_lease_bucket(conn: BusConnection, bucket: str, *, ttl_s: float, replicas: int = 1) -> KeyValue:
    """Create the lease bucket (a KV whose entries live `ttl_s` after their last write), or return
    the existing one; with per-identity permissions `rolectl provision` (admin) makes it."""
    try:
        return await conn.js.create_key_value(KeyValueConfig(
            bucket=bucket, ttl=ttl_s, history=1, storage=StorageType.FILE, replicas=replicas,
            description="rolectl synchronizer lease"))
    except nats.js.errors.BadRequestError:
        return await conn.js.key_value(bucket)  # exists with another ttl: use it as it is


class Lease:
    """One lease `key` in bucket `bucket`, held by `holder` (a string naming the process)."""

    def __init__(self, conn: BusConnection, *, bucket: str, key: str, holder: str, ttl_s: float,
                 replicas: int = 1):
        if ttl_s < 1.0:
            raise ValueError(f"a lease ttl below 1 s ({ttl_s}) is shorter than the server's expiry tick")
        self.conn = conn
        self.bucket = bucket
        self.key = key
        self.holder = holder
        self.ttl_s = ttl_s
        self.replicas = replicas
        self.revision: int | None = None  # our key revision while we hold it
        self.renewed_at = 0.0  # monotonic time our last successful create/update was sent
        self.current_holder: str | None = None  # who holds it, as last read (None: nobody / unknown)
        self._seen: tuple[int | None, float] | None = None  # another holder's revision, and when we first read it
        self._kv: KeyValue | None = None

    @property
    def renew_every_s(self) -> float:
        """How often a holder renews and a standby looks again."""
        return self.ttl_s / 3

    async def open(self, *, retry_for: float = 120.0) -> None:
        """Find or create the bucket and check it (`StreamMismatch` if it has too few copies):
        a holder calls this before it starts renewing, so a bucket set up wrong stops it at once.
        A server restarting or a cluster electing is waited out for up to `retry_for` seconds."""
        await self.conn.retry(self._bucket, what=f"open lease bucket {self.bucket}", retry_for=retry_for)

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            try:
                # provisioned already (`rolectl provision`, or an earlier replica): use it as it is
                self._kv = await self.conn.js.key_value(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                self._kv = await ensure_lease_bucket(self.conn, self.bucket, ttl_s=self.ttl_s,
                                                     replicas=self.replicas)
            await self._check_copies(self._kv)
        return self._kv

    async def _check_copies(self, kv: KeyValue) -> None:
        """Refuse a bucket kept on fewer nodes than asked: a lease with one copy dies with its node,
        and then no synchronizer can hold it (an older rolectl made R1 buckets on clusters). A
        bucket whose ttl is shorter than ours is the lease: the server would remove a key we still
        trust, so we renew and trust by its ttl."""
        config = (await kv.status()).stream_info.config
        shortfall = replica_shortfall(self.replicas, config.num_replicas)
        if shortfall:
            self._kv = None
            raise StreamMismatch(f"KV_{self.bucket}", shortfall)
        if config.max_age and config.max_age < self.ttl_s:
            self.conn.log.info("bus.lease_ttl_of_bucket", bucket=self.bucket, asked_s=self.ttl_s,
                               bucket_ttl_s=config.max_age)
            self.ttl_s = config.max_age

    @property
    def held(self) -> bool:
        """True while we hold the lease and our last renewal is recent enough to trust."""
        return self.revision is not None and time.monotonic() - self.renewed_at < self.ttl_s * SAFETY

    async def acquire_or_renew(self) -> bool:
        """Renew the lease if we hold it, else try to take it; True when we hold it afterwards.

        Transient errors (a reconnect, a leader election) leave the state as it was: a holder
        then stops being `held` on its own once its last renewal is too old.
        """
        try:
            kv = await self._bucket()
            if self.revision is not None:
                sent_at = time.monotonic()
                try:
                    self.revision = await kv.update(self.key, self.holder.encode(), last=self.revision)
                except nats.js.errors.KeyWrongLastSequenceError:
                    # it expired or was taken over (we were too slow): maybe someone else holds it
                    self.revision = None
                    return await self._take(kv)
                self._held_from(sent_at)
                return True
            return await self._take(kv)
        except StreamMismatch:
            raise  # a bucket set up wrong does not mend itself: say so rather than wait forever
        except (asyncio.TimeoutError, nats.errors.Error, nats.js.errors.Error, BusError) as exc:
            self.conn.log.info("bus.lease_unreachable", bucket=self.bucket, key=self.key, error=describe(exc))
            if self.revision is not None and self.conn.is_connected:
                # We hold it and the store itself cannot answer (its stream is electing a leader,
                # or lost with a cluster node): nobody else can take it from that store either, so
                # keep deciding rather than stall the job. The next answer settles it (a key that
                # expired meanwhile fails our compare-and-set and we step down if someone took it).
                self.renewed_at = time.monotonic()
            return self.held

    async def _take(self, kv: KeyValue) -> bool:
        sent_at = time.monotonic()
        try:
            self.revision = await kv.create(self.key, self.holder.encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            self.revision = None
            return await self._take_if_abandoned(kv)
        except nats.js.errors.KeyNotFoundError:
            # create found the key, then it expired before create read it back: free to take
            self.revision, self.current_holder = None, None
            return False
        self._held_from(sent_at)
        return True

    async def _take_if_abandoned(self, kv: KeyValue) -> bool:
        """Someone holds the key: rewrite it (compare-and-set) once we have read the same revision
        for `ttl_s`, as its holder would have renewed it by then."""
        try:
            entry = await kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            self.current_holder, self._seen = None, None  # expired since: the next try creates it
            return False
        read_at = time.monotonic()
        self.current_holder = entry.value.decode(errors="replace") if entry.value else None
        if self._seen is None or self._seen[0] != entry.revision:
            self._seen = (entry.revision, read_at)
            return False
        silent_s = read_at - self._seen[1]
        if silent_s < self.ttl_s:
            return False
        sent_at = time.monotonic()
        try:
            self.revision = await kv.update(self.key, self.holder.encode(), last=entry.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False  # renewed, expired or taken by another standby meanwhile: look again
        self.conn.log.info("bus.lease_taken_over", bucket=self.bucket, key=self.key,
                           previous_holder=self.current_holder, silent_s=round(silent_s, 2))
        self._held_from(sent_at)
        return True

    def _held_from(self, sent_at: float) -> None:
        self.renewed_at = sent_at
        self.current_holder = self.holder
        self._seen = None

    async def release(self) -> None:
        """Give the lease up now (a clean stop), so a standby takes over without waiting `ttl_s`."""
        if self.revision is None or self._kv is None:
            return
        revision, self.revision = self.revision, None
        try:
            await self._kv.delete(self.key, last=revision)
        except (asyncio.TimeoutError, nats.errors.Error, nats.js.errors.Error) as exc:
            self.conn.log.info("bus.lease_release_failed", bucket=self.bucket, key=self.key, error=describe(exc))
