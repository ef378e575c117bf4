"""The `agent:` section: typed, every problem by its dotted path, the environment resolved as
`module:Class` (like reward functions) only when the job is loaded with its engines."""

from __future__ import annotations

import pytest

from rolectl.roles.config import parse_config
from rolectl.roles.engines.agent.config import AgentSection, resolve_environment
from rolectl.sync_protocol import ConfigError


class CountdownEnv:
    """A small environment for the config's checks: done after `turns` steps."""

    tools = ()

    def __init__(self, turns: int = 2) -> None:
        self.left = turns

    def reset(self, task):
        return "go"

    def step(self, model_text):
        raise NotImplementedError


def not_an_environment(task):
    return "a function"


class NoStep:
    def reset(self, task):
        return ""


HERE = __name__


def _job(agent: dict, *, check_engines: bool = True):
    return parse_config({"job": "a", "agent": agent}, check_engines=check_engines)


def _problems(agent: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        _job(agent)
    return info.value.problems


def test_a_job_without_agent_is_single_turn():
    assert parse_config({"job": "a"}).agent is None


def test_the_section_is_typed_with_its_defaults():
    cfg = _job({"environment": f"{HERE}:CountdownEnv", "args": {"turns": 3}})
    assert isinstance(cfg.agent, AgentSection)
    assert (cfg.agent.max_turns, cfg.agent.max_tokens, cfg.agent.step_timeout_s, cfg.agent.reward) == (
        4, None, 10.0, "sum")
    assert cfg.agent.args == {"turns": 3}


@pytest.mark.parametrize(("environment", "says"), [
    ("no_such_module_here:Env", "cannot import module 'no_such_module_here'"),
    (f"{HERE}:Missing", f"module {HERE!r} has no class 'Missing'"),
    (f"{HERE}:not_an_environment", "is not a class"),
    (f"{HERE}:NoStep", "has no step method"),
    ("nonsense", "unknown environment 'nonsense'; built-ins: ['hidden_reverse', 'tools']"),
])
def test_an_environment_that_does_not_resolve_is_named_with_what_to_do(environment, says):
    [(path, why)] = _problems({"environment": environment})
    assert path == "agent.environment"
    assert says in why


def test_args_the_class_does_not_take_are_refused_by_its_signature():
    [(path, why)] = _problems({"environment": f"{HERE}:CountdownEnv", "args": {"rounds": 3}})
    assert path == "agent.args"
    assert "unexpected keyword argument 'rounds'" in why and why.endswith("it takes (turns=2)")


def test_every_problem_of_the_section_at_once_by_its_path():
    problems = _problems({"environment": f"{HERE}:CountdownEnv", "max_turns": 0, "reward": "max",
                          "discount": 1.5, "step_timeout_s": "10", "colour": "blue"})
    assert sorted(path for path, _ in problems) == [
        "agent.colour", "agent.discount", "agent.max_turns", "agent.reward", "agent.step_timeout_s"]
    assert dict(problems)["agent.colour"].startswith("unknown field; known: ['args', 'discount', 'environment'")


def test_the_environment_is_not_imported_without_the_engines():
    # a synchronizer loads the job without its engines: the user's module is not imported there
    cfg = _job({"environment": "no_such_module_here:Env"}, check_engines=False)
    assert cfg.agent.environment == "no_such_module_here:Env"


def test_a_built_in_environment_resolves_by_name():
    from rolectl.roles.engines.agent.examples import HiddenReverse

    assert resolve_environment("hidden_reverse") is HiddenReverse
    assert resolve_environment("rolectl.roles.engines.agent.examples:HiddenReverse") is HiddenReverse


def test_the_budget_defaults_to_the_engines_bounds():
    agent = AgentSection(environment="hidden_reverse")
    assert agent.budget(16) == (16, 16)
    assert AgentSection(environment="x", max_tokens=40).budget(16) == (40, 16)
    assert AgentSection(environment="x", max_tokens=8, max_tokens_per_turn=12).budget(16) == (8, 8)
