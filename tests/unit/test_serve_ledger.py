"""The reward ledger: sessions are trajectories, rewards make whole groups, the unrewarded expire."""

from __future__ import annotations

import math

import pytest

from rolectl.bus.experiences import MalformedExperience, validate_batch
from rolectl.roles.serve.ledger import BadReward, RewardLedger, Turn, UnknownCompletion
from rolectl.sync_protocol.experience import ExperienceBatch, ExperienceLimits


def turn(cid: str, version: int = 0) -> Turn:
    return Turn(completion_id=cid, prompt=(1, 2), response=(3, 4), logprobs=(-0.5, -0.25), version=version)


def test_a_session_is_one_trajectory_rewarded_once_for_all_its_turns():
    ledger = RewardLedger(prefix="p", group_size=2, timeout_s=10, straggler_s=5)
    ledger.record(turn("a"), session="s", now_s=0)
    # the second call's prompt: the first's, its response, and what the client added (7, 8)
    ledger.record(Turn(completion_id="b", prompt=(1, 2, 3, 4, 7, 8), response=(5, 6), logprobs=(-0.1, -0.2),
                       version=1), session="s", now_s=1)
    ledger.record(turn("c"), session=None, now_s=1)
    assert ledger.reward(0.5, completion_id="b", now_s=2) == 2  # any completion of a session rewards all of it
    with pytest.raises(UnknownCompletion):
        ledger.reward(0.5, session="s")  # rewarded already
    assert ledger.reward(1, completion_id="c", now_s=2) == 1
    # the session and c began with one prompt: a group
    [session, single] = ledger.take_groups(now_s=2)
    assert (session.id, session.group, session.reward, single.id, single.group, single.reward) == \
        ("a", "p-g1", 0.5, "c", "p-g1", 1)
    assert session.prompt == (1, 2) and session.response == (3, 4, 7, 8, 5, 6)
    assert session.loss_mask == (1, 1, 0, 0, 1, 1) and session.logprobs == (-0.5, -0.25, 0.0, 0.0, -0.1, -0.2)
    # the client's tokens carry the version of the turn they answer; the oldest sampled is the record's
    assert session.versions() == (0, 0, 0, 0, 1, 1) and session.model_version == 0 and session.turns == 2
    # one call is a single-turn record, as before
    assert (single.loss_mask, single.token_versions, single.response) == (None, None, (3, 4))
    assert ledger.counts() == {"served_requests": 3.0, "rewarded": 2.0, "expired": 0.0, "awaiting_reward": 0.0,
                               "trajectory_splits_history": 0.0, "trajectory_splits_budget": 0.0}


def test_a_prompt_without_the_end_of_turn_token_drops_it_from_the_trajectory():
    """A client that re-renders the conversation from text leaves out the token the model stopped
    with: the trajectory is what the model saw next, so that token leaves it."""
    ledger = RewardLedger(prefix="p", group_size=1, timeout_s=10)
    ledger.record(Turn(completion_id="a", prompt=(1, 2), response=(3, 9), logprobs=(-0.5, -0.1), version=0,
                       stopped=True), session="s", now_s=0)
    ledger.record(Turn(completion_id="b", prompt=(1, 2, 3, 7), response=(5,), logprobs=(-0.2,), version=0),
                  session="s", now_s=0)
    ledger.reward(1.0, session="s")
    [e] = ledger.take_groups()
    assert (e.response, e.loss_mask, e.logprobs) == ((3, 7, 5), (1, 0, 1), (-0.5, 0.0, -0.2))
    assert ledger.splits == {"history": 0, "budget": 0}


