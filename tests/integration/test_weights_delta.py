"""Delta versions in the pull transports against a real nats-server / real files: deltas rebuild the
exact version, a receiver that skipped a version falls back to the keyframe, a corrupt delta chunk is
named and hands nothing out, pruning keeps chains, a server restart loses nothing with file storage.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rolectl.bus.connection import connect
from rolectl.bus.weights.base import CorruptWeights, PullTransport, StoredVersion
from rolectl.bus.weights.checkpoint import CheckpointTransport
from rolectl.bus.weights.delta import cast_source
from rolectl.bus.weights.object_store import ObjectStoreTransport
from tests.support.tensors import assert_bit_exact

KINDS = ["object_store", "object_store_nats_py", "checkpoint"]
CHUNK = 4096


def states(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`count` versions of a small bf16 model, each a small update of the one before (as training makes)."""
    g = torch.Generator().manual_seed(seed)
    master = {
        "embed.weight": torch.randn(256, 32, generator=g),
        "layers.0.w": torch.randn(64, 64, generator=g),
        "layers.0.b": torch.randn(64, generator=g),
        "head.weight": torch.randn(48, 32, generator=g),
    }
    out = []
    for _ in range(count):
        out.append({name: t.to(torch.bfloat16) for name, t in master.items()})
        master = {name: t - 0.004 * torch.randn(t.shape, generator=g) * t.abs() for name, t in master.items()}
    return out


def make(kind: str, nc, job: str, tmp_path, *, interval: int = 4) -> PullTransport:
    if kind == "checkpoint":
        return CheckpointTransport(tmp_path / job, fsync=False, chunk_size=CHUNK, keyframe_interval=interval)
    return ObjectStoreTransport(nc, job, data_connection=(kind == "object_store"), chunk_size=CHUNK,
                                keyframe_interval=interval)


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


async def test_deltas_rebuild_every_version_bit_exact_and_store_less(kind, nc, job_name, tmp_path):
    pub = make(kind, nc, job_name, tmp_path)
    sub = make(kind, nc, job_name, tmp_path)
    versions = states(6)
    kinds, routes = [], []
    for v, state in enumerate(versions, start=1):
        ref = await pub.publish(v, state)
        kinds.append(pub.last_publish["kind"])
        assert_bit_exact(state, await sub.fetch(ref))
        routes.append(sub.last_fetch["route"])
        if pub.last_publish["kind"] == "delta":
            assert pub.last_publish["stored_bytes"] < 0.9 * ref.nbytes, pub.last_publish
            assert sub.last_fetch["bytes_moved"] == pub.last_publish["stored_bytes"]
    # a keyframe every 4 versions; a receiver holding N-1 applies the delta to it
    assert kinds == ["keyframe", "delta", "delta", "delta", "keyframe", "delta"]
    assert routes == ["full", "delta", "delta", "delta", "full", "delta"]


async def test_the_published_ref_says_how_the_version_was_stored(kind, nc, job_name, tmp_path):
    pub = make(kind, nc, job_name, tmp_path)
    versions = states(2)
    keyframe = await pub.publish(1, versions[0])
    delta = await pub.publish(2, versions[1])
    assert keyframe.stored == StoredVersion(kind="keyframe", stored_bytes=keyframe.nbytes,
                                            changed_bytes=keyframe.nbytes)
    assert delta.stored is not None and delta.stored.kind == "delta"
    assert delta.stored.stored_bytes == pub.last_publish["stored_bytes"] < 0.9 * delta.nbytes
    assert delta.stored.changed_bytes == pub.last_publish["changed_bytes"] < delta.nbytes
    # how it was stored is no part of where it lives: the announced ref equals the stored one
    assert await pub.latest() == delta and (await pub.latest()).stored is None


async def test_a_delta_gives_the_digest_a_full_publish_gives(kind, nc, job_name, tmp_path):
    versions = states(2)
    pub = make(kind, nc, job_name, tmp_path)
    await pub.publish(1, versions[0])
    delta_ref = await pub.publish(2, versions[1])
    assert pub.last_publish["kind"] == "delta"
    full = make(kind, nc, job_name + "-full", tmp_path, interval=1)
    full_ref = await full.publish(2, versions[1])
    assert full.last_publish["kind"] == "keyframe"
    assert delta_ref.digest == full_ref.digest and delta_ref.nbytes == full_ref.nbytes


async def test_a_receiver_that_skipped_a_version_is_refused_the_delta_and_fetches_the_keyframe(
        kind, nc, job_name, tmp_path):
    pub = make(kind, nc, job_name, tmp_path)
    sub = make(kind, nc, job_name, tmp_path)
    versions = states(3)
    ref1 = await pub.publish(1, versions[0])
    await sub.fetch(ref1)  # holds version 1
    await pub.publish(2, versions[1])  # skipped by the receiver
    ref3 = await pub.publish(3, versions[2])  # a delta on version 2
    assert pub.last_publish["kind"] == "delta"
    assert_bit_exact(versions[2], await sub.fetch(ref3))
    fetched = sub.last_fetch
    assert fetched["route"] == "keyframe", fetched
    assert fetched["versions"] == [1, 2, 3]
    assert "holds version 1, the delta is on version 2" in fetched["refused"]
    # now holding 3, the next delta applies directly
    ref4 = await pub.publish(4, states(5)[3])
    await sub.fetch(ref4)
    assert sub.last_fetch["route"] == "delta"


