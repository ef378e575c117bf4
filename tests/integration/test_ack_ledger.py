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


async def test_a_redelivered_message_its_checkpoint_marked_trained_is_acked_not_trained(conn, tmp_path):
    seq = await ExperiencePublisher(conn, "e0").publish(_batch(1))
    reader = ExperienceReader(conn, ack_wait_s=600)
    # The checkpoint acked it, and the process died before the server confirmed the ack.
    ledger = AckLedger(reader, held_file=tmp_path / "held.json", log=structlog.get_logger(),
                       saved={"acked_seqs": [seq], "partial": {}})
    [msg] = await reader.fetch(8, timeout=5)
    assert await ledger.receive(msg) == [] and ledger.held == {}
    assert await reader.ack_floor() == seq and ledger.acked_at_save == set()
