"""`roles.ack_ledger.train_order`: where an experience goes in a train step depends on its explore
step, its explorer and its place in that explorer's output, never on which batch arrived first."""

from __future__ import annotations

from itertools import permutations

from rolectl.roles.ack_ledger import train_order
from rolectl.sync_protocol.experience import Experience, ExperienceBatch


def _batch(member: str, step: int, tasks: int = 2, group_size: int = 2) -> ExperienceBatch:
    return ExperienceBatch(member=member, explore_step=step, model_version=0, experiences=tuple(
        Experience(id=f"{member}-{step}-{t}-{k}", group=f"{member}-{step}-{t}", prompt=(1,), response=(2,),
                   logprobs=(-0.5,), reward=0.0, model_version=0)
        for t in range(tasks) for k in range(group_size)))


def _ordered(arrivals: list[ExperienceBatch]) -> list[str]:
    """The ids of a step made of `arrivals` (stream seqs 1, 2, ... in that order), in train order."""
    rows = [(batch, seq, index, exp) for seq, batch in enumerate(arrivals, start=1)
            for index, exp in enumerate(batch.experiences)]
    return [exp.id for batch, seq, index, exp in sorted(rows, key=lambda r: train_order(r[0], r[1], r[2]))]


def test_a_steps_rows_are_the_same_whichever_explorers_batch_arrived_first():
    batches = [_batch("explorer-0", 1), _batch("explorer-1", 1), _batch("explorer-0", 2), _batch("explorer-1", 2)]
    orders = {tuple(_ordered(list(arrival))) for arrival in permutations(batches)}
    assert orders == {(
        "explorer-0-1-0-0", "explorer-0-1-0-1", "explorer-0-1-1-0", "explorer-0-1-1-1",
        "explorer-1-1-0-0", "explorer-1-1-0-1", "explorer-1-1-1-0", "explorer-1-1-1-1",
        "explorer-0-2-0-0", "explorer-0-2-0-1", "explorer-0-2-1-0", "explorer-0-2-1-1",
        "explorer-1-2-0-0", "explorer-1-2-0-1", "explorer-1-2-1-0", "explorer-1-2-1-1",
    )}


def test_an_explorers_step_sent_a_group_a_message_keeps_the_order_it_was_sent_in():
    """A batch over the message limit travels one message a group, published one after another:
    between them the stream's order is the explorer's own, whoever else published in between."""
    whole = _batch("explorer-1", 3, tasks=3)
    groups = [ExperienceBatch(member="explorer-1", explore_step=3, model_version=0,
                              experiences=whole.experiences[2 * g:2 * g + 2]) for g in range(3)]
    other = _batch("explorer-0", 3, tasks=1)
    for at in range(4):  # explorer-0's batch lands before, between or after explorer-1's messages
        arrivals = [*groups[:at], other, *groups[at:]]
        assert _ordered(arrivals) == [e.id for e in other.experiences] + [e.id for e in whole.experiences]
