"""The tool environment: the calculator (hostile input included), reading tool calls in both
syntaxes, and every call outcome answered to the model and counted."""

from __future__ import annotations

import threading
import time

import pytest

from rolectl.roles.engines.agent import Environment
from rolectl.roles.engines.agent.calculator import MAX_BITS, CalculatorError, calculator, evaluate
from rolectl.roles.engines.agent.config import AgentSection
from rolectl.roles.engines.agent.tool_calls import ToolTimeout, compact_calls, hermes_calls, resolve_parser
from rolectl.roles.engines.agent.tools import ToolEnvironment, is_answer, resolve_tools, tool_from_function
from rolectl.roles.engines.base import Task


def task(text: str = "what is 37 + 45 ?") -> Task:
    return Task(id="row0", prompt=(1, 2), answer="82", prompt_text=text)


@pytest.mark.parametrize("expression, value", [
    ("37 + 45", "82"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 % 3", "2"), ("2 ** 10", "1024"),
    ("-(3 + 4) * 2", "-14"), ("+5", "5"), ("0.1 + 0.2", "0.30000000000000004"), ("6 / 3", "2"),
    ("2 ** -2", "0.25"), ("1_000 * 3", "3000"), (" ( 1 ) ", "1"),
])
def test_the_calculator_computes_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, why", [
    ("__import__('os').system('true')", "not arithmetic: Call"),
    ("open('/etc/passwd')", "not arithmetic: Call"),
    ("x + 1", "not arithmetic: Name"),
    ("(1).real", "not arithmetic: Attribute"),
    ("'a' * 10", "not arithmetic: Constant"),
    ("True + 1", "not arithmetic: Constant"),
    ("1j * 2", "not arithmetic: Constant"),
    ("[1, 2]", "not arithmetic: List"),
    ("lambda: 1", "not arithmetic: Lambda"),
    ("1 << 100000", "not arithmetic: LShift"),
    ("~1", "not arithmetic: Invert"),
    ("1 if 1 else 2", "not arithmetic: IfExp"),
    ("1 < 2", "not arithmetic: Compare"),
    ("37 +", "not an arithmetic expression"),
    ("", "not an arithmetic expression"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("10.0 ** 400", "too large for a float"),
    ("1e308 * 10", "too large for a float"),
    ("(-8) ** 0.5", "not a real number"),
    ("9 ** 9 ** 9", f"more than {MAX_BITS} bits"),
    ("(2 ** 4000) * (2 ** 4000)", f"more than {MAX_BITS} bits"),
    ("-" * 100 + "1", "nests deeper"),
    ("(" * 40 + "1" + " + 1)" * 40, "nests deeper"),
    ("1 + " * 100 + "1", "characters long"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    started = time.perf_counter()
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)
    assert time.perf_counter() - started < 1.0  # refused, never computed


def test_the_largest_integer_the_calculator_takes_is_computed():
    assert len(calculator("2 ** 4095")) == 1233
    assert int(calculator("(-2) ** 4095")) == -(2 ** 4095)


@pytest.mark.parametrize("text, calls", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 2"}}</tool_call>',
     [("calculator", {"expression": "1 + 2"}, None)]),
    ('I will compute.\n<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>\n'
     '<tool_call>{"name": "b"}</tool_call>', [("a", {"x": 1}, None), ("b", {}, None)]),
    ("no call here: 82", []),
    ('<tool_call>{"name": calc}</tool_call>', [(None, None, "not valid JSON")]),
    ('<tool_call>["calculator"]</tool_call>', [(None, None, 'with a "name"')]),
    ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', [("c", None, "must be a JSON object")]),
    ('<tool_call>{"name": "c", "arguments": "{bad"}</tool_call>', [("c", None, "not valid JSON")]),
    ('<tool_call>{"name": "c", "arguments": {}}', [(None, None, "without its </tool_call>")]),
])
def test_hermes_calls_are_read_with_their_problems(text, calls):
    got = hermes_calls(text)
    assert [(c.name, c.arguments, c.problem) for c in got] == [(n, a, None) if p is None else (n, a, got[i].problem)
                                                                for i, (n, a, p) in enumerate(calls)]
    for call, (_, _, problem) in zip(got, calls):
        assert problem is None or problem in call.problem


