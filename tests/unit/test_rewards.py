"""Reward functions on decoded text: the built-ins, `module:function`, weighted specs and their errors."""

from __future__ import annotations

import pytest

from rolectl.roles.engines.rewards import (
    exact_match,
    format_reward,
    math_answer,
    parse_reward_specs,
    positional_match,
    resolve_reward,
    reward_spec_problems,
    score_all,
)


@pytest.mark.parametrize("response,answer,expected", [
    ("4 1 3", "4 1 3", 1.0),
    ("  4  1 3 \n", "4 1 3", 1.0),
    ("4 1 3\n\nbecause reversing", "4 1 3", 1.0),
    ("4 1", "4 1 3", 0.0),
    ("4 1 3 3", "4 1 3", 0.0),
])
def test_exact_match(response, answer, expected):
    assert exact_match(response, answer) == expected


@pytest.mark.parametrize("response,answer,expected", [
    ("4 1 3", "4 1 3", 1.0),
    ("4 0 3", "4 1 3", 2 / 3),
    ("4 1", "4 1 3", 2 / 3),
    ("4 1 3 9 9 9", "4 1 3", 0.5),  # padding costs credit
    ("", "4 1 3", 0.0),
    ("", "", 1.0),
])
def test_positional_match_gives_partial_credit(response, answer, expected):
    assert positional_match(response, answer) == pytest.approx(expected)


@pytest.mark.parametrize("response,answer,expected", [
    ("so the answer is \\boxed{42}", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("we get 3/4 at first, then \\boxed{0.75}", "3/4", 1.0),
    ("Total: 1,234 apples. The answer is 1234.", "1234", 1.0),
    ("first 3 then 5", "5", 1.0),  # the last number
    ("first 3 then 5", "3", 0.0),
    ("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs... #### 18", 1.0),  # a GSM8K-style worked reference
    ("\\boxed{x+1}", "x + 1", 1.0),  # not a number: normalised text
    ("no numbers here", "7", 0.0),
    ("\\boxed{12", "12", 1.0),  # unbalanced box: falls back to the last number
])
def test_math_answer_verifier(response, answer, expected):
    assert math_answer(response, answer) == expected


@pytest.mark.parametrize("response,expected", [("4 1 3", 1.0), ("4 1 3\n", 1.0), ("4, 1/3 -2.5", 1.0),
                                               ("4 1\n3", 0.0), ("<eos> 4", 0.0), ("", 0.0)])
def test_format_checks_shape_not_content(response, expected):
    assert format_reward(response, "anything") == expected


def test_module_function_rewards_are_imported():
    fn = resolve_reward("rolectl.roles.engines.rewards:positional_match")
    assert fn is positional_match


@pytest.mark.parametrize("spec,fragment", [
    ("nope", "unknown reward 'nope'"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("rolectl.roles.engines.rewards:missing", "has no function 'missing'"),
])
def test_unknown_rewards_say_what_to_do(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_reward(spec)


def test_spec_problems_are_all_reported_with_paths():
    problems = dict(reward_spec_problems(["exact_match", {"name": "nope"}, {"name": "format", "weight": "x"}, 3]))
    assert set(problems) == {"data.rewards[1]", "data.rewards[2].weight", "data.rewards[3]"}
    assert reward_spec_problems([]) and reward_spec_problems("exact_match") == []


def test_weighted_total_and_each_score():
    rewards = parse_reward_specs([{"name": "positional_match", "weight": 2.0}, {"name": "exact_match", "weight": 0}])
    total, scores = score_all(rewards, "4 0 3", "4 1 3")
    assert scores == {"positional_match": pytest.approx(2 / 3), "exact_match": 0.0}
    assert total == pytest.approx(4 / 3)
