"""Finding tool calls in a model's turn, in the syntax its chat template taught it.

A Hugging Face tokenizer renders tools into the prompt (`apply_chat_template(tools=...)`) but says
nothing about how the model writes a call back, so the job names the syntax (`parser`):

- `hermes` (the default): `<tool_call>{"name": "calculator", "arguments": {"expression": "37 + 45"}}
  </tool_call>`, any number per turn: the syntax of Qwen2/2.5/3, Hermes 2/3 and the models trained on
  their templates.
- `compact`: `<tool_call> calculator 37 + 45` (an optional `</tool_call>` ends it): one call per turn,
  the rest of the text after the tool's name is its one parameter (or a JSON object of arguments).
  Few tokens, all of them words: what a small model with a word-level vocabulary can learn to write
  (the chat template `model.build` gives a built tokenizer renders calls this way).
- `module:function`: your own, `fn(text) -> list[ToolCall]`.

A turn with no call is the model's answer. A call that cannot be read (bad JSON, no name) is still a
call: the environment answers it with what is wrong, and counts it as malformed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..user_code import resolve_object

__all__ = ["ToolError", "ToolTimeout", "ToolCall", "ToolCallParser", "hermes_calls", "compact_calls",
           "resolve_parser", "PARSERS", "CALL_OPEN", "CALL_CLOSE"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class ToolError(Exception):
    """A tool's way to say its call failed; the message is what the model reads (outcome `error`)."""


class ToolTimeout(ToolError):
    """A tool's way to say its call ran out of time (outcome `timeout`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """One call as written: the tool's name and arguments, or `problem` (why it cannot be read).

    `text` is the argument text of a compact call, mapped onto the tool's parameters once the tool is
    known (`arguments` is None until then)."""

    name: str | None
    arguments: Mapping[str, Any] | None = None
    text: str | None = None
    problem: str | None = None
    raw: str = field(default="", repr=False)


ToolCallParser = Callable[[str], Sequence[ToolCall]]

_HERMES = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def _hermes_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except ValueError as exc:
        return ToolCall(name=None, problem=f"the call is not valid JSON ({exc})", raw=body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall(name=None, problem='the call must be a JSON object with a "name" (text)', raw=body)
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            return ToolCall(name=call["name"], problem=f'"arguments" is not valid JSON ({exc})', raw=body)
    if not isinstance(arguments, dict):
        return ToolCall(name=call["name"], problem='"arguments" must be a JSON object', raw=body)
    return ToolCall(name=call["name"], arguments=arguments, raw=body)


def hermes_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{json}</tool_call>` of the turn, in order; an unclosed last one is malformed."""
    calls = [_hermes_call(m.group(1).strip()) for m in _HERMES.finditer(text)]
    tail = _HERMES.sub("", text)
    if CALL_OPEN in tail:
        calls.append(ToolCall(name=None, problem=f"a {CALL_OPEN} without its {CALL_CLOSE}",
                              raw=tail[tail.index(CALL_OPEN):]))
    return calls


def compact_calls(text: str) -> list[ToolCall]:
    """`<tool_call> name argument text [</tool_call>]`: at most one call, from the first `<tool_call>`."""
    at = text.find(CALL_OPEN)
    if at < 0:
        return []
    body = text[at + len(CALL_OPEN):]
    body = body.split(CALL_CLOSE, 1)[0].strip()
    if not body:
        return [ToolCall(name=None, problem=f"no tool name after {CALL_OPEN}", raw=body)]
    name, _, rest = body.partition(" ")
    rest = rest.strip()
    if rest.startswith("{"):
        call = _hermes_call(json.dumps({"name": name, "arguments": rest}))
        return [ToolCall(name=call.name, arguments=call.arguments, problem=call.problem, raw=body)]
    return [ToolCall(name=name, text=rest, raw=body)]


PARSERS: dict[str, ToolCallParser] = {"hermes": hermes_calls, "compact": compact_calls}


def resolve_parser(name: str) -> ToolCallParser:
    """A built-in parser by name, `module:function` or `path/to/file.py:function`; ValueError says
    what is wrong."""
    fn = resolve_object(name, what="tool-call parser", builtins=PARSERS)
    if not callable(fn):
        raise ValueError(f"tool-call parser {name!r}: {type(fn).__name__} {fn!r} is not a function")
    return fn