@pytest.mark.parametrize("text, call", [
    ("<tool_call> calculator 37 + 45", ("calculator", None, "37 + 45", None)),
    ("<tool_call> calculator 37 + 45 </tool_call> and more", ("calculator", None, "37 + 45", None)),
    ("thinking <tool_call> calculator", ("calculator", None, "", None)),
    ('<tool_call> calculator {"expression": "2 * 3"}', ("calculator", {"expression": "2 * 3"}, None, None)),
    ("<tool_call>", (None, None, None, "no tool name")),
    ("<tool_call> </tool_call>", (None, None, None, "no tool name")),
])
def test_compact_calls_are_one_name_then_the_argument_text(text, call):
    [got] = compact_calls(text)
    assert (got.name, got.arguments, got.text, got.problem and call[3] in got.problem and call[3]) == call
    assert compact_calls("82") == []


def test_tools_and_parsers_resolve_from_a_file_as_rewards_do(tmp_path):
    code = tmp_path / "my_tools.py"
    code.write_text('def double(x: int) -> int:\n    """Twice x.\n\n    Args:\n        x: A number.\n    """\n'
                    '    return 2 * x\n\n\nLIMIT = 3\n\n\ndef no_calls(text):\n    return []\n')
    assert list(resolve_tools([f"{code}:double"])) == ["double"]
    assert resolve_parser(f"{code}:no_calls")("<tool_call> double 2") == []
    with pytest.raises(ValueError, match=f"tool '{code}:LIMIT': int 3 is not a function"):
        resolve_tools([f"{code}:LIMIT"])
    with pytest.raises(ValueError, match="tool-call parser .*: no such file"):
        resolve_parser(f"{tmp_path / 'missing.py'}:no_calls")


def test_a_parser_is_named_or_imported_and_a_bad_name_says_what_exists():
    assert resolve_parser("hermes") is hermes_calls
    assert resolve_parser("rolectl.roles.engines.agent.tool_calls:compact_calls") is compact_calls
    with pytest.raises(ValueError, match="built-ins: \\['compact', 'hermes'\\]"):
        resolve_parser("json")
    with pytest.raises(ValueError, match="has no function"):
        resolve_parser("rolectl.roles.engines.agent.tool_calls:nothing")


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def power(base: float, exponent: float) -> float:
    """Raise a number to a power.

    Args:
        base: The number.
        exponent: The power.
    """
    return base ** exponent


def undocumented(a: int) -> int:
    return a


def test_a_tool_schema_comes_from_its_type_hints_and_docstring():
    tool = tool_from_function(add)
    assert tool.schema["function"]["name"] == "add"
    assert tool.schema["function"]["parameters"] == {
        "type": "object", "required": ["a"],
        "properties": {"a": {"type": "integer", "description": "The first."},
                       "b": {"type": "integer", "description": "The second."}}}
    with pytest.raises(ValueError, match="give every parameter a type hint .* `Args:` entry"):
        tool_from_function(undocumented)


def test_tools_resolve_from_builtin_names_and_module_paths_with_clear_errors():
    tools = resolve_tools(["calculator", "tests.unit.test_agent_tools:add"])
    assert list(tools) == ["calculator", "add"]
    for spec, why in [("abacus", "unknown tool 'abacus'; built-ins: \\['calculator', 'python'\\]"),
                      ("no_such_module:f", "cannot import module 'no_such_module'"),
                      ("tests.unit.test_agent_tools:nothing", "has no function 'nothing'")]:
        with pytest.raises(ValueError, match=why):
            resolve_tools([spec])
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        resolve_tools(["calculator", "calculator"])
    with pytest.raises(ValueError, match="tool_options for \\['python'\\]"):
        resolve_tools(["calculator"], options={"python": {"cpu_s": 1}})


def test_the_environment_shows_its_tools_and_asks_the_task():
    env = ToolEnvironment(tools=["calculator"], system_prompt="Use the tools.")
    assert isinstance(env, Environment)
    assert [t["function"]["name"] for t in env.tools] == ["calculator"]
    assert [(m.role, m.content) for m in env.reset(task())] == [("system", "Use the tools."),
                                                                ("user", "what is 37 + 45 ?")]


