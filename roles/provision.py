"""`rolectl provision`: create (or check) a job's streams with the admin identity, before any role runs.

Under per-identity permissions (`rolectl auth init`) only `admin` may create, update, purge or delete
streams, so members only check that the streams exist; this is what creates them, with exactly the
configuration the roles expect.
"""

from __future__ import annotations

from rolectl.bus.connection import connect
from rolectl.bus.lease import ensure_lease_bucket, lease_ttl_s
from rolectl.bus.security import ClientSecurity
from rolectl.bus.snapshots import SnapshotStore
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import JobConfig
from rolectl.sync_protocol import SyncMethod

__all__ = ["provision_job"]


async def provision_job(cfg: JobConfig, *, security: ClientSecurity | None = None,
                        url: str | None = None) -> list[str]:
    """Create or verify the job's event, experience and (object store method) weights streams;
    return their names. Raises `bus.errors.BusError` (e.g. `StreamMismatch`)."""
    async with connect(url or cfg.nats_url, job=cfg.job, role="observer", member="provision",
                       security=security if security is not None else cfg.nats.security) as conn:
        replicas = cfg.nats.replicas
        streams = [
            (await ensure_event_stream(conn.js, conn.names, replicas=replicas)).config.name,
            (await ensure_experience_stream(conn.js, conn.names, replicas=replicas)).config.name,
        ]
        # the synchronizers' lease and the reducer snapshots (key-value buckets)
        await ensure_lease_bucket(conn, conn.names.lease_bucket, ttl_s=lease_ttl_s(cfg.synchronizer.heartbeat_period),
                                  replicas=replicas)
        await SnapshotStore(conn, replicas=replicas).ensure_bucket()
        streams += [f"KV_{conn.names.lease_bucket}", f"KV_{conn.names.snapshot_bucket}"]
        if cfg.synchronizer.sync_method is SyncMethod.MEMORY:
            from rolectl.bus.weights.object_store import ObjectStoreTransport

            # the replicas the roles ask for: the weights stream is checked as strictly as the others
            weights = ObjectStoreTransport(conn.nc, cfg.job, storage=cfg.transport.object_store_storage,
                                           replicas=replicas)
            try:
                await weights.ensure_stream()
            finally:
                await weights.aclose()
            streams.append(weights.stream)
        conn.log.info("provisioned", streams=streams)
        return streams
