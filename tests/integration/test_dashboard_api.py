"""The dashboard's JSON snapshot, Prometheus figures and event feed, following a job on a real nats-server."""

from __future__ import annotations

import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolectl.roles.observe.dashboard import Dashboard, start_dashboard
from tests.support.scripted_job import NBYTES, run_scripted_job
from tests.support.wait import wait_until

STEPS = 3


async def _until(dashboard: Dashboard, predicate, what: str, timeout: float = 20.0) -> None:
    """Wait for the dashboard's model to satisfy `predicate` (it signals every change)."""
    await wait_until(lambda: predicate(dashboard), timeout=timeout, what=f"the dashboard to show {what}",
                     changed=lambda: dashboard.wait_change(dashboard.changes, timeout))


@pytest.fixture
async def followed(nats_server, job_name):
    """A dashboard started before the job existed, then the job ran (members left running)."""
    handle = await start_dashboard(job=job_name, nats_url=nats_server.url, monitor_url=nats_server.monitor_url)
    try:
        await _until(handle.dashboard, lambda d: d.connection == "waiting for the job's stream", "the wait")
        last = await run_scripted_job(nats_server.url, job_name, steps=STEPS, stop=False)
        await _until(handle.dashboard, lambda d: d.observer.state.last_seq >= last, f"seq {last}")
        # server health is polled every 2 s: wait for a poll that saw the job's stream filled
        await _until(handle.dashboard, lambda d: d.nats.get("ok") and d.nats["server"]["connections"] >= 1
                     and any(s["ours"] and s["messages"] for s in d.nats["streams"]), "NATS health")
        yield handle
    finally:
        await handle.aclose()


