"""`JobView.first_decision`: a member's wait for the decision about it looks at each recorded
decision once, however many bursts it spans (64 waiting explorers are not walked through every
decision since their request at every burst), and only at decisions after its request; a wait
times out naming what it waited for, and a wait answered or cancelled leaves no waiter behind."""

from __future__ import annotations

import asyncio

import pytest

from rolectl.roles.job_view import JobView
from rolectl.sync_protocol import (
    MemberRef,
    MemberReleased,
    Recorded,
    ReleaseReason,
    Role,
    RoundClosed,
    RoundOutcome,
)

ME = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1)
OTHER = MemberRef(role=Role.EXPLORER, id="explorer-1", incarnation=1)


def _released(seq: int, who: MemberRef, round_id: int) -> Recorded:
    return Recorded(seq=seq, time_ms=seq, event=MemberReleased(
        round=round_id, cause_seq=seq - 1, released=who, reason=ReleaseReason.NEW_VERSION, version=1, reload=True))


def _closed(seq: int, round_id: int) -> Recorded:
    return Recorded(seq=seq, time_ms=seq, event=RoundClosed(round=round_id, cause_seq=seq - 1,
                                                            outcome=RoundOutcome.COMPLETED))


def test_the_wait_sees_each_decision_after_the_request_once():
    view = JobView(conn=None)
    view.decisions = [_released(3, ME, 1), _closed(3, 1)]  # our release of an earlier request
    looked_at = []

    def about_me(d):
        looked_at.append((d.KIND, d.round))
        return d if isinstance(d, MemberReleased) and d.released == ME else None

    found = view.first_decision(5, about_me)  # our new request is seq 5
    assert found(view) is None and looked_at == []
    view.decisions += [_released(7, OTHER, 2), _closed(7, 2)]  # a burst about someone else
    assert found(view) is None
    assert found(view) is None  # asked again with nothing new: nothing looked at again
    view.decisions += [_released(9, ME, 3), _closed(9, 3)]  # a batch: release and close share seq 9
    assert found(view) == view.decisions[4].event
    assert looked_at == [("member_released", 2), ("round_closed", 2), ("member_released", 3)]


def test_decisions_after_a_sequence_are_those_recorded_after_it():
    view = JobView(conn=None)
    view.decisions = [_released(3, ME, 1), _closed(3, 1), _released(7, OTHER, 2), _closed(8, 2)]
    assert [r.seq for r in view.decisions_after(3)] == [7, 8]
    assert [r.seq for r in view.decisions_after(2)] == [3, 3, 7, 8]
    assert view.decisions_after(8) == []


async def test_a_membership_waiter_is_asked_only_after_a_join_stop_or_expiry_was_folded():
    """A member's own-expiry watch is not asked again after every burst of requests (64 members'
    watches after every burst cost more than the fold), only after bursts that changed membership."""
    view = JobView(conn=None)
    asked = []
    expired = False

    def our_expiry(_view):
        asked.append(1)
        return expired

    waiting = asyncio.ensure_future(view.wait_for(our_expiry, timeout=5, what="our expiry", membership_only=True))
    await asyncio.sleep(0)  # let it register (asked once, at once)
    assert len(asked) == 1
    view._answer_waiters()  # a burst of requests: not asked
    assert len(asked) == 1 and not waiting.done()
    expired = True
    view._membership_moved = True  # a burst that folded an expiry
    view._answer_waiters()
    assert await waiting is True and len(asked) == 2


async def _registered(view: JobView, predicate, **wait_args) -> asyncio.Future:
    """Start `view.wait_for(predicate)` and return once it waits (its first check ran)."""
    checked = asyncio.Event()

    def checking(v):
        checked.set()
        return predicate(v)

    waiting = asyncio.ensure_future(view.wait_for(checking, **wait_args))
    await asyncio.wait_for(checked.wait(), 5)
    return waiting


async def test_a_wait_that_times_out_names_what_it_waited_for_and_leaves_no_waiter():
    view = JobView(conn=None)
    with pytest.raises(TimeoutError, match=r"timed out after 0.05 s waiting for the trainer's version 7"):
        await view.wait_for(lambda v: None, timeout=0.05, what="the trainer's version 7")
    assert view._waiters == []


async def test_an_answered_wait_returns_the_value_and_a_cancelled_one_leaves_no_waiter():
    view = JobView(conn=None)
    answer: dict = {}
    answered = await _registered(view, lambda v: answer.get("value"), timeout=30, what="an answer")
    cancelled = await _registered(view, lambda v: None, timeout=30, what="nothing")
    assert len(view._waiters) == 2
    answer["value"] = "released"
    view._answer_waiters()
    assert await asyncio.wait_for(answered, 5) == "released"
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert view._waiters == []
    view._answer_waiters()  # nothing left to answer: no error from the cancelled one
