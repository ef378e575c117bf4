"""Reducer rules that hold for every method and style: legality, benign races, idempotency,
evaluation of requests made before the config was known, restarts, immutability."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import (
    IllegalEvent,
    MemberExpired,
    MemberRef,
    Recorded,
    Role,
    RoundClosed,
    RoundOutcome,
    State,
    SyncConfig,
    SyncMethod,
    SyncStyle,
    explorer_needs_sync,
    fold,
    fold_lenient,
    reduce,
    reduce_lenient,
)
from tests.support.reducer_scenario import (
    E1,
    E1_AGAIN,
    E2,
    E3,
    SYNC,
    T_AGAIN,
    Job,
    T,
    configured,
    expired,
    failed,
    join,
    loaded,
    no_new,
    publish,
    req,
    snapshot,
    step_done,
    stop,
    timed_out,
)

MEMORY_FIXED = SyncConfig(sync_method=SyncMethod.MEMORY, sync_style=SyncStyle.FIXED)
OTHER_TRAINER = MemberRef(role=Role.TRAINER, id="t2", incarnation=0)


def _job(*events, config: SyncConfig = MEMORY_FIXED) -> Job:
    job = Job()
    for event in (configured(config), join(T), join(E1), join(E2), *events):
        job.feed(event)
    return job


# ------------------------------------------------------------------------------------------------
# illegal inputs: typed error naming role, state and event; the state is left as it was

ILLEGAL = [
    pytest.param((), step_done(E3, 1, 0),
                 "explorer/e3#0 sent StepFinished(step=1, version=0) but explorer/e3 never joined "
                 "(member status not joined)", id="never-joined"),
    pytest.param((join(E1_AGAIN),), step_done(E1, 1, 0),
                 "explorer/e1#0 sent StepFinished(step=1, version=0) but it is a stale incarnation: "
                 "explorer/e1#1 joined at seq 5 (member status running)", id="stale-incarnation"),
    pytest.param((), step_done(E1_AGAIN, 1, 0),
                 "explorer/e1#1 sent StepFinished(step=1, version=0) but incarnation 1 never joined",
                 id="unjoined-incarnation"),
    pytest.param((publish(1),), publish(1),
                 "trainer/t#0 sent VersionPublished(version=1, step=1, method=memory, "
                 "location='weights/v1', nbytes=1001, digest='sha256:0001') but version 1 is already "
                 "published (versions only grow) (member status running)", id="version-not-newer"),
    pytest.param((), publish(1, by=E1),
                 "explorer/e1#0 sent VersionPublished(", id="version-from-explorer"),
    pytest.param((), no_new(0, 0, by=E1),
                 "but only trainer may send NoNewVersion (member status running)",
                 id="no-new-version-from-explorer"),
    pytest.param((), join(OTHER_TRAINER),
                 "trainer/t2#0 sent MemberJoined(host='host-t2', pid=100, step=0, version=0) but "
                 "trainer/t#0 is alive (one trainer per job) (member status not joined)",
                 id="second-trainer"),
    pytest.param((), configured(SyncConfig(sync_method=SyncMethod.NCCL), by=E1),
                 "explorer/e1#0 sent JobConfigured(config=SyncConfig()) but the job runs with "
                 "SyncConfig(sync_method=memory) (member status running)", id="different-config"),
    pytest.param((loaded(E1, 2),), loaded(E1, 1),
                 "explorer/e1#0 sent WeightsLoaded(version=1, nbytes=1000, seconds=0.5) but it already "
                 "holds version 2 (versions never go down) (member status running)",
                 id="loaded-version-down"),
    pytest.param((loaded(E1, 2),), req(E1, 3, 1),
                 "but it already holds version 2 (versions never go down) (member status running)",
                 id="status-version-down"),
    pytest.param((stop(E1, 1, 0),), req(E1, 2, 0),
                 "explorer/e1#0 sent StatusChanged(status=require_sync, step=2, version=0) but it "
                 "already left the job; a restart must join again (member status stopped)",
                 id="status-after-stopped"),
    pytest.param((expired(E1),), step_done(E1, 2, 0),
                 "but it already left the job; a restart must join again (member status expired)",
                 id="event-after-expired"),
    pytest.param((), join(E1),
                 "explorer/e1#0 sent MemberJoined(host='host-e1', pid=100, step=0, version=-1) but "
                 "this incarnation already joined (member status running)", id="joined-twice"),
    pytest.param((join(E1_AGAIN),), join(E1),
                 "but incarnation explorer/e1#1 already joined (stale process)", id="stale-join"),
    pytest.param((), MemberExpired(member=E2, expired=E1, silent_for=9.0),
                 "explorer/e2#0 sent MemberExpired(expired=explorer/e1#0, silent_for=9.0) but only "
                 "synchronizer may send MemberExpired (member status running)",
                 id="expiry-not-from-clock"),
    pytest.param((), join(E3, ranks=0),
                 "but an explorer brings at least one rank", id="explorer-without-ranks"),
]


@pytest.mark.parametrize("setup, event, message", ILLEGAL)
def test_illegal_event_raises_names_role_state_event_and_leaves_state(setup, event, message):
    job = _job(*setup)
    before = job.state
    with pytest.raises(IllegalEvent) as info:
        job.feed(event)
    assert message in str(info.value)
    assert info.value.seq == job.seq
    assert info.value.role == event.member.role.value
    assert info.value.event is event
    assert job.state is before


def test_status_from_stopped_member_is_illegal_with_status_in_exception():
    job = _job(stop(E1, 1, 0))
    with pytest.raises(IllegalEvent) as info:
        job.feed(step_done(E1, 2, 0))
    assert info.value.state == "stopped"


# ------------------------------------------------------------------------------------------------
# benign races with the clock and with other members: silent no-ops


BENIGN = [
    pytest.param((req(E1, 1, 0), publish(1)), timed_out(3), id="timeout-of-closed-round"),
    pytest.param((), timed_out(99), id="timeout-of-unknown-round"),
    pytest.param((stop(E1, 1, 0),), expired(E1), id="expiry-after-stop"),
    pytest.param((join(E1_AGAIN),), expired(E1), id="expiry-of-replaced-incarnation"),
    pytest.param((expired(E1),), expired(E1), id="expiry-twice"),
    pytest.param((), expired(E3), id="expiry-of-unknown-member"),
    pytest.param((), failed(E1, 1, round=None), id="background-pull-failed"),
    pytest.param((), failed(E1, 1, round=42), id="failure-of-closed-round"),
]


@pytest.mark.parametrize("setup, event", BENIGN)
def test_benign_race_is_a_silent_no_op(setup, event):
    job = _job(*setup)
    before = job.state
    assert job.feed(event) == ()
    assert snapshot(job.state) == snapshot(before)
    assert job.state.rounds == before.rounds
    assert job.state.last_seq == job.seq


# ------------------------------------------------------------------------------------------------
# idempotency and what is (not) an input


def test_redelivered_sequence_is_a_no_op():
    job = _job(req(E1, 1, 0))
    state = job.state
    again = reduce(state, job.history[-1])
    assert again == (state, ())
    assert again[0] is state
    assert reduce(state, job.history[0]) == (state, ())


def test_recorded_decision_is_not_an_input_but_advances_last_seq():
    job = _job()
    closed = RoundClosed(round=1, cause_seq=3, outcome=RoundOutcome.COMPLETED)
    state, decisions = reduce(job.state, Recorded(seq=job.seq + 1, time_ms=0, event=closed))
    assert decisions == ()
    assert state.last_seq == job.seq + 1
    assert (state.members, state.rounds, state.latest) == (job.state.members, job.state.rounds,
                                                           job.state.latest)


def test_fold_stops_at_the_first_illegal_event():
    job = _job()
    records = job.history + [Recorded(seq=job.seq + 1, time_ms=0, event=publish(0))]
    with pytest.raises(IllegalEvent):
        fold(records)


def test_lenient_fold_skips_illegal_events_and_marks_them_consumed():
    job = _job()
    bad = Recorded(seq=job.seq + 1, time_ms=job.time_ms + 1, event=publish(0))
    good = Recorded(seq=job.seq + 2, time_ms=job.time_ms + 2, event=publish(1))
    state, decisions, errors = fold_lenient(job.history + [bad, good])
    assert [e.seq for e in errors] == [bad.seq]
    assert state.latest.version == 1 and state.last_seq == good.seq
    skipped, caused, error = reduce_lenient(job.state, bad)
    assert caused == () and isinstance(error, IllegalEvent)
    assert skipped.last_seq == bad.seq and skipped.members == job.state.members
    assert reduce_lenient(skipped, bad) == (skipped, (), None)  # redelivery: no-op, no error


def test_folding_a_history_reproduces_the_stepwise_state_and_decisions():
    job = Job()
    stepwise = []
    for event in (configured(MEMORY_FIXED), join(T), join(E1), req(E1, 0, -1), req(E1, 1, -1),
                  publish(1), loaded(E1, 1)):
        stepwise.extend(job.feed(event))
    state, decisions = fold(job.history)
    assert state == job.state
    assert decisions == stepwise


# ------------------------------------------------------------------------------------------------
# before the config is known


def test_nothing_is_decided_before_the_config_is_known():
    job = Job()
    for event in (join(T), join(E1), join(E2), req(E1, 0, -1), publish(1)):
        assert job.feed(event) == ()
    assert snapshot(job.state) == "t=running@1 e1=require_sync@-1 e2=running@-1 | latest=1 | epoch=0 | -"
    assert job.state.config is None


def test_config_arrival_evaluates_pending_pull_requests():
    job = Job()
    for event in (join(T), join(E1), join(E2), req(E1, 0, -1), req(E2, 0, -1)):
        job.feed(event)
    assert job.lines(configured(MEMORY_FIXED)) == [
        "opened r1 by e1 @-1", "released r1 e1 new_version @0", "closed r1 completed",
        "opened r2 by e2 @-1", "released r2 e2 new_version @0", "closed r2 completed",
    ]
    assert job.state.config == MEMORY_FIXED


def test_config_arrival_evaluates_pending_rendezvous():
    job = Job()
    for event in (join(T), join(E1), join(E2), req(E1, 1, -1), req(T, 1, 1), req(E2, 1, -1)):
        job.feed(event)
    assert job.lines(configured(SyncConfig())) == [
        "opened r1 by t @1", "ready r1 @1 epoch=1 world=3 e1:1+1 e2:2+1 at 10.0.0.1:29500"]


def test_same_config_again_is_a_no_op():
    job = _job()
    assert job.feed(configured(MEMORY_FIXED, by=E2)) == ()
    assert State.initial(MEMORY_FIXED).config == MEMORY_FIXED


# ------------------------------------------------------------------------------------------------
# membership


def test_restarted_explorer_replaces_its_old_incarnation():
    job = _job(req(E1, 1, 0))
    assert job.lines(join(E1_AGAIN)) == ["closed r1 abandoned"]  # the old one left its round
    member = job.state.members["explorer/e1"]
    assert (member.ref, member.alive, member.version, member.joined_seq) == (E1_AGAIN, True, -1, job.seq)


def test_explorers_waiting_for_the_old_trainer_wait_for_the_restarted_one():
    job = _job(req(E1, 1, 0))
    assert job.lines(join(T_AGAIN)) == []
    assert job.state.trainer == "trainer/t" and job.state.trainer_state.ref == T_AGAIN
    assert job.lines(publish(1, by=T_AGAIN)) == ["released r1 e1 new_version @1 reload", "closed r1 completed"]


def test_new_trainer_id_may_join_after_the_old_one_stopped():
    job = _job(stop(T, 5, 5))
    assert job.feed(join(OTHER_TRAINER)) == ()
    assert job.state.trainer == "trainer/t2"
    assert job.lines(req(E1, 1, -1))[-1] == "closed r1 completed"  # -1: base model at once


def test_synchronizer_may_join_and_never_takes_part_in_rounds():
    job = _job(join(SYNC), config=SyncConfig())
    job.feed(req(SYNC, 0, 0))
    job.feed(req(T, 1, 1))
    assert tuple(job.state.rounds[1].participants) == ("trainer/t", "explorer/e1", "explorer/e2")


def test_state_read_helpers():
    job = _job(req(E1, 1, 0))
    assert job.state.member(E1) is job.state.member("explorer/e1")
    assert [m.ref for m in job.state.explorers()] == [E1, E2]
    assert job.state.round_of(E1).id == 1 and job.state.round_of(E2) is None


# ------------------------------------------------------------------------------------------------
# immutability


def test_returned_states_never_change():
    job = _job()
    kept = job.state
    kept_text, kept_members = snapshot(kept), dict(kept.members)
    for event in (req(E1, 1, 0), step_done(E2, 1, 0, reward=1.0), publish(1), loaded(E1, 1),
                  stop(E2, 1, 0)):
        job.feed(event)
    assert snapshot(kept) == kept_text
    assert dict(kept.members) == kept_members
    with pytest.raises(TypeError):
        kept.members["explorer/x"] = kept.members["explorer/e1"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        kept.last_seq = 99  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------
# sync_offset = 1: one-step off-policy


def test_sync_offset_one_skips_the_first_boundary_and_syncs_from_the_second():
    cfg = SyncConfig(sync_method=SyncMethod.MEMORY, sync_style=SyncStyle.FIXED, sync_offset=1)
    job = Job()
    for event in (configured(cfg), join(T), join(E1), req(E1, 0, -1), loaded(E1, 0)):
        job.feed(event)  # the one pull before exploring: the base model
    requested_at = []
    for step in (1, 2, 3):
        version = job.state.members["explorer/e1"].version
        job.feed(step_done(E1, step, version))
        if step == 1:
            job.feed(publish(1))  # the trainer trained on step-1 experiences meanwhile
        if explorer_needs_sync(step, cfg):
            requested_at.append(step)
            lines = job.lines(req(E1, step, version))
            if lines[-1] == f"closed r{job.state.next_round - 1} completed":
                job.feed(loaded(E1, job.state.latest.version))
    assert requested_at == [2, 3]
    assert job.state.members["explorer/e1"].version == 1
    assert snapshot(job.state) == "t=running@1 e1=require_sync@1 | latest=1 | epoch=0 | r3:waiting[e1]"
