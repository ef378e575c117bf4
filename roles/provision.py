"""`rolectl provision`: create (or check) a job's streams with the admin identity, before any role runs.

Under per-identity permissions (`rolectl auth init`) only `admin` may create, update, purge or delete
streams, so members only check that the streams exist; this is what creates them, with exactly the
configuration the roles expect.
"""

from __future__ import annotations

from bus.connection import connect
from bus.security import ClientSecurity
from bus.streams import ensure_event_stream, ensure_experience_stream
from roles.config import JobConfig
from sync_protocol import SyncMethod

__all__ = ["provision_job"]


async def provision_job(cfg: JobConfig, *, security: ClientSecurity | None = None,
                        url: str | None = None) -> list[str]:
    """Create or verify the job's event, experience and (object store method) weights streams;
    return their names. Raises `bus.errors.BusError` (e.g. `StreamMismatch`)."""
    async with connect(url or cfg.nats_url, job=cfg.job, role="observer", member="provision",
                       security=security if security is not None else cfg.nats.security) as conn:
        streams = [
            (await ensure_event_stream(conn.js, conn.names)).config.name,
            (await ensure_experience_stream(conn.js, conn.names)).config.name,
        ]
        if cfg.synchronizer.sync_method is SyncMethod.MEMORY:
            from bus.weights.object_store import ObjectStoreTransport

            weights = ObjectStoreTransport(conn.nc, cfg.job, storage=cfg.transport.object_store_storage)
            try:
                await weights.ensure_stream()
            finally:
                await weights.aclose()
            streams.append(weights.stream)
        conn.log.info("provisioned", streams=streams)
        return streams
