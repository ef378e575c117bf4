"""Rendezvous methods (nccl, cuda_ipc) x styles: trainer + two explorers (e1 brings 2 ranks)."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import (
    IllegalEvent,
    RendezvousReady,
    RunningStatus,
    StatusChanged,
    SyncConfig,
    SyncMethod,
    SyncStyle,
)
from tests.support.reducer_scenario import (
    E1,
    E2,
    E2_AGAIN,
    E3,
    T_AGAIN,
    Job,
    T,
    broadcast,
    configured,
    expired,
    failed,
    finish,
    join,
    loaded,
    no_new,
    req,
    run_script,
    snapshot,
    stop,
    timed_out,
)

RENDEZVOUS_METHODS = [SyncMethod.NCCL, SyncMethod.CUDA_IPC]
READY_1 = "ready r1 @1 epoch=1 world=4 e1:1+2 e2:3+1 at 10.0.0.1:29500"
ALL_RUNNING = "t=running@0 e1=running@-1 e2=running@-1 | latest=0 | epoch=0 | -"


def _start(style: SyncStyle, method: SyncMethod = SyncMethod.NCCL) -> list:
    cfg = SyncConfig(sync_method=method, sync_style=style)
    return [
        (configured(cfg), [], "- | latest=0 | epoch=0 | -"),
        (join(T), [], "t=running@0 | latest=0 | epoch=0 | -"),
        (join(E1, ranks=2), [], "t=running@0 e1=running@-1 | latest=0 | epoch=0 | -"),
        (join(E2), [], ALL_RUNNING),
    ]


def _transfer_round_1() -> list:
    """Round 1 is transferring version 1: everyone reports (and is running again at once), it
    completes, the group is kept."""
    return [
        (loaded(E1, 1, round=1), [],
         "t=require_sync@1 e1=running@1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r1:transferring@1[reported:e1]/of[t,e1,e2]"),
        (broadcast(1, round=1), [],
         "t=running@1 e1=running@1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r1:transferring@1[reported:e1,t]/of[t,e1,e2]"),
        (loaded(E2, 1, round=1), ["closed r1 completed"],
         "t=running@1 e1=running@1 e2=running@1 | latest=0 | epoch=1 | -"),
    ]


@pytest.mark.parametrize("method", RENDEZVOUS_METHODS)
def test_fixed_rendezvous_waits_for_trainer_and_every_explorer(method):
    script = _start(SyncStyle.FIXED, method) + [
        (req(E1, 1, -1), ["opened r1 by e1 @-1"],
         "t=running@0 e1=require_sync@-1 e2=running@-1 | latest=0 | epoch=0 "
         "| r1:waiting[e1]/of[t,e1,e2]"),
        (req(T, 1, 1), [],
         "t=require_sync@1 e1=require_sync@-1 e2=running@-1 | latest=0 | epoch=0 "
         "| r1:waiting[e1,t]/of[t,e1,e2]"),
        # the slow explorer arrives last: now everyone is there
        (req(E2, 1, -1), [READY_1],
         "t=require_sync@1 e1=require_sync@-1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r1:transferring@1[reported:]/of[t,e1,e2]"),
        *_transfer_round_1(),
        # same members again: same group epoch
        (req(T, 2, 2), ["opened r2 by t @2"],
         "t=require_sync@2 e1=running@1 e2=running@1 | latest=0 | epoch=1 | r2:waiting[t]/of[t,e1,e2]"),
        (req(E2, 2, 1), [],
         "t=require_sync@2 e1=running@1 e2=require_sync@1 | latest=0 | epoch=1 "
         "| r2:waiting[t,e2]/of[t,e1,e2]"),
        (req(E1, 2, 1), ["ready r2 @2 epoch=1 world=4 e1:1+2 e2:3+1 at 10.0.0.1:29500"],
         "t=require_sync@2 e1=require_sync@1 e2=require_sync@1 | latest=0 | epoch=1 "
         "| r2:transferring@2[reported:]/of[t,e1,e2]"),
        # a failed transfer: everyone goes on with the weights it had; the group is broken
        (failed(E1, 2, round=2), ["closed r2 failed"],
         "t=running@2 e1=running@1 e2=running@1 | latest=0 | epoch=1!broken | -"),
        (failed(E2, 2, round=2), [],  # the other side's failure report comes second: no-op
         "t=running@2 e1=running@1 e2=running@1 | latest=0 | epoch=1!broken | -"),
        (req(E1, 3, 1), ["opened r3 by e1 @1"],
         "t=running@2 e1=require_sync@1 e2=running@1 | latest=0 | epoch=1!broken "
         "| r3:waiting[e1]/of[t,e1,e2]"),
        (req(E2, 3, 1), [],
         "t=running@2 e1=require_sync@1 e2=require_sync@1 | latest=0 | epoch=1!broken "
         "| r3:waiting[e1,e2]/of[t,e1,e2]"),
        (req(T, 3, 3), ["ready r3 @3 epoch=2 world=4 e1:1+2 e2:3+1 at 10.0.0.1:29500"],
         "t=require_sync@3 e1=require_sync@1 e2=require_sync@1 | latest=0 | epoch=2 "
         "| r3:transferring@3[reported:]/of[t,e1,e2]"),
    ]
    job = run_script(script)
    assert (job.state.rounds_closed, job.state.syncs_completed) == (2, 1)
    assert [a.member.id for a in job.state.group.members] == ["t", "e1", "e2"]


def test_a_rendezvous_the_reducer_builds_finds_each_participant():
    # decisions are built by their plain constructor, so the derived index works on them too
    job = run_script(_start(SyncStyle.FIXED, SyncMethod.NCCL))
    job.feed(req(E1, 1, -1))
    job.feed(req(T, 1, 1))
    ready = next(d for d in job.feed(req(E2, 1, -1)) if isinstance(d, RendezvousReady))
    assert [ready.assignment_of(p.member) for p in ready.participants] == list(ready.participants)
    assert ready.assignment_of(T) is None  # the trainer is rank 0, not a listed participant


def test_explorer_driven_rendezvous_trainer_answers_no_new_version_then_meets():
    script = _start(SyncStyle.EXPLORER_DRIVEN) + [
        (req(E1, 1, -1), ["opened r1 by e1 @-1"],
         "t=running@0 e1=require_sync@-1 e2=running@-1 | latest=0 | epoch=0 "
         "| r1:waiting[e1]/of[t,e1,e2]"),
        (no_new(0, 0), ["released r1 e1 no_new_version @-1", "closed r1 no_new_version"], ALL_RUNNING),
        (req(E1, 2, -1), ["opened r2 by e1 @-1"],
         "t=running@0 e1=require_sync@-1 e2=running@-1 | latest=0 | epoch=0 "
         "| r2:waiting[e1]/of[t,e1,e2]"),
        (req(E2, 2, -1), [],
         "t=running@0 e1=require_sync@-1 e2=require_sync@-1 | latest=0 | epoch=0 "
         "| r2:waiting[e1,e2]/of[t,e1,e2]"),
        (req(T, 1, 1), ["ready r2 @1 epoch=1 world=4 e1:1+2 e2:3+1 at 10.0.0.1:29500"],
         "t=require_sync@1 e1=require_sync@-1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r2:transferring@1[reported:]/of[t,e1,e2]"),
        (broadcast(1, round=2), [],
         "t=running@1 e1=require_sync@-1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r2:transferring@1[reported:t]/of[t,e1,e2]"),
        (loaded(E2, 1, round=2), [],
         "t=running@1 e1=require_sync@-1 e2=running@1 | latest=0 | epoch=1 "
         "| r2:transferring@1[reported:t,e2]/of[t,e1,e2]"),
        (loaded(E1, 1, round=2), ["closed r2 completed"],
         "t=running@1 e1=running@1 e2=running@1 | latest=0 | epoch=1 | -"),
    ]
    run_script(script)


@pytest.mark.parametrize("style", [SyncStyle.TRAINER_DRIVEN, SyncStyle.FULLY_ASYNC])
def test_trainer_driven_rendezvous_opened_by_trainer_and_joined_by_explorers(style):
    script = _start(style) + [
        (req(T, 1, 1), ["opened r1 by t @1"],
         "t=require_sync@1 e1=running@-1 e2=running@-1 | latest=0 | epoch=0 | r1:waiting[t]/of[t,e1,e2]"),
        (req(E1, 1, -1), [],
         "t=require_sync@1 e1=require_sync@-1 e2=running@-1 | latest=0 | epoch=0 "
         "| r1:waiting[t,e1]/of[t,e1,e2]"),
        (req(E2, 1, -1), [READY_1],
         "t=require_sync@1 e1=require_sync@-1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r1:transferring@1[reported:]/of[t,e1,e2]"),
        *_transfer_round_1(),
        # an explorer may open the round itself; it simply waits for the trainer
        (req(E1, 2, 1), ["opened r2 by e1 @1"],
         "t=running@1 e1=require_sync@1 e2=running@1 | latest=0 | epoch=1 | r2:waiting[e1]/of[t,e1,e2]"),
        (req(E2, 2, 1), [],
         "t=running@1 e1=require_sync@1 e2=require_sync@1 | latest=0 | epoch=1 "
         "| r2:waiting[e1,e2]/of[t,e1,e2]"),
        (req(T, 2, 2), ["ready r2 @2 epoch=1 world=4 e1:1+2 e2:3+1 at 10.0.0.1:29500"],
         "t=require_sync@2 e1=require_sync@1 e2=require_sync@1 | latest=0 | epoch=1 "
         "| r2:transferring@2[reported:]/of[t,e1,e2]"),
    ]
    run_script(script)


def _waiting_round_1() -> Job:
    """Trainer and e1 wait in round 1; e2 has not arrived."""
    return run_script(_start(SyncStyle.FIXED) + [
        (req(T, 1, 1), ["opened r1 by t @1"],
         "t=require_sync@1 e1=running@-1 e2=running@-1 | latest=0 | epoch=0 | r1:waiting[t]/of[t,e1,e2]"),
        (req(E1, 1, -1), [],
         "t=require_sync@1 e1=require_sync@-1 e2=running@-1 | latest=0 | epoch=0 "
         "| r1:waiting[t,e1]/of[t,e1,e2]"),
    ])


def test_explorer_stopping_while_others_wait_lets_the_round_go_without_it():
    job = _waiting_round_1()
    assert job.lines(stop(E2, 0, -1)) == ["ready r1 @1 epoch=1 world=3 e1:1+2 at 10.0.0.1:29500"]
    assert snapshot(job.state) == (
        "t=require_sync@1 e1=require_sync@-1 e2=stopped@-1 | latest=0 | epoch=1 "
        "| r1:transferring@1[reported:]/of[t,e1]")


def test_explorer_expiring_while_others_wait_means_nobody_waits_for_it():
    job = _waiting_round_1()
    assert job.lines(expired(E2)) == ["ready r1 @1 epoch=1 world=3 e1:1+2 at 10.0.0.1:29500"]
    assert snapshot(job.state) == (
        "t=require_sync@1 e1=require_sync@-1 e2=expired@-1 | latest=0 | epoch=1 "
        "| r1:transferring@1[reported:]/of[t,e1]")


def test_membership_change_starts_a_new_group_epoch():
    job = run_script(_start(SyncStyle.FIXED))
    for event in (req(T, 1, 1), req(E1, 1, -1), req(E2, 1, -1), loaded(E1, 1, 1), broadcast(1, 1),
                  loaded(E2, 1, 1)):
        job.feed(event)
    assert job.state.group.epoch == 1
    job.feed(stop(E2, 1, 1))
    job.feed(req(T, 2, 2))
    assert job.lines(req(E1, 2, 1)) == ["ready r2 @2 epoch=2 world=3 e1:1+2 at 10.0.0.1:29500"]


def test_explorer_restart_is_a_new_incarnation_and_a_new_epoch():
    job = _waiting_round_1()
    job.feed(req(E2, 1, -1))  # round 1 ready, epoch 1
    for event in (loaded(E1, 1, 1), loaded(E2, 1, 1), broadcast(1, 1)):
        job.feed(event)
    assert job.lines(join(E2_AGAIN)) == []
    job.feed(req(T, 2, 2))
    job.feed(req(E1, 2, 1))
    assert job.lines(req(E2_AGAIN, 0, -1)) == [
        "ready r2 @2 epoch=2 world=4 e1:1+2 e2:3+1 at 10.0.0.1:29500"]
    assert job.state.group.members[2].member == E2_AGAIN


def test_participant_stopping_mid_transfer_fails_the_round():
    job = _waiting_round_1()
    job.feed(req(E2, 1, -1))
    job.feed(loaded(E1, 1, 1))
    assert job.lines(stop(E2, 1, -1)) == ["closed r1 failed"]
    assert snapshot(job.state) == "t=running@1 e1=running@1 e2=stopped@-1 | latest=0 | epoch=1!broken | -"


def test_trainer_finishing_releases_waiting_explorers():
    job = run_script(_start(SyncStyle.FIXED))
    job.feed(req(E1, 1, -1))
    job.feed(req(E2, 1, -1))
    assert job.lines(finish(T, 1, 1)) == [
        "released r1 e1 trainer_stopped @-1", "released r1 e2 trainer_stopped @-1",
        "closed r1 trainer_stopped",
    ]
    assert snapshot(job.state) == "t=stopped@1 e1=running@-1 e2=running@-1 | latest=0 | epoch=0 | -"
    # and a later request is answered at once
    assert job.lines(req(E1, 2, -1)) == [
        "opened r2 by e1 @-1", "released r2 e1 trainer_stopped @-1", "closed r2 trainer_stopped"]


@pytest.mark.parametrize("leave", ["stop", "expire"])
def test_explorers_wait_for_a_trainer_that_left_before_finishing(leave):
    """The round keeps gathering without the trainer; its next incarnation becomes a participant
    when it joins and the rendezvous happens once it asks."""
    job = run_script(_start(SyncStyle.FIXED))
    job.feed(req(T, 1, 1))
    job.feed(req(E1, 1, -1))
    assert job.lines(stop(T, 1, 1) if leave == "stop" else expired(T)) == []
    assert tuple(job.state.rounds[1].participants) == ("explorer/e1", "explorer/e2")
    assert job.lines(req(E2, 1, -1)) == []  # everyone but the trainer: still gathering
    assert job.lines(join(T_AGAIN, version=1, step=1)) == []
    assert job.lines(req(T_AGAIN, 1, 1, "10.0.0.1:29500")) == [
        "ready r1 @1 epoch=1 world=4 e1:1+2 e2:3+1 at 10.0.0.1:29500"]


def test_trainer_is_released_when_every_explorer_left():
    job = _waiting_round_1()
    assert job.lines(stop(E2, 0, -1)) == ["ready r1 @1 epoch=1 world=3 e1:1+2 at 10.0.0.1:29500"]
    job.feed(loaded(E1, 1, 1))
    job.feed(broadcast(1, 1))
    assert job.lines(req(T, 2, 2)) == ["opened r2 by t @2"]
    assert job.lines(expired(E1)) == ["released r2 t no_new_version @2", "closed r2 abandoned"]
    assert snapshot(job.state) == "t=running@2 e1=expired@1 e2=stopped@-1 | latest=0 | epoch=1 | -"


def test_trainer_alone_is_not_kept_waiting():
    job = run_script([(configured(SyncConfig()), [], "- | latest=0 | epoch=0 | -"),
                      (join(T), [], "t=running@0 | latest=0 | epoch=0 | -")])
    assert job.lines(req(T, 1, 1)) == [
        "opened r1 by t @1", "released r1 t no_new_version @1", "closed r1 abandoned"]
    assert snapshot(job.state) == "t=running@1 | latest=0 | epoch=0 | -"


def test_waiting_round_times_out_and_releases_who_waited():
    job = _waiting_round_1()
    assert job.lines(timed_out(1)) == [
        "released r1 t timed_out @1", "released r1 e1 timed_out @-1", "closed r1 timed_out"]
    assert snapshot(job.state) == ALL_RUNNING.replace("t=running@0", "t=running@1")
    assert job.state.group.broken is False


def test_transferring_round_times_out_and_breaks_the_group():
    job = _waiting_round_1()
    job.feed(req(E2, 1, -1))
    assert job.lines(timed_out(1)) == ["closed r1 timed_out"]
    assert snapshot(job.state) == "t=running@1 e1=running@-1 e2=running@-1 | latest=0 | epoch=1!broken | -"
    assert job.lines(timed_out(1)) == []  # the clock firing again for a closed round: no-op


def test_late_joining_explorer_becomes_a_participant_the_round_waits_for():
    job = _waiting_round_1()
    assert job.lines(join(E3, ranks=4)) == []
    assert snapshot(job.state).endswith("| r1:waiting[t,e1]/of[t,e1,e2,e3]")
    assert job.lines(req(E2, 1, -1)) == []  # still waiting for e3
    assert job.lines(req(E3, 0, -1)) == [
        "ready r1 @1 epoch=1 world=8 e1:1+2 e2:3+1 e3:4+4 at 10.0.0.1:29500"]


def test_explorer_joining_during_a_transfer_waits_for_the_next_round():
    job = _waiting_round_1()
    job.feed(req(E2, 1, -1))
    job.feed(join(E3))
    assert snapshot(job.state).endswith("| r1:transferring@1[reported:]/of[t,e1,e2]")
    assert job.lines(req(E3, 0, -1)) == ["opened r2 by e3 @-1"]
    assert snapshot(job.state).endswith(
        "| r1:transferring@1[reported:]/of[t,e1,e2] r2:waiting[e3]/of[t,e1,e2,e3]")


def test_explorer_can_open_a_round_before_the_trainer_joined():
    job = run_script([(configured(SyncConfig()), [], "- | latest=0 | epoch=0 | -")])
    job.feed(join(E1))
    assert job.lines(req(E1, 1, -1)) == ["opened r1 by e1 @-1"]
    job.feed(join(T))
    assert snapshot(job.state) == (
        "e1=require_sync@-1 t=running@0 | latest=0 | epoch=0 | r1:waiting[e1]/of[e1,t]")
    assert job.lines(req(T, 1, 1)) == ["ready r1 @1 epoch=1 world=2 e1:1+1 at 10.0.0.1:29500"]


def test_rendezvous_master_address_accepts_ipv6():
    job = run_script(_start(SyncStyle.FIXED))
    job.feed(req(E1, 1, -1))
    job.feed(req(E2, 1, -1))
    (ready,) = job.feed(req(T, 1, 1, rendezvous="[fd00::1]:29501"))
    assert (ready.master_addr, ready.master_port) == ("fd00::1", 29501)


def test_trainer_must_offer_a_rendezvous_address():
    job = run_script(_start(SyncStyle.FIXED))
    before = job.state
    with pytest.raises(IllegalEvent, match="must offer a rendezvous host:port"):
        job.feed(StatusChanged(member=T, status=RunningStatus.REQUIRE_SYNC, step=1, version=1))
    with pytest.raises(IllegalEvent, match="is not host:port"):
        job.feed(req(T, 1, 1, rendezvous="no-port"))
    assert job.state is before


def test_report_for_a_round_that_is_not_open_is_illegal():
    job = run_script(_start(SyncStyle.FIXED))
    with pytest.raises(IllegalEvent) as info:
        job.feed(loaded(E1, 3, round=7))
    assert str(info.value) == (
        "explorer/e1#0 sent WeightsLoaded(version=3, round=7, nbytes=1000, seconds=0.5) "
        "but round 7 is not open (member status running)")


def test_report_of_another_version_than_the_round_sends_is_illegal():
    job = _waiting_round_1()
    job.feed(req(E2, 1, -1))
    with pytest.raises(IllegalEvent, match="round 1 transfers version 1"):
        job.feed(loaded(E1, 2, round=1))


def test_report_before_rendezvous_ready_is_illegal():
    job = _waiting_round_1()
    with pytest.raises(IllegalEvent, match="round 1 is still waiting"):
        job.feed(broadcast(1, round=1))


def test_a_member_that_reported_may_ask_for_the_next_round_while_peers_still_receive():
    """Regression (found end to end): a fast explorer that loaded round 1 asks again while the slow
    one is still receiving. Its request opens round 2 — it is not taken for a repeat of its
    round-1 request — and round 1's close does not reset it to running."""
    script = _start(SyncStyle.FIXED) + [
        (req(E1, 1, -1), ["opened r1 by e1 @-1"],
         "t=running@0 e1=require_sync@-1 e2=running@-1 | latest=0 | epoch=0 "
         "| r1:waiting[e1]/of[t,e1,e2]"),
        (req(E2, 1, -1), [],
         "t=running@0 e1=require_sync@-1 e2=require_sync@-1 | latest=0 | epoch=0 "
         "| r1:waiting[e1,e2]/of[t,e1,e2]"),
        (req(T, 1, 1), [READY_1],
         "t=require_sync@1 e1=require_sync@-1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r1:transferring@1[reported:]/of[t,e1,e2]"),
        (broadcast(1, round=1), [],
         "t=running@1 e1=require_sync@-1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r1:transferring@1[reported:t]/of[t,e1,e2]"),
        (loaded(E1, 1, round=1), [],
         "t=running@1 e1=running@1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r1:transferring@1[reported:t,e1]/of[t,e1,e2]"),
        (req(E1, 2, 1), ["opened r2 by e1 @1"],
         "t=running@1 e1=require_sync@1 e2=require_sync@-1 | latest=0 | epoch=1 "
         "| r1:transferring@1[reported:t,e1]/of[t,e1,e2] r2:waiting[e1]/of[t,e1,e2]"),
        (loaded(E2, 1, round=1), ["closed r1 completed"],
         "t=running@1 e1=require_sync@1 e2=running@1 | latest=0 | epoch=1 "
         "| r2:waiting[e1]/of[t,e1,e2]"),
        (req(E2, 2, 1), [],
         "t=running@1 e1=require_sync@1 e2=require_sync@1 | latest=0 | epoch=1 "
         "| r2:waiting[e1,e2]/of[t,e1,e2]"),
        (req(T, 2, 2), ["ready r2 @2 epoch=1 world=4 e1:1+2 e2:3+1 at 10.0.0.1:29500"],
         "t=require_sync@2 e1=require_sync@1 e2=require_sync@1 | latest=0 | epoch=1 "
         "| r2:transferring@2[reported:]/of[t,e1,e2]"),
    ]
    run_script(script)