def hermes(name: str, arguments: object) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize("turn, outcome, reads", [
    (hermes("calculator", {"expression": "37 + 45"}), "calculator/ok", "82"),
    (hermes("calculator", {"expression": 37}), "calculator/malformed", "expression: Input should be a valid string"),
    (hermes("calculator", {"expr": "1"}), "calculator/malformed", "expr: Extra inputs are not permitted"),
    (hermes("calculator", {"expression": "1/0"}), "calculator/error", "error: division by zero"),
    (hermes("abacus", {}), "_unknown/unknown_tool", "there is no tool 'abacus'; the tools are calculator, add"),
    ("<tool_call>{oops</tool_call>", "_unknown/malformed", "malformed tool call: the call is not valid JSON"),
    (hermes("add", {"a": "1"}), "add/malformed", "a: Input should be a valid integer"),
    (hermes("add", {"a": 1, "b": 2}), "add/ok", "3"),
])
def test_every_call_is_answered_to_the_model_and_counted_by_outcome(turn, outcome, reads):
    env = ToolEnvironment(tools=["calculator", "tests.unit.test_agent_tools:add"])
    env.reset(task())
    result = env.step(f"Let me compute. {turn}")
    assert not result.done
    # 37 + 45: the prompt's numbers, and the task's answer
    useful = {"useful_calls": 1.0, "uses_prompt_calls": 1.0} if reads == "82" else {}
    assert result.info == {f"tool_calls/{outcome}": 1.0, **useful}
    [message] = result.observation
    assert message.role == "tool" and reads in message.content


def test_a_turn_without_a_call_ends_the_episode():
    env = ToolEnvironment(tools=["calculator"])
    env.reset(task())
    assert env.step("82") == type(env.step("82"))(done=True)


def test_call_reward_is_given_for_the_first_ok_call_of_an_episode_only():
    env = ToolEnvironment(tools=["calculator"], parser="compact", call_reward=0.25)
    env.reset(task())
    assert env.step("<tool_call> calculator 1 +").reward == 0.0  # an error earns nothing
    assert env.step("<tool_call> calculator 1 + 1").reward == 0.25
    assert env.step("<tool_call> calculator 2 + 2").reward == 0.0
    env.reset(task())
    assert env.step("<tool_call> calculator 2 + 2").reward == 0.25


def test_call_reward_by_outcome_pays_an_episode_its_best_call_once():
    env = ToolEnvironment(tools=["calculator"], parser="compact",
                          call_reward={"ok": 0.3, "error": 0.2, "malformed": 0.1, "unknown_tool": 0.1})
    env.reset(task())
    assert env.step("<tool_call> abacus 1").reward == pytest.approx(0.1)
    assert env.step("<tool_call> calculator 1 +").reward == pytest.approx(0.1)  # 0.2 in all
    assert env.step("<tool_call>").reward == 0.0
    assert env.step("<tool_call> calculator 1 + 1").reward == pytest.approx(0.1)  # 0.3 in all
    assert env.step("<tool_call> calculator 3").reward == 0.0
    with pytest.raises(ValueError, match="call_reward names outcomes \\['fine'\\]; .* and useful"):
        ToolEnvironment(tools=["calculator"], call_reward={"fine": 1.0})
    with pytest.raises(ValueError, match="call_reward ok: must be a finite number"):
        ToolEnvironment(tools=["calculator"], call_reward={"ok": float("nan")})


def test_call_reward_credits_calls_that_serve_the_task_and_counts_them():
    env = ToolEnvironment(tools=["calculator"], parser="compact",
                          call_reward={"useful": 0.6, "uses_prompt": 0.3, "ok": 0.1})
    env.reset(task())  # what is 37 + 45 ? -> 82
    result = env.step("<tool_call> calculator 55")  # works, but does not serve the task
    assert result.reward == pytest.approx(0.1) and result.info == {"tool_calls/calculator/ok": 1.0}
    result = env.step("<tool_call> calculator 37 * 45")  # the prompt's numbers, not its answer
    assert result.reward == pytest.approx(0.2) and result.info["uses_prompt_calls"] == 1.0
    assert env.step("<tool_call> calculator 37 + 1").reward == 0.0  # 1 is not the prompt's
    result = env.step("<tool_call> calculator 45 + 37")
    assert result.reward == pytest.approx(0.3)  # 0.6 in all, once
    assert result.info == {"tool_calls/calculator/ok": 1.0, "useful_calls": 1.0, "uses_prompt_calls": 1.0}
    assert env.step("<tool_call> calculator 37 + 45").reward == 0.0
    assert env.step("<tool_call> calculator 37 +").info == {"tool_calls/calculator/error": 1.0}  # not ok
    env.reset(task())
    assert env.step("<tool_call> calculator 164 / 2").reward == pytest.approx(0.6)  # 82.0 is 82
    env.reset(task())
    assert env.step('<tool_call> calculator {"expression": "45"}').reward == pytest.approx(0.3)  # as JSON
    # without a useful key such a call earns the ok credit, and is still counted
    env = ToolEnvironment(tools=["calculator"], parser="compact", call_reward=0.25)
    env.reset(task())
    result = env.step("<tool_call> calculator 37 + 45")
    assert result.reward == 0.25 and result.info["useful_calls"] == 1.0
    with pytest.raises(ValueError, match="call_reward useful: must be a finite number"):
        ToolEnvironment(tools=["calculator"], call_reward={"useful": "high"})


