"""The built-in tool environment (`agent.environment: tools`): the model calls Python functions in its
chat template's tool-call syntax and reads their results, until it answers without a call.

A tool is a Python function with type hints and a Google-style docstring (`Args:`); its JSON schema
is derived from them the way Hugging Face's chat templates expect (`transformers.utils.get_json_schema`)
and passed to the template (`Environment.tools` -> `apply_chat_template(tools=...)`). A call's
arguments are checked against the same signature (pydantic, strict JSON rules) before the function
runs. Built-ins: `calculator` (`roles.engines.agent.calculator`) and `python` (code in a limited child
process, `roles.engines.agent.python_tool`); your own as `module:function`.

Every call is answered with a `tool` message the model sees and counted in `StepResult.info` as
`tool_calls/<tool>/<outcome>` (the job's metrics `agent/tool_calls/...`):

| outcome | when | the model reads |
| --- | --- | --- |
| `ok` | the tool returned | its result |
| `malformed` | the call cannot be read, or its arguments do not fit the tool's parameters | what is wrong |
| `unknown_tool` | no tool by that name (counted under the tool name `_unknown`) | the tools there are |
| `error` | the tool raised | the error |
| `timeout` | the call ran past `tool_timeout_s` (abandoned), or the tool said so (`ToolTimeout`) | that it timed out |

The episode ends when a turn holds no call (the job's `data.rewards` then score that text), or at the
agent's `max_turns`. `call_reward` (default 0) is partial credit for calling, which teaches a model
to call before it can answer: a number is credit for an `ok` call; a mapping by outcome (`{ok: 0.3,
error: 0.2, malformed: 0.1}`) also credits calls that did not work, while a model learns the syntax;
two keys credit what a call does for the task rather than that it runs: `useful`, an `ok` call whose
result is the task's answer (`Task.answer`: equal as numbers, or as text), and `uses_prompt`, an `ok`
call whose arguments hold numbers, each one of the prompt's (`37 + 45` for "what is 37 + 45 ?"), a
step on the way to a useful call. An episode earns the best credit among its calls, once (as step
rewards: what a call adds to it). Such calls are counted as `useful_calls` and `uses_prompt_calls`
(the job's metrics `agent/useful_calls`, `agent/uses_prompt_calls`).
"""

from __future__ import annotations

import json
import math
import re
import threading
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pydantic

from ..user_code import resolve_object
from .calculator import calculator
from .environment import Message, StepResult
from .tool_calls import ToolCall, ToolError, ToolTimeout, resolve_parser

if TYPE_CHECKING:
    from ..base import Task

__all__ = ["Tool", "ToolError", "ToolTimeout", "ToolEnvironment", "tool_from_function", "resolve_tools",
           "BUILTIN_TOOLS", "OUTCOMES", "USEFUL", "USES_PROMPT", "UNKNOWN_TOOL"]

OUTCOMES = ("ok", "malformed", "error", "timeout", "unknown_tool")
USEFUL = "useful"  # a call_reward key beyond the outcomes: an ok call whose result is the task's answer
USES_PROMPT = "uses_prompt"  # and one for an ok call whose arguments' numbers are all the prompt's
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
UNKNOWN_TOOL = "_unknown"  # the metric name of a call to a tool that is not there (model text: unbounded)
_GRACE_S = 2.0  # past tool_timeout_s, for a tool that enforces the limit itself (python) to end cleanly


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: its name, its JSON schema (what the chat template shows), and
    the pydantic model its arguments are checked with."""

    name: str
    fn: Callable[..., Any]
    schema: Mapping[str, Any]
    arguments: type[pydantic.BaseModel]

    @property
    def text_parameter(self) -> str | None:
        """The one parameter a compact call's text fills (a tool with exactly one required parameter)."""
        required = self.schema["function"]["parameters"].get("required", [])
        return required[0] if len(required) == 1 else None

    def check(self, call: ToolCall) -> dict[str, Any]:
        """The call's arguments as the function takes them; ValueError says what does not fit."""
        arguments = call.arguments
        if arguments is None:
            parameter = self.text_parameter
            if parameter is None:
                raise ValueError(f"{self.name} takes several parameters: give them as a JSON object")
            arguments = {parameter: call.text or ""}
        try:
            checked = self.arguments.model_validate_json(json.dumps(arguments), strict=True)
        except pydantic.ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"arguments of {self.name} do not fit its parameters: {problems}") from None
        return {name: getattr(checked, name) for name in type(checked).model_fields}


