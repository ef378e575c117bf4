"""The experience record: what an explorer produced for the trainer, as data (the wire codec and
its validation live in `bus.experiences`). Here so the engine contract can use it without the NATS
layer."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Experience", "ExperienceBatch", "ExperienceLimits"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Experience:
    """One sampled response to one task, tagged with the weights version that produced it.

    `group` ties together the responses to the same prompt (group-relative advantages need it).
    """

    id: str
    group: str
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    logprobs: tuple[float, ...]
    reward: float
    model_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ExperienceBatch:
    """What one explorer publishes after one explore step."""

    member: str
    explore_step: int
    model_version: int
    experiences: tuple[Experience, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExperienceLimits:
    """What a train engine can take (`TrainEngine.experience_limits`); `validate_batch` checks it.

    `prompt_length` is the one prompt length the engine trains on (None: any); responses hold at
    most `max_response_length` tokens, each in `response_tokens` when given (tokens the policy may
    sample; another one has probability zero and an infinite loss); every group of a batch holds
    exactly `group_size` responses (advantages are group-relative).
    """

    vocab_size: int
    prompt_length: int | None
    max_response_length: int
    group_size: int
    response_tokens: frozenset[int] | None = None
