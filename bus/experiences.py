"""Experiences: explorers publish rollout batches to the job's experience stream; the trainer
reads them with a durable pull consumer and acks after use, so nothing is lost on a restart."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Experience", "ExperienceBatch"]


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
