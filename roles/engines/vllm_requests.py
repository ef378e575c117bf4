"""Responses in flight on a vLLM engine, each its own request run an engine step at a time: what
partial rollouts (a pause for new weights) and streaming rollouts (requests that outlive a step)
are built on (`VLLMRolloutEngine.rollout(..., pause_point=)`, `admit` / `collect`).

vLLM keeps each running request's KV cache: computed by the weights it held then. So whenever the
weights change under running requests (a pause between two tokens, or a version loaded between two
`collect` calls), they are aborted and each is admitted again as prompt + the tokens it has, with
what is left of its token budget: the prefix is recomputed with the new weights, as the tiny and
hf engines do. The synchronous `LLM` rolectl drives has no pause of its own (vLLM 0.32's
`pause_generation(mode="keep")` is its async engine's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .base import PausePoint, Task

if TYPE_CHECKING:
    from .vllm_engine import ServeDelta, VLLMRolloutEngine

__all__ = ["Generation", "RequestPool"]


@dataclass(slots=True)
class Generation:
    """One response in flight: its task, seed, and what it has sampled so far, each token's version."""

    task: Task
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def extend(self, delta: ServeDelta, version: int) -> None:
        self.tokens += delta.tokens
        self.logprobs += delta.logprobs
        self.versions += [version] * len(delta.tokens)


class RequestPool:
    """The responses an engine has in flight, group by group: `admit` adds a step's tasks (a request
    per response, seeded as the whole-batch rollout seeds them), `collect` runs engine steps until
    some groups are whole and takes them, earliest finished first; the rest run on."""

    def __init__(self, engine: VLLMRolloutEngine):
        self.engine = engine
        self.generations: dict[str, Generation] = {}  # response id -> generation, in admission order
        self.groups: dict[str, list[str]] = {}  # group -> its response ids, until it is taken
        self.finished: list[str] = []  # groups whose every response finished, in finishing order
        self._request_of: dict[str, str] = {}  # response id -> its live request
        self._running: set[str] = set()
        self._queued: list[Any] = []  # requests to admit at the next engine step
        self._segment = 0  # restarts so far: a request's id and seed take it
        self._version = engine.version  # the weights the running requests' KV caches were computed with

    def admit(self, tasks: list[Task] | tuple[Task, ...], explore_step: int) -> None:
        from .hf import task_seed
        from .vllm_engine import ServeRequest

        e = self.engine
        if not self._running:
            self._version = e.version  # nothing computed yet by older weights
        for i, task in enumerate(tasks):
            seed, group = task_seed(e.config.seed, e.member, explore_step, i), f"{e.member}-{explore_step}-{i}"
            self.groups[group] = [f"{group}-{k}" for k in range(e.group_size)]
            for k, gid in enumerate(self.groups[group]):
                self.generations[gid] = Generation(task, seed + k)
                self._request_of[gid] = gid
                self._running.add(gid)
                self._queued.append(ServeRequest(gid, tuple(task.prompt), e.config.max_new_tokens, seed + k))

    def collect(self, groups: int, pause_point: PausePoint | None = None) -> list[tuple[str, Generation]]:
        """Engine steps until `groups` groups are whole (or nothing runs), then those groups'
        responses, taken out of the pool: (response id, generation), group by group."""
        e = self.engine
        if self._running and e.version != self._version:
            self._abort_running()  # a version loaded since the last step: recompute every prefix
            self._readmit()
        while len(self.finished) < groups and self._running:
            deltas, self._queued = e.serve_step(self._queued), []
            generation_of = {rid: gid for gid, rid in self._request_of.items()}
            for delta in deltas:
                gid = generation_of[delta.id]
                self.generations[gid].extend(delta, e.version)
                if delta.finish_reason is not None:
                    self._done(gid)
            if not deltas and self._running and not e.serves_any():
                raise RuntimeError(f"{e.member}: vLLM dropped {len(self._running)} rollout requests unfinished")
            if self._running and pause_point is not None and pause_point.pending():
                self._abort_running()
                pause_point.load()  # the pause: what is left is sampled with the new weights
                self._readmit()
        taken, self.finished = self.finished[:groups], self.finished[groups:]
        return [(gid, self.generations.pop(gid)) for group in taken for gid in self.groups.pop(group)]

    def abandon(self) -> int:
        """Abort every request and forget every group not taken; how many groups there were."""
        self._abort_running()
        count = len(self.groups)
        for held in (self.generations, self.groups, self.finished, self._request_of, self._running):
            held.clear()
        self._queued = []
        return count

    def _done(self, gid: str) -> None:
        self._running.discard(gid)
        group = gid.rsplit("-", 1)[0]
        if not any(member in self._running for member in self.groups[group]):
            self.finished.append(group)

    def _abort_running(self) -> None:
        self.engine.serve_step((), abort=[self._request_of[gid] for gid in sorted(self._running)])

    def _readmit(self) -> None:
        """Admit each running response again as prompt + its tokens, under a new id (after an abort)."""
        from .vllm_engine import ServeRequest

        e = self.engine
        self._segment += 1
        self._queued = []
        for gid in sorted(self._running):
            g = self.generations[gid]
            self._request_of[gid] = f"{gid}#{self._segment}"
            self._queued.append(ServeRequest(self._request_of[gid], (*g.task.prompt, *g.tokens),
                                             e.config.max_new_tokens - len(g.tokens), g.seed + self._segment))
        self._version = e.version
