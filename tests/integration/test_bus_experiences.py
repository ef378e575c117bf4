"""bus.experiences against a real nats-server: codec, publish/fetch/ack, dedup, redelivery, garbage, and
batches over the stream's message limit (split by group, or refused)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from rolectl.bus.connection import connect
from rolectl.bus.errors import MalformedExperience, PayloadTooLarge
from rolectl.bus.experiences import (
    Experience,
    ExperienceBatch,
    ExperiencePublisher,
    ExperienceReader,
    decode_batch,
    encode_batch,
    experience_msg_id,
    split_by_group,
)
from rolectl.bus.streams import ensure_experience_stream


def _batch(step: int, member: str = "e0", n: int = 2) -> ExperienceBatch:
    return ExperienceBatch(
        member=member,
        explore_step=step,
        model_version=step - 1,
        experiences=tuple(
            Experience(
                id=f"{member}-{step}-{i}",
                group=f"g{step}",
                prompt=(1, 2, 3, 151_000),
                response=(7, 8, -1),
                logprobs=(-0.5, -1.25, 0.0),  # float32-exact, so the round trip is equal
                reward=0.75 * i,
                model_version=step - 1,
            )
            for i in range(n)
        ),
    )


@pytest.fixture
async def conn(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="explorer", member="e0") as c:
        await ensure_experience_stream(c.js, c.names)
        yield c


def test_codec_round_trip_and_compact_token_arrays():
    batch = _batch(3, n=3)
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    raw = msgpack.unpackb(payload)
    assert raw["schema"] == 1
    assert raw["experiences"][0]["prompt"] == (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + \
        (3).to_bytes(4, "little") + (151_000).to_bytes(4, "little")


def _two_turn_episode(model_version: int = 2) -> Experience:
    """Turn 1 sampled by version 2, a tool's answer (mask 0), turn 2 sampled by version 3."""
    return Experience(id="e0-4-0", group="g4", prompt=(1, 2), response=(7, 8, 50, 51, 52, 9, 3),
                      logprobs=(-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -0.125), reward=1.0, model_version=model_version,
                      loss_mask=(1, 1, 0, 0, 0, 1, 1), token_versions=((5, 2), (2, 3)))


def test_a_multi_turn_episode_round_trips_as_schema_2():
    batch = ExperienceBatch(member="e0", explore_step=4, model_version=3,
                            experiences=(_two_turn_episode(), *_batch(4).experiences))
    payload = encode_batch(batch)
    assert decode_batch(payload) == batch
    raw = msgpack.unpackb(payload)
    assert raw["schema"] == 2
    assert raw["experiences"][0]["loss_mask"] == bytes([1, 1, 0, 0, 0, 1, 1])
    assert "loss_mask" not in raw["experiences"][1]  # single-turn records carry nothing new


def test_a_schema_1_record_decodes_as_a_single_turn_episode():
    payload = encode_batch(_batch(3))
    assert msgpack.unpackb(payload)["schema"] == 1  # what builds before trajectories wrote and read
    exp = decode_batch(payload).experiences[0]
    assert exp.loss_mask is None and exp.token_versions is None
    assert exp.mask() == (1, 1, 1) and exp.versions() == (2, 2, 2) and exp.turns == 1


def test_an_episode_says_its_turns_segments_and_trained_tokens():
    exp = _two_turn_episode()
    assert exp.turns == 2 and exp.trained_tokens == 4
    assert exp.versions() == (2, 2, 2, 2, 2, 3, 3)
    assert [(s.start, s.end, s.sampled, s.version) for s in exp.segments()] == [
        (0, 2, True, 2), (2, 5, False, 2), (5, 7, True, 3)]


def test_logprobs_travel_as_float32():
    exp = Experience(id="x", group="g", prompt=(), response=(1,), logprobs=(0.1,), reward=1, model_version=0)
    back = decode_batch(encode_batch(ExperienceBatch(member="e0", explore_step=1, model_version=0,
                                                     experiences=(exp,))))
    assert back.experiences[0].logprobs == pytest.approx((0.1,), rel=1e-7)


