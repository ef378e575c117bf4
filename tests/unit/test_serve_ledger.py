"""The reward ledger: sessions are trajectories, rewards make whole groups, the unrewarded expire."""

from __future__ import annotations

import math

import pytest

from rolectl.roles.serve.ledger import BadReward, RewardLedger, Turn, UnknownCompletion


def turn(cid: str, version: int = 0) -> Turn:
    return Turn(completion_id=cid, prompt=(1, 2), response=(3, 4), logprobs=(-0.5, -0.25), version=version)


def test_a_session_is_one_trajectory_rewarded_once_for_all_its_turns():
    ledger = RewardLedger(prefix="p", group_size=2, timeout_s=10, straggler_s=5)
    ledger.record(turn("a"), session="s", now_s=0)
    ledger.record(turn("b", version=1), session="s", now_s=1)
    ledger.record(turn("c"), session=None, now_s=1)
    assert ledger.reward(0.5, completion_id="b", now_s=2) == 2  # any completion of a session rewards all of it
    with pytest.raises(UnknownCompletion):
        ledger.reward(0.5, session="s")  # rewarded already
    assert ledger.reward(1, completion_id="c", now_s=2) == 1
    # a and c are first turns of one prompt: a group; b (a second turn) waits for company
    first = ledger.take_groups(now_s=2)
    assert [(e.id, e.group, e.reward, e.model_version) for e in first] == [("a", "p-g1", 0.5, 0), ("c", "p-g1", 1, 0)]
    assert ledger.take_groups(now_s=6.9) == []  # one straggler: not a group
    assert ledger.counts() == {"served_requests": 3.0, "rewarded": 2.0, "expired": 0.0, "awaiting_reward": 0.0}


def test_same_prompt_turns_group_together_and_stragglers_in_arrival_order():
    ledger = RewardLedger(prefix="p", group_size=2, timeout_s=60, straggler_s=5)
    prompts = {"x1": (1,), "y1": (2,), "x2": (1,), "y2": (2,), "z": (3,)}
    for cid, prompt in prompts.items():
        ledger.record(Turn(completion_id=cid, prompt=prompt, response=(5,), logprobs=(-1.0,), version=0),
                      session=None, now_s=0)
        ledger.reward(0.0, completion_id=cid, now_s=0 if cid != "z" else 4)
    groups = {}
    for e in ledger.take_groups(now_s=1):
        groups.setdefault(e.group, []).append(e.id)
    assert sorted(groups.values()) == [["x1", "x2"], ["y1", "y2"]]
    ledger.record(turn("w"), session=None, now_s=1)
    ledger.reward(0.0, completion_id="w", now_s=1)
    assert ledger.take_groups(now_s=8) == []  # z is not old enough to be a straggler
    assert [e.id for e in ledger.take_groups(now_s=9)] == ["z", "w"]


def test_unrewarded_trajectories_expire_after_their_last_turn_and_are_counted():
    ledger = RewardLedger(prefix="p", group_size=1, timeout_s=10)
    ledger.record(turn("a"), session="s", now_s=0)
    ledger.record(turn("b"), session="s", now_s=8)  # the session is still going
    ledger.record(turn("c"), session=None, now_s=0)
    assert ledger.expire(12) == 1  # c; the session's clock restarted at 8
    assert ledger.expire(18.5) == 1
    with pytest.raises(UnknownCompletion, match="expired"):
        ledger.reward(1.0, completion_id="a")
    assert ledger.take_groups() == [] and ledger.expired == 2 and ledger.rewarded == 0


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1", None, True])
def test_a_reward_that_is_not_a_finite_number_is_refused_and_keeps_the_completion(value):
    ledger = RewardLedger(prefix="p", group_size=1, timeout_s=10)
    ledger.record(turn("a"), session=None, now_s=0)
    with pytest.raises(BadReward):
        ledger.reward(value, completion_id="a")
    assert ledger.reward(0.0, completion_id="a") == 1
