"""The experience record: what an explorer produced for the trainer, as data (the wire codec and
its validation live in `bus.experiences`). Here so the engine contract can use it without the NATS
layer.

An experience is one episode of one task: `prompt` is what the model saw before its first turn, and
`response` is everything after it — the model's turns and, in a multi-turn episode, the tokens the
environment, its tools and the chat template put between them. `loss_mask` says which response
tokens the policy sampled (the only ones trained on) and `token_versions` which weights version
sampled them (a weight update may land between turns, or inside one with partial rollouts). Both
default to None, which is a single-turn record: every response token sampled, by `model_version`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import groupby

__all__ = ["Experience", "ExperienceBatch", "ExperienceLimits", "Segment", "version_runs"]


def version_runs(versions: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
    """`Experience.token_versions` for tokens sampled by `versions` (one per token): run-length
    `(count, version)` pairs, or None when one version sampled them all (the single-version record)."""
    if len(set(versions)) <= 1:
        return None
    return tuple((sum(1 for _ in run), version) for version, run in groupby(versions))


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """A maximal run of response tokens `[start, end)` of one kind: sampled by the policy with
    weights `version` (`sampled`), or put there by the environment, a tool or the template."""

    start: int
    end: int
    sampled: bool
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Experience:
    """One episode of one task (a single-turn one is one sampled response), tagged with the weights
    versions that produced it.

    `group` ties together the episodes of the same prompt (group-relative advantages need it).
    """

    id: str
    group: str
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    logprobs: tuple[float, ...]
    """One per response token: the sampler's logprob (0.0 where `loss_mask` is 0: never read)."""
    reward: float
    model_version: int
    """The oldest weights version that sampled a token of the response: staleness is measured by it."""
    loss_mask: tuple[int, ...] | None = None
    """One per response token: 1 where the policy sampled it, 0 for environment, tool and template
    tokens. None: every response token was sampled."""
    token_versions: tuple[tuple[int, int], ...] | None = None
    """Run-length `(count, version)` pairs covering the response: the version that sampled each
    token (a token the policy did not sample carries the version of the turn before it). None: all
    `model_version`."""

    def mask(self) -> tuple[int, ...]:
        """`loss_mask`, or all ones for a single-turn record."""
        return self.loss_mask if self.loss_mask is not None else (1,) * len(self.response)

    def versions(self) -> tuple[int, ...]:
        """The version of every response token."""
        if self.token_versions is None:
            return (self.model_version,) * len(self.response)
        return tuple(version for count, version in self.token_versions for _ in range(count))

    @property
    def trained_tokens(self) -> int:
        """Response tokens the policy sampled: what a loss counts."""
        return sum(self.mask())

    @property
    def newest_version(self) -> int:
        """The newest version that sampled any of its tokens (`model_version` is the oldest)."""
        if self.token_versions is None:
            return self.model_version
        return max(version for _, version in self.token_versions)

    @property
    def turns(self) -> int:
        """The model's turns: maximal runs of sampled tokens (0 for an empty response)."""
        return sum(1 for sampled, _ in groupby(self.mask()) if sampled)

    def segments(self) -> tuple[Segment, ...]:
        """The response as maximal runs of one kind and one version, in order."""
        out: list[Segment] = []
        start = 0
        for (sampled, version), run in groupby(zip(self.mask(), self.versions())):
            end = start + sum(1 for _ in run)
            out.append(Segment(start=start, end=end, sampled=bool(sampled), version=version))
            start = end
        return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExperienceBatch:
    """What one explorer publishes after one explore step."""

    member: str
    explore_step: int
    model_version: int
    experiences: tuple[Experience, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, member: str, explore_step: int, experiences: tuple[Experience, ...]) -> ExperienceBatch:
        """A batch of `experiences` at the newest version that sampled any of their tokens (a
        multi-turn trajectory's later turns may be newer than its record's oldest `model_version`)."""
        return cls(member=member, explore_step=explore_step, experiences=experiences,
                   model_version=max((e.newest_version for e in experiences), default=0))


@dataclass(frozen=True, slots=True, kw_only=True)
class ExperienceLimits:
    """What a train engine can take (`TrainEngine.experience_limits`); `validate_batch` checks it.

    `prompt_length` is the longest prompt the engine trains on (None: any); responses hold at
    most `max_response_length` tokens (for multi-turn episodes: the trajectory's whole token budget),
    each sampled one in `response_tokens` when given (tokens the policy may sample; another one has
    probability zero and an infinite loss); every group of a batch holds exactly `group_size`
    responses (advantages are group-relative).
    """

    vocab_size: int
    prompt_length: int | None
    max_response_length: int
    group_size: int
    response_tokens: frozenset[int] | None = None
