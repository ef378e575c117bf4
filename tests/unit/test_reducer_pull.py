"""Pull methods (checkpoint, memory) x styles: one trainer, a fast explorer e1 and a slow one e2."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import MemberReleased, ReleaseReason, SyncConfig, SyncMethod, SyncStyle
from tests.support.reducer_scenario import (
    E1,
    E2,
    E3,
    T_AGAIN,
    T,
    configured,
    expired,
    finish,
    join,
    loaded,
    no_new,
    publish,
    req,
    run,
    run_script,
    snapshot,
    step_done,
    stop,
)

PULL_METHODS = [SyncMethod.CHECKPOINT, SyncMethod.MEMORY]


def _start(method: SyncMethod, style: SyncStyle) -> list:
    """Config, joins, and both explorers' first pull (-1 -> base model 0: nothing to reload)."""
    cfg = SyncConfig(sync_method=method, sync_style=style)
    return [
        (configured(cfg), [], "- | latest=0 | epoch=0 | -"),
        (join(T), [], "t=running@0 | latest=0 | epoch=0 | -"),
        (join(E1), [], "t=running@0 e1=running@-1 | latest=0 | epoch=0 | -"),
        (join(E2), [], "t=running@0 e1=running@-1 e2=running@-1 | latest=0 | epoch=0 | -"),
        (req(E1, 0, -1),
         ["opened r1 by e1 @-1", "released r1 e1 new_version @0", "closed r1 completed"],
         "t=running@0 e1=running@-1 e2=running@-1 | latest=0 | epoch=0 | -"),
        (loaded(E1, 0, round=1), [], "t=running@0 e1=running@0 e2=running@-1 | latest=0 | epoch=0 | -"),
        (req(E2, 0, -1),
         ["opened r2 by e2 @-1", "released r2 e2 new_version @0", "closed r2 completed"],
         "t=running@0 e1=running@0 e2=running@-1 | latest=0 | epoch=0 | -"),
        (loaded(E2, 0, round=2), [], "t=running@0 e1=running@0 e2=running@0 | latest=0 | epoch=0 | -"),
        (step_done(E1, 1, 0, reward=0.5), [],
         "t=running@0 e1=running@0 e2=running@0 | latest=0 | epoch=0 | -"),
    ]


@pytest.mark.parametrize("method", PULL_METHODS)
def test_fixed_explorer_waits_for_the_next_version(method):
    script = _start(method, SyncStyle.FIXED) + [
        # fast e1 reaches its boundary first: nothing newer than its 0 yet, so it waits
        (req(E1, 1, 0), ["opened r3 by e1 @0"],
         "t=running@0 e1=require_sync@0 e2=running@0 | latest=0 | epoch=0 | r3:waiting[e1]"),
        (step_done(T, 1, 0, loss=1.0), [],
         "t=running@0 e1=require_sync@0 e2=running@0 | latest=0 | epoch=0 | r3:waiting[e1]"),
        (publish(1, method), ["released r3 e1 new_version @1 reload", "closed r3 completed"],
         "t=running@1 e1=running@0 e2=running@0 | latest=1 | epoch=0 | -"),
        (loaded(E1, 1, round=3), [], "t=running@1 e1=running@1 e2=running@0 | latest=1 | epoch=0 | -"),
        # slow e2 arrives after version 1 exists: released at once
        (req(E2, 1, 0),
         ["opened r4 by e2 @0", "released r4 e2 new_version @1 reload", "closed r4 completed"],
         "t=running@1 e1=running@1 e2=running@0 | latest=1 | epoch=0 | -"),
        (loaded(E2, 1, round=4), [], "t=running@1 e1=running@1 e2=running@1 | latest=1 | epoch=0 | -"),
        # both wait; one publish releases both, in round order
        (req(E1, 2, 1), ["opened r5 by e1 @1"],
         "t=running@1 e1=require_sync@1 e2=running@1 | latest=1 | epoch=0 | r5:waiting[e1]"),
        (req(E2, 2, 1), ["opened r6 by e2 @1"],
         "t=running@1 e1=require_sync@1 e2=require_sync@1 | latest=1 | epoch=0 "
         "| r5:waiting[e1] r6:waiting[e2]"),
        (publish(2, method),
         ["released r5 e1 new_version @2 reload", "closed r5 completed",
          "released r6 e2 new_version @2 reload", "closed r6 completed"],
         "t=running@2 e1=running@1 e2=running@1 | latest=2 | epoch=0 | -"),
        (loaded(E1, 2, round=5), [], "t=running@2 e1=running@2 e2=running@1 | latest=2 | epoch=0 | -"),
        (loaded(E2, 2, round=6), [], "t=running@2 e1=running@2 e2=running@2 | latest=2 | epoch=0 | -"),
        # the trainer finished: a later request is answered at once instead of waiting
        (finish(T, 2, 2), [], "t=stopped@2 e1=running@2 e2=running@2 | latest=2 | epoch=0 | -"),
        (req(E1, 3, 2),
         ["opened r7 by e1 @2", "released r7 e1 trainer_stopped @2", "closed r7 trainer_stopped"],
         "t=stopped@2 e1=running@2 e2=running@2 | latest=2 | epoch=0 | -"),
    ]
    job = run_script(script)
    assert (job.state.rounds_closed, job.state.syncs_completed, job.state.versions_published) == (7, 6, 2)
    assert job.state.next_round == 8


