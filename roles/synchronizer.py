"""The synchronizer role: fold the job's stream, publish decisions, turn its clock into events.

Theory of operation
-------------------
The synchronizer holds no state of its own: on start it reads the job's stream from the first
sequence (or from the latest reducer snapshot), folds every input with the pure reducer, and
compares the decisions it computes with those already recorded (a previous incarnation, or a
replica, may have published them). From then on it follows the stream live.

Any number of replicas may run. They all fold and compute; only the one holding the job's lease
(a key in a JetStream KV bucket, renewed every heartbeat period, see `bus.lease`) publishes, so
decisions are recorded once and in the order the reducer computed them. A standby keeps the
decisions it computed until it sees them recorded; if the active one dies, a standby takes the
lease over once it has gone unrenewed for `3 x heartbeat_period`, and publishes whatever is still
missing.

Its clock never changes state directly. When a round passes its deadline or a member stops
beating, the active replica publishes `RoundTimedOut` / `MemberExpired` (deterministic message
ids) and only the reducer's reaction to those recorded events counts. Liveness is judged on
evidence: a member is expired only when the synchronizer heard its *own* heartbeat come back more
than `heartbeat_expiry` after that member's last sign of life — so a synchronizer that is cut off,
reconnecting or starved of CPU expires nobody, and every member gets a full window after a
reconnect.

Speed: decisions reach members through the stream, so the time to answer is the time to record
them. Records already delivered are folded together before anything is published (a burst of 64
requests is one fold pass, not 64 fold-publish-ack cycles). Publishing is a group commit on one
subject, the decision log (`rft.<job>.sync.log`): one batch (one message, any rounds' decisions,
up to `_BATCH_MAX`) is in flight at a time, and everything decided while it is being stored goes
out as the next batch, as soon as its ack comes back; the reader goes on folding meanwhile. A pull
round of 64 explorers (64 opens, releases and closes) is a few messages, not 96, which is what
every reader of the stream pays for. What keeps the record exact:

- one guard for all decisions: each batch names the log's last sequence it knows of
  (`Nats-Expected-Last-Subject-Sequence`), which its predecessor's ack gave it;
- computed order is recorded order: batches hold decisions in the order computed, and the next one
  leaves only after the previous one is recorded (so `rolectl replay --check` finds every decision
  in the reducer's order, across rounds too);
- a guard that fails (another replica recorded first, or junk sits on the log): the log is read
  after the sequence we expected; decisions found there count as recorded, and only what is still
  missing is sent, after the last message found.

It ends by itself (exit 0) once the job is done: every trainer and explorer that joined stopped for
good (final STOPPED) and every decision is recorded; `keep_running` (`rolectl start sync
--keep-running`) keeps it following the job instead. Whichever way it ends, Ctrl-C and SIGTERM
included, it records its own final STOPPED so `rolectl status` does not list it as running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict, deque

import structlog

from rolectl.bus.archive import ArchiveError, archive_and_trim, read_range
from rolectl.bus.connection import connect
from rolectl.bus.errors import DecisionSuperseded, PayloadTooLarge, SubjectMoved, describe
from rolectl.bus.events import (
    DecisionPublisher,
    EventPublisher,
    last_sequence,
    publish_heartbeat,
    read_events,
    subscribe_heartbeats,
)
from rolectl.bus.lease import Lease, lease_ttl_s
from rolectl.bus.snapshots import SnapshotStore
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import JobConfig
from rolectl.roles.identity import Claim, live_member_refusal, read_claim, refuse_if_synchronizer_live
from rolectl.roles.resume import StartRefused
from rolectl.roles.session import freeze_heap, stop_task
from rolectl.sync_protocol import (
    Decision,
    MemberExpired,
    MemberJoined,
    MemberRef,
    MemberReleased,
    ProtocolError,
    Recorded,
    RendezvousReady,
    Role,
    RoundTimedOut,
    RunningStatus,
    StatusChanged,
    decision_identity,
)
from rolectl.sync_protocol.reducer import reduce
from rolectl.sync_protocol.state import State

__all__ = ["Synchronizer"]

_FOREIGN_RETRIES = 3  # junk on the decision log: publish after it at most this many times in a row
_BATCH_MAX = 128  # decisions in one message at most (a burst of 64 requests decides 192: two messages)


class Synchronizer:
    """init → setup (connect, catch up) → loop (follow the stream, run timers) → cleanup."""

    def __init__(self, cfg: JobConfig, member_id: str, *, keep_running: bool = False):
        self.cfg = cfg
        self.keep_running = keep_running
        self.sync_cfg = cfg.synchronizer
        # the incarnation is claimed from the record when it runs (roles.identity); 0 until then
        self.me = MemberRef(role=Role.SYNCHRONIZER, id=member_id, incarnation=0)
        self._claim: Claim | None = None  # None also once our join lost to another start's: nothing to stop
        self.log = structlog.get_logger().bind(job=cfg.job, role="synchronizer", member=member_id)
        self.state = State.initial()
        self.recorded: dict[tuple, int] = {}  # decision_identity -> seq, for decisions already in the stream
        self.log_seq = 0  # the last sequence on the decision log we know of: the next batch's guard
        # decisions computed and not yet seen recorded, in the order computed: published once we
        # are caught up and hold the lease (a standby keeps them until the active one records them)
        self.pending: OrderedDict[tuple, Decision] = OrderedDict()
        self.caught_up = False
        self.active = False
        self.rejected = 0
        self.decisions_published = 0
        # liveness on evidence (monotonic seconds of this process)
        self._last_seen: dict[tuple[str, int], float] = {}  # (member key, incarnation) -> last sign of life
        self._started = time.monotonic()
        self._connected_since: float | None = None  # None while cut off from the server
        self._reconnects_seen = 0
        self._own_beats: deque[float] = deque(maxlen=64)  # send times of our beats not heard back yet
        self._heard_self_sent_at: float | None = None  # send time of the newest own beat heard back
        self._expired_sent: set[tuple[str, int]] = set()
        self._timeouts_sent: set[int] = set()
        self._snapshot_seq = 0  # last_seq of the newest snapshot written or loaded
        self.archive_dir = cfg.event_archive_dir  # the stream's history below the newest snapshot
        self._archiving: asyncio.Task | None = None
        self._standby_of: str | None = None  # the active replica we last logged standing by for
        # publishing (see "Speed" above): the pending decisions not handed to a publish yet (in
        # computed order), the batch in flight, how often in a row junk was met on the log
        self._unsent: OrderedDict[tuple, Decision] = OrderedDict()
        self._in_flight: asyncio.Task | None = None
        self._batch_max = _BATCH_MAX  # halved when a batch is over the server's max_payload
        self._foreign = 0
        self._read_seq = 0  # the last stream sequence the reader has delivered (any message)
        self._acked: set[int] = set()  # sequences of our own batches, acked, not yet read back
        self._failure: asyncio.Future | None = None  # a publish that failed for good ends the role
        self._stopping = False  # on the way out: nothing new is sent
        self._someone_finished = True  # a member stopped for good since we last asked whether the job is done
        self._groups_stored: set[int] = set()  # rendezvous groups whose record is stored (_store_groups)

    # -- setup -------------------------------------------------------------------------------------
    async def run(self) -> None:
        async with connect(self.cfg.nats_url, job=self.cfg.job, role="synchronizer", member=self.me.id,
                           security=self.cfg.nats.security) as conn:
            self.conn = conn
            await ensure_event_stream(conn.js, conn.names, replicas=self.cfg.nats.replicas)
            await ensure_experience_stream(conn.js, conn.names, replicas=self.cfg.nats.replicas)
            self.snapshots = SnapshotStore(conn, replicas=self.cfg.nats.replicas)
            from_seq = await self._load_snapshot()
            await self._claim_identity()
            self.events = EventPublisher(conn, self.me)
            self.decisions = DecisionPublisher(conn)
            self.lease = Lease(conn, bucket=conn.names.lease_bucket, key="synchronizer",
                               holder=f"{self.me.id}#{self.me.incarnation}",
                               ttl_s=lease_ttl_s(self.sync_cfg.heartbeat_period), replicas=self.cfg.nats.replicas)
            await self.lease.open()
            self._connected_since = time.monotonic()
            self._reconnects_seen = conn.reconnects
            await subscribe_heartbeats(conn, self._on_heartbeat)
            end = await last_sequence(conn, patience_s=self.sync_cfg.sync_timeout)  # a server away is waited for
            self.log.info("catching_up", from_seq=from_seq, last_seq=end)
            if end < from_seq:
                self._mark_caught_up()
            tasks: list[asyncio.Task] = []
            try:
                # Announce ourselves: the config we decide with, and that we are up (the dashboard
                # lists synchronizers too). Recorded like any input, so replay sees the same thing.
                # Inside the try: a stop that lands while the join's ack is on its way (it may be
                # recorded already) still records our STOPPED.
                await self._join()
                tasks = [asyncio.create_task(self._timers(), name="timers"),
                         asyncio.create_task(self._heartbeat(), name="heartbeat"),
                         asyncio.create_task(self._hold_lease(), name="lease")]
                if self.caught_up and self._job_done():
                    return
                # The fold runs until the job is done; a publish that failed for good (the server
                # gone longer than the retry budget, a full stream) ends it with that error.
                self._failure = asyncio.get_running_loop().create_future()
                follow = asyncio.create_task(self._follow(from_seq, end), name="follow")
                tasks.append(follow)
                # The timers, heartbeat and lease loops run for as long as we do: one that ended
                # raised, and a synchronizer without it would look alive and decide nothing.
                await asyncio.wait({*tasks, self._failure}, return_when=asyncio.FIRST_COMPLETED)
                if self._failure.done():
                    self._failure.result()  # raises the publish's error
                if follow.done():
                    follow.result()
                else:
                    ended = next(task for task in tasks if task.done())
                    ended.result()
                    raise RuntimeError(f"the synchronizer's {ended.get_name()} loop ended")
            finally:
                self._stopping = True
                for task in [*tasks, *([self._in_flight] if self._in_flight else []),
                             *([self._archiving] if self._archiving else [])]:
                    await stop_task(task, log=self.log)
                if self.active:
                    await self.lease.release()  # a standby takes over at once instead of after the ttl
                await self._record_stopped()

    async def _claim_identity(self) -> None:
        """Claim this start's incarnation (roles.identity); `StartRefused` while a process of the same
        replica id runs. The record's last join of it, and the snapshot's, are what it follows."""
        member = self.state.members.get(self.me.key)
        claim = await read_claim(self.conn, Role.SYNCHRONIZER, self.me.id,
                                 known=(member.ref.incarnation if member else None,))
        await refuse_if_synchronizer_live(self.conn, claim, expiry=self.sync_cfg.heartbeat_expiry, log=self.log)
        self._claim = claim
        self.me = MemberRef(role=Role.SYNCHRONIZER, id=self.me.id, incarnation=claim.incarnation)
        self.log = self.log.bind(incarnation=claim.incarnation)

    async def _join(self) -> None:
        """Announce the config we decide with and that we are up, as the incarnation claimed: the join
        is stored only if no other start of this replica id joined since the claim was read."""
        claim = self._claim
        await self.events.publish(self.cfg.job_configured(self.me))
        try:
            await self.events.publish(
                MemberJoined(member=self.me, host=socket.gethostname(), pid=os.getpid(), step=0, version=0, ranks=0),
                msg_id=claim.join_msg_id(self.me), expected_last_subject_seq=claim.guard)
        except SubjectMoved:
            self._claim = None  # the incarnation is the other start's: record nothing as it
            winner = (await read_claim(self.conn, Role.SYNCHRONIZER, self.me.id)).previous
            raise StartRefused(live_member_refusal(
                winner.member if winner else self.me, job=self.cfg.job, joined=winner,
                expiry=self.sync_cfg.heartbeat_expiry, lead="another start of it joined first: ")) from None

    def _job_done(self) -> bool:
        """Every trainer and explorer that joined stopped for good and every decision is recorded:
        nothing is left to decide (a member that comes back later joins as a new incarnation, and a
        synchronizer started then takes it from there)."""
        if self.keep_running or self.pending:
            return False
        self._someone_finished = False
        members = [m for m in self.state.members.values() if m.ref.role in (Role.TRAINER, Role.EXPLORER)]
        roles = {m.ref.role for m in members}
        if roles != {Role.TRAINER, Role.EXPLORER} or not all(m.finished for m in members):
            return False
        self.log.info("job_done_exiting", members=len(members), decisions_published=self.decisions_published,
                      last_seq=self.state.last_seq)
        return True

    async def _record_stopped(self) -> None:
        """Record our own final STOPPED (on the way out, also when cancelled by a signal)."""
        if self._claim is None:  # we never claimed an incarnation, or lost it to another start
            return
        try:
            await asyncio.wait_for(self.events.publish(StatusChanged(
                member=self.me, status=RunningStatus.STOPPED, step=0, version=0, final=True)), 10.0)
        except Exception as exc:  # the server is gone: nothing to tell it; status shows us expired
            self.log.warning("stopped_not_recorded", error=describe(exc))

    async def _load_snapshot(self) -> int:
        """Start from the newest reducer snapshot, if any: returns the first sequence to read."""
        snapshot = await self.snapshots.latest()
        if snapshot is None:
            return 1
        self.state = snapshot.state
        self.log_seq = snapshot.decision_log_seq
        self._snapshot_seq = snapshot.state.last_seq
        self.log.info("snapshot_loaded", seq=snapshot.state.last_seq, members=len(snapshot.state.members),
                      open_rounds=len(snapshot.state.rounds))
        return snapshot.state.last_seq + 1

    async def _follow(self, from_seq: int, end: int) -> None:
        """Fold the stream live; after each burst, send what it decided; stop when the job is done."""
        # A replica that lags behind a trim (paused, or started from a snapshot older than the
        # trim point) reads the purged stretch back from the archive: folding past a hole would
        # decide differently from the stream (HistoryGap ends the role when it cannot).
        async with read_events(self.conn, from_seq=from_seq, include_decisions=True, known=self._own,
                               backfill=lambda first, last: read_range(self.archive_dir, first, last)) as reader:
            while burst := await reader.next_burst():
                for rec in burst:
                    self._on_record(rec)
                    if not self.caught_up and rec.seq >= end:
                        self._mark_caught_up()
                if await reader.record_ready():
                    continue  # fold what is already here first; send for all of it at once
                self._send_ready()
                if self.active and self.caught_up and not self.pending:
                    await self._maybe_snapshot()
                if self.caught_up and self._someone_finished and self._job_done():
                    return

    def _mark_caught_up(self) -> None:
        self.caught_up = True
        freeze_heap()  # the replayed history stays out of full collections from now on
        sent = self._send_ready()
        self.log.info("caught_up", seq=self.state.last_seq, members=len(self.state.members),
                      open_rounds=len(self.state.rounds), republished=sent, active=self.active)

    # -- publishing --------------------------------------------------------------------------------
    def _send_ready(self) -> int:
        """Send the oldest unsent decisions (at most `_batch_max`, in computed order, any rounds)
        as one batch, unless one is in flight: its ack names the sequence the next batch's guard
        must expect, and whatever is decided meanwhile goes in that next batch. Only the active,
        caught-up replica sends. Returns how many decisions it sent."""
        if (not (self.active and self.caught_up) or self._stopping or self._in_flight is not None
                or not self._unsent or (self._failure is not None and self._failure.done())):
            return 0
        batch = [self._unsent.popitem(last=False) for _ in range(min(self._batch_max, len(self._unsent)))]
        self._in_flight = asyncio.create_task(self._publish_batch(batch), name="decisions")
        return len(batch)

    def _unsend(self, batch: list[tuple[tuple, Decision]]) -> None:
        """What of `batch` is still pending goes back to the front of the unsent: nothing computed
        before it is unsent (it was sent in computed order)."""
        for key, decision in reversed(batch):
            if key in self.pending:
                self._unsent[key] = decision
                self._unsent.move_to_end(key, last=False)

    async def _publish_batch(self, batch: list[tuple[tuple, Decision]]) -> None:
        """Append one batch to the decision log behind the log's guard."""
        decisions = [d for _, d in batch]
        cancelled = False
        try:
            if not self.lease.held:
                if self.active:
                    self.active = False
                    self.log.warning("stepped_down", reason="lease not renewed in time", pending=len(self.pending))
                return  # they stay pending: whoever holds the lease records them
            await self._store_groups(decisions)
            expected = self.log_seq
            try:
                seq = await self.decisions.publish(decisions, expected_last_subject_seq=expected)
            except DecisionSuperseded:
                await self._catch_up_on_log(expected, decisions)
                return
            except PayloadTooLarge as exc:
                if len(batch) == 1:
                    raise  # one decision the server cannot take: fatal, below
                # rendezvous groups of many ranks (the event stream takes 64 KiB a message by
                # default): fewer decisions per message from now on
                self._batch_max = max(1, len(batch) // 2)
                self.log.warning("decision_batch_too_large", decisions=len(batch), bytes=exc.size,
                                 limit=exc.limit, batch_max=self._batch_max)
                return  # sent again, smaller, by the _send_ready below
            self._foreign = 0
            if seq is not None:
                self.log_seq = max(self.log_seq, seq)
                self.decisions_published += len(decisions)
                if seq > self._read_seq:
                    self._acked.add(seq)  # its ack said all its reading back would: skip decoding it
            for key, _ in batch:
                self.pending.pop(key, None)
            self._log_decisions(decisions, seq)
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception as exc:  # the server gone past the retry budget, a full stream: fatal
            if self._failure is not None and not self._failure.done():
                self._failure.set_exception(exc)  # run() raises it
            else:
                self.log.error("decision_publish_failed", decisions=len(decisions), error=describe(exc))
        finally:
            self._unsend(batch)  # not recorded (lease lost, guard failed, error): to be sent again
            if self._in_flight is asyncio.current_task():
                self._in_flight = None
            if not cancelled:
                self._send_ready()  # whatever was decided while this batch was in flight

    async def _store_groups(self, decisions: list[Decision]) -> None:
        """Store the rank assignments of each group a batch's RendezvousReady names, before it is
        recorded: an explorer's view does not fold the other explorers and binds the decision with
        this record (see bus.snapshots). Once per group epoch (again after a restart: same bytes)."""
        for decision in decisions:
            if not isinstance(decision, RendezvousReady) or not decision.is_bound:
                continue
            if decision.epoch not in self._groups_stored:
                group = decision.participants
                await self.conn.retry(lambda d=decision, g=group: self.snapshots.save_group(d.epoch, g),
                                      what=f"store rendezvous group {decision.epoch}",
                                      retry_for=self.decisions.retry_for)
                self._groups_stored = {e for e in self._groups_stored if e > decision.epoch - 4} | {decision.epoch}

    def _log_decisions(self, decisions: list[Decision], seq: int | None) -> None:
        """One line per round of a recorded batch (a request answered at once is one line, not three)."""
        if not self.log.is_enabled_for(logging.INFO):
            return  # 64 explorers: ~200 decisions a round, whose fields are not worth gathering unlogged
        by_round: dict[int, list[Decision]] = {}
        for decision in decisions:
            by_round.setdefault(decision.round, []).append(decision)
        for round_id, held in by_round.items():
            fields: dict = {}
            for decision in held:
                fields.update(_decision_fields(decision))
            self.log.info("decision", kind=",".join(d.KIND for d in held), round=round_id,
                          cause_seq=held[0].cause_seq, seq=seq, **fields)

    async def _catch_up_on_log(self, expected: int, decisions: list[Decision]) -> None:
        """The decision log holds messages after `expected`: decisions there are recorded (by
        another replica, or by us before a lost ack); anything else is junk to publish after.
        What is still pending goes out next, guarded by the last message found."""
        found = await self.decisions.on_subject_after(expected)
        if not found:
            # Nothing after our guard, yet the guard failed: the log holds less than we knew of (its
            # messages aged out of the stream, max_age, or were purged). Guard on what is there
            # (never past `expected`: a message newer than that is read as above on the next try).
            last = await self.decisions.last_on_log()
            self.log_seq = min(last, expected)
            self.log.warning("decision_log_shorter_than_known", expected=expected, last=last)
            return
        junk = 0
        for seq, held in found:
            for d in held:
                self._mark_recorded(decision_identity(d), seq)  # not sent again, even if our fold gets there later
            junk += not held
        last = found[-1][0]
        self.log_seq = max(self.log_seq, last)
        if junk:
            self._foreign += 1
            self.log.warning("decision_log_had_foreign_message", seq=last, foreign=junk, tries=self._foreign)
            if self._foreign > _FOREIGN_RETRIES:
                self.log.error("decision_not_published", kinds=[d.KIND for d in decisions],
                               rounds=sorted({d.round for d in decisions}),
                               reason=f"the decision log kept changing under us {self._foreign} times in a row")
                self._foreign = 0
                for d in decisions:
                    self.pending.pop(decision_identity(d), None)

    def _mark_recorded(self, key: tuple, seq: int) -> None:
        """The decision `key` is in the stream at `seq`: no longer pending, never sent (again)."""
        self.recorded[key] = seq
        self.pending.pop(key, None)
        self._unsent.pop(key, None)

    def _own(self, seq: int) -> bool:
        """The reader's `known`: a batch we published, whose ack already did its bookkeeping."""
        self._read_seq = seq
        if seq in self._acked:
            self._acked.discard(seq)
            return True
        return False

    # -- the lease ---------------------------------------------------------------------------------
    async def _hold_lease(self) -> None:
        """Renew (or try to take) the lease every third of its ttl; take over or step down."""
        while True:
            held = await self.lease.acquire_or_renew()
            if held and not self.active:
                self.active = True
                self.log.info("became_active", lease_ttl_s=self.lease.ttl_s, pending=len(self.pending))
                self._send_ready()
            elif not held and self.active:
                self.active = False
                self.log.warning("stepped_down", holder=self.lease.current_holder)
            elif not held and self.lease.current_holder != self._standby_of:
                self._standby_of = self.lease.current_holder
                self.log.info("standby", active=self._standby_of)
            await asyncio.sleep(self.lease.renew_every_s)

    # -- loop --------------------------------------------------------------------------------------
    def _on_record(self, rec: Recorded) -> None:
        """Fold one record; decisions it yields that the stream does not hold yet become pending."""
        event = rec.event
        if isinstance(event, Decision):
            self._mark_recorded(decision_identity(event), rec.seq)
            if rec.subject == self.conn.names.decision_log:  # not a round's subject of an older build
                self.log_seq = max(self.log_seq, rec.seq)
            return
        self._last_seen[(event.member.key, event.member.incarnation)] = time.monotonic()
        if isinstance(event, StatusChanged) and event.final:
            self._someone_finished = True
        try:
            self.state, decisions = reduce(self.state, rec)
        except ProtocolError as exc:
            self.rejected += 1
            self.log.warning("event_rejected", seq=rec.seq, kind=event.KIND, member=str(event.member),
                             reason=str(exc))
            return
        for decision in decisions:
            key = decision_identity(decision)
            if key not in self.recorded:
                self.pending[key] = decision
                self._unsent[key] = decision

    async def _maybe_snapshot(self) -> None:
        every = self.sync_cfg.snapshot_every
        if every and self.state.last_seq - self._snapshot_seq >= every:
            saved = await self.snapshots.save(self.state, self.log_seq)
            # not saved (a newer one is stored, the server away): the next try is `every` records on
            self._snapshot_seq = self.state.last_seq
            if saved:
                self.log.info("snapshot_saved", seq=self.state.last_seq)
                if self.active and (self._archiving is None or self._archiving.done()):
                    self._archiving = asyncio.create_task(self._archive(self._snapshot_seq, self.log_seq),
                                                          name="archive")

    async def _archive(self, upto: int, log_seq: int) -> None:
        """Archive the history the new snapshot covers, then trim the stream below it (see
        bus.archive): the stream stays bounded for a job of any length. Only the active replica
        snapshots, so only it archives and trims; a failure trims nothing and says why."""
        try:
            trimmed = await archive_and_trim(self.conn, self.archive_dir, upto, keep_from=log_seq)
        except ArchiveError as exc:
            self.log.error("archive_failed_not_trimmed", upto_seq=upto, reason=str(exc))
        except Exception as exc:  # the server away: the next snapshot tries again
            self.log.warning("archive_or_trim_failed", upto_seq=upto, error=describe(exc))
        else:
            if trimmed:
                self.log.info("stream_trimmed", below_seq=trimmed, archive=str(self.archive_dir))

    # -- liveness ----------------------------------------------------------------------------------
    def _on_heartbeat(self, heartbeat) -> None:
        member = heartbeat.member
        now = time.monotonic()
        self._last_seen[(member.key, member.incarnation)] = now
        if member == self.me and self._own_beats:
            # our own beat came back: we can hear the job as of when it was sent
            self._heard_self_sent_at = self._own_beats.popleft()

    async def _heartbeat(self) -> None:
        """Replicas beat too, so a peer synchronizer does not declare us expired; and hearing our
        own beats come back is the evidence that silence from others means something."""
        while True:
            try:
                self._own_beats.append(time.monotonic())
                await publish_heartbeat(self.conn, self.me, step=0, version=0, status=RunningStatus.RUNNING)
            except Exception as exc:
                self.log.warning("heartbeat_failed", error=describe(exc))
            await asyncio.sleep(self.sync_cfg.heartbeat_period)

    def _note_connection(self) -> bool:
        """Track when we (re)connected; False while cut off from the server."""
        conn = self.conn
        if not conn.is_connected:
            if self._connected_since is not None:
                self.log.warning("cut_off_no_expiry", reason="disconnected from the server")
            self._connected_since = None
            return False
        if self._connected_since is None or conn.reconnects != self._reconnects_seen:
            # back: what we did not hear meanwhile proves nothing; everyone gets a full window
            self._connected_since = time.monotonic()
            self._reconnects_seen = conn.reconnects
            self._own_beats.clear()
            self._heard_self_sent_at = None
            self.log.info("reconnected_liveness_reset", expiry_window_s=self.sync_cfg.heartbeat_expiry)
        return True

    async def _timers(self) -> None:
        """Turn the clock into events: round deadlines and member expiry (active replica only)."""
        period = min(0.25, self.sync_cfg.heartbeat_period / 2)
        while True:
            await asyncio.sleep(period)
            connected = self._note_connection()
            if not (self.caught_up and self.active and connected):
                continue
            try:
                await self._check_rounds()
                await self._check_members()
            except Exception as exc:  # a publish failing during a reconnect: try again next tick
                self.log.warning("timer_check_failed", error=describe(exc))

    async def _check_rounds(self) -> None:
        # Deadlines are server time (when the round opened) plus sync_timeout, compared with our
        # wall clock: hosts are expected to run NTP; skew shifts a timeout by that much, which is
        # small against sync_timeout (minutes), and the recorded RoundTimedOut keeps replay exact.
        now_ms = time.time() * 1000
        cfg = self.state.config or self.sync_cfg
        for round_id, rnd in list(self.state.rounds.items()):
            if round_id in self._timeouts_sent:
                continue
            if now_ms >= rnd.opened_at_ms + cfg.sync_timeout * 1000:
                self.log.warning("round_timed_out", round=round_id, sync_timeout=cfg.sync_timeout)
                await self.events.publish(RoundTimedOut(member=self.me, round=round_id),
                                          msg_id=f"timeout/{round_id}")
                # Marked only once recorded: a publish that failed is tried again next tick.
                self._timeouts_sent.add(round_id)

    async def _check_members(self) -> None:
        horizon = self._heard_self_sent_at
        if horizon is None:
            return  # we have not heard ourselves since (re)connecting: no evidence about anyone
        cfg = self.state.config or self.sync_cfg
        baseline = max(self._started, self._connected_since or horizon)
        for member in list(self.state.members.values()):
            if not member.alive or member.ref == self.me:
                continue
            ident = (member.ref.key, member.ref.incarnation)
            if ident in self._expired_sent:
                continue
            # A member not heard since we started or reconnected gets one full window from then.
            last = max(self._last_seen.get(ident, baseline), baseline)
            silent = horizon - last
            if silent > cfg.heartbeat_expiry:
                self.log.warning("member_expired", expired=str(member.ref), silent_for=round(silent, 2))
                await self.events.publish(
                    MemberExpired(member=self.me, expired=member.ref, silent_for=round(silent, 3)),
                    msg_id=f"expired/{member.ref.key}#{member.ref.incarnation}",
                )
                self._expired_sent.add(ident)  # only once recorded, as above


def _decision_fields(decision: Decision) -> dict:
    out = {}
    for name in ("reason", "version", "outcome", "epoch", "world_size", "method"):
        if hasattr(decision, name):
            value = getattr(decision, name)
            out[name] = getattr(value, "value", value)
    if isinstance(decision, MemberReleased):
        out["released"] = str(decision.released)
    return out