@pytest.mark.parametrize("result, answer, useful", [
    ("82", "82", True), ("82.0", " 82 ", True), ("0.30000000000000004", "0.3", True), ("81", "82", False),
    ("Paris", "Paris", True), ("paris", "Paris", False), ("82", "", False), ("", "", False),
])
def test_a_result_is_the_answer_as_a_number_or_as_text(result, answer, useful):
    assert is_answer(result, answer) is useful


def test_calls_past_the_turn_limit_are_not_run_and_counted_malformed():
    env = ToolEnvironment(tools=["calculator"], max_calls_per_turn=2)
    env.reset(task())
    result = env.step(hermes("calculator", {"expression": "1"}) * 3)
    assert result.info == {"tool_calls/calculator/ok": 2.0, "tool_calls/calculator/malformed": 1.0}
    assert "at most 2 tool calls a turn" in result.observation[2].content


hang = threading.Event()


def slow(seconds: float) -> str:
    """Wait.

    Args:
        seconds: How long.
    """
    hang.wait(seconds)
    return "done"


def give_up() -> str:
    """Say it took too long."""
    raise ToolTimeout("the service did not answer")


def test_a_call_past_its_time_limit_is_abandoned_and_counted_as_a_timeout():
    env = ToolEnvironment(tools=["tests.unit.test_agent_tools:slow", "tests.unit.test_agent_tools:give_up"],
                          tool_timeout_s=0.1)
    env.reset(task())
    started = time.perf_counter()
    result = env.step(hermes("slow", {"seconds": 30}))
    hang.set()  # the abandoned thread ends
    assert time.perf_counter() - started < 10
    assert result.info == {"tool_calls/slow/timeout": 1.0}
    assert "time limit of 0.1 s" in result.observation[0].content
    assert env.step(hermes("give_up", {})).info == {"tool_calls/give_up/timeout": 1.0}


def test_a_compact_call_fills_the_one_parameter_and_refuses_a_tool_of_several():
    env = ToolEnvironment(tools=["calculator", "tests.unit.test_agent_tools:power"], parser="compact")
    env.reset(task())
    assert env.step("<tool_call> calculator 6 * 7").observation[0].content == "42"
    result = env.step("<tool_call> power 2 3")
    assert result.info == {"tool_calls/power/malformed": 1.0}
    assert "power takes several parameters: give them as a JSON object" in result.observation[0].content
    assert env.step('<tool_call> power {"base": 2, "exponent": 3}').observation[0].content == "8.0"


def test_a_long_result_is_cut_for_the_model():
    env = ToolEnvironment(tools=["calculator"], max_result_chars=50)
    env.reset(task())
    content = env.step(hermes("calculator", {"expression": "2 ** 4000"})).observation[0].content
    assert content.startswith(calculator("2 ** 4000")[:50]) and content.endswith("characters cut]")


def test_the_agent_section_builds_environments_with_its_tools_resolved_once():
    section = AgentSection(environment="tools", tools=("calculator",), tool_timeout_s=3.0,
                           args={"parser": "compact", "call_reward": 0.5})
    make = ToolEnvironment.for_agent(section)
    first, second = make(), make()
    assert first is not second and first.by_name == second.by_name
    assert first.tool_timeout_s == 3.0 and first.call_reward == {"ok": 0.5}
    first.reset(task())
    assert first.step("<tool_call> calculator 2 + 3").observation[0].content == "5"
    with pytest.raises(ValueError, match="unknown tool 'abacus'"):
        ToolEnvironment.for_agent(AgentSection(environment="tools", tools=("abacus",)))
    with pytest.raises(ValueError, match="agent.tools: the tool environment needs at least one tool"):
        ToolEnvironment.for_agent(AgentSection(environment="tools"))