@pytest.mark.parametrize("method", PULL_METHODS)
def test_explorer_driven_request_cues_trainer_which_publishes_or_says_nothing_new(method):
    script = _start(method, SyncStyle.EXPLORER_DRIVEN) + [
        (req(E1, 1, 0), ["opened r3 by e1 @0"],  # the trainer's cue
         "t=running@0 e1=require_sync@0 e2=running@0 | latest=0 | epoch=0 | r3:waiting[e1]"),
        (publish(1, method), ["released r3 e1 new_version @1 reload", "closed r3 completed"],
         "t=running@1 e1=running@0 e2=running@0 | latest=1 | epoch=0 | -"),
        (loaded(E1, 1, round=3), [], "t=running@1 e1=running@1 e2=running@0 | latest=1 | epoch=0 | -"),
        (req(E2, 1, 0),
         ["opened r4 by e2 @0", "released r4 e2 new_version @1 reload", "closed r4 completed"],
         "t=running@1 e1=running@1 e2=running@0 | latest=1 | epoch=0 | -"),
        (loaded(E2, 1, round=4), [], "t=running@1 e1=running@1 e2=running@1 | latest=1 | epoch=0 | -"),
        # the trainer has not stepped since: it answers "nothing new" and e1 goes on with 1
        (req(E1, 2, 1), ["opened r5 by e1 @1"],
         "t=running@1 e1=require_sync@1 e2=running@1 | latest=1 | epoch=0 | r5:waiting[e1]"),
        (no_new(1, 1), ["released r5 e1 no_new_version @1", "closed r5 no_new_version"],
         "t=running@1 e1=running@1 e2=running@1 | latest=1 | epoch=0 | -"),
        (req(E2, 2, 1), ["opened r6 by e2 @1"],
         "t=running@1 e1=running@1 e2=require_sync@1 | latest=1 | epoch=0 | r6:waiting[e2]"),
        (step_done(T, 2, 1), [],
         "t=running@1 e1=running@1 e2=require_sync@1 | latest=1 | epoch=0 | r6:waiting[e2]"),
        (publish(2, method), ["released r6 e2 new_version @2 reload", "closed r6 completed"],
         "t=running@2 e1=running@1 e2=running@1 | latest=2 | epoch=0 | -"),
        (loaded(E2, 2, round=6), [], "t=running@2 e1=running@1 e2=running@2 | latest=2 | epoch=0 | -"),
        # e1 missed version 2: its next request is answered from what is already published
        (req(E1, 3, 1),
         ["opened r7 by e1 @1", "released r7 e1 new_version @2 reload", "closed r7 completed"],
         "t=running@2 e1=running@1 e2=running@2 | latest=2 | epoch=0 | -"),
    ]
    job = run_script(script)
    assert (job.state.rounds_closed, job.state.syncs_completed) == (7, 6)


