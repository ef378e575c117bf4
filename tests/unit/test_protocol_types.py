"""The core's types: one public `describe` (and words for people), immutable slotted state,
constructors that trust their types."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import (
    KINDS,
    JobConfigured,
    MemberJoined,
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
from rolectl.sync_protocol.describe import in_words
from tests.support.reducer_scenario import T


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


def test_every_kind_has_words_for_people():
    # the observer's log says each record in a sentence: a kind without a phrase would show its class name
    assert set(in_words.phrases) == set(KINDS.values())
    assert in_words(StepFinished(member=T, step=3, version=2, metrics={"reward_mean": 0.5})) == \
        "step 3 done with v2, reward 0.500"


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