@pytest.mark.parametrize("second_prompt, budget, split", [
    ((1, 2, 3, 5, 7), None, "history"),  # the client changed a token the model sampled
    ((1, 9), None, "history"),  # a new conversation under the same session id
    ((1, 2, 3, 4, 7), 4, "budget"),  # 2 + 1 + 2 tokens would pass a budget of 4
])
def test_a_call_that_does_not_extend_the_trajectory_starts_a_new_one_counted(second_prompt, budget, split):
    ledger = RewardLedger(prefix="p", group_size=1, timeout_s=10, max_response_tokens=budget)
    ledger.record(turn("a"), session="s", now_s=0)
    ledger.record(Turn(completion_id="b", prompt=second_prompt, response=(5, 6), logprobs=(-0.1, -0.2), version=1),
                  session="s", now_s=0)
    assert ledger.reward(0.75, session="s") == 2
    first, second = ledger.take_groups()
    assert (first.id, first.prompt, first.response, first.loss_mask) == ("a", (1, 2), (3, 4), None)
    assert (second.id, second.prompt, second.response, second.model_version) == ("b", second_prompt, (5, 6), 1)
    assert first.reward == second.reward == 0.75  # each trajectory of the session carries its reward
    assert ledger.counts()[f"trajectory_splits_{split}"] == 1.0


def _three_turns(ledger: RewardLedger) -> None:
    prompt: tuple[int, ...] = (1,)
    for k, cid in enumerate("abc"):
        ledger.record(Turn(completion_id=cid, prompt=prompt, response=(2,), logprobs=(-1.0,), version=0),
                      session="s", now_s=k)
        prompt = (*prompt, 2, 3)


@pytest.mark.parametrize("discount, total", [(1.0, 0.25 + 0.5 + 1.0 + 2.0), (0.5, 0.25 + 0.5 * 0.5 + 0.25 * (1 + 2))])
def test_per_turn_rewards_are_kept_until_the_session_ends_then_summed_or_discounted(discount, total):
    ledger = RewardLedger(prefix="p", group_size=1, timeout_s=10, discount=discount)
    _three_turns(ledger)
    assert ledger.reward(0.25, completion_id="a", done=False) == 3
    assert ledger.reward(0.5, completion_id="b", done=False) == 3
    assert ledger.reward(1.0, session="s", done=False) == 3  # the session's latest turn: c
    assert ledger.take_groups() == [] and ledger.waiting == 1 and ledger.rewarded == 0
    assert ledger.reward(2.0, session="s") == 3  # the final reward, to the latest turn too
    [e] = ledger.take_groups()
    assert e.reward == pytest.approx(total) and e.turns == 3 and ledger.rewarded == 1


def test_a_per_turn_reward_restarts_the_session_s_clock():
    ledger = RewardLedger(prefix="p", group_size=1, timeout_s=10)
    ledger.record(turn("a"), session="s", now_s=0)
    ledger.reward(0.5, session="s", done=False, now_s=8)
    assert ledger.expire(12) == 0 and ledger.expire(18.5) == 1


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


def test_a_session_sampled_by_two_versions_is_published_at_the_newer():
    ledger = RewardLedger(prefix="p", group_size=1, timeout_s=10, straggler_s=5)
    ledger.record(turn("a", version=3), session="s", now_s=0)
    ledger.record(Turn(completion_id="b", prompt=(1, 2, 3, 4, 7), response=(5, 6), logprobs=(-0.1, -0.2), version=4),
                  session="s", now_s=1)
    ledger.reward(1.0, session="s", now_s=2)
    [session] = ledger.take_groups(now_s=2)
    assert (session.model_version, session.newest_version) == (3, 4)
    limits = ExperienceLimits(vocab_size=16, prompt_length=None, max_response_length=16, group_size=1)
    batch = ExperienceBatch.of("explorer-0", 1, (session,))
    assert batch.model_version == 4
    validate_batch(batch, limits)  # what the trainer checks
    # at the record's oldest version, its newer turn would be a version the batch does not have
    with pytest.raises(MalformedExperience, match="token version outside 3..3"):
        validate_batch(ExperienceBatch(member="explorer-0", explore_step=1, model_version=3,
                                       experiences=(session,)), limits)