@pytest.mark.parametrize("method", PULL_METHODS)
def test_trainer_driven_explorer_never_waits_for_unproduced_weights(method):
    script = _start(method, SyncStyle.TRAINER_DRIVEN) + [
        (req(E1, 1, 0),
         ["opened r3 by e1 @0", "released r3 e1 no_new_version @0", "closed r3 no_new_version"],
         "t=running@0 e1=running@0 e2=running@0 | latest=0 | epoch=0 | -"),
        (step_done(T, 1, 0), [], "t=running@0 e1=running@0 e2=running@0 | latest=0 | epoch=0 | -"),
        (publish(1, method), [], "t=running@1 e1=running@0 e2=running@0 | latest=1 | epoch=0 | -"),
        (req(E2, 1, 0),
         ["opened r4 by e2 @0", "released r4 e2 new_version @1 reload", "closed r4 completed"],
         "t=running@1 e1=running@0 e2=running@0 | latest=1 | epoch=0 | -"),
        (loaded(E2, 1, round=4), [], "t=running@1 e1=running@0 e2=running@1 | latest=1 | epoch=0 | -"),
        (req(E1, 2, 0),
         ["opened r5 by e1 @0", "released r5 e1 new_version @1 reload", "closed r5 completed"],
         "t=running@1 e1=running@0 e2=running@1 | latest=1 | epoch=0 | -"),
        (loaded(E1, 1, round=5), [], "t=running@1 e1=running@1 e2=running@1 | latest=1 | epoch=0 | -"),
        (req(E1, 3, 1),
         ["opened r6 by e1 @1", "released r6 e1 no_new_version @1", "closed r6 no_new_version"],
         "t=running@1 e1=running@1 e2=running@1 | latest=1 | epoch=0 | -"),
    ]
    job = run_script(script)
    assert (job.state.rounds_closed, job.state.syncs_completed) == (6, 4)


def test_release_carries_where_and_what_to_fetch():
    job = run_script(_start(SyncMethod.CHECKPOINT, SyncStyle.FIXED))
    job.feed(req(E1, 1, 0))
    (released, closed) = job.feed(publish(1, SyncMethod.CHECKPOINT))
    assert released == MemberReleased(
        round=3, cause_seq=job.seq, released=E1, reason=ReleaseReason.NEW_VERSION, version=1,
        reload=True, location="weights/v1", digest="sha256:0001", nbytes=1001,
    )
    assert job.state.latest.location == "weights/v1" and job.state.latest.method is SyncMethod.CHECKPOINT


def test_publish_skips_nobody_and_releases_only_older_waiters():
    # a waiter that somehow already holds the new version is not released by it
    job = run_script(_start(SyncMethod.MEMORY, SyncStyle.FIXED))
    job.feed(req(E1, 1, 0))
    assert job.lines(publish(1)) == ["released r3 e1 new_version @1 reload", "closed r3 completed"]
    assert job.lines(publish(2)) == []


def test_fully_async_explorers_load_in_background_without_rounds():
    cfg = SyncConfig(sync_method=SyncMethod.MEMORY, sync_style=SyncStyle.FULLY_ASYNC)
    script = [
        (configured(cfg), [], "- | latest=0 | epoch=0 | -"),
        (join(T), [], "t=running@0 | latest=0 | epoch=0 | -"),
        (join(E1), [], "t=running@0 e1=running@-1 | latest=0 | epoch=0 | -"),
        # the one blocking pull before exploring: base model, nothing to reload
        (req(E1, 0, -1),
         ["opened r1 by e1 @-1", "released r1 e1 new_version @0", "closed r1 completed"],
         "t=running@0 e1=running@-1 | latest=0 | epoch=0 | -"),
        (step_done(E1, 1, 0), [], "t=running@0 e1=running@0 | latest=0 | epoch=0 | -"),
        (publish(1), [], "t=running@1 e1=running@0 | latest=1 | epoch=0 | -"),
        (publish(2), [], "t=running@2 e1=running@0 | latest=2 | epoch=0 | -"),
        (loaded(E1, 2), [], "t=running@2 e1=running@2 | latest=2 | epoch=0 | -"),
        # a step that started with version 0 finishes after 2 was loaded: the held version stays 2
        (step_done(E1, 2, 0), [], "t=running@2 e1=running@2 | latest=2 | epoch=0 | -"),
        # a request when nothing is newer never blocks
        (req(E1, 3, 2),
         ["opened r2 by e1 @2", "released r2 e1 no_new_version @2", "closed r2 no_new_version"],
         "t=running@2 e1=running@2 | latest=2 | epoch=0 | -"),
    ]
    job = run_script(script)
    assert job.state.rounds == {}
    assert job.state.members["explorer/e1"].metrics == {}


