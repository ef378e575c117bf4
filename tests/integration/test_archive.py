"""The stream's history archived and trimmed, on a real nats-server: the active synchronizer writes
segments with digests after each snapshot and only then trims; replay, export and status read
archive plus tail as one history; a kill -9 mid-archive trims nothing unarchived; a damaged segment
is named and stops the replay; an archive directory that cannot be written trims nothing."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import structlog.testing

from rolectl.bus.archive import (
    ArchiveError,
    archive_and_trim,
    archived_upto,
    read_archive,
    segments,
    write_segment,
)
from rolectl.bus.connection import connect
from rolectl.bus.events import last_sequence, read_all
from rolectl.bus.snapshots import SnapshotStore
from rolectl.roles.observe.export import read_history
from rolectl.roles.observe.replay import run_replay
from rolectl.roles.observe.status import collect_status
from rolectl.sync_protocol.reducer import fold_lenient
from tests.support.scripted_job import run_scripted_job


async def _first_seq(conn) -> int:
    return (await conn.js.stream_info(conn.names.event_stream)).state.first_seq


async def test_the_synchronizer_archives_then_trims_and_history_reads_as_one(nats_url, job_name, tmp_path):
    await run_scripted_job(nats_url, job_name, steps=6, snapshot_every=10, run_dir=str(tmp_path))
    archive = tmp_path / job_name / "archive"
    async with connect(nats_url, job=job_name, role="observer", member="archive-test") as conn:
        done = segments(archive)
        assert done, "no segment was archived"
        first = await _first_seq(conn)
        assert 1 < first <= archived_upto(archive) + 1  # trimmed, and only what is archived
        history = await read_history(conn, archive)
        assert history[0].seq == 1 and history[-1].seq == await last_sequence(conn)
        assert [r.seq for r in history] == sorted(r.seq for r in history)
        snapshot = await SnapshotStore(conn).latest()
        head, _, _ = fold_lenient([r for r in history if r.seq <= snapshot.state.last_seq])
        assert head == snapshot.state  # the archive holds exactly what the snapshot folded
        observer, _ = await collect_status(job_name, nats_url, heartbeat_wait_s=0, archive_dir=archive)
        assert observer.state.last_seq == history[-1].seq and observer.outcome().complete
    assert await asyncio.to_thread(run_replay, job=job_name, nats=nats_url, file=None, until=None, check=True,
                                   as_json=False, archive=archive) == 0


async def test_a_segment_whose_digest_does_not_match_is_named_and_the_replay_stops(nats_url, job_name, tmp_path,
                                                                                 capsys):
    await run_scripted_job(nats_url, job_name, steps=4, snapshot_every=10, run_dir=str(tmp_path))
    archive = tmp_path / job_name / "archive"
    damaged = segments(archive)[0]
    data = bytearray(damaged.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.path.write_bytes(bytes(data))
    with pytest.raises(ArchiveError, match=damaged.path.name):
        read_archive(archive)
    capsys.readouterr()
    assert await asyncio.to_thread(run_replay, job=job_name, nats=nats_url, file=None, until=None, check=True,
                                   as_json=False, archive=archive) == 2
    err = capsys.readouterr().err.replace("\n", "")
    assert damaged.path.name in err and "damaged" in err, err


async def test_an_archive_directory_that_cannot_be_written_trims_nothing(nats_url, job_name, tmp_path):
    (tmp_path / job_name).mkdir()
    (tmp_path / job_name / "archive").write_text("a file where the archive directory should be")
    with structlog.testing.capture_logs() as logs:
        await run_scripted_job(nats_url, job_name, steps=4, snapshot_every=10, run_dir=str(tmp_path))
    async with connect(nats_url, job=job_name, role="observer", member="archive-test") as conn:
        assert await SnapshotStore(conn).latest() is not None  # it did snapshot...
        assert await _first_seq(conn) == 1  # ... and trimmed nothing
        with pytest.raises(ArchiveError, match="cannot write archive segment"):
            await archive_and_trim(conn, tmp_path / job_name / "archive", 10)
        assert await _first_seq(conn) == 1
    failed = [e for e in logs if e["event"] == "archive_failed_not_trimmed"]
    assert failed and "cannot write archive segment" in failed[0]["reason"], logs[-5:]


_ARCHIVER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from rolectl.bus.archive import archive_and_trim
    from rolectl.bus.connection import connect

    async def main(url, job, directory, upto):
        async with connect(url, job=job, role="observer", member="archiver") as conn:
            print("connected", flush=True)
            while True:  # archive and trim again and again until killed
                await archive_and_trim(conn, Path(directory), int(upto))

    asyncio.run(main(*sys.argv[1:]))
""")


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_kill9_mid_archive_trims_nothing_that_is_not_archived(nats_url, job_name, tmp_path, seed):
    """An archiver killed -9 at a seeded random moment: whatever it had done, the stream's first
    record is at most one past the archive's last, and the archive reads back whole."""
    end = await run_scripted_job(nats_url, job_name, steps=6, run_dir=str(tmp_path / "sync"))
    archive = tmp_path / "archive"
    proc = subprocess.Popen([sys.executable, "-c", _ARCHIVER, nats_url, job_name, str(archive), str(end)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while (line := proc.stdout.readline()) and line.strip() != b"connected":
            pass  # its log lines
        assert line, "the archiver exited before it connected"
        await asyncio.sleep(random.Random(seed).uniform(0.0, 0.5))  # the moment of the kill (seeded)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the process this test started, by its PID
        proc.wait()
    async with connect(nats_url, job=job_name, role="observer", member="archive-test") as conn:
        first = await _first_seq(conn)
        assert first <= archived_upto(archive) + 1, (first, archived_upto(archive))
        archived = read_archive(archive)
        tail = await read_all(conn)
        history = archived + [r for r in tail if not archived or r.seq > archived[-1].seq]
        assert history and history[0].seq == 1 and history[-1].seq == end
        # and a later archiver takes it from there
        await archive_and_trim(conn, archive, end)
        assert archived_upto(archive) == end


async def test_overlapping_segments_read_back_each_record_once(nats_url, job_name, tmp_path):
    """A replica paused mid-archive may finish a segment after its successor archived further: the
    two overlap, and the history holds each record once."""
    end = await run_scripted_job(nats_url, job_name, steps=3, run_dir=str(tmp_path / "sync"))
    async with connect(nats_url, job=job_name, role="observer", member="archive-test") as conn:
        records = await read_all(conn)
    archive = tmp_path / "archive"
    write_segment(archive, [r for r in records if r.seq <= end // 2])
    write_segment(archive, records)  # the successor's, from the same first record further on
    assert read_archive(archive) == records
