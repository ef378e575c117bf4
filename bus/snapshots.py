"""Reducer snapshots in a JetStream key-value bucket (`rft_<job>_snapshots`, key `latest`).

The active synchronizer writes one every `synchronizer.snapshot_every` records, never over a newer
one (compare-and-set on the key's revision); synchronizers,
members' job views and `rolectl replay` start from the newest one and fold the stream's tail. The
bytes are `sync_protocol.snapshot.encode_state` (msgpack with a schema version; no pickle). A
snapshot that does not decode is ignored with a warning: the fold then starts from the stream's
first record, as it would with no snapshot at all.

The same bucket holds the rank assignments of each rendezvous group formed (key `group.<epoch>`,
`sync_protocol.snapshot.encode_group`): an explorer's view folds only its own scope, so it reads
the group a `RendezvousReady` names here instead of folding every explorer's joins. The active
synchronizer stores a group before it records the first decision naming it, and deletes the
record of the group `GROUPS_KEPT` epochs older; a reader checks what it reads against the
decision's digest (`RendezvousReady.bound`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from rolectl.sync_protocol import DecodeError, RankAssignment
from rolectl.sync_protocol.snapshot import decode_group, decode_state, encode_group, encode_state
from rolectl.sync_protocol.state import State

from .connection import BusConnection
from .errors import describe

__all__ = ["Snapshot", "SnapshotStore", "GROUPS_KEPT"]

_KEY = "latest"
GROUPS_KEPT = 4
"""Group records kept: a member binding a decision reads the group of the round it is in, which
is the newest or (while a slower member still receives) the one before."""


def _group_key(epoch: int) -> str:
    return f"group.{int(epoch)}"


@dataclass(frozen=True)
class Snapshot:
    """A folded state as of `state.last_seq`, with the last sequence on the decision log the
    synchronizer knew of (its guard's `expected`; 0 in a snapshot of a build before schema 4, which
    wrote no decision log)."""

    state: State
    decision_log_seq: int


class SnapshotStore:
    def __init__(self, conn: BusConnection, *, replicas: int = 1):
        self.conn = conn
        self.bucket = conn.names.snapshot_bucket
        self.replicas = replicas
        self._kv: KeyValue | None = None

    async def _bucket(self, *, create: bool) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await self.conn.js.key_value(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                if not create:
                    raise
                self._kv = await self.ensure_bucket()
        return self._kv

    async def ensure_bucket(self) -> KeyValue:
        """Create the snapshot bucket, or return the existing one (`rolectl provision` makes it
        under per-identity permissions; otherwise the first synchronizer that saves does)."""
        try:
            return await self.conn.js.create_key_value(KeyValueConfig(
                bucket=self.bucket, history=2, storage=StorageType.FILE, replicas=self.replicas,
                description=f"rolectl job {self.conn.names.job}: reducer snapshots"))
        except nats.js.errors.BadRequestError:
            return await self.conn.js.key_value(self.bucket)

    async def save(self, state: State, decision_log_seq: int) -> bool:
        """Store a snapshot; False (logged) when it could not be stored — snapshots are an
        optimisation, a failed one only means the next restart folds a longer tail."""
        payload = encode_state(state, extra={"decision_log_seq": int(decision_log_seq)})
        if len(payload) > self.conn.nc.max_payload:
            self.conn.log.warning("bus.snapshot_too_large", bytes=len(payload), max_payload=self.conn.nc.max_payload)
            return False
        try:
            kv = await self._bucket(create=True)
            try:
                entry = await kv.get(_KEY)
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                entry = None
            stored = self._last_seq_of(entry.value) if entry is not None else None
            if stored is not None and stored > state.last_seq:
                # A replica that lagged (paused, cut off) must not put an older snapshot over a
                # newer one: the stream may be trimmed up to the newer one, and a restart from the
                # older one would start before the stream's first record.
                self.conn.log.info("bus.snapshot_not_newer", seq=state.last_seq, stored_seq=stored)
                return False
            if entry is None:
                await kv.create(_KEY, payload)
            else:
                await kv.update(_KEY, payload, last=entry.revision)  # nobody wrote in between
        except nats.js.errors.KeyWrongLastSequenceError:
            self.conn.log.info("bus.snapshot_not_saved", bucket=self.bucket, seq=state.last_seq,
                               error="another replica saved one meanwhile")
            return False
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            self.conn.log.info("bus.snapshot_not_saved", bucket=self.bucket, error=describe(exc))
            return False
        return True

    def _last_seq_of(self, payload: bytes | None) -> int | None:
        try:
            state, _ = decode_state(payload or b"")
        except (DecodeError, ValueError, TypeError):
            return None  # unreadable: any snapshot we write is better
        return state.last_seq

    async def latest(self) -> Snapshot | None:
        """The newest snapshot, or None (no bucket, no snapshot yet, or one that does not decode)."""
        try:
            kv = await self._bucket(create=False)
            entry = await kv.get(_KEY)
        except (nats.js.errors.NotFoundError, nats.js.errors.BucketNotFoundError):
            return None
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            self.conn.log.warning("bus.snapshot_unreadable", bucket=self.bucket, error=describe(exc))
            return None
        try:
            state, extra = decode_state(entry.value or b"")
            log_seq = extra.get("decision_log_seq", 0)
            if isinstance(log_seq, bool) or not isinstance(log_seq, int) or log_seq < 0:
                raise DecodeError(f"decision_log_seq must be a sequence number, got {log_seq!r}")
        except (DecodeError, ValueError, TypeError) as exc:
            self.conn.log.warning("bus.snapshot_ignored", bucket=self.bucket, reason=str(exc))
            return None
        return Snapshot(state=state, decision_log_seq=log_seq)

    async def save_group(self, epoch: int, participants: tuple[RankAssignment, ...]) -> None:
        """Store group `epoch`'s rank assignments (before a decision names it); delete the record
        `GROUPS_KEPT` epochs older. Raises what the server raised: a group not stored is a decision
        its members cannot bind, so it is not recorded yet (the caller tries again)."""
        payload = encode_group(epoch, participants)
        kv = await self._bucket(create=True)
        await kv.put(_group_key(epoch), payload)
        if epoch > GROUPS_KEPT:
            try:
                await kv.delete(_group_key(epoch - GROUPS_KEPT))
            except (asyncio.TimeoutError, nats.errors.Error) as exc:  # left behind: harmless, small
                self.conn.log.debug("bus.group_not_deleted", epoch=epoch - GROUPS_KEPT, error=describe(exc))

    async def group(self, epoch: int) -> tuple[RankAssignment, ...] | None:
        """Group `epoch`'s rank assignments, or None when no such record is stored (or it does not
        decode: logged). Server errors are raised (the caller waits for the server)."""
        try:
            kv = await self._bucket(create=False)
            entry = await kv.get(_group_key(epoch))
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError,
                nats.js.errors.KeyDeletedError):
            return None
        try:
            stored, participants = decode_group(entry.value or b"")
        except DecodeError as exc:
            self.conn.log.warning("bus.group_unreadable", bucket=self.bucket, epoch=epoch, reason=str(exc))
            return None
        return participants if stored == epoch else None
