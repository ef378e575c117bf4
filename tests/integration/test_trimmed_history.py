"""A history trimmed under a lagging reader, on a real nats-server (found by the chaos soak: a
synchronizer replica paused past a trim folded over the hole and recorded a second outcome for a
round): a reader behind the trim reads the trimmed records back from the archive, a synchronizer
starting behind it decides what the stream says, and a snapshot never replaces a newer one."""

from __future__ import annotations

import asyncio

import pytest

from rolectl.bus.archive import archive_and_trim, read_range, segments
from rolectl.bus.connection import connect
from rolectl.bus.errors import HistoryGap
from rolectl.bus.events import EventPublisher, EventReader, read_events
from rolectl.bus.snapshots import SnapshotStore
from rolectl.bus.streams import ensure_event_stream
from rolectl.bus.subjects import subject_matches
from rolectl.roles.config import parse_config
from rolectl.roles.observe.check import check_decisions
from rolectl.roles.observe.export import read_history
from rolectl.roles.synchronizer import Synchronizer
from rolectl.sync_protocol import Decision, MemberRef, Role, StepFinished
from rolectl.sync_protocol.reducer import fold_lenient
from rolectl.sync_protocol.snapshot import encode_state
from tests.support.scripted_job import run_scripted_job


def _config(nats_url: str, job: str, run_dir) -> object:
    return parse_config({"job": job, "nats_url": nats_url, "run_dir": str(run_dir),
                         "synchronizer": {"sync_method": "memory", "heartbeat_expiry": 600, "sync_timeout": 600,
                                          "snapshot_every": 10}})


async def test_a_reader_behind_a_trim_reads_the_trimmed_records_back_from_the_archive(nats_url, job_name, tmp_path):
    await run_scripted_job(nats_url, job_name, steps=6, snapshot_every=10, run_dir=str(tmp_path))
    archive = tmp_path / job_name / "archive"
    async with connect(nats_url, job=job_name, role="observer", member="trim-test") as conn:
        first = (await conn.js.stream_info(conn.names.event_stream)).state.first_seq
        assert first > 2 and segments(archive), "the job did not trim its stream"
        history = await read_history(conn, archive)
        async with read_events(conn, from_seq=1, stop_at_end=True,
                               backfill=lambda a, b: read_range(archive, a, b)) as reader:
            read = [rec async for rec in reader]
        assert [(r.seq, r.event) for r in read] == [(r.seq, r.event) for r in history]
        assert reader.backfilled >= first - 1
        # an archive that lacks the trimmed stretch: the reader stops, naming it, instead of skipping it
        empty = tmp_path / "elsewhere"
        with pytest.raises(HistoryGap, match=f"records 1..{first - 1}"):
            async with read_events(conn, from_seq=1, stop_at_end=True,
                                   backfill=lambda a, b: read_range(empty, a, b)) as reader:
                [rec async for rec in reader]


async def test_a_filtered_reader_behind_a_trim_reads_its_scope_back_from_the_archive(nats_url, job_name, tmp_path):
    """An explorer's view reads only its scope (subjects): it skips sequences by design, so a trim is
    found by asking where the stream starts; the scope's trimmed records come back, in order, and
    nothing outside the scope."""
    await run_scripted_job(nats_url, job_name, steps=6, snapshot_every=10, run_dir=str(tmp_path))
    archive = tmp_path / job_name / "archive"
    async with connect(nats_url, job=job_name, role="observer", member="trim-test") as conn:
        first = (await conn.js.stream_info(conn.names.event_stream)).state.first_seq
        assert first > 2 and segments(archive), "the job did not trim its stream"
        scope = [conn.names.member_events(Role.TRAINER), conn.names.all_decisions]
        history = [r for r in await read_history(conn, archive)
                   if any(subject_matches(p, r.subject or conn.names.recorded_subject(r.event)) for p in scope)]
        async with read_events(conn, from_seq=1, stop_at_end=True, subjects=scope,
                               backfill=lambda a, b: read_range(archive, a, b)) as reader:
            read = [rec async for rec in reader]
    assert any(r.seq < first for r in history) and any(r.seq >= first for r in history)
    assert [(r.seq, r.event) for r in read] == [(r.seq, r.event) for r in history]
    assert reader.backfilled == sum(r.seq < first for r in history)


