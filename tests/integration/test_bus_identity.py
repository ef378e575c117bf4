"""Verified identity against a real nats-server: the reader rejects records whose subject does not
vouch for their payload, heartbeats that claim another member are dropped, export keeps the real
subject and `replay --check` names the forged record."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from rolectl.bus.connection import connect
from rolectl.bus.events import EventPublisher, publish_heartbeat, read_all, read_events, subscribe_heartbeats
from rolectl.bus.logging import setup_logging
from rolectl.bus.streams import ensure_event_stream
from rolectl.bus.subjects import identity_problem
from rolectl.roles.observe.replay import check_decisions, export_job, load_export, run_replay
from rolectl.sync_protocol import (
    MemberRef,
    Role,
    RoundClosed,
    RoundOutcome,
    RunningStatus,
    StatusChanged,
    StepFinished,
    SyncMethod,
    VersionPublished,
    encode,
)

TRAINER = MemberRef(role=Role.TRAINER, id="trainer", incarnation=1)
EXPLORER = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1)


def _forged_version(version: int = 1_000_000) -> VersionPublished:
    return VersionPublished(member=TRAINER, version=version, step=version, method=SyncMethod.MEMORY,
                            location="junk", nbytes=1, digest="x")


@pytest.fixture
async def conn(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="explorer", member="explorer-0") as c:
        await ensure_event_stream(c.js, c.names)
        yield c


async def _publish_forgeries(conn) -> list[int]:
    """Each kind of forgery once; returns their stream sequences."""
    names = conn.names
    forged = [
        # an explorer speaking as the trainer, on its own subject (the attack of issue #10)
        (names.event("explorer", "explorer-0", "version_published"), encode(_forged_version())),
        # the right member, the subject of another kind
        (names.event("trainer", "trainer", "step_finished"), encode(_forged_version(7))),
        # a decision on an event subject, and on another round's subject
        (names.event("explorer", "explorer-0", "round_closed"),
         encode(RoundClosed(round=1, cause_seq=1, outcome=RoundOutcome.COMPLETED))),
        (names.decision(2), encode(RoundClosed(round=1, cause_seq=1, outcome=RoundOutcome.COMPLETED))),
        # an input on a decision subject
        (names.decision(1), encode(StepFinished(member=EXPLORER, step=1, version=0))),
    ]
    return [(await conn.js.publish(subject, payload)).seq for subject, payload in forged]


@pytest.mark.parametrize(
    "subject, event, ok",
    [
        ("rft.j.evt.trainer.trainer.version_published", _forged_version(), True),
        ("rft.j.evt.explorer.explorer-0.version_published", _forged_version(), False),
        ("rft.j.evt.trainer.trainer.step_finished", _forged_version(), False),
        ("rft.j.sync.log", RoundClosed(round=3, cause_seq=1, outcome=RoundOutcome.COMPLETED), True),
        ("rft.j.sync.log", RoundClosed(round=4, cause_seq=1, outcome=RoundOutcome.COMPLETED), True),
        ("rft.j.sync.log.3", RoundClosed(round=3, cause_seq=1, outcome=RoundOutcome.COMPLETED), False),
        ("rft.j.sync.log", StepFinished(member=EXPLORER, step=1, version=0), False),
        # a round's own subject: where builds before schema 4 recorded its decisions
        ("rft.j.sync.3", RoundClosed(round=3, cause_seq=1, outcome=RoundOutcome.COMPLETED), True),
        ("rft.j.sync.4", RoundClosed(round=3, cause_seq=1, outcome=RoundOutcome.COMPLETED), False),
        ("rft.j.evt.synchronizer.s.round_closed", RoundClosed(round=3, cause_seq=1, outcome=RoundOutcome.COMPLETED),
         False),
        ("rft.j.sync.3", StepFinished(member=EXPLORER, step=1, version=0), False),
        ("rft.j.evt.explorer.explorer-0.step_finished.extra", StepFinished(member=EXPLORER, step=1, version=0),
         False),
    ],
)
def test_identity_problem_accepts_only_what_the_subject_vouches_for(subject, event, ok):
    problem = identity_problem(subject, event)
    assert (problem is None) == ok, problem
    if not ok:
        assert subject in problem  # the message names where it was published


async def test_reader_rejects_forged_records_before_the_fold_and_counts_them(conn):
    real = [StatusChanged(member=EXPLORER, status=RunningStatus.RUNNING, step=0, version=0),
            StepFinished(member=EXPLORER, step=1, version=0)]
    pub = EventPublisher(conn, EXPLORER)
    await pub.publish(real[0])
    forged_seqs = await _publish_forgeries(conn)
    await pub.publish(real[1])

    reader = read_events(conn, stop_at_end=True)
    async with reader:
        records = [rec async for rec in reader]

    assert [r.event for r in records] == real
    assert reader.rejected == len(forged_seqs) and reader.malformed == 0
    assert [r.subject for r in records] == [conn.names.event("explorer", "explorer-0", e.KIND) for e in real]


async def test_export_keeps_the_real_subject_and_replay_check_names_the_forged_record(conn, nats_url, tmp_path,
                                                                                    capsys):
    pub = EventPublisher(conn, EXPLORER)
    await pub.publish(StepFinished(member=EXPLORER, step=1, version=0))
    forged_seq = (await conn.js.publish(conn.names.event("explorer", "explorer-0", "version_published"),
                                        encode(_forged_version()))).seq

    # Every record, forged ones included, with the subject the stream recorded.
    everything = await read_all(conn, verify_identity=False)
    assert [r.seq for r in everything][-1] == forged_seq
    path = tmp_path / "events.jsonl"
    assert await export_job(conn.names.job, nats_url, path) == 2
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[1]["subject"] == conn.names.event("explorer", "explorer-0", "version_published")
    assert rows[1]["event"]["member"]["role"] == "trainer"  # the payload's claim, kept as evidence

    [mismatch] = check_decisions(load_export(path))
    assert mismatch.kind == "subject" and mismatch.seq == forged_seq and not mismatch.warning
    assert await asyncio.to_thread(run_replay, job=None, nats=nats_url, file=path, until=None, check=True,
                                   as_json=False) == 1
    assert f"seq {forged_seq}:" in capsys.readouterr().out


async def test_a_heartbeat_claiming_another_member_is_dropped(conn):
    got: asyncio.Queue = asyncio.Queue()
    sub = await subscribe_heartbeats(conn, got.put)
    async with sub:
        # explorer-0's connection beats on its own subject but claims to be the trainer ...
        await publish_heartbeat(conn, TRAINER, step=9, version=9, status="running", host="h")
        forged_subject = conn.names.heartbeat("explorer", "explorer-0")
        from rolectl.bus.events import Heartbeat, encode_heartbeat

        await conn.nc.publish(forged_subject, encode_heartbeat(
            Heartbeat(member=TRAINER, step=9, version=9, status=RunningStatus.RUNNING, host="h")))
        # ... then beats as itself.
        await publish_heartbeat(conn, EXPLORER, step=1, version=0, status="running", host="h")
        first = await asyncio.wait_for(got.get(), 5)
        second = await asyncio.wait_for(got.get(), 5)

    # The trainer's own subject carries the first (publish_heartbeat picks the subject from the
    # member: it is the server's permissions that stop an explorer from using it); the forged one
    # on explorer-0's subject never reaches the callback.
    assert [first.member, second.member] == [TRAINER, EXPLORER]
    assert sub.forged == 1 and sub.received == 2


async def test_a_flood_of_junk_costs_a_few_log_lines(nats_url, job_name):
    captured = io.StringIO()
    setup_logging("info", stream=captured)
    async with connect(nats_url, job=job_name, role="observer", member="o") as conn:
        await ensure_event_stream(conn.js, conn.names)
        subject = conn.names.event("explorer", "explorer-0", "step_finished")
        forged = encode(_forged_version())
        for i in range(300):
            await conn.js.publish(subject, b"\xc1junk" if i % 2 else forged)
        reader = read_events(conn, stop_at_end=True)
        async with reader:
            assert [rec async for rec in reader] == []
    assert (reader.malformed, reader.rejected) == (150, 150)
    lines = [json.loads(line) for line in captured.getvalue().splitlines() if line.startswith("{")]
    warnings = [x for x in lines if x["event"].startswith(("bus.event_malformed", "bus.event_rejected"))]
    # The first 10 of each in full; the rest only in summaries (at most one per 30 s per kind).
    assert len([x for x in warnings if x["event"] == "bus.event_malformed"]) == 10
    assert len([x for x in warnings if x["event"] == "bus.event_rejected"]) == 10
    assert len(warnings) <= 22