async def _get(url: str) -> tuple[str, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(url) as resp:
            assert resp.status == 200, (url, resp.status)
            return resp.headers["Content-Type"], await resp.text()


async def test_api_state_has_members_versions_rounds_and_figures(followed, job_name):
    _, body = await _get(followed.url + "api/state")
    state = json.loads(body)
    assert state["job"] == job_name and state["connection"]["state"] == "live"
    members = {m["key"]: m for m in state["members"]}
    assert {"trainer/trainer", "explorer/explorer-0", "explorer/explorer-1"} <= set(members)
    assert members["trainer/trainer"]["host"] == "host-trainer"
    assert (members["trainer/trainer"]["total_steps"], members["trainer/trainer"]["fraction"]) == (2 * STEPS, 0.5)
    assert state["trainer"]["total_steps"] == 2 * STEPS
    assert all(members[k]["version"] == STEPS and members[k]["status"] == "running"
               for k in ("trainer/trainer", "explorer/explorer-0", "explorer/explorer-1"))
    assert state["latest"]["version"] == STEPS
    assert sorted(state["latest"]["held_by"]) == ["explorer/explorer-0", "explorer/explorer-1", "trainer/trainer"]
    assert len(state["rounds"]) == 2 + 2 * STEPS and state["rounds_summary"]["outcomes"] == {"completed": 2 + 2 * STEPS}
    assert state["throughput"]["bytes_loaded_total"] == 2 * STEPS * NBYTES
    # "loads" counts what the run summary's weight_loads counts
    assert state["throughput"]["transfers"] == followed.dashboard.observer.summary(job=job_name)["weight_loads"] > 0
    assert state["throughput"]["last_gbps"] > 0
    assert [p[0] for p in state["series"]["reward"]] == list(range(1, STEPS + 1))
    assert state["series"]["reward"][-1][1] == pytest.approx(0.2 * STEPS)
    assert len(state["series"]["sync_time"]) == 2 + 2 * STEPS
    assert state["staleness"]["mean"] == 0.5 and state["staleness"]["dropped_total"] == STEPS // 2
    assert state["log"][-1]["seq"] == state["stream"]["last_seq"]
    nats = state["nats"]
    assert nats["ok"] and nats["server"]["connections"] >= 1
    ours = [s for s in nats["streams"] if s["ours"]]
    assert any(s["name"].endswith("_EVENTS") and s["messages"] > 0 for s in ours)


async def test_metrics_exports_the_same_figures(followed, job_name):
    content_type, text = await _get(followed.url + "metrics")
    assert content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("job") == job_name
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value

    def value(name: str, **labels) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("rolectl_member_version", role="explorer", member="explorer-1") == STEPS
    assert value("rolectl_member_step", role="trainer", member="trainer") == STEPS
    assert value("rolectl_member_total_steps", role="trainer", member="trainer") == 2 * STEPS
    assert value("rolectl_member_progress_ratio", role="trainer", member="trainer") == 0.5
    assert value("rolectl_member_status", role="explorer", member="explorer-0", status="running") == 1
    assert value("rolectl_member_alive", role="trainer", member="trainer") == 1
    assert value("rolectl_latest_version") == STEPS
    assert value("rolectl_sync_rounds_closed_total", outcome="completed") == 2 + 2 * STEPS
    assert value("rolectl_sync_rounds_open") == 0
    assert value("rolectl_sync_bytes_total") == 2 * STEPS * NBYTES
    assert value("rolectl_sync_last_gbps") > 0
    assert value("rolectl_trainer_reward_mean") == pytest.approx(0.2 * STEPS)
    assert value("rolectl_trainer_mean_staleness") == 0.5
    assert value("rolectl_trainer_dropped_stale_total") == STEPS // 2
    assert value("rolectl_nats_up") == 1
    assert value("rolectl_nats_connections") >= 1
    assert any(name == "rolectl_nats_stream_messages" for name, _ in samples)


async def test_event_feed_pushes_snapshots(followed, job_name):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(followed.url + "api/events") as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    snapshot = json.loads(line[len("data: "):])
                    break
    assert snapshot["job"] == job_name and snapshot["latest"]["version"] == STEPS


async def test_the_page_and_its_assets_are_served(followed):
    content_type, html = await _get(followed.url)
    assert content_type.startswith("text/html") and 'id="members"' in html and "/static/app.js" in html
    for asset in ("static/app.js", "static/style.css"):
        await _get(followed.url + asset)


async def test_two_dashboards_in_one_process(nats_server, job_name):
    # each has its own Prometheus registry: no "duplicated timeseries" clash
    first = await start_dashboard(job=job_name, nats_url=nats_server.url, monitor_url=None)
    second = await start_dashboard(job=job_name, nats_url=nats_server.url, monitor_url=None)
    try:
        for handle in (first, second):
            _, text = await _get(handle.url + "metrics")
            assert f'rolectl_nats_up{{job="{job_name}"}} 0.0' in text
    finally:
        await second.aclose()
        await first.aclose()
        await first.aclose()  # safe twice


async def test_a_bad_job_name_is_refused_at_start(nats_server):
    with pytest.raises(ValueError, match="invalid job name"):
        await start_dashboard(job="no spaces please", nats_url=nats_server.url, monitor_url=None)


async def test_the_page_says_live_while_the_job_runs(followed):
    _, body = await _get(followed.url + "api/state")
    assert json.loads(body)["job_state"] == {"ended": False, "outcome": "running",
                                             "reason": "the trainer is running (step 3)"}


async def test_the_page_stops_saying_live_once_the_job_ended(nats_server, job_name):
    handle = await start_dashboard(job=job_name, nats_url=nats_server.url, monitor_url=nats_server.monitor_url)
    try:
        last = await run_scripted_job(nats_server.url, job_name, steps=2, stop=True)
        await _until(handle.dashboard, lambda d: d.observer.state.last_seq >= last, f"seq {last}")
        _, body = await _get(handle.url + "api/state")
        job_state = json.loads(body)["job_state"]
        assert job_state["ended"] is True and job_state["outcome"] == "complete", job_state
        assert json.loads(body)["connection"]["state"] == "live"  # still connected: the page shows "ended"
        _, script = await _get(handle.url + "static/app.js")
        assert "ended ·" in script
    finally:
        await handle.aclose()


def test_the_eval_curve_is_plotted_by_version_beside_the_reward():
    from rolectl.roles.observe.observer import JobObserver
    from rolectl.sync_protocol import EvalFinished, MemberJoined, MemberRef, Recorded, Role

    e = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=0)
    events = [MemberJoined(member=e, host="h", pid=1, step=0, version=-1),
              EvalFinished(member=e, version=0, step=0, rewards={"positional_match": 0.1, "exact_match": 0.0}),
              EvalFinished(member=e, version=9, step=10, rewards={"positional_match": 0.5, "exact_match": 0.25})]
    dashboard = Dashboard(job="evals", nats_url="nats://127.0.0.1:4222", monitor_url=None)
    dashboard.observer = JobObserver().extend(Recorded(seq=i + 1, time_ms=i, event=ev) for i, ev in enumerate(events))
    series = dashboard.snapshot()["series"]["eval"]
    assert series == {"positional_match": [[0, 0.1], [9, 0.5]], "exact_match": [[0, 0.0], [9, 0.25]]}