@pytest.mark.parametrize(
    "payload, words",
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"schema": 99, "member": "e0"}), "schema 99"),
        (msgpack.packb({"schema": 1, "member": "e0", "explore_step": 1, "model_version": 0,
                        "experiences": [{"id": "x"}]}), "missing field 'group'"),
        (msgpack.packb({"schema": 1, "member": "e0", "explore_step": 1, "model_version": 0,
                        "experiences": [{"id": "x", "group": "g", "prompt": b"\x01\x02\x03",
                                         "response": b"", "logprobs": b"", "reward": 0.0,
                                         "model_version": 0}]}), "whole number"),
        (msgpack.packb({"schema": 2, "member": "e0", "explore_step": 1, "model_version": 0,
                        "experiences": [{"id": "x", "group": "g", "prompt": b"", "response": b"",
                                         "logprobs": b"", "reward": 0.0, "model_version": 0,
                                         "token_versions": b"\x01\x00\x00\x00"}]}), "not \\(count, version\\) pairs"),
    ],
)
def test_decode_rejects_malformed_input_with_a_typed_error(payload, words):
    with pytest.raises(MalformedExperience, match=words):
        decode_batch(payload)


def test_encode_rejects_token_ids_outside_int32():
    exp = Experience(id="x", group="g", prompt=(2**31,), response=(), logprobs=(), reward=0, model_version=0)
    with pytest.raises(ValueError, match="int32"):
        encode_batch(ExperienceBatch(member="e0", explore_step=1, model_version=0, experiences=(exp,)))


async def test_published_batches_are_fetched_acked_and_gone(conn):
    pub = ExperiencePublisher(conn, "e0")
    batches = [_batch(s) for s in (1, 2, 3)]
    for b in batches:
        await pub.publish(b)

    async with ExperienceReader(conn, ack_wait_s=30) as reader:
        got = await reader.fetch(10, timeout=5)
        assert [r.batch for r in got] == batches
        assert all(r.num_delivered == 1 for r in got)
        for r in got:
            await r.ack()
        assert await reader.fetch(10, timeout=0.3) == []

    info = await conn.js.stream_info(conn.names.experience_stream)
    assert info.state.messages == 0  # work-queue: acked batches are deleted


async def test_the_ack_floor_passes_a_batch_only_once_it_and_all_before_it_are_acked(conn):
    """What a restarted trainer prunes its checkpoint's `acked_seqs` with."""
    pub = ExperiencePublisher(conn, "e0")
    seqs = [await pub.publish(_batch(s)) for s in (1, 2, 3)]
    async with ExperienceReader(conn, ack_wait_s=30) as reader:
        assert await reader.ack_floor() == 0
        got = await reader.fetch(10, timeout=5)
        await got[1].ack()
        assert await reader.ack_floor() < seqs[1]  # the first is still held: the floor stays below it
        await got[0].ack()
        assert await reader.ack_floor() == seqs[1]
        await got[2].ack()
        assert await reader.ack_floor() == seqs[2]


async def test_republished_step_is_stored_once(conn):
    pub = ExperiencePublisher(conn, "e0")
    first = await pub.publish(_batch(5))
    assert await pub.publish(_batch(5)) == first  # a restarted explorer re-publishing step 5

    info = await conn.js.stream_info(conn.names.experience_stream)
    assert info.state.messages == 1
    msg = await conn.js.get_msg(conn.names.experience_stream, first)
    assert msg.subject == conn.names.experiences("e0") and msg.headers["Nats-Msg-Id"] == "exp/e0/5"


async def test_batches_of_a_dead_trainer_are_redelivered_to_the_next(nats_url, job_name, conn):
    await ExperiencePublisher(conn, "e0").publish(_batch(1))
    await ExperiencePublisher(conn, "e0").publish(_batch(2))

    # First trainer takes both and dies (its connection closes) without acking.
    async with connect(nats_url, job=job_name, role="trainer", member="t0") as first:
        held = await ExperienceReader(first, ack_wait_s=1.0).fetch(10, timeout=5)
        assert [r.batch.explore_step for r in held] == [1, 2]

    async with connect(nats_url, job=job_name, role="trainer", member="t0") as second:
        reader = ExperienceReader(second, ack_wait_s=1.0)
        got: list = []
        async def until_both() -> None:
            while len(got) < 2:
                got.extend(await reader.fetch(10, timeout=1.0))
        await asyncio.wait_for(until_both(), 10)
        for r in got:
            await r.ack()

    assert sorted(r.batch.explore_step for r in got) == [1, 2]
    assert all(r.num_delivered == 2 for r in got)


