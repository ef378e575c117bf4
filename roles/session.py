"""What every role process shares: its identity in the job (claimed from the record, joined, rejoined
after an expiry, fenced once a newer incarnation took over), event publishing, heartbeats, and a
live view of the job.

The views (`roles.job_view.JobView`, the trainer's; `roles.member_view.MemberView`, an explorer's)
and the stopping helpers (`roles.stopping`) live in modules of
their own; they are imported from here too, as the role loops always have."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import structlog
from msgspec.structs import replace

from rolectl.bus.archive import read_range
from rolectl.bus.connection import BusConnection, connect
from rolectl.bus.errors import SubjectMoved, describe
from rolectl.bus.events import EventPublisher, last_sequence, publish_heartbeat
from rolectl.bus.files import write_json_atomic  # re-exported: the roles write their state with it
from rolectl.bus.retry import backoff_delay
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.roles.config import JobConfig
from rolectl.roles.identity import Claim, live_member_refusal, pid_running, read_claim
from rolectl.roles.job_view import DECISIONS_KEPT, JobView
from rolectl.roles.member_view import MemberView
from rolectl.roles.resume import StartRefused
from rolectl.roles.stopping import finish_before_stopping, install_stop_signals, stop_task
from rolectl.roles.stream_view import StreamView
from rolectl.roles.waiting import WaitNotice
from rolectl.sync_protocol import (
    Decision,
    EvalFinished,
    Event,
    IllegalEvent,
    MemberJoined,
    MemberRef,
    Recorded,
    Role,
    RunningStatus,
    StatusChanged,
    StepFinished,
    VersionPublished,
)

__all__ = [
    "write_json_atomic", "JobView", "MemberView", "DECISIONS_KEPT", "MemberSession", "install_stop_signals",
    "finish_before_stopping",
    "RoleStopped", "MemberRejoined", "MemberReplaced", "JobIncomplete", "stop_task", "freeze_heap"]


class RoleStopped(Exception):
    """Raised inside a role's loop when it was asked to stop (signal) so cleanup runs."""


class MemberRejoined(Exception):
    """The synchronizer expired this member while it was alive (it was cut off, or starved), and the
    session joined again as a new incarnation: whatever it was waiting for must be asked again."""


class MemberReplaced(Exception):
    """A newer incarnation of this member joined while this process was paused or cut off: it is
    fenced, and stops without training, saving or acking anything more (the exit is non-zero)."""


class JobIncomplete(Exception):
    """The role ended before the job's work was done (the trainer short of `total_steps`, an
    explorer that gave up on a trainer that never came back). The process exits non-zero."""


def freeze_heap() -> None:
    """Keep what the process set up (imports, engine, model) out of Python's cyclic GC from now on.

    A full collection walks every tracked object; with torch and a model loaded that is hundreds of
    thousands, tens of ms at a random moment, and a member in the middle of a sync waits that much
    longer for its answer (seen as 40-90 ms outliers in benchmarks.sync_latency). Frozen objects are
    still freed by reference counting; only cycles among them would stay, and what setup made
    lives as long as the process anyway."""
    gc.freeze()


_JOIN_TRIES = 3  # a join whose guard failed on something that is not another start's join tries again


