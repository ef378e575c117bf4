"""The trainer's ack ledger (`roles.ack_ledger`) against a real nats-server: a message is acked only once a
checkpoint covers every experience in it, and a restarted ledger trains each experience exactly once."""

from __future__ import annotations

import json

import pytest
import structlog

from rolectl.bus.connection import connect
from rolectl.bus.experiences import Experience, ExperienceBatch, ExperiencePublisher, ExperienceReader
from rolectl.bus.streams import ensure_experience_stream
from rolectl.roles.ack_ledger import AckLedger
from tests.support.wait import wait_until


def _batch(step: int) -> ExperienceBatch:
    return ExperienceBatch(member="e0", explore_step=step, model_version=0, experiences=tuple(
        Experience(id=f"e0-{step}-{i}", group=f"g{step}", prompt=(1, 2), response=(3,), logprobs=(-0.5,),
                   reward=float(i), model_version=0) for i in range(2)))


@pytest.fixture
async def conn(nats_url, job_name):
    async with connect(nats_url, job=job_name, role="trainer", member="trainer") as c:
        await ensure_experience_stream(c.js, c.names)
        yield c


async def _receive_all(ledger: AckLedger, reader: ExperienceReader, count: int) -> None:
    """Fetch until `count` experiences are pending, as the trainer's fill loop does."""
    async def enough() -> bool:
        for msg in await reader.fetch(8, timeout=0.5):
            ledger.pending.extend((msg.seq, index, exp) for index, exp in await ledger.receive(msg))
        ledger.record_held()
        return len(ledger.pending) >= count
    await wait_until(enough, timeout=30, what=f"{count} experiences fetched")


async def test_a_message_is_acked_once_a_checkpoint_covers_it_and_a_restart_trains_only_its_rest(conn, tmp_path):
    pub = ExperiencePublisher(conn, "e0")
    first, second = [await pub.publish(_batch(step)) for step in (1, 2)]
    held_file = tmp_path / "held_batches.json"
    log = structlog.get_logger()
    reader = ExperienceReader(conn, ack_wait_s=600)
    ledger = AckLedger(reader, held_file=held_file, log=log)
    await _receive_all(ledger, reader, 4)
    trained = ledger.start_step(3)  # the first message whole, one experience of the second
    assert [e.id for e in trained] == ["e0-1-0", "e0-1-1", "e0-2-0"]

    before_trained = ledger.at_checkpoint()  # a save while the step is in flight acks nothing of it
    assert before_trained.done == () and before_trained.state["partial"] == {str(first): [0, 1], str(second): [1, 0]}
    ledger.step_trained()
    acks = ledger.at_checkpoint()
    assert [m.seq for m in acks.done] == [first]
    assert acks.state == {"acked_seqs": [first], "partial": {str(second): [1]}}
    await ledger.ack_trained(acks)
    assert await reader.ack_floor() == first and set(ledger.held) == {second}
    assert [b["seq"] for b in json.loads(held_file.read_text())["batches"]] == [second]
    await reader.aclose()

    # A restart: the new ledger gives back what its predecessor held and trains only the rest.
    restarted = AckLedger(reader, held_file=held_file, log=log, saved=acks.state)
    await restarted.give_back_predecessors()  # at once, not after the 600 s ack wait
    await _receive_all(restarted, reader, 1)
    assert [(seq, e.id) for seq, _, e in restarted.pending] == [(second, "e0-2-1")]
    restarted.start_step()
    restarted.step_trained()
    final = restarted.at_checkpoint()
    assert final.state == {"acked_seqs": [first, second], "partial": {}}
    await restarted.ack_trained(final)
    await restarted.forget_confirmed()
    assert restarted.acked_at_save == set() and await reader.ack_floor() == second
    assert await reader.fetch(8, timeout=0.5) == []  # nothing left to train, nothing trained twice


def _explorer_batch(member: str, step: int) -> ExperienceBatch:
    return ExperienceBatch(member=member, explore_step=step, model_version=0, experiences=tuple(
        Experience(id=f"{member}-{step}-{t}-{k}", group=f"{member}-{step}-{t}", prompt=(1, 2), response=(3,),
                   logprobs=(-0.5,), reward=float(k), model_version=0) for t in range(2) for k in range(2)))


