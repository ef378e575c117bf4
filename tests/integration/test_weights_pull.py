"""Pull weight transports against a real nats-server / real files: bit-exact round trips, corruption,
partial uploads that never become visible, pruning, missing versions.

The object store runs three times: over its plain data connection, over three of them at once
(a striped fetch), and over the nats-py fallback path.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import nats
import pytest
import torch
from safetensors.torch import load_file

from rolectl.bus.server import NatsServer
from rolectl.bus.subjects import JobNames
from rolectl.bus.weights.base import CorruptWeights, PullTransport, WeightsNotFound, WeightsRef
from rolectl.bus.weights.checkpoint import CheckpointTransport
from rolectl.bus.weights.host_memory import _HUGE_PAGE_MIN
from rolectl.bus.weights.object_store import ObjectStoreTransport
from tests.support.tensors import assert_bit_exact

KINDS = ["object_store", "object_store_striped", "object_store_nats_py", "checkpoint"]
OBJECT_STORE_KINDS = ["object_store", "object_store_striped", "object_store_nats_py"]


def small_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g).bfloat16(),
        "layers.0.attn.w": torch.randn(16, 16, generator=g),
        "layers.0.attn.b": torch.randn(16, generator=g),
        "layers.0.mlp.w": torch.randn(32, 16, generator=g).bfloat16(),
        "position_ids": torch.arange(40, dtype=torch.int64),
        "step": torch.tensor(7, dtype=torch.int64),  # 0-d
        "scale": torch.tensor(1.25),  # 0-d float
        "empty": torch.empty(0, 8),
        "mask": torch.tensor([True, False, True, True]),
    }


def make_transport(kind: str, nc, job: str, tmp_path: Path, **kw) -> PullTransport:
    if kind == "checkpoint":
        kw.pop("chunk_size_os", None)
        return CheckpointTransport(tmp_path / job, fsync=False, **kw)
    chunk = kw.pop("chunk_size_os", None)
    if chunk:
        kw["chunk_size"] = chunk
    if kind == "object_store_striped":
        kw["fetch_connections"] = 3
    return ObjectStoreTransport(nc, job, data_connection=(kind != "object_store_nats_py"), **kw)


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
async def transport(kind, nc, job_name, tmp_path):
    # Small chunks, so even the small state spans many chunks and chunk boundaries split tensors.
    t = make_transport(kind, nc, job_name, tmp_path, chunk_size=256, chunk_size_os=256)
    yield t
    await t.aclose()


# round trips --------------------------------------------------------------------------------------


async def test_round_trip_is_bit_exact(transport):
    state = small_state()
    ref = await transport.publish(1, state)
    assert ref.version == 1 and ref.nbytes == sum(t.numel() * t.element_size() for t in state.values())
    assert_bit_exact(state, await transport.fetch(ref))


@pytest.mark.parametrize("digest", ["blake3", "sha256"])
async def test_a_receiver_checks_with_the_digest_the_publisher_chose(kind, digest, nc, job_name, tmp_path):
    """The manifest names the publisher's algorithm; a receiver built with the default checks every
    chunk with that one."""
    publisher = make_transport(kind, nc, job_name, tmp_path, chunk_size=256, chunk_size_os=256, algorithm=digest)
    receiver = make_transport(kind, nc, job_name, tmp_path)
    try:
        state = small_state(4)
        ref = await publisher.publish(1, state)
        assert ref.digest.startswith(f"{digest}:")
        assert_bit_exact(state, await receiver.fetch(ref))
    finally:
        await publisher.aclose()
        await receiver.aclose()


@pytest.mark.parametrize("method", ["memory", "checkpoint"])
async def test_a_job_publishes_with_its_transport_digest(method, nats_url, job_name, tmp_path):
    from rolectl.bus.connection import connect
    from rolectl.roles.config import JobConfig, parse_config
    from rolectl.roles.transports import make_pull_transport

    def job(**transport) -> JobConfig:
        return parse_config({"job": job_name, "nats_url": nats_url, "synchronizer": {"sync_method": method},
                             "transport": {"checkpoint_dir": str(tmp_path / "weights"), **transport}})

    async with connect(nats_url, job=job_name, role="trainer", member="trainer") as conn:
        chosen, default = make_pull_transport(job(digest="blake3"), conn), make_pull_transport(job(), conn)
        try:
            assert (await chosen.publish(1, small_state(5))).digest.startswith("blake3:")
            assert (await default.publish(2, small_state(6))).digest.startswith("xxh3-128:")
        finally:
            await chosen.aclose()
            await default.aclose()


async def test_a_fetch_lands_in_the_memory_the_last_one_gave_back(transport):
    """`recycle` after the receiver copied a fetch into its model: the next fetch of that size
    writes into the same buffer (no fresh pages to fault in) and is still bit-exact. Tensors of
    any other memory, or a fetch not given back, change nothing."""
    first, second = small_state(1), small_state(2)
    ref1, ref2 = await transport.publish(1, first), await transport.publish(2, second)
    got1 = await transport.fetch(ref1)
    buffer = next(iter(got1.values())).untyped_storage().data_ptr()
    assert not transport.recycle(small_state(3))  # not the fetch's memory: refused
    assert not transport.recycle({n: t.clone() for n, t in got1.items()})
    assert transport.recycle(got1)
    assert not transport.recycle(got1)  # once
    del got1
    got2 = await transport.fetch(ref2)
    assert next(iter(got2.values())).untyped_storage().data_ptr() == buffer
    assert_bit_exact(second, got2)
    kept = got2  # not given back: the next fetch must not write under it
    got3 = await transport.fetch(ref1)
    assert next(iter(got3.values())).untyped_storage().data_ptr() != buffer
    assert_bit_exact(second, kept)
    assert_bit_exact(first, got3)


async def test_a_model_sized_fetch_lands_in_the_memory_the_last_one_gave_back(kind, nc, job_name, tmp_path):
    """Above `_HUGE_PAGE_MIN` a fetch's buffer is a huge-page-aligned view into a larger allocation:
    giving it back must keep that view, so the next fetch writes the same pages."""
    g = torch.Generator().manual_seed(5)
    big = {f"layers.{i}.w": torch.randn(1024, 1024, generator=g) for i in range(_HUGE_PAGE_MIN // (4 << 20) + 2)}
    t = make_transport(kind, nc, job_name, tmp_path)
    try:
        ref1 = await t.publish(1, big)
        ref2 = await t.publish(2, {name: -w for name, w in big.items()})
        got1 = await t.fetch(ref1)
        first = got1["layers.0.w"].data_ptr()
        assert t.recycle(got1)
        del got1
        got2 = await t.fetch(ref2)
        assert got2["layers.0.w"].data_ptr() == first
        assert_bit_exact({name: -w for name, w in big.items()}, got2)
    finally:
        await t.aclose()


async def test_delta_sync_keeps_its_held_version_out_of_recycling(kind, nc, job_name, tmp_path):
    t = make_transport(kind, nc, job_name, tmp_path, keyframe_interval=4)
    try:
        ref = await t.publish(1, small_state(1))
        got = await t.fetch(ref)
        assert not t.recycle(got)  # its memory is the base the next delta applies to
    finally:
        await t.aclose()


async def test_an_empty_state_dict_round_trips(transport):
    ref = await transport.publish(1, {})
    assert ref.nbytes == 0
    assert await transport.fetch(ref) == {}
    only_empty = {"e": torch.empty(0, 3, dtype=torch.bfloat16)}
    ref = await transport.publish(2, only_empty)
    assert_bit_exact(only_empty, await transport.fetch(ref))


async def test_fetched_tensors_are_independent_of_the_sender(transport):
    state = small_state()
    ref = await transport.publish(1, state)
    got = await transport.fetch(ref)
    state["layers.0.attn.w"].zero_()
    assert got["layers.0.attn.w"].abs().sum() > 0


async def test_a_multi_chunk_state_round_trips(kind, nc, job_name, tmp_path):
    # 32 MiB on the fast paths; the pure nats-py fallback parses every byte in Python, so it gets
    # 4 MiB — still many chunks, and the suite stays fast.
    n = 512 if kind == "object_store_nats_py" else 2048
    t = make_transport(kind, nc, job_name, tmp_path)
    g = torch.Generator().manual_seed(1)
    state = {
        "w1": torch.randn(n, n, generator=g),  # 16 MiB fp32 at n=2048
        "w2": torch.randn(n, n, generator=g).bfloat16(),  # 8 MiB
        "ids": torch.arange(n * n // 4, dtype=torch.int64),  # 8 MiB
        "b": torch.randn(n, generator=g),
    }
    ref = await t.publish(3, state)
    assert ref.nbytes > 8 * n * n
    assert_bit_exact(state, await t.fetch(ref))


async def test_explorers_fetch_the_same_version_concurrently(transport):
    state = small_state()
    ref = await transport.publish(2, state)
    results = await asyncio.gather(*(transport.fetch(ref) for _ in range(4)))
    for got in results:
        assert_bit_exact(state, got)


async def test_same_tensors_give_the_same_digest_in_both_transports(nc, job_name, tmp_path):
    state = small_state()
    os_ref = await ObjectStoreTransport(nc, job_name, chunk_size=4096).publish(1, state)
    ck_ref = await CheckpointTransport(tmp_path, chunk_size=4096, fsync=False).publish(1, state)
    assert os_ref.digest == ck_ref.digest


# missing, pruned, republished -----------------------------------------------------------------------


async def test_fetch_of_a_missing_version_is_weights_not_found(transport):
    ghost = WeightsRef(version=42, location="nowhere", nbytes=0, digest="blake3:00")
    with pytest.raises(WeightsNotFound, match="version 42"):
        await transport.fetch(ghost)  # nothing ever published for this job
    await transport.publish(1, small_state())
    with pytest.raises(WeightsNotFound, match="version 42"):
        await transport.fetch(ghost)


async def test_prune_keeps_the_newest_k(transport):
    t = transport
    refs = [await t.publish(v, small_state(v)) for v in range(1, 5)]
    assert await t.versions() == [1, 2, 3, 4]  # publishing never deletes
    assert await t.prune() == [1, 2]  # default: keep 2
    assert await t.versions() == [3, 4]
    assert (await t.latest()).version == 4
    assert await t.prune(1) == [3]
    assert await t.versions() == [4]
    with pytest.raises(WeightsNotFound):
        await t.fetch(refs[2])
    assert_bit_exact(small_state(4), await t.fetch(refs[3]))


async def test_a_republished_version_invalidates_the_old_ref(transport):
    old = await transport.publish(5, small_state(1))
    new = await transport.publish(5, small_state(2))
    assert old.digest != new.digest
    with pytest.raises(WeightsNotFound, match="republished"):
        await transport.fetch(old)
    assert_bit_exact(small_state(2), await transport.fetch(new))


async def test_latest_is_none_before_any_publish(transport):
    assert await transport.latest() is None
    assert await transport.versions() == []


# corruption -----------------------------------------------------------------------------------------


async def tamper_object_store(nc, t: ObjectStoreTransport, version: int, index: int, *, size_delta: int = 0):
    """Replace stored chunk `index` with flipped bytes (same subject: one message per subject)."""
    names = JobNames(t.names.job)
    subject = names.weights_chunk(version, index)
    msg = await nc.jetstream().get_last_msg(t.stream, subject)
    data = bytearray(msg.data)
    data[len(data) // 2] ^= 0xFF
    data = bytes(data) + b"x" * size_delta if size_delta >= 0 else bytes(data[:size_delta])
    await nc.jetstream().publish(subject, data, stream=t.stream)


def tamper_checkpoint(t: CheckpointTransport, version: int, offset_from_end: int) -> None:
    path = t.path_of(version)
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("size_delta", [0, 3, -3])
async def test_a_corrupt_object_store_chunk_names_version_chunk_and_tensor(nc, job_name, tmp_path, size_delta):
    for kind in OBJECT_STORE_KINDS:
        t = make_transport(kind, nc, f"{job_name[:40]}-{len(kind)}", tmp_path, chunk_size_os=256)
        state = small_state()
        ref = await t.publish(4, state)
        await tamper_object_store(nc, t, 4, 2, size_delta=size_delta)
        with pytest.raises(CorruptWeights) as info:
            await t.fetch(ref)
        text = str(info.value)
        assert "version 4 chunk 2 of" in text, text
        assert "tensors " in text and "no tensors were returned" in text


@pytest.mark.parametrize("kind", OBJECT_STORE_KINDS)
async def test_one_chunk_per_request_still_finds_a_rewritten_chunk(nc, job_name, tmp_path, kind):
    # The rewritten chunk sits after the manifest in the stream: only catch-up requests reach it.
    t = make_transport(kind, nc, job_name, tmp_path, chunk_size_os=256, request_bytes=256, window_bytes=1024)
    ref = await t.publish(4, small_state())
    await tamper_object_store(nc, t, 4, 1)
    with pytest.raises(CorruptWeights, match="version 4 chunk 1 of"):
        await t.fetch(ref)


@pytest.mark.parametrize("kind", OBJECT_STORE_KINDS)
async def test_a_deleted_chunk_is_reported_missing(nc, job_name, tmp_path, kind):
    t = make_transport(kind, nc, job_name, tmp_path, chunk_size_os=256, request_bytes=512, window_bytes=1024)
    ref = await t.publish(4, small_state())
    js = nc.jetstream()
    msg = await js.get_last_msg(t.stream, t.names.weights_chunk(4, 3))
    await js.delete_msg(t.stream, msg.seq)
    with pytest.raises(CorruptWeights, match=r"version 4 chunks \[3\] are missing"):
        await t.fetch(ref)


async def test_a_corrupt_checkpoint_file_names_version_chunk_and_tensor(tmp_path):
    t = CheckpointTransport(tmp_path, chunk_size=256, fsync=False)
    ref = await t.publish(4, small_state())
    tamper_checkpoint(t, 4, offset_from_end=10)  # inside the last chunk
    with pytest.raises(CorruptWeights) as info:
        await t.fetch(ref)
    assert f"version 4 chunk {len(range(0, ref.nbytes, 256)) - 1} of" in str(info.value)
    assert "digest mismatch" in str(info.value)


async def test_a_truncated_checkpoint_file_is_corrupt(tmp_path):
    t = CheckpointTransport(tmp_path, chunk_size=256, fsync=False)
    ref = await t.publish(4, small_state())
    path = t.path_of(4)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptWeights, match="bytes, expected"):
        await t.fetch(ref)


async def test_a_corrupt_manifest_is_corrupt_weights(nc, job_name, tmp_path):
    t = make_transport("object_store", nc, job_name, tmp_path)
    ref = await t.publish(6, small_state())
    await nc.jetstream().publish(t.names.weights_manifest(6), b'{"format": "rolectl-weights/1"}')
    with pytest.raises(CorruptWeights, match="malformed manifest"):
        await t.fetch(ref)


async def test_checkpoint_files_are_standard_safetensors(tmp_path):
    t = CheckpointTransport(tmp_path, fsync=False)
    state = small_state()
    await t.publish(1, state)
    assert_bit_exact(state, load_file(t.path_of(1)))


# partial uploads --------------------------------------------------------------------------------


async def test_chunks_without_a_manifest_are_never_visible(nc, job_name, tmp_path):
    t = make_transport("object_store", nc, job_name, tmp_path, chunk_size_os=256)
    ref1 = await t.publish(1, small_state(1))
    ref2 = await t.publish(2, small_state(2))
    # A trainer that died after some chunks of version 3 (no manifest) and some of version 0.
    js = nc.jetstream()
    for version in (0, 3):
        for index in range(3):
            await js.publish(t.names.weights_chunk(version, index), b"\x00" * 256, stream=t.stream)
    assert await t.versions() == [1, 2]
    assert (await t.latest()).version == 2
    with pytest.raises(WeightsNotFound, match="version 3"):
        await t.fetch(WeightsRef(version=3, location="", nbytes=768, digest=ref2.digest))
    # prune cleans the crashed upload older than the newest version, keeps a possible upload in progress
    assert await t.prune(2) == []
    info = await js.stream_info(t.stream, subjects_filter=t.names.all_weights_first_chunks)
    assert sorted(info.state.subjects) == sorted(t.names.weights_chunk(v, 0) for v in (1, 2, 3))
    assert_bit_exact(small_state(1), await t.fetch(ref1))


_PUBLISHER = textwrap.dedent(
    """
    import asyncio, sys, torch, nats
    from rolectl.bus.weights.object_store import ObjectStoreTransport

    async def main(url, job):
        nc = await nats.connect(url)
        # Tiny chunks and one chunk in flight: the upload takes long enough to be killed midway.
        t = ObjectStoreTransport(nc, job, chunk_size=64 * 1024, window_bytes=64 * 1024)
        await t.publish(9, {"w": torch.randn(16 * 1024 * 1024 // 4)})
        print("FINISHED", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_a_publisher_killed_mid_upload_leaves_nothing_visible(nc, nats_url, job_name, tmp_path):
    t = make_transport("object_store", nc, job_name, tmp_path)
    ref1 = await t.publish(1, small_state())
    seen = asyncio.Event()

    async def on_chunk(msg) -> None:
        seen.set()

    sub = await nc.subscribe(t.names.weights_chunks(9), cb=on_chunk)
    await nc.flush()
    proc = subprocess.Popen(
        [sys.executable, "-c", _PUBLISHER, nats_url, job_name],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
    )
    try:
        await asyncio.wait_for(seen.wait(), 60)  # the first chunk is on its way to the stream
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        await sub.unsubscribe()
    assert b"FINISHED" not in proc.stdout.read()
    assert await t.versions() == [1]
    assert (await t.latest()).version == 1
    with pytest.raises(WeightsNotFound, match="version 9"):
        await t.fetch(WeightsRef(version=9, location="", nbytes=0, digest=ref1.digest))


async def test_a_checkpoint_temp_file_is_never_a_version(tmp_path):
    t = CheckpointTransport(tmp_path, fsync=False)
    ref = await t.publish(1, small_state())
    # A writer that died while writing version 2 leaves only its temporary file.
    partial = t.path_of(2).with_name(f".{t.path_of(2).name}.{os.getpid()}.dead.tmp")
    partial.write_bytes(t.path_of(1).read_bytes()[:100])
    assert await t.versions() == [1]
    assert (await t.latest()).version == 1
    with pytest.raises(WeightsNotFound, match="version 2"):
        await t.fetch(WeightsRef(version=2, location=str(partial), nbytes=0, digest=ref.digest))
    await t.publish(3, small_state())  # newer version: the dead temp file is garbage now
    assert await t.prune(2) == []
    assert not partial.exists()


def test_after_a_lost_connection_the_plan_asks_again_for_missing_chunks_only():
    from rolectl.bus.weights.fetch_plan import ChunkPlan
    from rolectl.bus.weights.format import Destination, SourceBytes, build_manifest

    source = SourceBytes({"w": torch.arange(1000, dtype=torch.int64)})  # 8000 bytes: 8 chunks
    manifest = build_manifest(1, source, chunk_size=1000, extra={"first_seq": 11})
    plan = ChunkPlan(manifest, Destination(manifest.layout), "s.>", 2000, 4000, "here")
    sent = [json.loads(b) for b in plan.requests()]
    assert [(r["seq"], r["batch"]) for r in sent] == [(11, 2), (13, 2)]  # 4000-byte window
    for index in (0, 1, 3):  # chunk 2 was on the wire when the server closed the connection
        plan.received[index] = 1
        plan.count += 1
    plan.restart(2000)
    again = [json.loads(b) for b in plan.requests()]
    assert [(r["seq"], r["batch"]) for r in again] == [(13, 2)]  # half the window, from chunk 2


def _chunk_headers(seq: int, index: int) -> dict[str, str]:
    return {"Nats-Sequence": str(seq), "Nats-Subject": f"s.{index}"}


def test_stripes_split_the_plan_and_the_parent_asks_for_what_they_missed():
    from rolectl.bus.weights.fetch_plan import ChunkPlan
    from rolectl.bus.weights.format import Destination, SourceBytes, build_manifest

    source = SourceBytes({"w": torch.arange(2000, dtype=torch.int64)})  # 16000 bytes: 16 chunks
    manifest = build_manifest(1, source, chunk_size=1000, extra={"first_seq": 11})
    plan = ChunkPlan(manifest, Destination(manifest.layout), "s.>", 1000, 4000, "here")
    stripes = plan.stripes(3, 4000)
    assert [s.indices for s in stripes] == [range(0, 5), range(5, 10), range(10, 16)]
    # each its own sequences, at least two chunks in flight (4000 / 3 would be one)
    assert [json.loads(b)["seq"] for b in stripes[1].requests()] == [16, 17]
    assert stripes[1].target(_chunk_headers(11, 0), 1000) is None  # stripe 0's chunk: not its own
    assert stripes[0].target(_chunk_headers(11, 0), 1000) is not None
    for index in range(16):  # every chunk landed but 7: stripe 1's connection dropped
        if index != 7:
            plan.received[index] = 1
    plan.absorb(stripes, 2000)
    assert plan.count == 15 and not plan.done
    assert [(r["seq"], r["batch"]) for r in map(json.loads, plan.requests())] == [(18, 1), (19, 1)]
    # no stripes where sequences are unknown, or a part would be under two chunks
    assert ChunkPlan(build_manifest(1, source, chunk_size=1000), Destination(manifest.layout), "s.>", 1000, 4000,
                      "here").stripes(3, 4000) == []
    assert ChunkPlan(manifest, Destination(manifest.layout), "s.>", 1000, 4000, "here").stripes(9, 4000) == []


async def test_a_striped_fetch_opens_its_connections_and_reports_them(nc, job_name, tmp_path):
    t = make_transport("object_store_striped", nc, job_name, tmp_path, chunk_size_os=256)
    plain = make_transport("object_store", nc, job_name, tmp_path, chunk_size_os=256)
    state = small_state()
    ref = await t.publish(1, state)
    assert_bit_exact(state, await t.fetch(ref))
    assert t.last_fetch["data_connections"] == 3
    assert_bit_exact(state, await plain.fetch(ref))
    assert plain.last_fetch["data_connections"] == 1  # a plain client's default: one
    with pytest.raises(ValueError, match="fetch_connections must be an int >= 1"):
        ObjectStoreTransport(nc, job_name, fetch_connections=0)


async def test_a_refused_stripe_connection_leaves_one_connection_not_nats_py(nc, job_name, tmp_path, monkeypatch):
    """A server at its connection limit refuses one of the stripes' connections: the fetch still
    lands over one data connection (not the slow nats-py path), and later fetches do not stripe.
    The refusal is injected into the second connection a fetch opens, as a real server's -ERR
    reads (the real limit would refuse whichever stripe connected last, which a test cannot pin)."""
    from rolectl.bus.weights import _wire_client

    t = make_transport("object_store_striped", nc, job_name, tmp_path, chunk_size_os=256)
    state = small_state()
    ref = await t.publish(1, state)
    real_open, opened = _wire_client.DataConnection.open, []

    def open_at_the_limit(self) -> None:
        opened.append(self)
        if len(opened) == 2:
            raise _wire_client.NoDataConnection("server greeting is not INFO: b\"-ERR 'maximum connections exceeded'\"")
        real_open(self)

    monkeypatch.setattr(_wire_client.DataConnection, "open", open_at_the_limit)
    assert_bit_exact(state, await t.fetch(ref))
    assert t.last_fetch["data_connections"] == 4  # three tried, then one for the rest
    assert_bit_exact(state, await t.fetch(ref))
    assert t.last_fetch["data_connections"] == 1 and len(opened) == 5


def test_by_default_only_a_tls_fetch_is_striped():
    from rolectl.bus.weights.data_plane import fetch_connections_for

    assert fetch_connections_for(secure=False) == 1
    assert fetch_connections_for(secure=True) == min(4, max(2, len(os.sched_getaffinity(0)) // 2))


# storage and lifecycle ------------------------------------------------------------------------------


async def test_file_storage_keeps_versions_across_a_server_restart(tmp_path):
    server = NatsServer(store_dir=str(tmp_path / "nats"))
    await asyncio.to_thread(server.start)
    try:
        client = await nats.connect(server.url)
        t = ObjectStoreTransport(client, "restart", storage="file")
        ref = await t.publish(1, small_state())
        await client.close()
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start)  # same port, same store
        client = await nats.connect(server.url)
        t = ObjectStoreTransport(client, "restart", storage="file")
        assert (await t.latest()) == ref
        assert_bit_exact(small_state(), await t.fetch(ref))
        await client.close()
    finally:
        await asyncio.to_thread(server.stop)


async def test_cancelling_a_blocked_transfer_aborts_its_data_connection(nc, job_name, tmp_path):
    t = make_transport("object_store", nc, job_name, tmp_path)
    ref = await t.publish(1, small_state())
    loop = asyncio.get_running_loop()
    blocked = asyncio.Event()

    def work(conn):
        loop.call_soon_threadsafe(blocked.set)
        conn.next_message()  # nothing was asked for: blocks until the socket is aborted

    task = asyncio.create_task(t._in_thread(work))
    await asyncio.wait_for(blocked.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)  # a hang here fails the test instead of the suite
    assert_bit_exact(small_state(), await t.fetch(ref))


# the interface ----------------------------------------------------------------------------------------


async def test_transports_satisfy_the_pull_protocol(transport):
    assert isinstance(transport, PullTransport)
    await transport.aclose()
    await transport.aclose()  # safe twice


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_fetch_to_cuda(transport):
    state = small_state()
    ref = await transport.publish(1, state)
    got = await transport.fetch(ref, device="cuda")
    assert all(t.device.type == "cuda" for t in got.values())
    assert_bit_exact(state, {k: v.cpu() for k, v in got.items()})


# junk on the weight subjects ----------------------------------------------------------------------


async def test_junk_manifests_are_never_versions_and_never_push_real_ones_out(nc, job_name, tmp_path):
    t = make_transport("object_store", nc, job_name, tmp_path, chunk_size_os=256)
    refs = {v: await t.publish(v, small_state(v)) for v in (1, 2, 3)}
    js = nc.jetstream()
    # Junk with high version numbers: not JSON, a JSON object that is no manifest, a valid
    # manifest of version 2 filed under version 999999 (mislabelled), and a lone junk chunk.
    await js.publish(t.names.weights_manifest(1_000_000), b"\xc1 junk", stream=t.stream)
    await js.publish(t.names.weights_manifest(1_000_001), b'{"format": "rolectl-weights/1"}', stream=t.stream)
    stored_2 = await nc.request(f"$JS.API.DIRECT.GET.{t.stream}.{t.names.weights_manifest(2)}", b"", timeout=5)
    await js.publish(t.names.weights_manifest(999_999), stored_2.data, stream=t.stream)
    await js.publish(t.names.weights_chunk(5_000_000, 0), b"\x00" * 256, stream=t.stream)

    assert await t.versions() == [1, 2, 3]  # junk never counts as a version
    assert (await t.latest()).version == 3
    assert t.junk_manifests >= 3

    # Pruning by the announced versions keeps the newest announced ones and removes all junk.
    assert await t.prune(2, announced=[1, 2, 3]) == [1, 999_999, 1_000_000, 1_000_001, 5_000_000]
    info = await js.stream_info(t.stream, subjects_filter=t.names.all_weights)
    versions_left = {int(s.split(".")[3]) for s in info.state.subjects}
    assert versions_left == {2, 3}
    for v in (2, 3):
        assert_bit_exact(small_state(v), await t.fetch(refs[v]))


async def test_prune_by_announced_versions_on_a_checkpoint_directory(tmp_path):
    t = CheckpointTransport(tmp_path, chunk_size=256, fsync=False)
    for v in (1, 2, 3, 7):
        await t.publish(v, small_state(v))
    # 7 was never announced (a stray file): it neither counts among the kept nor survives.
    assert await t.prune(2, announced=[1, 2, 3]) == [1, 7]
    assert await t.versions() == [2, 3]
