"""Transient JetStream failures under a real nats-server kill -9 and restart (same port, same store):
the retry helper waits them out, every publish path in `bus` rides through, and the object store
comes back with both storage settings (memory: re-created, lost versions reported clearly; file:
every version kept)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import nats.errors
import nats.js.errors
import pytest
import torch

from rolectl.bus.connection import connect
from rolectl.bus.errors import BusError, RetriesExhausted
from rolectl.bus.events import EventPublisher, read_all
from rolectl.bus.experiences import ExperienceBatch, ExperiencePublisher
from rolectl.bus.retry import is_transient, retry_transient
from rolectl.bus.server import NatsServer
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.bus.weights.base import WeightsNotFound
from rolectl.bus.weights.object_store import ObjectStoreTransport
from rolectl.roles.job_view import JobView
from rolectl.roles.member_view import MemberView
from rolectl.sync_protocol import MemberRef, Role, StepFinished, encode
from tests.support.wait import wait_until, wait_until_sync

ME = MemberRef(role=Role.TRAINER, id="t0", incarnation=0)


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).bfloat16()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)



async def _restart_after_first_failure(server: NatsServer, failed: asyncio.Event) -> None:
    """Bring the killed server back once the operation under test has failed at least once."""
    await asyncio.wait_for(failed.wait(), 30)
    await asyncio.to_thread(server.start)


# -- the helper ------------------------------------------------------------------------------------

async def test_retry_helper_rides_out_a_server_restart(own_server):
    async with connect(own_server.url, job="retry-helper", role="observer", member="o") as conn:
        await asyncio.to_thread(own_server.kill)
        await conn.wait_disconnected(timeout=5)
        failures: list[BaseException] = []
        failed = asyncio.Event()

        async def account_info():
            try:
                return await conn.js.account_info()
            except Exception as exc:
                failures.append(exc)
                failed.set()
                raise

        restarter = asyncio.create_task(_restart_after_first_failure(own_server, failed))
        info = await retry_transient(account_info, what="account info", retry_for=60)
        await restarter
        assert info.limits is not None
        assert failures and all(is_transient(f) for f in failures), failures


async def test_retry_helper_gives_up_after_its_budget_naming_the_operation(own_server):
    async with connect(own_server.url, job="retry-budget", role="observer", member="o") as conn:
        await asyncio.to_thread(own_server.kill)
        await conn.wait_disconnected(timeout=5)
        js = conn.nc.jetstream(timeout=0.3)
        started = time.monotonic()
        with pytest.raises(RetriesExhausted) as caught:
            await retry_transient(js.account_info, what="account info of job x", retry_for=1.5)
        elapsed = time.monotonic() - started
        assert caught.value.attempts >= 2
        assert "account info of job x" in str(caught.value) and "still failing" in str(caught.value)
        assert elapsed < 30, elapsed  # bounded (budget plus one attempt's timeout), with room for a loaded machine


async def test_a_request_lost_in_an_outage_is_retried_at_reconnect_not_after_its_timeout(own_server):
    """A request in flight when the server dies is never answered; with `interrupt` the helper
    abandons it when the connection is back and asks again at once."""
    async with connect(own_server.url, job="retry-interrupt", role="observer", member="o") as conn:
        got_first = asyncio.Event()

        async def responder(msg):
            got_first.set()
            if conn.reconnects >= 1:  # only answers after the outage
                await msg.respond(b"pong")

        await conn.nc.subscribe("retry.interrupt.ping", cb=responder)
        attempts = 0

        async def ping():
            nonlocal attempts
            attempts += 1
            return await conn.nc.request("retry.interrupt.ping", b"", timeout=60)

        started = time.monotonic()
        asking = asyncio.create_task(retry_transient(ping, what="ping", retry_for=120,
                                                     interrupt=conn.reconnect_signal))
        await asyncio.wait_for(got_first.wait(), 10)  # the first request reached the responder
        await asyncio.to_thread(own_server.kill)
        await asyncio.to_thread(own_server.start)
        reply = await asyncio.wait_for(asking, 60)
        assert reply.data == b"pong"
        assert attempts == 2
        assert time.monotonic() - started < 30, "waited out the lost request's timeout"


def _stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every thread of it is stopped: the signal takes effect
    asynchronously, and a server thread still running answered a publish sent right after (seen
    under load)."""
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                states.append(open(f"/proc/{pid}/task/{task}/stat").read().rsplit(")", 1)[1].split()[0])
            except OSError:  # a thread that just ended
                continue
        return bool(states) and all(state in "tT" for state in states)

    # polling the kernel's view of the threads
    wait_until_sync(all_stopped, timeout=timeout, poll=0.01, what=f"every thread of nats-server {pid} to stop "
                    "after SIGSTOP")