async def test_a_restarted_trainer_gets_its_predecessors_batches_back_at_once(nats_url, job_name, conn):
    """The dead trainer's held batches come back on the new one's nak of their ack subjects,
    long before ack_wait (here 600 s: without the give-back the test would time out)."""
    for step in (1, 2):
        await ExperiencePublisher(conn, "e0").publish(_batch(step))
    async with connect(nats_url, job=job_name, role="trainer", member="t0") as first:
        held = await ExperienceReader(first, ack_wait_s=600).fetch(10, timeout=5)
        ack_subjects = [r.ack_subject for r in held]
    assert len(ack_subjects) == 2

    async with connect(nats_url, job=job_name, role="trainer", member="t0") as second:
        reader = ExperienceReader(second, ack_wait_s=600)
        assert await reader.fetch(10, timeout=0.5) == []  # still held by the dead one
        assert await reader.give_back(ack_subjects + ["$JS.ACK.OTHER.trainer.1.9.9.0.0", "junk"]) == 2
        got: list = []
        async def until_both() -> None:
            while len(got) < 2:
                got.extend(await reader.fetch(10, timeout=1.0))
        await asyncio.wait_for(until_both(), 20)
        for r in got:
            await r.ack()
    assert sorted(r.batch.explore_step for r in got) == [1, 2]


async def test_nak_gives_a_batch_back_at_once(conn):
    await ExperiencePublisher(conn, "e0").publish(_batch(1))
    reader = ExperienceReader(conn, ack_wait_s=30)
    [held] = await reader.fetch(1, timeout=5)
    await held.nak()
    [again] = await reader.fetch(1, timeout=5)
    assert again.seq == held.seq and again.num_delivered == 2
    await again.ack()


async def test_garbage_on_the_experience_subject_is_terminated_and_counted(conn):
    pub = ExperiencePublisher(conn, "e0")
    await pub.publish(_batch(1))
    await conn.js.publish(conn.names.experiences("e0"), b"\xc1 not a batch")
    await conn.js.publish(conn.names.experiences("e0"), msgpack.packb({"schema": 1}))
    await pub.publish(_batch(2))

    reader = ExperienceReader(conn, ack_wait_s=1.0)
    got = await reader.fetch(10, timeout=5)

    assert [r.batch.explore_step for r in got] == [1, 2]
    assert reader.malformed == 2
    for r in got:
        await r.ack()
    info = await conn.js.stream_info(conn.names.experience_stream)
    assert info.state.messages == 0  # terminated garbage is not kept for redelivery


async def test_batches_that_do_not_fit_the_engine_are_terminated_counted_and_name_the_sender(conn):
    from rolectl.bus.experiences import ExperienceLimits

    limits = ExperienceLimits(vocab_size=200_000, prompt_length=4, max_response_length=3, group_size=2)

    def good(step: int) -> ExperienceBatch:
        batch = _batch(step)
        return dataclass_replace(batch, experiences=tuple(dataclass_replace(e, response=(7, 8, 9))
                                                          for e in batch.experiences))

    pub = ExperiencePublisher(conn, "e0")
    await pub.publish(good(1))
    bad = good(2)
    nan_reward = dataclass_replace(bad.experiences[0], reward=float("nan"))
    await pub.publish(dataclass_replace(bad, experiences=(nan_reward, bad.experiences[1])))
    # A batch of e0's published on e1's subject: schema-valid, but not e1's to send.
    await conn.js.publish(conn.names.experiences("e1"), encode_batch(good(3)))
    await pub.publish(good(4))

    reader = ExperienceReader(conn, ack_wait_s=1.0, limits=limits)
    got = await reader.fetch(10, timeout=5)

    assert [r.batch.explore_step for r in got] == [1, 4]
    assert (reader.invalid, reader.malformed, reader.rejected) == (2, 0, 2)
    for r in got:
        await r.ack()
    info = await conn.js.stream_info(conn.names.experience_stream)
    assert info.state.messages == 0  # terminated: never redelivered, never trained


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def _episodes(step: int, *, groups: int, group_size: int = 2, turns: int = 8, member: str = "e0") -> ExperienceBatch:
    """`groups` groups of multi-turn episodes: `turns` sampled turns of 6 tokens, each but the last
    followed by a 10-token observation (mask 0)."""
    turn, observation = (1, 2, 3, 4, 5, 6), (20,) * 10
    response = tuple(t for k in range(turns) for t in (*turn, *(observation if k < turns - 1 else ())))
    mask = tuple(m for k in range(turns) for m in ((1,) * 6 + ((0,) * 10 if k < turns - 1 else ())))
    return ExperienceBatch(member=member, explore_step=step, model_version=1, experiences=tuple(
        Experience(id=f"{member}-{step}-{g}-{k}", group=f"{member}-{step}-{g}", prompt=(9,) * (3 + g),
                   response=response, logprobs=tuple(-0.5 * m for m in mask), reward=float(k), model_version=1,
                   loss_mask=mask)
        for g in range(groups) for k in range(group_size)))