def test_step_finished_records_step_and_metrics():
    job = run_script(_start(SyncMethod.MEMORY, SyncStyle.FIXED))
    member = job.state.members["explorer/e1"]
    assert (member.step, dict(member.metrics)) == (1, {"reward": 0.5})
    assert member.last_seq == job.seq and member.last_time_ms == job.time_ms


def test_late_joiner_gets_the_latest_version_at_once():
    job = run_script(_start(SyncMethod.MEMORY, SyncStyle.FIXED))
    job.feed(publish(1))
    job.feed(publish(2))
    job.feed(join(E3))
    assert job.lines(req(E3, 0, -1)) == [
        "opened r3 by e3 @-1", "released r3 e3 new_version @2 reload", "closed r3 completed",
    ]
    assert snapshot(job.state).endswith("| latest=2 | epoch=0 | -")


def test_repeated_request_while_waiting_opens_no_second_round():
    job = run_script(_start(SyncMethod.MEMORY, SyncStyle.FIXED))
    assert job.lines(req(E1, 1, 0)) == ["opened r3 by e1 @0"]
    assert job.lines(req(E1, 1, 0)) == []
    assert list(job.state.rounds) == [3]


def test_explorer_that_goes_back_to_running_withdraws_its_request():
    job = run_script(_start(SyncMethod.MEMORY, SyncStyle.FIXED))
    job.feed(req(E1, 1, 0))
    assert job.lines(run(E1, 1, 0)) == ["closed r3 abandoned"]
    assert snapshot(job.state) == "t=running@0 e1=running@0 e2=running@0 | latest=0 | epoch=0 | -"


@pytest.mark.parametrize("method", PULL_METHODS)
def test_trainer_finishing_releases_every_waiting_explorer(method):
    job = run_script(_start(method, SyncStyle.FIXED))
    job.feed(req(E1, 1, 0))
    job.feed(req(E2, 1, 0))
    assert job.lines(finish(T, 1, 0)) == [
        "released r3 e1 trainer_stopped @0", "closed r3 trainer_stopped",
        "released r4 e2 trainer_stopped @0", "closed r4 trainer_stopped",
    ]
    assert snapshot(job.state) == "t=stopped@0 e1=running@0 e2=running@0 | latest=0 | epoch=0 | -"


@pytest.mark.parametrize("leave", ["stop", "expire", "restart"])
@pytest.mark.parametrize("method", PULL_METHODS)
def test_waiting_explorers_wait_through_a_trainer_restart(method, leave):
    """A trainer that stops early, expires or restarts may come back: waiting rounds stay open
    and the restarted trainer's next version releases them."""
    job = run_script(_start(method, SyncStyle.FIXED))
    job.feed(req(E1, 1, 0))
    job.feed(req(E2, 1, 0))
    gone = {"stop": stop(T, 1, 0), "expire": expired(T), "restart": join(T_AGAIN, version=0)}[leave]
    assert job.lines(gone) == []
    assert sorted(job.state.rounds) == [3, 4]
    if leave != "restart":
        # a request made while the trainer is away waits too (instead of "trainer_stopped")
        job.feed(join(E3, version=0))
        assert job.lines(req(E3, 1, 0)) == ["opened r5 by e3 @0"]
        job.feed(join(T_AGAIN, version=0))
    expected = ["released r3 e1 new_version @1 reload", "closed r3 completed",
                "released r4 e2 new_version @1 reload", "closed r4 completed"]
    if leave != "restart":
        expected += ["released r5 e3 new_version @1 reload", "closed r5 completed"]
    assert job.lines(publish(1, method, by=T_AGAIN)) == expected


def test_explorer_stopping_while_waiting_abandons_its_round_without_release():
    job = run_script(_start(SyncMethod.MEMORY, SyncStyle.FIXED))
    job.feed(req(E1, 1, 0))
    assert job.lines(stop(E1, 1, 0)) == ["closed r3 abandoned"]
    assert snapshot(job.state) == "t=running@0 e1=stopped@0 e2=running@0 | latest=0 | epoch=0 | -"