async def test_a_reader_paused_while_the_stream_is_trimmed_under_it_misses_nothing(nats_url, job_name, tmp_path):
    """The soak's case exactly: a replica's live reader stands still (SIGSTOP) while the active one
    archives and purges past its position; when it reads on, the purged records come from the archive."""
    archive = tmp_path / "archive"
    explorer = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1)
    async with connect(nats_url, job=job_name, role="explorer", member="explorer-0") as conn:
        await ensure_event_stream(conn.js, conn.names)
        publisher = EventPublisher(conn, explorer)
        for step in range(1, 4):
            await publisher.publish(StepFinished(member=explorer, step=step, version=0))
        # one record per pull request: the reader holds nothing delivered ahead of where it stands
        reader = EventReader(conn, from_seq=1, batch=1, backfill=lambda a, b: read_range(archive, a, b))
        try:
            seen = [(await reader.__anext__()).seq for _ in range(3)]
            for step in range(4, 10):
                await publisher.publish(StepFinished(member=explorer, step=step, version=0))
            assert await archive_and_trim(conn, archive, 7) == 8  # records 1..7 archived, purged
            while seen[-1] < 9:
                seen.append((await asyncio.wait_for(reader.__anext__(), 30)).seq)
        finally:
            await reader.aclose()
        assert seen == list(range(1, 10))
        assert reader.backfilled >= 1


async def test_a_synchronizer_starting_behind_the_trim_decides_what_the_stream_says(nats_url, job_name, tmp_path):
    await run_scripted_job(nats_url, job_name, steps=6, snapshot_every=10, run_dir=str(tmp_path))
    archive = tmp_path / job_name / "archive"
    async with connect(nats_url, job=job_name, role="observer", member="trim-test") as conn:
        first = (await conn.js.stream_info(conn.names.event_stream)).state.first_seq
        history = await read_history(conn, archive)
        # what a replica paused before the trim left behind: a snapshot well before the stream's
        # first record (written before snapshots were compare-and-set)
        old = [r for r in history if r.seq <= first // 2]
        old_state, _, _ = fold_lenient(old)
        log_seq = max((r.seq for r in old if isinstance(r.event, Decision) and r.subject == conn.names.decision_log),
                      default=0)
        kv = await conn.js.key_value(conn.names.snapshot_bucket)
        await kv.put("latest", encode_state(old_state, extra={"decision_log_seq": log_seq}))

        sync = Synchronizer(_config(nats_url, job_name, tmp_path), "sync-late")
        await asyncio.wait_for(sync.run(), timeout=60)  # the job is done: it catches up and ends

        after = await read_history(conn, archive)
        folded, _, _ = fold_lenient([r for r in after if r.seq <= sync.state.last_seq])
        assert sync.state == folded
        assert [m.describe() for m in check_decisions(after) if not m.warning] == []


async def test_a_snapshot_never_replaces_a_newer_one(nats_url, job_name, tmp_path):
    await run_scripted_job(nats_url, job_name, steps=4, snapshot_every=10, run_dir=str(tmp_path))
    async with connect(nats_url, job=job_name, role="observer", member="snap-test") as conn:
        store = SnapshotStore(conn)
        newest = await store.latest()
        records = await read_history(conn, tmp_path / job_name / "archive")
        older, _, _ = fold_lenient([r for r in records if r.seq <= newest.state.last_seq - 5])
        assert await store.save(older, 0) is False
        assert (await store.latest()).state == newest.state
        whole, _, _ = fold_lenient(records)
        assert await store.save(whole, newest.decision_log_seq) is True
        assert (await store.latest()).state.last_seq == whole.last_seq
