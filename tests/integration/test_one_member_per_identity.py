"""One identity, one member, on a real nats-server: two starts of one member that read the same record
(the wall clock frozen, so the old millisecond incarnations were equal) give exactly one member and
one refusal naming it, for trainers, explorers and synchronizer replicas; a restart on a host whose
clock runs behind, after a record of the old numbering, is still the newer incarnation; and the
join's guard finds its own stored try when an ack was lost."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from rolectl.bus.connection import connect
from rolectl.bus.errors import SubjectMoved
from rolectl.bus.events import EventPublisher, read_all
from rolectl.bus.streams import ensure_event_stream
from rolectl.roles.config import parse_config
from rolectl.roles.resume import StartRefused
from rolectl.roles.session import MemberSession
from rolectl.roles.stopping import stop_task
from rolectl.roles.synchronizer import Synchronizer
from rolectl.sync_protocol import (
    JobConfigured,
    MemberExpired,
    MemberJoined,
    MemberRef,
    Role,
    RunningStatus,
    StatusChanged,
)
from tests.support.wait import wait_until

FROZEN_NS = 1_764_000_000_123_456_789  # the same clock reading for every start
OLD_NUMBERING = 1_790_000_000_000  # an incarnation an old build wrote (ms), ahead of the frozen clock


def _config(nats_url: str, job: str, tmp_path):
    return parse_config({"job": job, "nats_url": nats_url, "run_dir": str(tmp_path),
                         "synchronizer": {"sync_method": "memory", "heartbeat_expiry": 600,
                                          "heartbeat_period": 0.2}})


@pytest.fixture
def frozen_clock(monkeypatch):
    """Every start reads the same wall-clock time (what two starts in one millisecond see)."""
    monkeypatch.setattr(time, "time_ns", lambda: FROZEN_NS)


async def _joins(conn, role: Role, member_id: str) -> list[MemberJoined]:
    return [r.event for r in await read_all(conn)
            if isinstance(r.event, MemberJoined) and r.event.member.key == f"{role.value}/{member_id}"]


@pytest.mark.parametrize("role", [Role.TRAINER, Role.EXPLORER])
async def test_two_starts_with_the_same_clock_reading_give_one_member_and_one_refusal(
        nats_url, job_name, tmp_path, frozen_clock, role):
    cfg = _config(nats_url, job_name, tmp_path)
    member_id = f"{role.value}-x"
    checked = asyncio.Barrier(2)

    async def start(session: MemberSession) -> int:
        await session.view.start()
        await session.refuse_if_live()  # both pass: neither has joined yet
        await checked.wait()  # ... and both join now, from the same record
        return await session.join(step=0, version=0)

    async with MemberSession(cfg, role, member_id) as first, MemberSession(cfg, role, member_id) as second:
        outcomes = await asyncio.gather(start(first), start(second), return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, StartRefused)]
        joined = [s for s, o in zip((first, second), outcomes) if isinstance(o, int)]
        assert len(joined) == 1 and len(refused) == 1, outcomes
        (winner,) = joined
        message = str(refused[0])
        assert f"{role.value} '{member_id}' of job '{job_name}' is already running" in message, message
        assert f"pid {os.getpid()} on host {socket.gethostname()}, incarnation {winner.incarnation}" in message
        assert "another start of it joined first" in message
        joins = await _joins(winner.conn, role, member_id)
        assert [j.member for j in joins] == [winner.me]
        member = winner.view.member_state(winner.key)  # an explorer reads its MemberView
        assert member.alive and member.ref == winner.me


async def test_a_restart_on_a_host_whose_clock_runs_behind_is_newer_than_an_old_numbering_record(
        nats_url, job_name, tmp_path, frozen_clock):
    """The record holds a trainer of the old numbering (a timestamp ahead of this host's clock) that
    stopped; the restart takes the next incarnation and the fold takes it as alive, its rejoin the one
    after that."""
    cfg = _config(nats_url, job_name, tmp_path)
    old = MemberRef(role=Role.TRAINER, id="trainer", incarnation=OLD_NUMBERING)
    async with MemberSession(cfg, Role.TRAINER, "trainer") as session:
        before = EventPublisher(session.conn, old)
        await before.publish(JobConfigured(member=old, config=cfg.synchronizer))
        await before.publish(MemberJoined(member=old, host="elsewhere", pid=1, step=0, version=0))
        await before.publish(StatusChanged(member=old, status=RunningStatus.STOPPED, step=0, version=0))
        await session.view.start()
        await session.refuse_if_live()
        await session.join(step=0, version=0)
        assert session.incarnation == OLD_NUMBERING + 1
        member = await session.view.wait_for(lambda v: v.state.members[session.key].ref == session.me
                                             and v.state.members[session.key], timeout=30,
                                             what="the restart folded as the member's live incarnation")
        assert member.alive

        clock = MemberRef(role=Role.SYNCHRONIZER, id="sync-0", incarnation=1)
        await EventPublisher(session.conn, clock).publish(
            MemberExpired(member=clock, expired=session.me, silent_for=5.0))
        await wait_until(lambda: session.rejoins == 1, timeout=30, what="the rejoin after the expiry")
        assert session.incarnation == OLD_NUMBERING + 2
        assert session.view.state.members[session.key].alive


async def test_two_synchronizer_starts_of_one_replica_id_give_one_member(nats_url, job_name, tmp_path, frozen_clock):
    """Two `rolectl start sync --id sync-0` at once: one runs, the other is refused naming it and
    records nothing; after the one running stops, the next start of the id takes the next incarnation."""
    cfg = _config(nats_url, job_name, tmp_path)
    first, second = Synchronizer(cfg, "sync-0", keep_running=True), Synchronizer(cfg, "sync-0", keep_running=True)
    tasks = {asyncio.create_task(s.run(), name=f"sync-{i}"): s for i, s in enumerate((first, second))}
    try:
        done, _ = await asyncio.wait(tasks, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        assert done, "neither start was refused"
        (ended,) = done
        with pytest.raises(StartRefused) as refused:
            ended.result()
        running = next(s for t, s in tasks.items() if t is not ended)
        await wait_until(lambda: running.me.incarnation > 0 and running.state.members.get(running.me.key),
                         timeout=30, what="the running one to fold its own join")
        message = str(refused.value)
        assert f"synchronizer 'sync-0' of job '{job_name}' is already running" in message, message
        assert f"pid {os.getpid()} on host {socket.gethostname()}, incarnation {running.me.incarnation}" in message
    finally:
        for task in tasks:
            await stop_task(task)  # the running one records its STOPPED
    third = Synchronizer(cfg, "sync-0", keep_running=True)
    task = asyncio.create_task(third.run(), name="sync-again")
    try:
        await wait_until(lambda: third.state.members.get(third.me.key) is not None and third.me.incarnation > 0,
                         timeout=30, what="the next start of sync-0 to join")
        assert third.me.incarnation == running.me.incarnation + 1
        joins = await _joins(third.conn, Role.SYNCHRONIZER, "sync-0")
        assert [j.member for j in joins] == [running.me, third.me]
        stops = [r.event for r in await read_all(third.conn)
                 if isinstance(r.event, StatusChanged) and r.event.member.role is Role.SYNCHRONIZER]
        assert [s.member for s in stops] == [running.me]  # the refused start recorded nothing
    finally:
        await stop_task(task)


async def test_a_guarded_join_whose_ack_was_lost_is_found_stored_and_another_is_refused(nats_url, job_name):
    ref = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1)
    joined = MemberJoined(member=ref, host="h", pid=1, step=0, version=-1)
    async with connect(nats_url, job=job_name, role="observer", member="test") as conn:
        await ensure_event_stream(conn.js, conn.names)
        publisher = EventPublisher(conn, ref)
        seq = await publisher.publish(joined, msg_id="explorer/explorer-0#1/joined.a", expected_last_subject_seq=0)
        # the same message again with the guard it was sent with: the server refuses the guard
        # before it looks at the msg id, and the publisher finds the message as its own
        again = await publisher.publish(joined, msg_id="explorer/explorer-0#1/joined.a", expected_last_subject_seq=0)
        assert again == seq
        with pytest.raises(SubjectMoved, match="does not end at seq 0"):
            await publisher.publish(joined, msg_id="explorer/explorer-0#1/joined.b", expected_last_subject_seq=0)
        assert len(await _joins(conn, Role.EXPLORER, "explorer-0")) == 1
