"""The reward ledger: sessions are trajectories, rewards make whole groups, the unrewarded expire."""

from __future__ import annotations

import math

import pytest

from rolectl.roles.serve.ledger import BadReward, RewardLedger, Turn, UnknownCompletion


def turn(cid: str, version: int = 0) -> Turn:
    return Turn(completion_id=cid, prompt=(1, 2), response=(3, 4), logprobs=(-0.5, -0.25), version=version)


def test_a_session_is_one_trajectory_rewarded_once_and_grouped_in_arrival_order():
    ledger = RewardLedger(prefix="p", group_size=2, timeout_s=10)
    ledger.record(turn("a"), session="s", now_s=0)
    ledger.record(turn("b", version=1), session="s", now_s=1)
    ledger.record(turn("c"), session=None, now_s=1)
    assert ledger.reward(0.5, completion_id="b") == 2  # any completion of a session rewards all of it
    with pytest.raises(UnknownCompletion):
        ledger.reward(0.5, session="s")  # rewarded already
    first = ledger.take_groups()
    assert [(e.id, e.group, e.reward, e.model_version) for e in first] == [("a", "p-g1", 0.5, 0), ("b", "p-g1", 0.5, 1)]
    assert ledger.reward(1, completion_id="c") == 1
    assert ledger.take_groups() == []  # one of two: waits for a full group
    assert ledger.counts() == {"served_requests": 3.0, "rewarded": 2.0, "expired": 0.0, "awaiting_reward": 0.0}


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
