"""Reward functions on decoded text: the built-ins, `module:function`, weighted specs, the row form
(`fn(response, answer, *, prompt, row)`) and their errors."""

from __future__ import annotations

import pytest

from rolectl.roles.engines.base import Task
from rolectl.roles.engines.rewards import (
    WeightedReward,
    exact_match,
    format_reward,
    math_answer,
    parse_reward_specs,
    positional_match,
    resolve_reward,
    reward_keywords,
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


def _within_tolerance(response, answer, *, row):
    return 1.0 if abs(float(response) - float(answer)) <= row["tolerance"] else 0.0


def _prompt_echo(response, answer, prompt):
    return 1.0 if prompt.endswith(response) else 0.0


def _everything(response, answer, **extra):
    return float(len(extra))


def _scaled(response, answer, scale=2.0):
    return scale * positional_match(response, answer)


def test_rewards_take_the_row_and_prompt_they_declare():
    rewards = tuple(WeightedReward(name, 1.0, fn, reward_keywords(fn, name)) for name, fn in (
        ("tol", _within_tolerance), ("echo", _prompt_echo), ("all", _everything), ("old", positional_match),
        ("default", _scaled)))
    assert [r.keywords for r in rewards] == [{"row"}, {"prompt"}, {"prompt", "row"}, set(), set()]
    task = Task(id="t", prompt=(1, 2), answer="3.0", prompt_text="what is 1.5 + 1.3? 2.9",
                row={"question": "what is 1.5 + 1.3?", "answer": "3.0", "tolerance": 0.15})
    total, scores = score_all(rewards, "2.9", task)
    assert scores == {"tol": 1.0, "echo": 1.0, "all": 2.0, "old": 0.0, "default": 0.0} and total == 4.0
    strict = task.__class__(**{**{f: getattr(task, f) for f in task.__slots__}, "row": {"tolerance": 0.05}})
    assert score_all(rewards[:1], "2.9", strict)[1] == {"tol": 0.0}


def test_a_reward_cannot_change_the_row_the_next_one_sees():
    def greedy(response, answer, *, row):
        row["tolerance"] = 0.0
        return 0.0

    rewards = (WeightedReward("greedy", 1.0, greedy, frozenset({"row"})),
               WeightedReward("tol", 1.0, _within_tolerance, frozenset({"row"})))
    task = Task(id="t", prompt=(), answer="1", row={"tolerance": 0.5})
    assert score_all(rewards, "1.2", task)[1]["tol"] == 1.0 and task.row == {"tolerance": 0.5}


def test_a_bare_answer_still_scores_the_two_argument_way():
    rewards = parse_reward_specs(["positional_match", "exact_match"])
    assert score_all(rewards, "4 1 3", "4 1 3") == (2.0, {"positional_match": 1.0, "exact_match": 1.0})


@pytest.mark.parametrize("source,fragment", [
    ("def fn(response):\n    return 0.0\n", "takes 1 positional argument(s), not response and answer"),
    ("def fn(response, answer, tolerance):\n    return 0.0\n", "rolectl passes no 'tolerance'"),
    ("def fn(response, answer, *, rubric):\n    return 0.0\n", "rolectl passes no 'rubric'"),
    ("def fn(response, answer, row, /):\n    return 0.0\n", "rolectl passes no 'row'"),  # positional only
    ("fn = 3\n", "is not a function"),
])
def test_a_reward_rolectl_cannot_call_is_refused_with_the_forms_it_can(tmp_path, source, fragment):
    (tmp_path / "mine.py").write_text(source)
    problems = dict(reward_spec_problems([f"{tmp_path}/mine.py:fn"]))
    assert fragment in problems["data.rewards[0]"], problems
    if "function" not in fragment:
        assert "fn(response, answer, *, prompt, row)" in problems["data.rewards[0]"]


def test_a_bad_reward_signature_fails_the_job_config(tmp_path):
    from rolectl.roles.config import parse_config
    from rolectl.sync_protocol import ConfigError

    (tmp_path / "mine.py").write_text("def fn(response, answer, tolerance):\n    return 0.0\n")
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "a", "answer": "b"}\n')
    for section in ("data", "eval"):
        job = {"job": "j", "model": {"engine": "hf", "path": str(tmp_path / "m"), "build": {}},
               "data": {"path": str(tmp_path / "tasks.jsonl")}, "eval": {"path": str(tmp_path / "tasks.jsonl")}}
        job[section]["rewards"] = [f"{tmp_path}/mine.py:fn"]
        with pytest.raises(ConfigError) as caught:
            parse_config(job)
        said = dict(caught.value.problems)
        assert "rolectl passes no 'tolerance'" in said[f"{section}.rewards[0]"], said
