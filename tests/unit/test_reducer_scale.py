"""A fleet of thousands: the reducer decides for 4,096 explorers, and no decision grows with them."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import (
    MemberRef,
    MemberReleased,
    RendezvousReady,
    Role,
    RoundClosed,
    RoundOpened,
    SyncConfig,
    SyncMethod,
    SyncStyle,
    decode,
    decode_all,
    encode,
    encode_decisions,
)
from rolectl.sync_protocol.reducer import fold
from tests.support.reducer_scenario import Job, T, broadcast, configured, join, loaded, publish, req

FLEET = 4096
STREAM_MAX_MSG = 64 * 1024  # the event stream's default max_msg_size (bus.streams)


def _explorer(i: int) -> MemberRef:
    return MemberRef(role=Role.EXPLORER, id=f"explorer-{i:05d}", incarnation=1_700_000_000_000 + i)


def _fleet(method: SyncMethod, ranks=lambda i: 1, version: int = -1) -> tuple[Job, list[MemberRef]]:
    job = Job()
    explorers = [_explorer(i) for i in range(FLEET)]
    job.feed(configured(SyncConfig(sync_method=method, sync_style=SyncStyle.FIXED)))
    job.feed(join(T))
    # joined in an order that is not their id order: ranks follow ids, not arrival
    for i in sorted(range(FLEET), key=lambda i: (i * 7919) % FLEET):
        job.feed(join(explorers[i], ranks=ranks(i), version=version))
    return job, explorers


@pytest.mark.parametrize("method", [SyncMethod.NCCL, SyncMethod.CUDA_IPC])
def test_a_rendezvous_of_4096_explorers_decides_in_one_small_message(method):
    job, explorers = _fleet(method, ranks=lambda i: 1 + i % 3)
    decided = [d for e in reversed(explorers) for d in job.feed(req(e, 1, -1))]
    assert [type(d) for d in decided] == [RoundOpened]
    ready = next(d for d in job.feed(req(T, 1, 1)) if isinstance(d, RendezvousReady))
    assert ready.explorers == FLEET and ready.world_size == 1 + sum(1 + i % 3 for i in range(FLEET))
    # ranks follow member ids after the trainer's rank 0, each explorer's right after the one before
    offset = 1
    for i, e in enumerate(explorers):
        assert ready.assignment_of(e).rank_offset == offset
        offset += 1 + i % 3
    payload = encode(ready)
    assert len(payload) < 512 < STREAM_MAX_MSG  # the same size at 4 explorers or 4,096
    # a member reads it from the wire and binds it to the group its own fold of the stream holds
    member_view, _ = fold(job.history)
    bound = member_view.group.bind(decode(payload))
    assert bound == ready and bound.assignment_of(explorers[-1]) == ready.assignment_of(explorers[-1])
    # the group is formed once: everyone reports, the next round reuses it under the same epoch
    for e in explorers:
        job.feed(loaded(e, 1, round=ready.round))
    assert [type(d) for d in job.feed(broadcast(1, round=ready.round))] == [RoundClosed]
    for e in explorers:
        job.feed(req(e, 2, 1))
    again = next(d for d in job.feed(req(T, 2, 2)) if isinstance(d, RendezvousReady))
    assert (again.epoch, again.membership) == (ready.epoch, ready.membership)


def test_a_pull_round_of_4096_explorers_answers_each_in_constant_sized_decisions():
    job, explorers = _fleet(SyncMethod.MEMORY, version=0)
    for e in explorers:  # everyone holds the base model and waits for the first version
        job.feed(req(e, 1, 0))
    released = job.feed(publish(1))
    assert sum(isinstance(d, MemberReleased) for d in released) == FLEET
    sizes = {type(d).KIND: len(encode(d)) for d in released}
    assert max(sizes.values()) < 512
    # the synchronizer records them in batches of 128 (roles.synchronizer), each under the limit
    batches = [released[i:i + 128] for i in range(0, len(released), 128)]
    assert all(len(encode_decisions(b)) < STREAM_MAX_MSG for b in batches)
    assert decode_all(encode_decisions(batches[0])) == tuple(batches[0])


def test_a_reader_of_a_recorded_stream_binds_each_rendezvous_to_the_group_before_it():
    from rolectl.sync_protocol import Recorded
    from rolectl.sync_protocol.groups import bind_groups

    job, explorers = Job(), [_explorer(i) for i in range(5)]
    records = []
    for event in [configured(SyncConfig(sync_method=SyncMethod.NCCL)), join(T), *(join(e) for e in explorers),
                  *(req(e, 1, -1) for e in explorers), req(T, 1, 1)]:
        decisions = job.feed(event)
        records.append(job.history[-1])
        for d in decisions:  # as read from the wire: unbound
            job.seq += 1
            records.append(Recorded(seq=job.seq, time_ms=job.time_ms, event=decode(encode(d))))
    read = bind_groups(records)
    ready = [r.event for r in read if isinstance(r.event, RendezvousReady)]
    assert len(ready) == 1 and ready[0].is_bound and [p.member for p in ready[0].participants] == explorers
    assert [r.seq for r in read] == [r.seq for r in records]
    # a decision whose inputs the reader never saw (it starts after them) stays unbound, and says so
    alone = bind_groups([r for r in records if isinstance(r.event, RendezvousReady)])
    assert not alone[0].event.is_bound