async def test_an_acked_publish_caught_by_an_outage_is_sent_again_at_reconnect(own_server):
    """`publish_acked` waits for its ack on the connection's one reply subscription; a publish whose
    ack went with the old socket is sent again as soon as the connection is back (same msg id:
    stored once), not after its ack timeout."""
    async with connect(own_server.url, job="ack-outage", role="trainer", member="t0") as conn:
        await ensure_event_stream(conn.js, conn.names)
        first = await EventPublisher(conn, ME).publish(StepFinished(member=ME, step=1, version=0))
        _stop_process(own_server.pid)  # it takes the publish, and never answers
        started = time.monotonic()
        publishing = asyncio.create_task(conn.publish_acked(
            conn.names.event("trainer", "t0", "step_finished"),
            encode(StepFinished(member=ME, step=2, version=0)), msg_id="t0#0/2", ack_timeout=60, retry_for=120))
        # the publish is out, its ack awaited
        await wait_until(lambda: conn._acks, timeout=10, poll=0.01, what="the publish to wait for its ack")
        assert conn._acks, "the publish never got to wait for its ack"
        await asyncio.to_thread(own_server.kill)
        await asyncio.to_thread(own_server.start)
        ack = await asyncio.wait_for(publishing, 60)
        assert time.monotonic() - started < 30, "waited out the lost ack's timeout"
        records = await read_all(conn)
    assert ack.seq == first + 1
    assert [r.event.step for r in records] == [1, 2]  # stored once


async def test_a_non_transient_error_is_raised_at_once(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="observer", member="o") as conn:
        calls = 0

        async def bad_stream():
            nonlocal calls
            calls += 1
            return await conn.js.stream_info("no-such-stream-" + job_name)

        with pytest.raises(nats.js.errors.NotFoundError):
            await retry_transient(bad_stream, what="lookup", retry_for=30)
        assert calls == 1


def test_what_counts_as_transient():
    assert is_transient(nats.errors.TimeoutError())
    assert is_transient(nats.errors.NoRespondersError())
    assert is_transient(nats.js.errors.NoStreamResponseError())
    assert is_transient(nats.js.errors.APIError(code=503, err_code=10008, description="temporarily unavailable"))
    assert is_transient(nats.js.errors.APIError(code=500, err_code=10118, description="stream is offline"))
    assert not is_transient(nats.js.errors.NotFoundError(code=404, err_code=10059, description="stream not found"))
    assert not is_transient(nats.js.errors.BadRequestError(code=400, err_code=10071, description="wrong last seq"))
    assert not is_transient(nats.errors.ConnectionClosedError())


# -- publish paths ---------------------------------------------------------------------------------

async def test_stream_ensure_and_both_publishers_wait_for_a_restarted_server(own_server):
    async with connect(own_server.url, job="restart-paths", role="trainer", member="t0") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await ensure_experience_stream(conn.js, conn.names)
        await asyncio.to_thread(own_server.kill)
        await conn.wait_disconnected(timeout=5)
        # All three start while the server is down, and finish once it is back.
        pending = [
            asyncio.create_task(ensure_event_stream(conn.js, conn.names)),
            asyncio.create_task(EventPublisher(conn, ME).publish(StepFinished(member=ME, step=1, version=0))),
            asyncio.create_task(ExperiencePublisher(conn, "e0").publish(
                ExperienceBatch(member="e0", explore_step=1, model_version=0))),
        ]
        await asyncio.to_thread(own_server.start)
        info, event_seq, exp_seq = await asyncio.wait_for(asyncio.gather(*pending), 60)
        assert info.config.name == conn.names.event_stream
        assert event_seq >= 1 and exp_seq >= 1
        records = await read_all(conn)
        assert [r.event for r in records] == [StepFinished(member=ME, step=1, version=0)]


# -- the object store ------------------------------------------------------------------------------

async def test_memory_object_store_is_recreated_after_a_restart_and_lost_versions_are_reported(own_server):
    """With memory storage a restart loses the weights stream: a publish re-creates it (the trainer
    never fails), and a fetch of a version whose bytes were lost says so (the explorer keeps its
    weights until the next version)."""
    async with connect(own_server.url, job="restart-mem", role="trainer", member="t0") as conn:
        trainer = ObjectStoreTransport(conn.nc, "restart-mem", storage="memory")
        explorer = ObjectStoreTransport(conn.nc, "restart-mem", storage="memory")
        ref1 = await trainer.publish(1, state(1))
        assert same(await explorer.fetch(ref1), state(1))

        await asyncio.to_thread(own_server.kill)
        await conn.wait_disconnected(timeout=5)
        publishing = asyncio.create_task(trainer.publish(2, state(2)))  # while the server is down
        await asyncio.to_thread(own_server.start)
        assert not publishing.done() or publishing.exception() is None
        ref2 = await asyncio.wait_for(publishing, 60)

        with pytest.raises(WeightsNotFound, match="version 1 is not in stream"):
            await explorer.fetch(ref1)
        assert same(await explorer.fetch(ref2), state(2))
        assert await trainer.versions() == [2]
        assert await trainer.prune(keep=2) == []


