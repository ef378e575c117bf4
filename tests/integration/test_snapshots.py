"""Reducer snapshots on a real nats-server: the synchronizer writes them, a job view and replay
start from one, and a stream trimmed up to a snapshot still replays and checks."""

from __future__ import annotations

import asyncio

from rolectl.bus.connection import connect
from rolectl.bus.snapshots import SnapshotStore
from rolectl.roles.job_view import JobView
from rolectl.roles.observe.export import read_history
from rolectl.roles.observe.replay import run_replay
from rolectl.sync_protocol import Decision
from rolectl.sync_protocol.reducer import fold_lenient
from rolectl.sync_protocol.snapshot import encode_state
from rolectl.sync_protocol.state import State
from tests.support.scripted_job import run_scripted_job


async def test_snapshot_is_the_fold_of_the_stream_up_to_it_and_views_start_from_it(nats_url, job_name, tmp_path):
    await run_scripted_job(nats_url, job_name, steps=4, snapshot_every=10, run_dir=str(tmp_path))
    async with connect(nats_url, job=job_name, role="observer", member="snap-test") as conn:
        snapshot = await SnapshotStore(conn).latest()
        assert snapshot is not None and snapshot.state.last_seq >= 10
        # the synchronizer archived what its snapshots cover and trimmed the stream (issue 28):
        # the whole history is the archive plus the stream's tail
        records = await read_history(conn, tmp_path / job_name / "archive")
        head_state, _, _ = fold_lenient([r for r in records if r.seq <= snapshot.state.last_seq])
        assert snapshot.state == head_state
        # the decision log's guard it carries names a real message of the log, no older than the
        # last one the snapshot's fold had read
        on_log = sorted({r.seq for r in records
                         if isinstance(r.event, Decision) and r.subject == conn.names.decision_log})
        assert snapshot.decision_log_seq in on_log
        assert snapshot.decision_log_seq >= max(seq for seq in on_log if seq <= snapshot.state.last_seq)
        whole_state, _, _ = fold_lenient(records)

        # trim what the snapshot covers: a view folds snapshot + tail into the same state
        await conn.js.purge_stream(conn.names.event_stream, seq=snapshot.state.last_seq + 1)
        view = JobView(conn)
        await view.start()
        try:
            assert view.state == whole_state
        finally:
            await view.aclose()


def test_replay_checks_a_trimmed_stream_from_its_snapshot(nats_url, job_name, capsys):
    asyncio.run(run_scripted_job(nats_url, job_name, steps=4, snapshot_every=10))

    async def trim() -> int:
        async with connect(nats_url, job=job_name, role="observer", member="snap-test") as conn:
            snapshot = await SnapshotStore(conn).latest()
            await conn.js.purge_stream(conn.names.event_stream, seq=snapshot.state.last_seq + 1)
            return snapshot.state.last_seq

    assert asyncio.run(trim()) >= 10
    assert run_replay(job=job_name, nats=nats_url, file=None, until=None, check=True, as_json=False) == 0
    out = capsys.readouterr()
    assert "check OK" in out.out and "job complete" in out.err


async def test_a_snapshot_of_an_older_build_starts_the_decision_log_guard_at_zero(nats_url, job_name):
    """Builds before schema 4 wrote each open round's subject sequence, and no decision log."""
    async with connect(nats_url, job=job_name, role="synchronizer", member="snap-test") as conn:
        await _older_and_newer_snapshots(SnapshotStore(conn))


async def _older_and_newer_snapshots(store: SnapshotStore) -> None:
    kv = await store.ensure_bucket()
    await kv.put("latest", encode_state(State.initial(), extra={"round_subject_seq": {"3": 7}}))
    assert (await store.latest()).decision_log_seq == 0
    await kv.put("latest", encode_state(State.initial(), extra={"decision_log_seq": "7"}))
    assert await store.latest() is None  # not a sequence: ignored (logged), the fold starts at 1
    assert await store.save(State.initial(), 12)
    assert (await store.latest()).decision_log_seq == 12