async def test_a_fresh_receiver_fetches_the_keyframe_and_the_deltas_after_it(kind, nc, job_name, tmp_path):
    pub = make(kind, nc, job_name, tmp_path)
    versions = states(4)
    for v, state in enumerate(versions, start=1):
        ref = await pub.publish(v, state)
    fresh = make(kind, nc, job_name, tmp_path)
    assert_bit_exact(versions[3], await fresh.fetch(ref))
    assert fresh.last_fetch["route"] == "keyframe" and fresh.last_fetch["versions"] == [1, 2, 3, 4]
    assert fresh.last_fetch["refused"] == "holds no version"


async def tamper_delta_chunk(kind, nc, t, version: int, index: int) -> None:
    if kind == "checkpoint":
        t.tamper_delta_chunk_for_tests(version, index)
        return
    subject = t.names.weights_chunk(version, index)
    msg = await nc.jetstream().get_last_msg(t.stream, subject)
    data = bytearray(msg.data)
    data[len(data) // 2] ^= 0xFF
    await nc.jetstream().publish(subject, bytes(data), stream=t.stream)


@pytest.mark.parametrize("holds_base", [True, False])
async def test_a_corrupt_delta_chunk_names_version_and_chunk_and_hands_nothing_out(
        kind, nc, job_name, tmp_path, holds_base):
    pub = make(kind, nc, job_name, tmp_path)
    sub = make(kind, nc, job_name, tmp_path)
    versions = states(2)
    ref1 = await pub.publish(1, versions[0])
    if holds_base:
        await sub.fetch(ref1)
    ref2 = await pub.publish(2, versions[1])
    assert pub.last_publish["kind"] == "delta"
    await tamper_delta_chunk(kind, nc, pub, 2, 3)
    with pytest.raises(CorruptWeights) as info:
        await sub.fetch(ref2)
    text = str(info.value)
    assert "version 2" in text and "chunk 3 of" in text and "no tensors were returned" in text, text
    assert sub.last_fetch.get("version") != 2
    # the keyframe itself is intact and still served
    assert_bit_exact(versions[0], await make(kind, nc, job_name, tmp_path).fetch(ref1))


async def test_pruning_keeps_the_keyframe_and_deltas_the_kept_versions_need(kind, nc, job_name, tmp_path):
    pub = make(kind, nc, job_name, tmp_path, interval=3)
    versions = states(5)
    refs = []
    for v, state in enumerate(versions, start=1):
        refs.append(await pub.publish(v, state))
    # keyframes 1 and 4; keeping the newest two (4, 5) needs nothing older
    assert await pub.prune(2, announced=range(1, 6)) == [1, 2, 3]
    pub2 = make(kind, nc, job_name + "-b", tmp_path, interval=3)
    for v, state in enumerate(versions[:3], start=1):
        await pub2.publish(v, state)
    # keeping the newest one (3, a delta on 2 on keyframe 1) keeps its whole chain
    assert await pub2.prune(1, announced=[1, 2, 3]) == []
    assert await pub2.prune(1) == []
    fresh = make(kind, nc, job_name + "-b", tmp_path, interval=3)
    assert_bit_exact(versions[2], await fresh.fetch(await pub2.latest()))


async def test_the_wire_dtype_casts_floats_and_keeps_the_rest(kind, nc, job_name, tmp_path):
    master = {"w": torch.randn(8, 8, dtype=torch.float32), "ids": torch.arange(4)}
    pub = make(kind, nc, job_name, tmp_path)
    ref = await pub.publish(1, cast_source(lambda: [list(master.items())], torch.bfloat16))
    got = await make(kind, nc, job_name, tmp_path).fetch(ref)
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], master["w"].bfloat16())
    assert got["ids"].dtype == torch.int64 and torch.equal(got["ids"], master["ids"])
    assert master["w"].dtype == torch.float32  # the master copy is untouched


async def test_a_server_restart_between_a_keyframe_and_its_deltas_loses_nothing_with_file_storage(own_server):
    versions = states(4)
    async with connect(own_server.url, job="restart-delta", role="trainer", member="t0") as conn:
        pub = ObjectStoreTransport(conn.nc, "restart-delta", storage="file", chunk_size=CHUNK,
                                   keyframe_interval=4, reconnected=conn.reconnect_signal)
        await pub.publish(1, versions[0])
        await pub.publish(2, versions[1])

        await asyncio.to_thread(own_server.kill)  # kill -9: nothing flushed on the way out
        await conn.wait_disconnected(timeout=5)
        await asyncio.to_thread(own_server.start)

        ref3 = await pub.publish(3, versions[2])
        assert pub.last_publish["kind"] == "delta"  # the stream, and so the base, survived
        fresh = ObjectStoreTransport(conn.nc, "restart-delta", storage="file", keyframe_interval=4)
        assert_bit_exact(versions[2], await fresh.fetch(ref3))
        assert fresh.last_fetch["versions"] == [1, 2, 3]


async def test_a_lost_memory_stream_makes_the_next_version_a_keyframe(own_server):
    versions = states(3)
    async with connect(own_server.url, job="restart-delta-mem", role="trainer", member="t0") as conn:
        pub = ObjectStoreTransport(conn.nc, "restart-delta-mem", storage="memory", chunk_size=CHUNK,
                                   keyframe_interval=4, reconnected=conn.reconnect_signal)
        await pub.publish(1, versions[0])
        await asyncio.to_thread(own_server.kill)
        await conn.wait_disconnected(timeout=5)
        await asyncio.to_thread(own_server.start)
        ref2 = await pub.publish(2, versions[1])
        assert pub.last_publish["kind"] == "keyframe"  # its base went with the in-memory stream
        fresh = ObjectStoreTransport(conn.nc, "restart-delta-mem", storage="memory", keyframe_interval=4)
        assert_bit_exact(versions[1], await fresh.fetch(ref2))