@dataclass
class MemberSession:
    """A role's connection to its job: identity, publisher, heartbeats and view. Async context manager."""

    cfg: JobConfig
    role: Role
    member_id: str
    ranks: int = 1
    # claimed from the record (roles.identity) by `refuse_if_live` or `join`; 0 until then
    incarnation: int = 0

    step: int = 0
    version: int = -1
    status: RunningStatus = RunningStatus.RUNNING

    conn: BusConnection | None = None
    publisher: EventPublisher | None = None
    view: JobView | MemberView | None = None
    log: structlog.typing.FilteringBoundLogger | None = None
    rejoins: int = 0  # times this process found itself expired and joined again
    _stack: AsyncExitStack | None = None
    _heartbeat_task: asyncio.Task | None = None
    _rejoin_task: asyncio.Task | None = None
    _rejoining: MemberRef | None = None  # the incarnation a rejoin that has not succeeded yet joins as
    _claim: Claim | None = field(default=None, repr=False, compare=False)  # read by refuse_if_live, for join
    _rejoin_claim: Claim | None = field(default=None, repr=False, compare=False)  # _rejoining's
    _me: MemberRef | None = field(default=None, repr=False, compare=False)
    replaced_by: MemberRef | None = None  # set once a newer incarnation of this member joined
    _main_task: asyncio.Task | None = field(default=None, repr=False, compare=False)
    # monotonic time up to which a chain of heartbeats, each within `_trust_s` of the one before,
    # shows this process was not paused: past it, the record is read again before acting (fence)
    _current_at: float = field(default=0.0, repr=False, compare=False)
    # records of ours the fold refused because they landed after our expiry (or after our rejoin
    # overtook them), to be said again by the incarnation we joined as (see _note_refused)
    _refused: list[Event] = field(default_factory=list, repr=False, compare=False)
    _ours: set[int] = field(default_factory=set, repr=False, compare=False)  # incarnations of this process
    _republishing: set[asyncio.Task] = field(default_factory=set, repr=False, compare=False)

    @property
    def me(self) -> MemberRef:
        """Who we are now. Built again only when the incarnation changed (a rejoin): every event
        we publish and every decision we look for asks."""
        ref = self._me
        if ref is None or ref.incarnation != self.incarnation or ref.id != self.member_id or ref.role is not self.role:
            ref = self._me = MemberRef(role=self.role, id=self.member_id, incarnation=self.incarnation)
        return ref

    @property
    def key(self) -> str:
        """`role/id`: this member's name across incarnations (as `MemberRef.key`)."""
        return f"{self.role.value}/{self.member_id}"

    async def __aenter__(self) -> MemberSession:
        self.log = structlog.get_logger().bind(job=self.cfg.job, role=self.role.value, member=self.member_id)
        self._stack = AsyncExitStack()
        self.conn = await self._stack.enter_async_context(
            connect(self.cfg.nats_url, job=self.cfg.job, role=self.role.value, member=self.member_id,
                    security=self.cfg.nats.security)
        )
        try:
            await ensure_event_stream(self.conn.js, self.conn.names, replicas=self.cfg.nats.replicas)
            await ensure_experience_stream(self.conn.js, self.conn.names, replicas=self.cfg.nats.replicas)
        except BaseException:  # __aexit__ does not run when __aenter__ raises: close what we opened
            await self._stack.aclose()
            raise
        self.publisher = EventPublisher(self.conn, self.me)
        archive = self.cfg.event_archive_dir
        backfill = lambda first, last: read_range(archive, first, last)  # noqa: E731
        # an explorer reads only its own scope (its cost per round does not grow with the fleet);
        # the trainer waits for every explorer and reads the whole job
        self.view = (MemberView(self.conn, [self.member_id], log=self.log, backfill=backfill)
                     if self.role is Role.EXPLORER else JobView(self.conn, log=self.log, backfill=backfill))
        self.view.on_refused = self._note_refused
        return self

    async def join(self, *, step: int, version: int) -> int:
        """Announce the config this member runs with and that it is up; start heartbeats.

        The join claims this start's incarnation (see roles.identity): it is stored only if no
        other start joined since the claim was read, else `StartRefused` names the one that did.
        The view must be following the stream (`view.start()`)."""
        self.step, self.version = step, version
        for _ in range(_JOIN_TRIES):
            claim = self._claim or await self._read_claim()
            self._claim = None
            self.incarnation = claim.incarnation
            self.publisher = EventPublisher(self.conn, self.me)
            # the same msg id in two racing starts of this incarnation: stored once, either way
            await self.publish(self.cfg.job_configured(self.me))
            try:
                seq = await self.publisher.publish(self._joined(), msg_id=claim.join_msg_id(self.me),
                                                   expected_last_subject_seq=claim.guard)
                break
            except SubjectMoved:
                await self._refuse_raced(claim)  # returns when what came first was no other start's join
        else:
            raise StartRefused(f"{self.key} of job {self.cfg.job!r}: its join subject kept changing under "
                               f"{_JOIN_TRIES} tries to join; something else publishes there")
        self._ours.add(self.incarnation)
        self.status = RunningStatus.RUNNING
        self._main_task = asyncio.current_task()
        self._current_at = time.monotonic()
        self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="heartbeat")
        self._rejoin_task = asyncio.create_task(self._rejoin_when_expired(), name="rejoin")
        freeze_heap()  # set up: from here on a sync's answer should not wait for a full collection
        self.log.info("joined", step=step, version=version, incarnation=self.incarnation, seq=seq)
        return seq

    async def publish(self, event: Event) -> int:
        return await self.publisher.publish(event)

    def _joined(self, ref: MemberRef | None = None) -> MemberJoined:
        return MemberJoined(member=ref or self.me, host=socket.gethostname(), pid=os.getpid(), step=self.step,
                            version=self.version, ranks=self.ranks)

    async def _read_claim(self) -> Claim:
        """The incarnation this start (or rejoin) claims: read the member's join subject, then fold
        the record at least that far, so the claim's guard and the fold (who is alive) agree."""
        claim = await read_claim(self.conn, self.role, self.member_id)
        await self.view.read_to(claim.guard, timeout=self.cfg.synchronizer.sync_timeout,
                                what=f"the job's record up to this member's last join (seq {claim.guard})")
        member = self.view.member_state(self.key)
        return claim.after(member.ref.incarnation if member else None, *self._ours)

    async def _refuse_raced(self, claim: Claim) -> None:
        """Our join lost its compare-and-set: raise `StartRefused` naming the start that joined
        first; return (try again) when what moved the subject holds no newer incarnation (junk)."""
        await self._read_to_end("after another start joined first")
        member = self.view.member_state(self.key)
        if member is None or member.ref.incarnation < claim.incarnation:
            self.log.warning("join_subject_moved", incarnation=claim.incarnation, guard=claim.guard)
            return
        joined = await self.view.joined_event(self.key)
        if member.alive:
            raise StartRefused(live_member_refusal(
                member.ref, job=self.cfg.job, joined=joined, host=member.host, step=member.step,
                expiry=self.cfg.synchronizer.heartbeat_expiry, lead="another start of it joined first: "))
        raise StartRefused(f"{self.role.value} {self.member_id!r} of job {self.cfg.job!r}: another start joined "
                           f"first (incarnation {member.ref.incarnation}) and has left since; start again to "
                           "resume after it")

    def expired(self, view: StreamView) -> bool:
        """True when the job's record says our current incarnation left, and we did not stop:
        the synchronizer expired us (it could not hear us for `heartbeat_expiry`)."""
        member = view.member_state(self.key)
        return (member is not None and member.ref.incarnation == self.incarnation and not member.alive
                and self.status is not RunningStatus.STOPPED)

    async def refuse_if_live(self) -> None:
        """Claim this start's incarnation (see roles.identity) and raise `StartRefused` when the
        job's record shows this member alive in another process: two live trainers train the same
        steps twice. A restart goes on: the old incarnation stopped, expired, or (on this host) its
        process is gone although not yet expired. A start that passes here and is overtaken by
        another one's join before its own is refused by `join` (the claim's guard)."""
        claim = await self._read_claim()
        member = self.view.member_state(self.key)
        if member is not None and member.alive:
            joined = await self.view.joined_event(self.key)
            if joined is None or joined.host != socket.gethostname() or pid_running(joined.pid):
                raise StartRefused(live_member_refusal(member.ref, job=self.cfg.job, joined=joined, host=member.host,
                                                       step=member.step, expiry=self.cfg.synchronizer.heartbeat_expiry))
            self.log.info("previous_process_gone", incarnation=member.ref.incarnation, pid=joined.pid)
        self._claim = claim
        self.incarnation = claim.incarnation
        self.publisher = EventPublisher(self.conn, self.me)

    def replaced(self, view: StreamView) -> bool:
        """True when the record's current incarnation of this member is newer than ours, and not
        the join this very process made for its rejoin (see `_our_pending_join`)."""
        member = view.member_state(self.key)
        return member is not None and member.ref.incarnation > self.incarnation \
            and not self._our_pending_join(view)

    def _our_pending_join(self, view: StreamView) -> bool:
        """The record's current incarnation is the one a rejoin of ours is still trying (its join
        stored, its ack lost), joined from this host and pid: not an identity another process has."""
        joined = view.joins.get(self.key)
        member = view.member_state(self.key)
        return (self._rejoining is not None and joined is not None and member is not None
                and joined.member == self._rejoining == member.ref
                and joined.host == socket.gethostname() and joined.pid == os.getpid())

    @property
    def _trust_s(self) -> float:
        # Half the expiry: within it, no synchronizer can have expired us, so no replacement joined.
        return self.cfg.synchronizer.heartbeat_expiry / 2

    async def fence(self) -> None:
        """Before an act with effects outside the stream (train a step, save, ack, publish
        experiences): raise `MemberReplaced` if a newer incarnation took over. After a pause
        (SIGSTOP, a starved loop, a long disconnect) the record is read to its end first, so a
        process that comes back learns it was replaced before it acts."""
        if self.replaced_by is None and time.monotonic() - self._current_at > self._trust_s:
            await self._read_to_end("checked after a pause")
            if self.replaced(self.view):
                self._note_replaced()
            else:
                self._current_at = time.monotonic()
        if self.replaced_by is not None:
            raise MemberReplaced(self._replaced_message())

    async def _read_to_end(self, why: str) -> None:
        """Fold the job's record up to its end as of now; a server away (restarting) is waited for
        as every other part of the role waits for it."""
        patience = self.cfg.synchronizer.sync_timeout
        end = await last_sequence(self.conn, patience_s=patience)
        await self.view.read_to(end, timeout=patience, what=f"the job's record up to seq {end} ({why})")

    def _note_replaced(self) -> None:
        if self.replaced_by is None:
            self.replaced_by = self.view.member_state(self.key).ref
            self.log.error("replaced_by_newer_incarnation", incarnation=self.incarnation,
                           new_incarnation=self.replaced_by.incarnation, hint=self._replaced_message())

    def _replaced_message(self) -> str:
        joined = self.view.joins.get(self.key)
        where = f" (pid {joined.pid} on host {joined.host})" if joined is not None else ""
        return (f"{self.role.value} {self.member_id!r}: incarnation {self.incarnation} was replaced by "
                f"incarnation {self.replaced_by.incarnation}{where} while this process was paused or cut off; "
                "it stops without training, saving or acking anything more")

    async def _rejoin_when_expired(self) -> None:
        """Expiry is not a death sentence: an expired member that is alive joins again as a new
        incarnation, keeping its step and version, and carries on — unless a newer incarnation
        joined meanwhile (a restart replaced us): then this process is fenced and its role stops.
        A try that fails (the server away or still recovering its streams: expiry comes with
        outages) is tried again; the member stays expired, and says so, until one succeeds."""
        failures = 0
        period = self.cfg.synchronizer.heartbeat_period
        while True:
            await self.view.wait_for(lambda v: self.expired(v) or self.replaced(v) or self._rejoining is not None,
                                     timeout=None, what="our own expiry or replacement", wake_on=self.key)
            try:
                if await self._rejoin_or_stop():
                    return
                failures = 0
            except Exception as exc:
                self.log.warning("rejoin_failed", incarnation=self.incarnation, error=describe(exc),
                                 hint="tried again in a moment")
                # a pause between tries, not a wait; jittered and growing, so a fleet back from a
                # server restart does not rejoin in one burst
                await asyncio.sleep(backoff_delay(failures, base=period, cap=8 * period))
                failures += 1

    async def _rejoin_or_stop(self) -> bool:
        """One try at `_rejoin_when_expired`: True when a newer incarnation replaced us (stop)."""
        if not self.replaced(self.view):
            # the replacement may be recorded already and not yet folded: read to the end first
            await self._read_to_end("before rejoining")
        if self.replaced(self.view):
            self._note_replaced()
            if self._main_task is not None and not self._main_task.done():
                self._main_task.cancel()
            return True
        if self.expired(self.view) or self._rejoining is not None:
            await self._rejoin()
        return False

    async def _rejoin(self) -> None:
        """Join again as a new incarnation, keeping step and version. A try that failed is repeated
        as the same incarnation with the same message ids: a join stored before its ack was lost
        is stored once, and is ours."""
        old = self.me
        if self._rejoining is None or self._rejoin_claim is None:
            self._rejoin_claim = await self._read_claim()  # the next incarnation, as a start claims it
            self._rejoining = MemberRef(role=self.role, id=self.member_id, incarnation=self._rejoin_claim.incarnation)
        new, claim = self._rejoining, self._rejoin_claim
        # Joined first, switched after: anything this process says from now on comes from an
        # incarnation already in the record (a waiter asking again must not overtake the join).
        publisher = EventPublisher(self.conn, new)
        await publisher.publish(self.cfg.job_configured(new))
        try:
            await publisher.publish(self._joined(new), msg_id=claim.join_msg_id(new),
                                    expected_last_subject_seq=claim.guard)
        except SubjectMoved:
            # another start joined meanwhile: the next try finds us replaced, or claims after it
            self._rejoining = self._rejoin_claim = None
            raise
        self._rejoining = self._rejoin_claim = None
        self._ours.add(new.incarnation)
        self.incarnation, self.publisher = new.incarnation, publisher
        self.status = RunningStatus.RUNNING
        self.rejoins += 1
        self.log.warning("rejoined_after_expiry", expired_incarnation=old.incarnation,
                         incarnation=self.incarnation, step=self.step, version=self.version,
                         rejoins=self.rejoins)
        self._republish_refused()

    # Facts about work this process did (a step trained or explored, an eval, a version stored): a
    # record of one that lands after our expiry is refused by the fold, yet the work happened (the
    # experiences were acked, the bytes stored). The new incarnation records it again, or the job's
    # accounting (experiences trained, produced) would miss it. Requests are not here: a waiter
    # asks again itself (MemberRejoined).
    _REPUBLISHED = (StepFinished, EvalFinished, VersionPublished)

    def _note_refused(self, rec: Recorded, error: IllegalEvent) -> None:
        event = rec.event
        if (isinstance(event, self._REPUBLISHED) and event.member.key == self.key
                and event.member.incarnation in self._ours and self.replaced_by is None):
            self.log.warning("record_refused_after_expiry", seq=rec.seq, kind=event.KIND, reason=str(error))
            self._refused.append(event)
            del self._refused[:-64]  # bounded: a rejoin follows within one expiry
            self._republish_refused()

    def _republish_refused(self) -> None:
        """Say again, as the incarnation we are now, what the fold refused from an older one of ours
        (one still expired waits for its rejoin)."""
        ready = [e for e in self._refused if e.member.incarnation < self.incarnation]
        if not ready or self.replaced_by is not None:
            return
        self._refused = [e for e in self._refused if e.member.incarnation >= self.incarnation]
        task = asyncio.get_running_loop().create_task(self._republish(ready), name="republish")
        self._republishing.add(task)
        task.add_done_callback(self._republishing.discard)

    async def _republish(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, VersionPublished) and event.version <= self.view.latest.version:
                continue  # published again meanwhile (the trainer's next sync does)
            try:
                seq = await self.publish(replace(event, member=self.me))
            except Exception as exc:  # the server away: the job's accounting misses it, the work stands
                self.log.warning("republish_failed", kind=event.KIND, error=describe(exc))
                continue
            self.log.info("republished_after_rejoin", kind=event.KIND, seq=seq, incarnation=self.incarnation)

    async def wait_decision(self, match: Callable[[Decision], object], *, after: int, what: str,
                            give_up: Callable[[StreamView], str | None] | None = None,
                            detail: Callable[[], str | None] | None = None):
        """Wait for the synchronizer's decision about our request: the first decision recorded
        after stream sequence `after` (our request) for which `match(decision)` is truthy, and
        return that value; None if none ever comes. `match` is shown the decisions that name this
        member and those that name no one member (a `RendezvousReady` names its group).

        The synchronizer answers by `sync_timeout` at the latest (a timed-out round releases us).
        Silence beyond that (plus a grace period) means no synchronizer is running: withdraw the
        request and go on with the weights we have, like the reference on a failed sync.
        A wait that lasts logs what it waits for, with `detail()` (see `WaitNotice`).
        Raises `MemberRejoined` when we were expired meanwhile (ask again as the new incarnation),
        and `JobIncomplete` when `give_up(view)` says why waiting is pointless (checked every few
        seconds: it may depend on time alone, like a trainer gone longer than its grace).
        """
        incarnation = self.incarnation
        rejoined = object()
        outcome = self.view.first_decision(after, match, about=self.key)

        def decided(view: StreamView):
            if self.incarnation != incarnation:
                return rejoined
            return outcome(view)

        with WaitNotice(self.log, what, detail=detail):
            return await self._wait_decision(decided, rejoined, what=what, give_up=give_up)

    async def _wait_decision(self, decided, rejoined, *, what: str, give_up):
        deadline = time.monotonic() + self.cfg.synchronizer.sync_timeout + 30
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.log.warning("sync_decision_timed_out", what=what,
                                 waited_s=self.cfg.synchronizer.sync_timeout + 30)
                await self.set_status(RunningStatus.RUNNING)
                return None
            try:
                result = await self.view.wait_for(decided, timeout=min(remaining, 2.0), what=what, announce=False,
                                                  wake_on=self.key)
            except TimeoutError:
                reason = give_up(self.view) if give_up is not None else None
                if reason:
                    await self.set_status(RunningStatus.RUNNING)
                    raise JobIncomplete(reason) from None
                continue
            if result is rejoined:
                raise MemberRejoined(f"expired while waiting for {what}; joined again as incarnation "
                                     f"{self.incarnation}")
            return result

    async def set_status(self, status: RunningStatus, *, rendezvous: str | None = None,
                         final: bool = False, metrics: dict[str, float] | None = None,
                         interrupted: bool = False) -> int:
        self.status = status
        return await self.publish(
            StatusChanged(member=self.me, status=status, step=self.step, version=self.version,
                          rendezvous=rendezvous, final=final, metrics=metrics or {}, interrupted=interrupted)
        )

    async def _heartbeat(self) -> None:
        # a large fleet beats less often, so the synchronizer hears a bounded number a second
        period = self.cfg.synchronizer.beat_period(self.cfg.explorers.count + 1)
        while True:
            started = time.monotonic()
            try:
                await publish_heartbeat(self.conn, self.me, step=self.step, version=self.version,
                                        status=self.status)
            except Exception as exc:  # a disconnect must not kill the role; the client reconnects
                self.log.warning("heartbeat_failed", error=describe(exc))
            else:
                # only a beat close to the last trusted one extends the trust: after a pause the
                # fence reads the record instead (a beat then says nothing about what happened)
                if started - self._current_at <= self._trust_s:
                    self._current_at = started
            await asyncio.sleep(period)

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            await self._close()
        finally:
            if self.replaced_by is not None and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
                # cancelled by our own fence, not by a signal: say why the role stopped
                if hasattr(self._main_task, "uncancel"):  # Python 3.11+: this cancel was ours, handled
                    self._main_task.uncancel()
                raise MemberReplaced(self._replaced_message())

    async def _close(self) -> None:
        for task in list(self._republishing):
            await stop_task(task, log=self.log)
        if self._rejoin_task is not None:
            await stop_task(self._rejoin_task, log=self.log)
        if self._heartbeat_task is not None:
            await stop_task(self._heartbeat_task, log=self.log)
        if self.view is not None:
            await self.view.aclose()
        if self._stack is not None:
            await self._stack.aclose()