def tool_from_function(fn: Callable[..., Any], *, name: str | None = None) -> Tool:
    """A tool from a function with type hints and an `Args:` docstring; ValueError says what is missing."""
    import inspect

    from transformers.utils import get_json_schema

    label = name or getattr(fn, "__name__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers raises its own types for a missing hint or docstring entry
        raise ValueError(f"tool {label!r}: no JSON schema from its signature ({exc}); give every parameter a "
                         "type hint and the function a Google-style docstring with an `Args:` entry for each "
                         "parameter (transformers.utils.get_json_schema reads them)") from None
    hints = typing.get_type_hints(fn)
    fields: dict[str, Any] = {}
    for parameter in inspect.signature(fn).parameters.values():
        default = ... if parameter.default is inspect.Parameter.empty else parameter.default
        fields[parameter.name] = (hints[parameter.name], default)
    arguments = pydantic.create_model(f"{label}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields)
    if name is not None:
        schema = {**schema, "function": {**schema["function"], "name": name}}
    return Tool(name=schema["function"]["name"], fn=fn, schema=schema, arguments=arguments)


def _python(options: Mapping[str, Any], tool_timeout_s: float) -> Callable[..., Any]:
    from rolectl.roles.config_base import validate_section

    from .python_tool import PythonLimits, python_tool

    limits, problems = validate_section(PythonLimits, {"wall_s": tool_timeout_s, **options},
                                        where="tool_options.python")
    if problems:
        raise ValueError("; ".join(f"{where}: {what}" for where, what in problems))
    return python_tool(limits)


# name -> (builder from the tool's options and the per-call limit): built once per environment
BUILTIN_TOOLS: dict[str, Callable[[Mapping[str, Any], float], Callable[..., Any]]] = {
    "calculator": lambda options, _: calculator,
    "python": _python,
}


def _resolve(spec: str | Callable[..., Any], options: Mapping[str, Any], tool_timeout_s: float) -> Tool:
    if callable(spec):
        return tool_from_function(spec)
    if spec in BUILTIN_TOOLS:
        return tool_from_function(BUILTIN_TOOLS[spec](options, tool_timeout_s), name=spec)
    fn = resolve_object(spec, what="tool", builtins=BUILTIN_TOOLS)
    if not callable(fn):
        raise ValueError(f"tool {spec!r}: {type(fn).__name__} {fn!r} is not a function")
    return tool_from_function(fn)


def resolve_tools(specs: Sequence[str | Callable[..., Any]], *, options: Mapping[str, Mapping[str, Any]] | None = None,
                  tool_timeout_s: float = 10.0) -> dict[str, Tool]:
    """Tools by name from built-in names, `module:function` names or functions; `options` by tool
    name are a built-in's settings (`{python: {memory_mb: 256}}`)."""
    options = dict(options or {})
    tools: dict[str, Tool] = {}
    for spec in specs:
        key = spec if isinstance(spec, str) else getattr(spec, "__name__", "")
        tool = _resolve(spec, options.pop(key, {}), tool_timeout_s)
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}: a call could not say which it means")
        tools[tool.name] = tool
    if options:
        raise ValueError(f"tool_options for {sorted(options)}, which are not among the tools {sorted(tools)}")
    return tools


def _call_with_limit(fn: Callable[[], str], limit_s: float) -> str:
    """`fn()` in a daemon thread; past `limit_s` (and a grace for a tool that enforces the limit
    itself to end cleanly) it is abandoned, as a thread cannot be killed, and ToolTimeout raised."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller, whatever it is
            result["error"] = exc

    thread = threading.Thread(target=target, name="tool-call", daemon=True)
    thread.start()
    thread.join(limit_s + _GRACE_S)
    if thread.is_alive():
        raise ToolTimeout(f"the call ran past its time limit of {limit_s:g} s")
    if "error" in result:
        raise result["error"]
    return str(result["value"])


class ToolEnvironment:
    """One episode of a task with tools: the task's prompt as the user's message, then each model turn
    answered with its tool calls' results, until a turn holds no call.

    Built once per episode by the agent loop with the agent section's `tools`, `tool_timeout_s` and
    `args` (the keyword arguments below)."""

    def __init__(self, *, tools: Sequence[str | Callable[..., Any]] = ("calculator",), tool_timeout_s: float = 10.0,
                 parser: str = "hermes", system_prompt: str | None = None,
                 call_reward: float | Mapping[str, float] = 0.0,
                 max_calls_per_turn: int = 4, max_result_chars: int = 2000,
                 tool_options: Mapping[str, Mapping[str, Any]] | None = None,
                 resolved: Mapping[str, Tool] | None = None) -> None:
        if not tools and not resolved:
            raise ValueError("the tool environment needs at least one tool (agent.tools)")
        self.by_name = dict(resolved) if resolved is not None else \
            resolve_tools(tools, options=tool_options, tool_timeout_s=tool_timeout_s)
        self.tools = [tool.schema for tool in self.by_name.values()]
        self.parse = resolve_parser(parser)
        self.tool_timeout_s = tool_timeout_s
        self.system_prompt = system_prompt
        self.call_reward = _call_credit(call_reward)
        self.max_calls_per_turn = max_calls_per_turn
        self.max_result_chars = max_result_chars
        self.credited = 0.0  # the best call credit this episode has earned
        self.answer = ""  # the task's answer, which a useful call's result equals
        self.prompt_numbers: set[str] = set()  # the numbers of the task's prompt

    @classmethod
    def for_agent(cls, section: Any) -> Callable[[], ToolEnvironment]:
        """How the agent loop builds this environment for a job's `agent:` section: its `tools` and
        `tool_timeout_s` with its `args`; the tools resolved (and a bad one refused) once, not per episode."""
        if not section.tools:
            raise ValueError("agent.tools: the tool environment needs at least one tool (built-ins: "
                             f"{', '.join(BUILTIN_TOOLS)}, or your own as module:function)")
        args = dict(section.args)
        tools = resolve_tools(section.tools, options=args.pop("tool_options", None),
                              tool_timeout_s=section.tool_timeout_s)
        return lambda: cls(resolved=tools, tool_timeout_s=section.tool_timeout_s, **args)

    def reset(self, task: Task) -> list[Message]:
        self.credited, self.answer = 0.0, task.answer
        self.prompt_numbers = set(_NUMBER.findall(task.prompt_text))
        first = [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        return [*first, Message(role="user", content=task_text(task))]

    def step(self, model_text: str) -> StepResult:
        calls = list(self.parse(model_text))
        if not calls:
            return StepResult(done=True)
        answers, info, reward = [], {}, 0.0
        for index, call in enumerate(calls):
            if index >= self.max_calls_per_turn:
                name, outcome = self._metric_name(call), "malformed"
                text = f"error: at most {self.max_calls_per_turn} tool calls a turn; this one was not run"
            else:
                name, outcome, text = self._answer(call)
            key = f"tool_calls/{name}/{outcome}"
            info[key] = info.get(key, 0.0) + 1.0
            credit = self.call_reward.get(outcome, 0.0)
            for serves in self._serves(call, outcome, text):
                info[f"{serves}_calls"] = info.get(f"{serves}_calls", 0.0) + 1.0
                credit = max(credit, self.call_reward.get(serves, 0.0))
            if credit > self.credited:
                reward, self.credited = reward + credit - self.credited, credit
            answers.append(Message(role="tool", content=_cut(text, self.max_result_chars),
                                   name=name if name in self.by_name else None))
        return StepResult(observation=answers, reward=reward, info=info)

    def _serves(self, call: ToolCall, outcome: str, result: str) -> list[str]:
        """How a call serves the task: `useful` (its result is the answer), `uses_prompt` (its
        arguments' numbers are all the prompt's); none for a call that did not work."""
        if outcome != "ok":
            return []
        arguments = call.text if call.arguments is None else json.dumps(call.arguments)
        numbers = _NUMBER.findall(arguments or "")
        return ([USEFUL] if is_answer(result, self.answer) else []) + \
            ([USES_PROMPT] if numbers and set(numbers) <= self.prompt_numbers else [])

    def _metric_name(self, call: ToolCall) -> str:
        return call.name if call.name in self.by_name else UNKNOWN_TOOL

    def _answer(self, call: ToolCall) -> tuple[str, str, str]:
        """(the tool's metric name, the outcome, what the model reads)."""
        if call.problem is not None:
            return self._metric_name(call), "malformed", f"error: malformed tool call: {call.problem}"
        tool = self.by_name.get(call.name or "")
        if tool is None:
            return UNKNOWN_TOOL, "unknown_tool", f"error: there is no tool {call.name!r}; the tools are " \
                                                 f"{', '.join(self.by_name)}"
        try:
            arguments = tool.check(call)
        except ValueError as exc:
            return tool.name, "malformed", f"error: {exc}"
        try:
            return tool.name, "ok", _call_with_limit(lambda: tool.fn(**arguments), self.tool_timeout_s)
        except ToolTimeout as exc:
            return tool.name, "timeout", f"error: {exc}"
        except ToolError as exc:
            return tool.name, "error", f"error: {exc}"
        except Exception as exc:
            return tool.name, "error", f"error: {type(exc).__name__}: {exc}".rstrip(": ")


def _call_credit(value: float | Mapping[str, float]) -> dict[str, float]:
    """`call_reward` by outcome; ValueError names what is wrong."""
    credit = dict(value) if isinstance(value, Mapping) else {"ok": value}
    unknown = sorted(set(credit) - {*OUTCOMES, USEFUL, USES_PROMPT})
    if unknown:
        raise ValueError(f"call_reward names outcomes {unknown}; the outcomes are {', '.join(OUTCOMES)}, and "
                         f"{USEFUL} (an ok call whose result is the task's answer) and {USES_PROMPT} (an ok "
                         "call whose arguments' numbers are all the prompt's)")
    for outcome, amount in credit.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount):
            raise ValueError(f"call_reward {outcome}: must be a finite number, got {amount!r}")
    return {outcome: float(amount) for outcome, amount in credit.items()}


def is_answer(result: str, answer: str) -> bool:
    """Whether a tool's result is the task's answer: equal as numbers (`82.0` is `82`), else as text
    with the spaces around it cut; never for a task without an answer."""
    result, answer = result.strip(), answer.strip()
    if not answer:
        return False
    try:
        return math.isclose(float(result), float(answer), rel_tol=1e-9, abs_tol=1e-12)
    except ValueError:
        return result == answer


def task_text(task: Task) -> str:
    """The task's prompt as the data row gives it (what the user asks)."""
    if not task.prompt_text:
        raise ValueError(f"task {task.id!r} has no prompt text: the tool environment asks the task's prompt as "
                         "the user's message (tasks read from data.path carry it)")
    return task.prompt_text


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]} [... {len(text) - limit} characters cut]"
