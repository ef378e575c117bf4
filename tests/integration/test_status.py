"""`rolectl status`: the members table of a job that is running on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from rolectl.bus.connection import connect
from rolectl.bus.events import publish_heartbeat
from rolectl.bus.server import free_port
from rolectl.roles.observe.status import collect_status, print_status
from rolectl.sync_protocol import RunningStatus
from tests.support.fleet import BEHIND, EXPIRED, STOPPED, explorer_id, record_fleet
from tests.support.scripted_job import EXPLORERS, TRAINER, run_scripted_job, stop_task


@pytest.fixture
def running_job(nats_url: str, job_name: str) -> str:
    """A job whose trainer and explorers are still up (they never said STOPPED)."""
    asyncio.run(run_scripted_job(nats_url, job_name, steps=2, stop=False))
    return job_name


async def _beat(nats_url: str, job: str) -> None:
    # The members' heartbeats: core NATS, what `status` uses for "last seen" between events.
    async with connect(nats_url, job=job, role="trainer", member="beats") as conn:
        while True:
            for ref in (TRAINER, *EXPLORERS):
                await publish_heartbeat(conn, ref, step=2, version=2, status=RunningStatus.RUNNING,
                                        host=f"host-{ref.id}")
            await asyncio.sleep(0.2)  # heartbeat period


async def test_status_table_lists_every_member(running_job, nats_url, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich fits the table to the terminal; keep every cell whole
    assert await print_status(running_job, nats_url) == 0
    out = capsys.readouterr().out
    for text in ("trainer", "explorer-0", "explorer-1", "sync-0", "host-explorer-1", "running",
                 f"job {running_job}", "latest version 2", "2/4 (50%)"):
        assert text in out, text


async def test_status_in_a_pipe_prints_whole_rows_and_what_the_synchronizer_decided(running_job, nats_url, capsys,
                                                                                    monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # not a terminal: no width to fit to, rows are whole
    assert await print_status(running_job, nats_url) == 0
    lines = capsys.readouterr().out.splitlines()
    trainer = next(line for line in lines if "host-trainer" in line)
    explorer = next(line for line in lines if "explorer-1" in line)
    assert "2/4 (50%)" in trainer and "host-explorer-1" in explorer, "\n".join(lines)
    # a synchronizer has no step nor version: the row says what the job's synchronizers decided
    sync = next(line for line in lines if "sync-0" in line)
    assert re.search(r"\d+ decisions, round \d+", sync) and "—" in sync, sync


async def test_status_json_has_role_status_step_version_host(running_job, nats_url, capsys):
    assert await print_status(running_job, nats_url, as_json=True) == 0
    shown = json.loads(capsys.readouterr().out)
    rows = {m["key"]: m for m in shown["members"]}
    assert set(rows) == {"trainer/trainer", "explorer/explorer-0", "explorer/explorer-1", "synchronizer/sync-0"}
    trainer = rows["trainer/trainer"]
    assert (trainer["role"], trainer["status"], trainer["step"], trainer["version"], trainer["host"]) == (
        "trainer", "running", 2, 2, "host-trainer")
    assert (trainer["total_steps"], trainer["fraction"]) == (4, 0.5)  # the total the trainer reports
    assert rows["explorer/explorer-1"]["version"] == 2
    assert shown["latest"]["version"] == 2
    assert all(m["last_seen_ms"] for m in rows.values())


async def test_last_seen_follows_heartbeats(running_job, nats_url):
    beats = asyncio.create_task(_beat(nats_url, running_job))
    try:
        observer, now_ms = await collect_status(running_job, nats_url, heartbeat_wait_s=10.0)
    finally:
        await stop_task(beats)
    rows = {m["key"]: m for m in observer.members(now_ms)}
    for ref in (TRAINER, *EXPLORERS):
        assert ref.key in observer.heartbeats
        assert rows[ref.key]["last_seen_ms"] == observer.heartbeats[ref.key]
        assert rows[ref.key]["last_seen_ms"] > observer.state.members[ref.key].last_time_ms


async def test_status_of_a_job_without_stream_exits_1(nats_url, job_name, capsys):
    assert await print_status(job_name, nats_url) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and job_name in err


async def test_status_with_nats_unreachable_exits_1(job_name, capsys):
    url = f"nats://127.0.0.1:{free_port()}"
    assert await print_status(job_name, url, connect_timeout=1.0) == 1
    assert url in capsys.readouterr().err


async def test_a_member_that_finished_its_work_is_shown_finished(nats_url, job_name, capsys):
    await run_scripted_job(nats_url, job_name, steps=2, stop=True)
    assert await print_status(job_name, nats_url, as_json=True) == 0
    rows = {m["key"]: m for m in json.loads(capsys.readouterr().out)["members"]}
    assert rows["trainer/trainer"]["status"] == "finished"
    assert rows["explorer/explorer-0"]["status"] == "finished"


async def test_a_thousand_members_are_counted_by_status_and_the_stragglers_listed_first(
        nats_url, job_name, capsys, monkeypatch):
    """At fleet size the table stays one screen: every role's members counted by status, then the
    explorers furthest behind (expired, stopped, then the lowest versions), and how many are left out."""
    await record_fleet(nats_url, job_name, explorers=1000)
    monkeypatch.setenv("COLUMNS", "200")
    assert await print_status(job_name, nats_url, limit=10) == 0
    out = capsys.readouterr().out
    listed = [int(i) for i in re.findall(r"│ explorer-(\d{4}) ", out)]  # the id column (hosts are host-...)
    stragglers = [*EXPIRED, *STOPPED, *sorted(BEHIND, key=BEHIND.get)]
    keeping_up = [i for i in range(1000) if i not in stragglers]
    assert listed == stragglers + keeping_up[:10 - len(stragglers)]
    assert "990 more explorers not listed" in out and "--all" in out
    counts = next(line for line in out.splitlines() if line.strip("│ ").startswith("explorer"))
    assert [c.strip() for c in counts.split("│")[1:-1]] == ["explorer", "997", "·", "·", "1", "2", "1000"], counts

    assert await print_status(job_name, nats_url, as_json=True, limit=None) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["counts"]["explorer"] == {"running": 997, "require_sync": 0, "finished": 0, "stopped": 1,
                                           "expired": 2, "total": 1000}
    assert shown["counts"]["trainer"]["running"] == 1 and shown["members_left_out"] == 0
    explorers = [m for m in shown["members"] if m["role"] == "explorer"]
    assert len(explorers) == 1000 and [m["id"] for m in explorers[:len(stragglers)]] == [
        explorer_id(i) for i in stragglers]
