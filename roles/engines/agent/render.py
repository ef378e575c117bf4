"""Renderers: how an episode's messages become exactly the tokens the model sees, around the tokens
it sampled (which are kept as sampled, never re-tokenized).

- `ChatTemplateRenderer(tokenizer)`: a Hugging Face tokenizer's chat template. The prompt is
  `apply_chat_template(first_messages, tools=..., add_generation_prompt=True)`. After a model turn,
  the environment's answer is the DELTA the template adds to a fixed stand-in conversation ending
  with a model turn (verl's agent loop does the same): render it with the observation and the next
  generation prompt, take what follows the stand-in without them, and put in front what the template
  closes a model turn with (`<|im_end|>\\n`: the end-of-turn token, when the model did not sample it,
  and what follows it). For a template that renders a conversation as the concatenation of its
  turns (prefix-stable, as ChatML is), the trajectory then equals `apply_chat_template` of the whole
  conversation.
- `TinyRenderer`: the tiny engine's vocabulary, one symbol a token (`roles.engines.task`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..task import BOS, EOS, PAD, QUERY, SEP
from .environment import Message

__all__ = ["Renderer", "ChatTemplateRenderer", "TinyRenderer", "as_messages", "RenderError"]


class RenderError(ValueError):
    """What an environment returned cannot be rendered (a symbol outside the vocabulary, a template
    that is not prefix-stable)."""


class Renderer(Protocol):
    """Messages to tokens, and a model turn's tokens to text, for one model's vocabulary."""

    def prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        """The tokens before the model's first turn, its generation prompt included."""

    def observation(self, messages: Sequence[Message], *, turn_finished: bool) -> list[int]:
        """The tokens after a model turn and before the next: what closes the turn (its end-of-turn
        token too when the turn was cut, `turn_finished` False), `messages`, the generation prompt."""

    def decode(self, tokens: Sequence[int]) -> str:
        """A model turn's text, as the environment reads it (special tokens left out)."""


def as_messages(said: str | Message | Sequence[Message] | None) -> list[Message]:
    """What an environment said as messages: a plain string is the user's."""
    if said is None:
        return []
    if isinstance(said, str):
        return [Message(role="user", content=said)]
    if isinstance(said, Message):
        return [said]
    messages = list(said)
    wrong = [type(m).__name__ for m in messages if not isinstance(m, Message)]
    if wrong:
        raise RenderError(f"an environment says a string, a Message or a list of Messages; got a list with {wrong}")
    return messages


# The stand-in conversation the observation deltas are cut from: its text never reaches a trajectory.
_STAND_IN = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
_STAND_IN_TURN = {"role": "assistant", "content": "a"}


class ChatTemplateRenderer:
    """A tokenizer's chat template (see the module's docstring). Built once per engine: the tokens that
    close a model turn are found here, from the stand-in conversation."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError("an agent job renders episodes with the model's chat template, and this tokenizer "
                              "has none: use a chat model, or set `chat_template` in its tokenizer_config.json")
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        before = self._ids(_STAND_IN, add_generation_prompt=True)
        self._with_turn = self._ids([*_STAND_IN, _STAND_IN_TURN])
        if self._with_turn[:len(before)] != before:
            raise RenderError("the chat template does not render a model turn after the generation prompt it ends "
                              "the prompt with; the agent loop cannot keep the model's tokens as sampled")
        turn = self._with_turn[len(before):]
        content = tokenizer.encode(_STAND_IN_TURN["content"], add_special_tokens=False)
        if self.eos_id in turn:
            self._closing = turn[turn.index(self.eos_id):]
        elif turn[:len(content)] == content:
            self._closing = turn[len(content):]
        else:
            raise RenderError("cannot tell where the chat template closes a model turn (no end-of-turn token)")

    def _ids(self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool = False,
             tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        ids = self.tokenizer.apply_chat_template(conversation, tools=list(tools) or None, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt)
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
        return [int(t) for t in ids]

    def prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        return self._ids([m.as_chat() for m in messages], add_generation_prompt=True, tools=tools)

    def observation(self, messages: Sequence[Message], *, turn_finished: bool) -> list[int]:
        after = self._ids([*_STAND_IN, _STAND_IN_TURN, *(m.as_chat() for m in messages)],
                          add_generation_prompt=True)
        if after[:len(self._with_turn)] != self._with_turn:
            raise RenderError(f"the chat template renders the conversation before {[m.role for m in messages]} "
                              "messages differently once they follow: their tokens cannot be appended")
        closing = self._closing[1:] if turn_finished and self._closing[:1] == [self.eos_id] else self._closing
        return [*closing, *after[len(self._with_turn):]]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)


_SYMBOLS = {**{str(d): d for d in range(10)}, "?": QUERY, "_": PAD}
_NAMES = {token: symbol for symbol, token in _SYMBOLS.items()}


class TinyRenderer:
    """The tiny engine's episodes: a message is whitespace-separated symbols, one token each (digits
    `0`-`9`, `?` the query token, `_` a blank). The prompt is `BOS <first messages> SEP`, an
    observation `<messages> SEP` (SEP: the model's turn begins), and a model turn ends with EOS (one
    is put in, not trained on, when the turn was cut)."""

    def encode(self, messages: Sequence[Message]) -> list[int]:
        out = []
        for message in messages:
            for symbol in message.content.split():
                if symbol not in _SYMBOLS:
                    raise RenderError(f"the tiny engine's vocabulary has no {symbol!r} (a {message.role} message); "
                                      f"it has {sorted(_SYMBOLS)}")
                out.append(_SYMBOLS[symbol])
        return out

    def prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
        return [BOS, *self.encode(messages), SEP]

    def observation(self, messages: Sequence[Message], *, turn_finished: bool) -> list[int]:
        return [*([] if turn_finished else [EOS]), *self.encode(messages), SEP]

    def decode(self, tokens: Sequence[int]) -> str:
        tokens = list(tokens)
        if EOS in tokens:
            tokens = tokens[:tokens.index(EOS)]
        return " ".join(_NAMES.get(t, "") for t in tokens)