async def test_file_object_store_fetch_waits_for_a_restarted_server_and_keeps_every_version(own_server):
    async with connect(own_server.url, job="restart-file", role="explorer", member="e0") as conn:
        trainer = ObjectStoreTransport(conn.nc, "restart-file", storage="file")
        explorer = ObjectStoreTransport(conn.nc, "restart-file", storage="file")
        ref1 = await trainer.publish(1, state(1))

        await asyncio.to_thread(own_server.kill)
        await conn.wait_disconnected(timeout=5)
        fetching = asyncio.create_task(explorer.fetch(ref1))  # while the server is down
        await asyncio.to_thread(own_server.start)
        assert same(await asyncio.wait_for(fetching, 60), state(1))

        ref2 = await trainer.publish(2, state(2))  # the transport's cached "stream ready" still holds
        assert same(await explorer.fetch(ref2), state(2))
        assert await trainer.versions() == [1, 2]


async def test_a_server_killed_mid_striped_fetch_is_ridden_out_bit_exact(own_server, monkeypatch):
    """kill -9 while three data connections are landing chunks: every stripe fails, the fetch is
    tried again once the server is back (file storage kept the version) and lands bit-exact."""
    from rolectl.bus.weights import fetch_plan

    async with connect(own_server.url, job="restart-stripes", role="explorer", member="e0") as conn:
        trainer = ObjectStoreTransport(conn.nc, "restart-stripes", storage="file", chunk_size=64 << 10)
        explorer = ObjectStoreTransport(conn.nc, "restart-stripes", storage="file", fetch_connections=3)
        weights = {"w": torch.randn(4 << 20, generator=torch.Generator().manual_seed(3))}  # 16 MiB: 256 chunks
        ref = await trainer.publish(1, weights)
        landed, killed = [], asyncio.Event()
        loop = asyncio.get_running_loop()
        real_landed = fetch_plan.Stripe.landed

        def landed_then_kill(self, headers, digest=None):
            real_landed(self, headers, digest)
            landed.append(1)
            if len(landed) == 10:  # on a stripe's thread, mid-fetch: the other stripes are still receiving
                own_server.kill()
                loop.call_soon_threadsafe(killed.set)

        monkeypatch.setattr(fetch_plan.Stripe, "landed", landed_then_kill)
        fetching = asyncio.create_task(explorer.fetch(ref))
        await asyncio.wait_for(killed.wait(), 30)
        await conn.wait_disconnected(timeout=5)
        assert not fetching.done()
        await asyncio.to_thread(own_server.start)
        got = await asyncio.wait_for(fetching, 60)
        assert torch.equal(got["w"], weights["w"])
        assert len(landed) > 10  # the retry striped again, from a fresh plan


async def test_an_object_store_outage_longer_than_the_budget_is_a_transfer_error(own_server):
    async with connect(own_server.url, job="restart-budget", role="explorer", member="e0") as conn:
        t = ObjectStoreTransport(conn.nc, "restart-budget", storage="file", timeout=0.5,
                                 publish_retry_s=1.5, fetch_retry_s=1.5)
        ref = await t.publish(1, state(1))
        await asyncio.to_thread(own_server.kill)
        await conn.wait_disconnected(timeout=5)
        from rolectl.bus.weights.base import TransferError

        with pytest.raises(TransferError, match="fetch of version 1 .* still failing"):
            await asyncio.wait_for(t.fetch(ref), 20)
        with pytest.raises(TransferError, match="publish of version 2 .* still failing"):
            await asyncio.wait_for(t.publish(2, state(2)), 20)


async def test_replicas_on_a_single_server_is_a_clear_error(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="observer", member="o") as conn:
        with pytest.raises(BusError, match="not part of a JetStream cluster.*nats.replicas: 1"):
            await ensure_event_stream(conn.js, conn.names, replicas=3)


# -- a view starting ---------------------------------------------------------------------------

@pytest.mark.parametrize("make_view", [JobView, lambda conn: MemberView(conn, ["e0"])], ids=["job", "member"])
async def test_a_view_starting_while_the_server_is_away_waits_for_it(own_server, make_view):
    """A role that starts while the server restarts (or a cluster elects a stream leader after losing
    a node: the soak's trainer, restarted into one, exited 1) asks for the stream's end and gets no
    answer: its view (the whole job's, or an explorer's) asks again until the server is back, then
    catches up."""
    async with connect(own_server.url, job="view-start", role="observer", member="o") as conn:
        await ensure_event_stream(conn.js, conn.names)
        seq = await EventPublisher(conn, ME).publish(StepFinished(member=ME, step=1, version=0))
        await asyncio.to_thread(own_server.kill)
        await conn.wait_disconnected(timeout=5)
        failed = asyncio.Event()
        asked = conn.js.stream_info

        async def stream_info(*args, **kwargs):
            try:
                return await asked(*args, **kwargs)
            except Exception:
                failed.set()
                raise

        conn.js.stream_info = stream_info  # type: ignore[method-assign]
        restarter = asyncio.create_task(_restart_after_first_failure(own_server, failed))
        view = make_view(conn)
        try:
            end = await asyncio.wait_for(view.start(), 90)
            await restarter
            assert failed.is_set() and end == seq and view.last_seq == seq
        finally:
            await view.aclose()