@pytest.mark.parametrize("first", ["e1", "e0"])
async def test_a_step_trains_its_experiences_in_one_order_whichever_explorer_published_first(conn, tmp_path,
                                                                                               first):
    """The rows of a step (so its minibatches) are in explore step, explorer, task, response order,
    not in the order the explorers' batches reached the stream: a synchronous job is reproducible."""
    second = "e0" if first == "e1" else "e1"
    for member in (first, second):
        await ExperiencePublisher(conn, member).publish(_explorer_batch(member, 1))
    reader = ExperienceReader(conn, ack_wait_s=600)
    ledger = AckLedger(reader, held_file=tmp_path / "held.json", log=structlog.get_logger())
    await _receive_all(ledger, reader, 8)
    assert [e.id for _, _, e in ledger.pending][0].startswith(first)  # as they arrived
    assert [e.id for e in ledger.start_step(8)] == [f"{m}-1-{t}-{k}" for m in ("e0", "e1") for t in range(2)
                                                   for k in range(2)]
    await reader.aclose()


async def test_a_redelivered_message_its_checkpoint_marked_trained_is_acked_not_trained(conn, tmp_path):
    seq = await ExperiencePublisher(conn, "e0").publish(_batch(1))
    reader = ExperienceReader(conn, ack_wait_s=600)
    # The checkpoint acked it, and the process died before the server confirmed the ack.
    ledger = AckLedger(reader, held_file=tmp_path / "held.json", log=structlog.get_logger(),
                       saved={"acked_seqs": [seq], "partial": {}})
    [msg] = await reader.fetch(8, timeout=5)
    assert await ledger.receive(msg) == [] and ledger.held == {}
    assert await reader.ack_floor() == seq and ledger.acked_at_save == set()


def _episodes(step: int, *, turns: int) -> ExperienceBatch:
    """6 groups of two multi-turn episodes (~1.5 KiB a group): over a 4 KiB message limit together."""
    response = (3,) * (12 * turns)
    mask = tuple(1 if i % 12 < 6 else 0 for i in range(len(response)))
    return ExperienceBatch(member="e0", explore_step=step, model_version=0, experiences=tuple(
        Experience(id=f"e0-{step}-{g}-{k}", group=f"g{step}-{g}", prompt=(1, 2), response=response,
                   logprobs=(-0.5,) * len(response), reward=float(k), model_version=0, loss_mask=mask)
        for g in range(6) for k in range(2)))


async def test_a_step_split_by_group_is_trained_exactly_once_across_restarts_of_both_sides(nats_url, job_name,
                                                                                          tmp_path):
    async with connect(nats_url, job=job_name, role="trainer", member="trainer") as conn:
        await ensure_experience_stream(conn.js, conn.names, max_msg_size=4096)
        await ExperiencePublisher(conn, "e0").publish(_episodes(1, turns=8))
        held_file, log = tmp_path / "held_batches.json", structlog.get_logger()
        reader = ExperienceReader(conn, ack_wait_s=600)
        ledger = AckLedger(reader, held_file=held_file, log=log)
        await _receive_all(ledger, reader, 12)
        assert len(ledger.held) == 6  # one message a group
        trained = [e.id for e in ledger.start_step(5)]  # two groups whole, one episode of the third
        ledger.step_trained()
        acks = ledger.at_checkpoint()
        assert len(acks.done) == 2 and len(acks.state["partial"]) == 4
        await ledger.ack_trained(acks)
        await reader.aclose()

        # The explorer restarts and publishes the step again, its episodes now of other lengths.
        await ExperiencePublisher(conn, "e0").publish(_episodes(1, turns=7))
        restarted = AckLedger(reader, held_file=held_file, log=log, saved=acks.state)
        await restarted.give_back_predecessors()
        await _receive_all(restarted, reader, 7)
        trained += [e.id for e in restarted.start_step()]
        restarted.step_trained()
        await restarted.ack_trained(restarted.at_checkpoint())
        assert await reader.fetch(8, timeout=0.5) == []
    assert sorted(trained) == sorted(e.id for e in _episodes(1, turns=8).experiences)  # each once
