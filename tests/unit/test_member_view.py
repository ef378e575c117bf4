"""`MemberView`: an explorer's view folds only its scope (the trainer's, the synchronizers' and its
own records, and every decision), and what it says of that scope is what the whole fold says.

On random interleavings (the reducer properties' model: restarts, expiries, stale and illegal
inputs included) the scope's view agrees with a `JobView` of the whole stream on every fact an
explorer reads: the trainer's and its own incarnation, liveness, end, step and host, the latest
version, whether the trainer waits in a round, whether the trainer is gone or finished. It refuses
to answer about another explorer; a wait about one member is handed that member's decisions only;
a rendezvous decision binds to the group record it reads, digest checked."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings

from rolectl.bus.subjects import JobNames, subject_matches
from rolectl.roles.job_view import JobView
from rolectl.roles.member_view import MemberView, OutOfScope
from rolectl.sync_protocol import (
    Decision,
    MemberReleased,
    RankAssignment,
    Recorded,
    ReleaseReason,
    RendezvousReady,
    Role,
    SyncMethod,
    decode,
    encode,
    reduce_lenient,
)
from rolectl.sync_protocol.state import State
from tests.support.reducer_scenario import E1, E2, T
from tests.unit.test_reducer_properties import _configs, _scripts, _stream

JOB = JobNames("j")


class _Conn:
    names = JOB  # what a view asks of its connection before it follows anything


def _member_view(*explorers: str) -> MemberView:
    return MemberView(_Conn(), list(explorers))  # type: ignore[arg-type]


def _recorded(inputs: list[Recorded]) -> list[Recorded]:
    """The inputs with the decisions the synchronizer would record after each (one batch, its own
    sequence), and the subject each record is recorded on."""
    state, out, seq = State.initial(), [], 0
    for rec in inputs:
        seq += 1
        event = rec.event
        state, decisions, _ = reduce_lenient(state, Recorded(seq=seq, time_ms=rec.time_ms, event=event))
        out.append(Recorded(seq=seq, time_ms=rec.time_ms, event=event, subject=JOB.recorded_subject(event)))
        if decisions:
            seq += 1
            out += [Recorded(seq=seq, time_ms=rec.time_ms, event=d, subject=JOB.decision_log) for d in decisions]
    return out


def _facts(member) -> tuple | None:
    if member is None:
        return None
    return member.ref, member.alive, member.finished, member.step, member.host, member.joined_seq


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(config=_configs, script=_scripts)
def test_the_scope_s_view_says_what_the_whole_fold_says_about_the_scope(config, script):
    records = _recorded(_stream(config, script, configure_first=True))
    whole, scoped = JobView(conn=None), _member_view("e1")
    scope = scoped.subjects
    for n, rec in enumerate(records):
        whole.fold(rec)
        if any(subject_matches(pattern, rec.subject) for pattern in scope):
            scoped.fold(rec)
        if n + 1 < len(records) and isinstance(records[n + 1].event, Decision):
            continue  # an input's decisions are recorded after it: compare once they are
        for key in ("trainer/t", "explorer/e1"):
            assert _facts(scoped.member_state(key)) == _facts(whole.member_state(key)), (rec, key)
        assert scoped.latest == whole.latest
        assert scoped.trainer_waiting() == whole.trainer_waiting(), rec
        assert scoped.all_finished(Role.TRAINER) == whole.all_finished(Role.TRAINER)
        assert scoped.all_gone(Role.TRAINER) == whole.all_gone(Role.TRAINER)
        assert [r.seq for r in scoped.decisions] == [r.seq for r in whole.decisions]
        assert not scoped._partial.rounds  # the config withheld: it opens no round it cannot see whole


def test_another_explorer_is_out_of_the_scope():
    view = _member_view("e1")
    assert view.member(Role.EXPLORER, "e1") is None  # in scope, not joined yet
    with pytest.raises(OutOfScope, match="explorer/e2 is outside this explorer view's scope"):
        view.member(Role.EXPLORER, "e2")
    with pytest.raises(OutOfScope, match="does not fold every explorer"):
        view.all_finished(Role.EXPLORER)
    assert not hasattr(view, "state")  # no whole-job state to read by mistake


def _released(seq: int, who, round_id: int) -> Recorded:
    return Recorded(seq=seq, time_ms=seq, event=MemberReleased(
        round=round_id, cause_seq=seq - 1, released=who, reason=ReleaseReason.NEW_VERSION, version=1, reload=True))


async def test_a_wait_about_a_member_is_shown_and_woken_by_its_decisions_only():
    view = _member_view("e1", "e2")  # a view serving two simulated explorers, as the benchmarks do
    shown = []

    def about_e1(d):
        shown.append(d.round)
        return d if isinstance(d, MemberReleased) and d.released == E1 else None

    cursor = view.first_decision(0, about_e1, about=E1.key)
    asked = []

    def predicate(v):
        asked.append(1)
        return cursor(v)

    waiting = asyncio.ensure_future(view.wait_for(predicate, timeout=5, what="e1's release", wake_on=E1.key))
    await asyncio.sleep(0)  # registered (asked once, at once)
    for seq in range(2, 40, 2):  # a burst of other members' releases: e1's wait is not asked
        view.fold(_released(seq, E2, seq))
        view._answer_waiters()
    assert len(asked) == 1 and shown == []
    view.fold(_released(41, E1, 41))
    view._answer_waiters()
    assert (await waiting).round == 41 and shown == [41] and len(asked) == 2


def _ready(participants: tuple[RankAssignment, ...], epoch: int) -> RendezvousReady:
    return RendezvousReady.for_group(round=3, cause_seq=9, method=SyncMethod.NCCL, version=2, epoch=epoch,
                                     master_addr="10.0.0.1", master_port=29500, participants=participants)


def test_a_rendezvous_decision_is_bound_to_the_group_record_read_for_it():
    group = (RankAssignment(member=E1, rank_offset=1, ranks=1), RankAssignment(member=E2, rank_offset=2, ranks=2))
    unbound = decode(encode(_ready(group, epoch=4)))  # the wire drops the list
    assert not unbound.is_bound
    view = _member_view("e1")
    view._groups[4] = group  # what _prepare read from the group record
    view.fold(Recorded(seq=10, time_ms=10, event=unbound))
    bound = view.decisions[-1].event
    assert bound.is_bound and bound.assignment_of(E1).rank_offset == 1 and bound.assignment_of(T) is None
    # a record of another group (same epoch, other members) does not bind: the digest differs
    other = _member_view("e1")
    other._groups[4] = group[:1]
    other.fold(Recorded(seq=10, time_ms=10, event=unbound))
    assert not other.decisions[-1].event.is_bound
