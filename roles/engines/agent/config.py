"""The job's `agent:` section (multi-turn episodes against an environment) and how its environment is
found: a built-in name, or `module:Class` imported from the Python path, as reward functions are.

Pydantic alone at import: a synchronizer loads the job config without torch. What the section names
outside itself (the environment's class, its `args`) is checked when the job is loaded with its
engines (`config_base.checking`), once.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, ValidationInfo, field_validator, model_validator

from rolectl.roles.config_base import Name, PositiveInt, Seconds, Section, checking, invalid

__all__ = ["AgentSection", "BUILTIN_ENVIRONMENTS", "resolve_environment", "environment_problems"]

BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "tools": "rolectl.roles.engines.agent.tools:ToolEnvironment",
    "hidden_reverse": "rolectl.roles.engines.agent.examples:HiddenReverse",
}
"""Environments rolectl ships, by the name a job may give instead of `module:Class`."""


def resolve_environment(name: str) -> type:
    """The environment class `name` names (a built-in, or `package.module:Class`).

    Raises ValueError saying what is missing and what to do."""
    spec = BUILTIN_ENVIRONMENTS.get(name, name)
    if ":" not in spec:
        raise ValueError(f"unknown environment {name!r}; built-ins: {sorted(BUILTIN_ENVIRONMENTS)}, or give "
                         "your own as 'module:Class'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"environment {name!r}: cannot import module {module_name!r} ({exc}); is it on "
                         "PYTHONPATH of every explorer?") from None
    found = getattr(module, attr, None)
    if found is None:
        raise ValueError(f"environment {name!r}: module {module_name!r} has no class {attr!r}")
    missing = [method for method in ("reset", "step") if not callable(getattr(found, method, None))]
    if not isinstance(found, type) or missing:
        what = f"has no {' or '.join(missing)} method" if isinstance(found, type) else "is not a class"
        raise ValueError(f"environment {name!r}: {module_name}.{attr} {what}; an environment is a class with "
                         "reset(task) and step(model_text) (rolectl.roles.engines.agent.Environment)")
    return found


def environment_problems(name: str, args: dict[str, Any]) -> list[tuple[str, str]]:
    """Problems with `environment` and its `args`, by path relative to the section: the class does
    not resolve, or does not take these keyword arguments (checked against its signature, not built)."""
    try:
        found = resolve_environment(name)
    except ValueError as exc:
        return [("environment", str(exc))]
    try:
        signature = inspect.signature(found)
    except ValueError:  # no signature to read (a builtin): it is built as it stands
        return []
    try:
        signature.bind(**args)
    except TypeError as exc:
        takes = ", ".join(str(p.replace(annotation=p.empty)) for p in signature.parameters.values())
        return [("args", f"{found.__module__}.{found.__qualname__} does not take these arguments ({exc}); "
                         f"it takes ({takes})")]
    return []


class AgentSection(Section):
    """`agent:` multi-turn episodes. Each task is played as `group_size` episodes, each against its own
    environment (`environment` built with `args`): the model's turn, the environment's answer (rendered
    with the model's chat template, never trained on), the model's next turn, until the environment
    says done, `max_turns` or the `max_tokens` budget. An episode is one experience whose loss mask
    trains only the tokens the policy sampled. Without this section a job is single-turn
    (docs/agents.md)."""

    environment: Name
    """The environment: a built-in (`tools`, `hidden_reverse`) or your own class as `module:Class`,
    imported from the Python path of every explorer."""
    args: Annotated[dict[str, Any], Strict()] = {}
    """Keyword arguments the environment's class is built with, one instance per episode."""
    max_turns: PositiveInt = 4
    """Model turns per episode at most; an episode still going then ends (counted `agent/truncated`)."""
    max_tokens: PositiveInt | None = None
    """The trajectory's token budget: the model's and the environment's tokens after the prompt. A
    turn samples at most what is left; an observation that would fill it ends the episode (counted
    `agent/truncated`). Default: the engine's response bound (`model.max_new_tokens`; the tiny
    engine's `task_length + 1`)."""
    max_tokens_per_turn: PositiveInt | None = None
    """Tokens one model turn samples at most. Default: the engine's response bound."""
    step_timeout_s: Seconds = 10.0
    """Seconds `reset` or one `step` of the environment may take; past it the episode ends (reward 0,
    counted `agent/env_errors/timeout`) and its thread is abandoned."""
    reward: Literal["sum", "discounted"] = "sum"
    """The episode's reward from the environment's per-turn rewards: their sum, or their sum
    discounted by `discount` per turn. The job's `data.rewards`, when given, score the final model
    turn's text against the task's answer and are added."""
    discount: Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    """`reward: discounted`: turn t's reward counts `discount ** t` (t = 0 for the first turn)."""
    tools: tuple[Name, ...] = ()
    """The built-in tool environment (`environment: tools`): the tools the model may call, built-ins by
    name or `module:function`."""
    tool_timeout_s: Seconds = 5.0
    """The built-in tool environment: seconds one tool call may take; past it the model is told so."""

    @field_validator("args")
    @classmethod
    def _keyword_names(cls, args: dict[str, Any]) -> dict[str, Any]:
        bad = [key for key in args if not isinstance(key, str) or not key.isidentifier()]
        if bad:
            raise ValueError(f"keys are the class's keyword arguments (identifiers), got {bad}")
        return args

    @model_validator(mode="after")
    def _environment_resolves(self, info: ValidationInfo) -> AgentSection:
        # importing a user's module runs its code: only when the engines are checked
        if checking(info):
            problems = environment_problems(self.environment, self.args)
            if problems:
                raise invalid(problems)
        return self

    def budget(self, response_bound: int, turn_bound: int | None = None) -> tuple[int, int]:
        """(the trajectory's token budget, one turn's bound), defaults from the engine's bounds."""
        total = self.max_tokens or response_bound
        return total, min(self.max_tokens_per_turn or turn_bound or response_bound, total)
