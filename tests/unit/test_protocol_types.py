"""The core's types: one public `describe`, immutable slotted state, constructors that trust their types."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import (
    JobConfigured,
    MemberJoined,
    MemberRef,
    MemberState,
    Recorded,
    RoundClosed,
    RoundOutcome,
    State,
    StepFinished,
    SyncConfig,
    SyncMethod,
    VersionPublished,
    describe,
    reduce,
)
from rolectl.sync_protocol.enums import Role

T = MemberRef(role=Role.TRAINER, id="t", incarnation=0)


@pytest.mark.parametrize("event, text", [
    (StepFinished(member=T, step=1, version=0), "StepFinished(step=1, version=0)"),
    (VersionPublished(member=T, version=2, step=2, method=SyncMethod.MEMORY, location="v2", nbytes=5,
                      digest="d"),
     "VersionPublished(version=2, step=2, method=memory, location='v2', nbytes=5, digest='d')"),
    (JobConfigured(member=T, config=SyncConfig(sync_interval=3)), "JobConfigured(config=SyncConfig(sync_interval=3))"),
    (RoundClosed(round=1, cause_seq=7, outcome=RoundOutcome.COMPLETED),
     "RoundClosed(round=1, cause_seq=7, outcome=completed)"),
])
def test_describe_shows_the_kind_and_every_field_off_its_default_but_the_sender(event, text):
    assert describe(event) == text


def test_states_are_slotted_and_frozen():
    state = State.initial()
    member = MemberState(ref=T)
    for obj in (state, member, state.latest, state.group):
        assert not hasattr(obj, "__dict__")
        with pytest.raises(AttributeError):
            obj.last_seq = 1  # type: ignore[misc]


def test_a_fold_leaves_its_predecessor_untouched():
    state = State.initial(SyncConfig(sync_method=SyncMethod.MEMORY))
    before = (state.last_seq, dict(state.members))
    with pytest.raises(TypeError):
        state.members["x"] = MemberState(ref=T)  # type: ignore[index]
    after, _ = reduce(state, Recorded(seq=1, time_ms=0, event=MemberJoined(member=T, host="h", pid=1, step=0,
                                                                            version=0)))
    assert (state.last_seq, dict(state.members)) == before
    assert after.member(T) is not None and after.last_seq == 1
