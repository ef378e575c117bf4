"""A real local 3-node JetStream cluster (`bus.server.NatsCluster`): URL lists, reconnect rotation,
stream replicas, and a stream leader lost under a publisher and a reader."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rolectl.bus.connection import connect, parse_server_urls
from rolectl.bus.errors import StreamMismatch
from rolectl.bus.events import EventPublisher, EventReader
from rolectl.bus.lease import Lease, ensure_lease_bucket
from rolectl.bus.server import NatsCluster
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream, event_stream_config
from rolectl.bus.subjects import JobNames
from rolectl.bus.weights.object_store import ObjectStoreTransport
from rolectl.sync_protocol import MemberRef, Role, StepFinished
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
ME = MemberRef(role=Role.TRAINER, id="t0", incarnation=0)


@pytest.fixture
def cluster(tmp_path):
    """A fresh 3-node cluster per test (tests kill nodes)."""
    with NatsCluster(size=3, store_dir=str(tmp_path / "cluster"), log_dir=str(tmp_path / "logs")) as c:
        yield c


# -- URL lists --------------------------------------------------------------------------------------

def test_a_url_list_is_split_and_bare_hosts_get_the_nats_scheme():
    assert parse_server_urls("nats://a:4222, b:4223 ,tls://c:4224") == [
        "nats://a:4222", "nats://b:4223", "tls://c:4224"]


@pytest.mark.parametrize("bad, says", [
    ("nats://a:4222,,nats://b:4222", "entry 2 is empty"),
    ("nats://a:4222,http://b:80", "'http://b:80' is not a NATS server URL"),
    ("nats://a:xx", "port that is not a number"),
])
def test_a_malformed_url_list_names_the_bad_entry(bad, says):
    with pytest.raises(ValueError, match=says):
        parse_server_urls(bad)


async def test_a_url_list_connects_when_a_listed_server_is_down(cluster, job_name):
    cluster.kill_node(0)  # two of three up: JetStream keeps its majority
    live = {n.url.removeprefix("nats://") for n in cluster.nodes[1:]}
    for i in range(4):  # the order is random: several connects try the dead one first
        async with connect(cluster.url, job=job_name, role="observer", member=f"o{i}", connect_timeout=10) as conn:
            assert conn.server in live
            await ensure_event_stream(conn.js, conn.names, replicas=3)


# -- rotation ---------------------------------------------------------------------------------------

async def test_reconnect_rotates_to_another_node_when_its_node_dies(cluster, job_name):
    async with connect(cluster.url, job=job_name, role="trainer", member="t0") as conn:
        await ensure_event_stream(conn.js, conn.names, replicas=3)
        first = conn.server
        lost = next(i for i, n in enumerate(cluster.nodes) if n.url.endswith(first))
        cluster.kill_node(lost)  # the node it is connected to; never restarted in this test
        await conn.wait_disconnected(timeout=5)
        await conn.wait_connected(timeout=10)
        assert conn.server != first and conn.reconnects == 1
        # ... and the job's stream (R3) still takes events through the new node.
        seq = await EventPublisher(conn, ME).publish(StepFinished(member=ME, step=1, version=0))
        assert seq >= 1


# -- replicas ---------------------------------------------------------------------------------------

async def test_replicas_apply_to_the_event_experience_and_weight_streams(cluster, job_name):
    async with connect(cluster.url, job=job_name, role="trainer", member="t0") as conn:
        event = await ensure_event_stream(conn.js, conn.names, replicas=3)
        experience = await ensure_experience_stream(conn.js, conn.names, replicas=3)
        weights = ObjectStoreTransport(conn.nc, job_name, replicas=3)
        ref = await weights.publish(1, {"w": torch.arange(1000, dtype=torch.float32)})
        info = await conn.js.stream_info(weights.stream)
        for stream in (event, experience, info):
            assert stream.config.num_replicas == 3, stream.config.name
            assert stream.cluster is not None and len(stream.cluster.replicas or []) == 2, stream.config.name
        assert torch.equal((await weights.fetch(ref))["w"], torch.arange(1000, dtype=torch.float32))


async def test_an_existing_stream_with_more_replicas_is_accepted_and_one_with_fewer_is_not(cluster, job_name):
    async with connect(cluster.url, job=job_name, role="observer", member="o") as conn:
        names = JobNames(job_name)
        await conn.js.add_stream(event_stream_config(names, replicas=3))  # pre-created by an operator
        info = await ensure_event_stream(conn.js, names, replicas=1)
        assert info.config.num_replicas == 3
        assert (await ensure_event_stream(conn.js, names, replicas=3)).config.num_replicas == 3

        other = JobNames(job_name + "-r1")
        await ensure_event_stream(conn.js, other, replicas=1)
        with pytest.raises(StreamMismatch, match=r"num_replicas \(at least\): expected 3, found 1"):
            await ensure_event_stream(conn.js, other, replicas=3)

        # the lease bucket by the same rule: one copy would die with its node and no synchronizer
        # could hold the lease again, so a lease asked for 3 copies refuses a bucket with one
        bucket = f"lease-{job_name}"
        await ensure_lease_bucket(conn, bucket, ttl_s=5, replicas=1)
        lease = Lease(conn, bucket=bucket, key="sync", holder="s1", ttl_s=5, replicas=3)
        with pytest.raises(StreamMismatch, match=rf"KV_{bucket}.*num_replicas \(at least\): expected 3, found 1"):
            await lease.acquire_or_renew()
        # a bucket just made on a cluster may not be reachable from every node yet ("no stream
        # listens"): the synchronizer tries again every renewal, and so does this
        one_copy = Lease(conn, bucket=bucket, key="sync", holder="s1", ttl_s=5, replicas=1)
        await wait_until(one_copy.acquire_or_renew, timeout=30, poll=0.2, what="the one-copy lease to be held")


# -- losing the stream leader ----------------------------------------------------------------------

@pytest.mark.parametrize("following", [False, True], ids=["reader-starts-after", "reader-already-following"])
async def test_losing_the_event_stream_leader_costs_a_stall_not_an_event(cluster, job_name, following):
    """kill -9 the node that leads the job's R3 event stream, under a publisher and a live reader
    connected elsewhere: every event is stored once, in order, and the reader sees them all.

    `following`: the reader has read half before the kill, so its one-copy consumer lives on a node
    (the one killed here): no answer to its pull requests but "no responders", and it must make a
    new consumer and miss nothing. The synchronizer once went silent this way."""
    async with connect(cluster.url, job=job_name, role="trainer", member="t0") as conn:
        await ensure_event_stream(conn.js, conn.names, replicas=3)
        leader = await wait_until(lambda: cluster.stream_leader(conn.names.event_stream), timeout=10,
                                 what="the event stream's leader")
        publisher = EventPublisher(conn, ME)
        events = [StepFinished(member=ME, step=s, version=0) for s in range(1, 21)]
        seen = []
        async with EventReader(conn, poll_s=0.5) as reader:
            for e in events[:10]:
                await publisher.publish(e)
            if following:
                seen = [(await asyncio.wait_for(reader.__anext__(), 60)).event for _ in events[:10]]
                killed = _consumer_leader(cluster, conn.names.event_stream, reader._consumer) or leader
            else:
                killed = leader
            cluster.kill_node(cluster.index_of(killed))
            for e in events[10:]:
                await asyncio.wait_for(publisher.publish(e), 60)
            seen += [(await asyncio.wait_for(reader.__anext__(), 60)).event for _ in events[len(seen):]]
        assert seen == events
        # a survivor's monitoring may name the dead leader for a moment: wait for one that is alive
        await wait_until(lambda: cluster.stream_leader(conn.names.event_stream) not in (None, killed), timeout=20,
                        what=f"an event stream leader other than the killed {killed}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _consumer_leader(cluster: NatsCluster, stream: str, consumer: str) -> str | None:
    """The node leading `consumer` of `stream`, from the nodes' /jsz (None if none says)."""
    import urllib.request

    for node in cluster.nodes:
        try:
            with urllib.request.urlopen(f"{node.monitor_url}/jsz?consumers=1", timeout=2.0) as resp:
                data = json.load(resp)
        except OSError:
            continue
        for account in data.get("account_details") or []:
            for detail in account.get("stream_detail") or []:
                if detail.get("name") != stream:
                    continue
                for c in detail.get("consumer_detail") or []:
                    if c.get("name") == consumer and (c.get("cluster") or {}).get("leader"):
                        return c["cluster"]["leader"]
    return None


