"""Renderers: a trajectory is exactly what the model saw. With a real chat template (Qwen2.5's, which
renders a conversation as its turns one after another) the trajectory's tokens equal
`apply_chat_template` of the whole conversation, and the model's tokens stay as it sampled them."""

from __future__ import annotations

import pytest

from rolectl.roles.engines.agent.config import AgentSection
from rolectl.roles.engines.agent.environment import Message, StepResult
from rolectl.roles.engines.agent.loop import AgentLoop
from rolectl.roles.engines.agent.render import ChatTemplateRenderer, RenderError, TinyRenderer
from rolectl.roles.engines.base import Task
from rolectl.roles.engines.task import BOS, EOS, PAD, QUERY, SEP
from tests.support.chat_model import chat_tokenizer
from tests.support.scripted_turns import ScriptedTurns

HERE = __name__
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


def _ids(tokenizer, conversation, **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)["input_ids"])


def _text(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("observation", [
    [Message(role="tool", content="408", name="calculator")],
    [Message(role="tool", content="408"), Message(role="tool", content="12")],  # one user turn for both
    [Message(role="user", content="Are you sure?")],
])
@pytest.mark.parametrize("system", [True, False])
def test_a_trajectory_is_the_chat_template_of_the_whole_conversation(observation, system):
    tokenizer = chat_tokenizer()
    renderer = ChatTemplateRenderer(tokenizer)
    end = tokenizer.eos_token_id
    first = [*([Message(role="system", content="Be brief.")] if system else []),
             Message(role="user", content="What is 12 times 34?")]
    turn_1, turn_2 = "Let me call the calculator.", "The answer is 408."
    trajectory = [*renderer.prompt(first, tools=TOOLS), *_text(tokenizer, turn_1), end,
                  *renderer.observation(observation, turn_finished=True), *_text(tokenizer, turn_2), end]
    conversation = [*(m.as_chat() for m in first), {"role": "assistant", "content": turn_1},
                    *(m.as_chat() for m in observation), {"role": "assistant", "content": turn_2}]
    whole = _ids(tokenizer, conversation, tools=TOOLS)
    assert whole == [*trajectory, *_text(tokenizer, "\n")]  # the template closes the last turn with `\n`
    assert renderer.decode([*_text(tokenizer, turn_2), end]) == turn_2


def test_a_turn_cut_at_its_limit_is_closed_by_the_observation():
    tokenizer = chat_tokenizer()
    renderer = ChatTemplateRenderer(tokenizer)
    first, cut = [Message(role="user", content="Reverse 3 1 4")], "Let me"  # no end-of-turn sampled
    observation = [Message(role="user", content="Go on.")]
    trajectory = [*renderer.prompt(first), *_text(tokenizer, cut),
                  *renderer.observation(observation, turn_finished=False)]
    conversation = [*(m.as_chat() for m in first), {"role": "assistant", "content": cut},
                    *(m.as_chat() for m in observation)]
    assert trajectory == _ids(tokenizer, conversation, add_generation_prompt=True)


class Calculator:
    """Answers every turn with a tool message; done after two turns."""

    tools = TOOLS

    def reset(self, task: Task):
        self.turns = 0
        return task.answer

    def step(self, model_text: str) -> StepResult:
        self.turns += 1
        return StepResult(observation=Message(role="tool", content=f"got {len(model_text)}", name="calculator"),
                          reward=0.5, done=self.turns == 2)


def test_the_loop_keeps_the_sampled_tokens_as_sampled_around_the_templates_tokens():
    tokenizer = chat_tokenizer()
    renderer = ChatTemplateRenderer(tokenizer)
    end = tokenizer.eos_token_id
    # "408" one byte a token: not how the tokenizer would write it, but what the model sampled
    sampled = [*(tokenizer.convert_tokens_to_ids(c) for c in "408"), end]
    assert _text(tokenizer, "408") != sampled[:-1]
    generator = ScriptedTurns(lambda sequence: sampled, version=2)
    section = AgentSection(environment=f"{HERE}:Calculator", max_tokens=200, max_tokens_per_turn=8)
    loop = AgentLoop(section, generator=generator, renderer=renderer, group_size=2, member="m", seed=0,
                     budget=200, turn_tokens=8, version=lambda: 2)
    [episode, _] = loop.rollout([Task(id="t", prompt=(), answer="What is 12 times 34?")], explore_step=1)
    kept = [token for token, mask in zip(episode.response, episode.loss_mask) if mask]
    assert kept == sampled * 2
    assert episode.reward == 1.0 and episode.turns == 2
    # the environment's tokens are the template's: the tool answer, in the user turn Qwen puts it in
    between = [token for token, mask in zip(episode.response, episode.loss_mask) if not mask]
    assert tokenizer.decode(between) == "\n<|im_start|>user\n<tool_response>\ngot 3\n</tool_response><|im_end|>\n" \
                                        "<|im_start|>assistant\n"
    assert episode.prompt == tuple(renderer.prompt([Message(role="user", content="What is 12 times 34?")], TOOLS))


def test_a_tokenizer_without_a_chat_template_is_refused_with_what_to_do():
    tokenizer = chat_tokenizer()
    plain = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    with pytest.raises(RenderError, match="has none: use a chat model, or set `chat_template`"):
        ChatTemplateRenderer(plain)


def test_the_tiny_renderer_speaks_the_tiny_vocabulary():
    renderer = TinyRenderer()
    assert renderer.prompt([Message(role="user", content="_ _ 3")]) == [BOS, PAD, PAD, 3, SEP]
    assert renderer.observation([Message(role="user", content="4 ?")], turn_finished=True) == [4, QUERY, SEP]
    assert renderer.observation([], turn_finished=False) == [EOS, SEP]  # a cut turn is closed
    assert renderer.decode([QUERY, 3, EOS, 5]) == "? 3"
    with pytest.raises(RenderError, match="the tiny engine's vocabulary has no 'x'"):
        renderer.prompt([Message(role="user", content="x")])
