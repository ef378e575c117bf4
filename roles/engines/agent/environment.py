"""The contracts of a multi-turn episode: `Environment` (what answers the model), `Message`,
`StepResult`, and `TurnGenerator` (what a rollout engine offers the agent loop).

A user's environment is a class named `module:Class` in the job's config, built once per episode with
the config's `args`; it never sees tokens, only text: the agent loop renders what it returns with the
model's chat template, so the token sequence the trainer sees is exactly what the model saw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..base import Task

__all__ = ["Message", "StepResult", "Environment", "TurnOutput", "TurnGenerator"]

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One chat message; `tool` messages answer a tool call (`name`: the tool's)."""

    role: Role
    content: str
    name: str | None = None

    def as_chat(self) -> dict[str, str]:
        """The mapping `tokenizer.apply_chat_template` reads."""
        out = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What the environment answers to one model turn.

    `observation`: the next message(s) the model sees (a plain string is a `user` message); None when
    the episode is `done` and nothing more is said. `reward`: this turn's reward (the episode's reward
    is their sum, or their discounted sum, as configured). `info`: counters for the job's metrics
    (e.g. `{"tool_calls/calculator/ok": 1}`), summed over episodes.
    """

    observation: str | Message | Sequence[Message] | None = None
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A task's world for one episode.

    `reset(task)` returns the first observation (the user's request: a string, or messages such as a
    system prompt and the user's); `step(model_text)` takes the model's turn, decoded, and answers.
    An environment that raises, or whose step runs past the job's per-step time limit, costs that
    episode only (counted by reason, logged with the task and the turn). `tools`, when not empty, are
    JSON-schema function declarations passed to the chat template (`apply_chat_template(tools=...)`).
    """

    tools: Sequence[Mapping[str, Any]]

    def reset(self, task: Task) -> str | Sequence[Message]: ...

    def step(self, model_text: str) -> StepResult: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnOutput:
    """One model turn: the sampled token ids (ending with the end-of-turn token when the model
    stopped by itself), their logprobs, the weights version that sampled them, and whether it stopped
    by itself (False: cut at the turn's token limit)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    finished: bool


class TurnGenerator(Protocol):
    """What a rollout engine offers the agent loop: continue each token sequence by one model turn,
    sampled with the weights the engine holds, at most `max_tokens` tokens, with a seed per sequence
    (a replayed explore step samples the same turns)."""

    def generate_turns(self, sequences: Sequence[Sequence[int]], *, max_tokens: Sequence[int],
                       seeds: Sequence[int]) -> list[TurnOutput]: ...