# -- rolectl server --cluster -----------------------------------------------------------------------

def test_rolectl_server_cluster_prints_the_url_writes_cluster_json_and_stops_every_node(tmp_path):
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolectl", "server", "--cluster", "3", "--store-dir", str(store)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        # started with SIGINT ignored, as a shell's `&` (or a test worker that loaded vLLM/Ray) does:
        # it still stops on SIGINT (it once hung here, leaving the nodes running)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    pids: list[int] = []
    try:
        url_line = proc.stdout.readline().strip()  # blocks until the cluster is ready (or exit)
        assert url_line.count(",") == 2, url_line + proc.stdout.read() if proc.poll() is not None else url_line
        described = json.loads((store / "cluster.json").read_text())
        assert described["url"] == url_line
        assert [n["name"] for n in described["nodes"]] == ["rolectl-1", "rolectl-2", "rolectl-3"]
        assert [n["url"] for n in described["nodes"]] == parse_server_urls(url_line)
        pids = [n["pid"] for n in described["nodes"]]
        for node in described["nodes"]:
            assert node["monitor_url"].startswith("http://127.0.0.1:")
            os.kill(node["pid"], 0)  # alive
        proc.send_signal(signal.SIGINT)
        # A bound on "hung", not on speed: on a loaded machine the nodes' JetStream shutdown (and
        # the SIGKILL after 10 s) has taken over 30 s once.
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            alive = [pid for pid in pids if _alive(pid)]
            raise AssertionError(f"`rolectl server --cluster 3` still running 120 s after SIGINT; node pids "
                                 f"still alive: {alive} of {pids}") from None
        assert code == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:  # a failed stop must not leave the nodes running past the test
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_rolectl_server_cluster_refuses_a_fixed_port():
    result = subprocess.run([sys.executable, "-m", "rolectl", "server", "--cluster", "3", "--port", "4333"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--port apply to a single server" in result.stderr
