"""Chat templates with tools, round trip: what a template renders as a tool call, the parser of its
syntax reads back as the same call; and the built model's template in words its vocabulary holds."""

from __future__ import annotations

import json

import pytest

from rolectl.roles.engines.agent.tool_calls import compact_calls, hermes_calls
from rolectl.roles.engines.agent.tools import ToolEnvironment, resolve_tools
from rolectl.roles.engines.base import Task
from rolectl.roles.engines.hf_model import HFModelConfig, ensure_model, load_tokenizer
from tests.support.tiny_llm import ROOT

ADD_NUMBERS = ROOT / "examples" / "data" / "add_numbers.jsonl"
BUILD = {"family": "gpt2", "hidden_size": 64, "num_layers": 1, "num_heads": 2, "head_dim": 32, "seed": 0}

# The tool parts of the Qwen2.5 template (Hermes syntax), as its tokenizer_config.json has them
QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def call_message(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("built") / "model"
    config = HFModelConfig.model_validate({"path": str(path), "build": {**BUILD, "chat_template": True}})
    return load_tokenizer(ensure_model(config, data_path=str(ADD_NUMBERS)))


def assistant_text(rendered: str, start: str, end: str) -> str:
    """The last assistant turn's text in a rendered conversation."""
    return rendered.rsplit(start, 1)[1].split(end, 1)[0]


def test_a_hermes_template_call_reads_back_as_the_same_call():
    tools = [t.schema for t in resolve_tools(["calculator"]).values()]
    messages = [{"role": "user", "content": "what is 37 + 45 ?"},
                call_message("calculator", {"expression": "37 + 45"})]
    rendered = _render(QWEN_TOOLS, messages, tools)
    assert '"name": "calculator"' in rendered.split("</tools>")[0]  # the schema is shown to the model
    [call] = hermes_calls(assistant_text(rendered, "<|im_start|>assistant\n", "<|im_end|>"))
    assert (call.name, call.arguments, call.problem) == ("calculator", {"expression": "37 + 45"}, None)


def _render(template: str, messages: list[dict], tools: list[dict] | None = None, **extra) -> str:
    """A template rendered as transformers renders it (its own jinja environment)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template, **extra)
    return rendered[0]


def test_the_built_template_renders_tools_calls_and_results_in_its_own_words(built):
    tools = [t.schema for t in resolve_tools(["calculator", "python"]).values()]
    messages = [{"role": "system", "content": "what is"}, {"role": "user", "content": "what is 37 + 45 ?"},
                call_message("calculator", {"expression": "37 + 45"}),
                {"role": "tool", "content": "82", "name": "calculator"}, {"role": "assistant", "content": "82"}]
    ids = built.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    assert built.convert_ids_to_tokens(ids) == [
        "<tools>", "calculator", "python", "</tools>", "<system>", "what", "is", "<user>", "what", "is", "37", "+",
        "45", "?", "<assistant>", "<tool_call>", "calculator", "37", "+", "45", "<eos>", "<tool>", "82", "<assistant>",
        "82", "<eos>"]
    assert built.unk_token_id not in ids  # every word of the template is in the vocabulary
    prompt = built.apply_chat_template(messages[:2], tools=tools, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    assert ids[:len(prompt)] == prompt  # the generation prompt is the assistant turn's start


def test_a_built_model_s_call_runs_and_its_result_renders_back(built):
    """What the model would sample, decoded, is a compact call; the environment's answer renders as
    the tokens the model sees next."""
    env = ToolEnvironment(tools=["calculator"], parser="compact")
    env.reset(Task(id="row0", prompt=(1,), prompt_text="what is 37 + 45 ?"))
    sampled = built.convert_tokens_to_ids(["<tool_call>", "calculator", "37", "+", "45", "<eos>"])
    text = built.decode(sampled, skip_special_tokens=True)
    assert [(c.name, c.text) for c in compact_calls(text)] == [("calculator", "37 + 45")]
    result = env.step(text)
    assert result.info == {"tool_calls/calculator/ok": 1.0, "uses_prompt_calls": 1.0}  # the prompt's numbers
    rendered = built.apply_chat_template([m.as_chat() for m in result.observation], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    assert built.convert_ids_to_tokens(rendered) == ["<tool>", "82", "<assistant>"]


def test_a_compact_call_of_several_arguments_renders_as_json_the_parser_reads():
    rendered = _render(_built_template(), [call_message("power", {"base": 2, "exponent": 3})], eos_token="<eos>")
    [call] = compact_calls(rendered.removesuffix("<eos>"))
    assert (call.name, call.arguments) == ("power", {"base": 2, "exponent": 3})
    openai_style = _render(_built_template(), [call_message("calculator", json.dumps({"expression": "1 + 2"}))],
                           eos_token="<eos>")
    [call] = compact_calls(openai_style.removesuffix("<eos>"))
    assert (call.name, call.arguments) == ("calculator", {"expression": "1 + 2"})


def _built_template() -> str:
    from rolectl.roles.engines.hf_model import CHAT_TEMPLATE

    return CHAT_TEMPLATE


def test_a_build_without_a_template_is_as_before_and_an_older_build_still_matches(tmp_path):
    path = tmp_path / "model"
    config = HFModelConfig.model_validate({"path": str(path), "build": BUILD})
    tokenizer = load_tokenizer(ensure_model(config, data_path=str(ADD_NUMBERS)))
    assert tokenizer.chat_template is None and "<tool_call>" not in tokenizer.get_vocab()
    marker = path / "rolectl-build.json"
    written = json.loads(marker.read_text())
    written["build"].pop("chat_template")  # as a build before the field existed wrote it
    marker.write_text(json.dumps(written))
    assert ensure_model(config, data_path=str(ADD_NUMBERS)) == path
    with pytest.raises(ValueError, match="holds a model built with"):
        ensure_model(HFModelConfig.model_validate({"path": str(path), "build": {**BUILD, "chat_template": True}}),
                     data_path=str(ADD_NUMBERS))


def test_the_agent_loop_plays_the_tool_environment_through_the_built_template(built):
    """The policy the tool example wants, as a rule: copy the sum into a calculator call, then the
    result into the answer. Through the loop and the chat template it earns the call's credit and the
    answer's, and the trajectory is exactly the whole conversation rendered by the template."""
    from rolectl.roles.engines.agent.config import AgentSection
    from rolectl.roles.engines.agent.loop import AgentLoop
    from rolectl.roles.engines.agent.render import ChatTemplateRenderer
    from rolectl.roles.engines.rewards import parse_reward_specs
    from tests.support.scripted_turns import ScriptedTurns

    ids = built.convert_tokens_to_ids
    call, tool, eos = ids("<tool_call>"), ids("<tool>"), built.eos_token_id

    def uses_the_calculator(sequence: list[int]) -> list[int]:
        if tool not in sequence:
            plus = sequence.index(ids("+"))
            return [call, ids("calculator"), *sequence[plus - 1:plus + 2], eos]
        return [sequence[sequence.index(tool) + 1], eos]

    section = AgentSection(environment="tools", tools=("calculator",), max_tokens=16, max_tokens_per_turn=6,
                           args={"parser": "compact", "call_reward": 0.5})
    generator = ScriptedTurns(uses_the_calculator)
    loop = AgentLoop(section, generator=generator, renderer=ChatTemplateRenderer(built), group_size=2,
                     member="explorer-0", seed=0, budget=16, turn_tokens=6, version=lambda: 3,
                     rewards=parse_reward_specs("math"))
    tasks = [Task(id="row0", prompt=(), answer="82", prompt_text="what is 37 + 45 ?"),
             Task(id="row1", prompt=(), answer="30", prompt_text="what is 11 + 19 ?")]
    experiences = loop.rollout(tasks, explore_step=0)
    assert [e.reward for e in experiences] == [1.5] * 4 and all(e.turns == 2 for e in experiences)
    assert loop.metrics["agent/tool_calls/calculator/ok"] == 4.0 and loop.metrics["agent/turns_mean"] == 2.0
    first = experiences[0]
    conversation = [{"role": "user", "content": "what is 37 + 45 ?"}, call_message("calculator", {"e": "37 + 45"}),
                    {"role": "tool", "content": "82"}, {"role": "assistant", "content": "82"}]
    whole = built.apply_chat_template(conversation, tools=loop.new_environment().tools, tokenize=True,
                                      return_dict=False)
    assert [*first.prompt, *first.response] == whole
    assert built.convert_ids_to_tokens([t for t, m in zip(first.response, first.loss_mask) if not m]) == \
        ["<tool>", "82", "<assistant>"]