@pytest.fixture
async def small_stream(nats_url, job_name):
    """An experience stream whose messages carry at most 4 KiB: a batch of 6 groups of 8-turn episodes
    (about 2 KiB a group) is over it."""
    async with connect(nats_url, job=job_name, role="explorer", member="e0") as c:
        await ensure_experience_stream(c.js, c.names, max_msg_size=4096)
        yield c


async def test_a_batch_over_the_message_limit_travels_one_group_a_message(small_stream):
    from rolectl.bus.experiences import ExperienceLimits

    conn, batch = small_stream, _episodes(3, groups=6)
    assert 4096 < len(encode_batch(batch)) and all(len(encode_batch(ExperienceBatch(
        member="e0", explore_step=3, model_version=1, experiences=batch.experiences[i:i + 2]))) < 3800
        for i in range(0, 12, 2))
    first = await ExperiencePublisher(conn, "e0").publish(batch)
    limits = ExperienceLimits(vocab_size=32, prompt_length=None, max_response_length=200, group_size=2)
    reader = ExperienceReader(conn, ack_wait_s=30, limits=limits)
    got = await reader.fetch(20, timeout=5)
    assert reader.rejected == 0 and [r.seq for r in got] == list(range(first, first + 6))
    assert [r.batch.experiences for r in got] == [batch.experiences[i:i + 2] for i in range(0, 12, 2)]
    assert all((r.batch.member, r.batch.explore_step, r.batch.model_version) == ("e0", 3, 1) for r in got)
    ids = [(await conn.js.get_msg(conn.names.experience_stream, r.seq)).headers["Nats-Msg-Id"] for r in got]
    assert ids == [f"exp/e0/3/{g}" for g in range(6)]
    for r in got:
        await r.ack()


async def test_a_split_step_published_again_is_stored_once_even_after_a_partial_publish(small_stream):
    """An explorer killed mid-way through a split step's messages publishes the step again when it
    restarts (here with episodes of other lengths, as newer weights would sample): each group is
    stored once, the first time."""
    conn = small_stream
    first = _episodes(4, groups=6)
    for index, group in enumerate(split_by_group(first)[:2]):  # the dead explorer got two groups out
        await conn.publish_acked(conn.names.experiences("e0"), encode_batch(group),
                                 msg_id=experience_msg_id("e0", 4, index))
    again = _episodes(4, groups=6, turns=7)
    await ExperiencePublisher(conn, "e0").publish(again)
    await ExperiencePublisher(conn, "e0").publish(again)  # and once more: nothing new
    info = await conn.js.stream_info(conn.names.experience_stream)
    assert info.state.messages == 6
    got = await ExperienceReader(conn, ack_wait_s=30).fetch(20, timeout=5)
    stored = [e for r in got for e in r.batch.experiences]
    assert sorted(e.id for e in stored) == sorted(e.id for e in first.experiences)  # every group once
    assert stored[:4] == list(first.experiences[:4]) and stored[4:] == list(again.experiences[4:])
    for r in got:
        await r.ack()


async def test_a_group_over_the_message_limit_is_refused_naming_the_settings(small_stream):
    conn = small_stream
    big = _episodes(5, groups=3, group_size=4, turns=12)
    with pytest.raises(PayloadTooLarge) as refused:
        await ExperiencePublisher(conn, "e0").publish(big)
    message = str(refused.value)
    assert "group 'e0-5-0'" in message and "agent.max_tokens" in message and "max_msg_size" in message
    assert "buffer.batch_size" in message and conn.names.experience_stream in message
    assert refused.value.limit < 4096 < refused.value.size
    info = await conn.js.stream_info(conn.names.experience_stream)
    assert info.state.messages == 0  # nothing of the batch was sent
