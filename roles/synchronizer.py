"""The synchronizer role: fold the job's stream, publish decisions, turn its clock into events.

Theory of operation
-------------------
The synchronizer holds no state of its own: on start it reads the job's stream from the first
sequence, folds every input with the pure reducer, and compares the decisions it computes with
those already recorded (a previous incarnation, or a replica, may have published them). Decisions
not yet recorded are published once it has caught up. From then on it follows the stream live.

Its clock never changes state directly. When a round passes its deadline or a member stops
beating, it publishes `RoundTimedOut` / `MemberExpired` (with deterministic message ids, so two
replicas publish them once) and only the reducer's reaction to those recorded events counts.
Kill it at any moment: the next one replays and the job goes on.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from bus.connection import connect
from bus.events import (
    DecisionPublisher,
    EventPublisher,
    last_sequence,
    publish_heartbeat,
    read_events,
    subscribe_heartbeats,
)
from bus.streams import ensure_event_stream, ensure_experience_stream
from roles.common import new_incarnation, stop_task
from roles.config import JobConfig
from sync_protocol import (
    Decision,
    JobConfigured,
    MemberExpired,
    MemberJoined,
    MemberRef,
    MemberReleased,
    ProtocolError,
    Recorded,
    Role,
    RoundTimedOut,
    RunningStatus,
    decision_identity,
)
from sync_protocol.reducer import reduce
from sync_protocol.state import State

__all__ = ["Synchronizer"]


class Synchronizer:
    """init → setup (connect, catch up) → loop (follow the stream, run timers) → cleanup."""

    def __init__(self, cfg: JobConfig, member_id: str):
        self.cfg = cfg
        self.sync_cfg = cfg.synchronizer
        self.me = MemberRef(role=Role.SYNCHRONIZER, id=member_id, incarnation=new_incarnation())
        self.log = structlog.get_logger().bind(job=cfg.job, role="synchronizer", member=member_id)
        self.state = State.initial()
        self.recorded: dict[tuple, int] = {}  # decision_identity -> seq, for decisions already in the stream
        self.round_subject_seq: dict[int, int] = {}  # round -> last seq on its subject
        self.pending: list[Decision] = []  # computed during catch-up, published once caught up
        self.caught_up = False
        self.rejected = 0
        self.decisions_published = 0
        self._last_seen: dict[tuple[str, int], float] = {}  # (member key, incarnation) -> monotonic
        self._expired_sent: set[tuple[str, int]] = set()
        self._timeouts_sent: set[int] = set()
        self._started = time.monotonic()

    # -- setup -------------------------------------------------------------------------------------
    async def run(self) -> None:
        async with connect(self.cfg.nats_url, job=self.cfg.job, role="synchronizer", member=self.me.id,
                           security=self.cfg.nats.security) as conn:
            self.conn = conn
            await ensure_event_stream(conn.js, conn.names)
            await ensure_experience_stream(conn.js, conn.names)
            self.events = EventPublisher(conn, self.me)
            self.decisions = DecisionPublisher(conn)
            await subscribe_heartbeats(conn, self._on_heartbeat)
            end = await last_sequence(conn)
            self.log.info("catching_up", last_seq=end)
            if end == 0:
                await self._mark_caught_up()
            # Announce ourselves: the config we decide with, and that we are up (the dashboard
            # lists synchronizers too). Recorded like any input, so replay sees the same thing.
            await self.events.publish(JobConfigured(member=self.me, config=self.sync_cfg))
            await self.events.publish(
                MemberJoined(member=self.me, host=_hostname(), pid=_pid(), step=0, version=0, ranks=0)
            )
            timers = asyncio.create_task(self._timers(), name="timers")
            beats = asyncio.create_task(self._heartbeat(), name="heartbeat")
            try:
                async with read_events(conn, from_seq=1, include_decisions=True) as reader:  # drops its consumer
                    async for rec in reader:
                        await self._on_record(rec)
                        if not self.caught_up and rec.seq >= end:
                            await self._mark_caught_up()
            finally:
                await stop_task(timers, log=self.log)
                await stop_task(beats, log=self.log)

    async def _mark_caught_up(self) -> None:
        self.caught_up = True
        pending, self.pending = self.pending, []
        published = 0
        for decision in pending:
            if decision_identity(decision) not in self.recorded:
                await self._publish_decision(decision)
                published += 1
        self.log.info("caught_up", seq=self.state.last_seq, members=len(self.state.members),
                      open_rounds=len(self.state.rounds), republished=published)

    # -- loop --------------------------------------------------------------------------------------
    async def _on_record(self, rec: Recorded) -> None:
        event = rec.event
        if isinstance(event, Decision):
            key = decision_identity(event)
            self.recorded[key] = rec.seq
            self.round_subject_seq[event.round] = max(self.round_subject_seq.get(event.round, 0), rec.seq)
            return
        self._last_seen[(event.member.key, event.member.incarnation)] = time.monotonic()
        try:
            self.state, decisions = reduce(self.state, rec)
        except ProtocolError as exc:
            self.rejected += 1
            self.log.warning("event_rejected", seq=rec.seq, kind=event.KIND, member=str(event.member),
                             reason=str(exc))
            return
        for decision in decisions:
            if not self.caught_up:
                self.pending.append(decision)
            elif decision_identity(decision) not in self.recorded:
                await self._publish_decision(decision)

    async def _publish_decision(self, decision: Decision) -> None:
        expected = self.round_subject_seq.get(decision.round, 0)
        seq = await self.decisions.publish(decision, expected_last_subject_seq=expected)
        if seq is not None:
            self.round_subject_seq[decision.round] = max(expected, seq)
            self.decisions_published += 1
        self.log.info("decision", kind=decision.KIND, round=decision.round, cause_seq=decision.cause_seq,
                      seq=seq, **_decision_fields(decision))

    def _on_heartbeat(self, heartbeat) -> None:
        member = heartbeat.member
        self._last_seen[(member.key, member.incarnation)] = time.monotonic()

    async def _heartbeat(self) -> None:
        """Replicas beat too, so a peer synchronizer does not declare us expired."""
        while True:
            try:
                await publish_heartbeat(self.conn, self.me, step=0, version=0, status=RunningStatus.RUNNING)
            except Exception as exc:
                self.log.warning("heartbeat_failed", error=str(exc))
            await asyncio.sleep(self.sync_cfg.heartbeat_period)

    async def _timers(self) -> None:
        """Turn the clock into events: round deadlines and member expiry."""
        period = min(0.25, self.sync_cfg.heartbeat_period / 2)
        while True:
            await asyncio.sleep(period)
            if not self.caught_up:
                continue
            try:
                await self._check_rounds()
                await self._check_members()
            except Exception as exc:  # a publish failing during a reconnect: try again next tick
                self.log.warning("timer_check_failed", error=str(exc))

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
        now = time.monotonic()
        cfg = self.state.config or self.sync_cfg
        for member in list(self.state.members.values()):
            if not member.alive or member.ref == self.me:
                continue
            ident = (member.ref.key, member.ref.incarnation)
            if ident in self._expired_sent:
                continue
            # A member we have not heard from since we started gets one full expiry window.
            last = self._last_seen.get(ident, self._started)
            silent = now - last
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


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _pid() -> int:
    import os

    return os.getpid()
