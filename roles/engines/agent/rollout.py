"""`AgentRollout`: a rollout engine whose `rollout` plays the job's agent episodes (`AgentLoop`);
everything else (weights, version, evaluation, serving) is the engine's it wraps.

`make_rollout_engine` wraps an explorer's engine in it when the job has an `agent:` section, so the
explorer role is the same for single-turn and multi-turn jobs: it calls `rollout`, reports
`rollout_metrics` (here the loop's `agent/*` figures) and publishes what comes back. An engine plays
episodes when it offers the agent loop what it needs: `generate_turns` (a `TurnGenerator`),
`agent_renderer()`, `response_bound` (its longest response: an agent's default token budget),
`sampling_seed`, `member` and `group_size`; `rewards` (the job's `data.rewards`) when it has them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rolectl.sync_protocol.experience import Experience

from ..base import PausePoint, Task
from .config import AgentSection
from .loop import AgentLoop

__all__ = ["AgentRollout"]

_NEEDED = ("generate_turns", "agent_renderer", "response_bound", "sampling_seed", "member", "group_size")


class AgentRollout:
    """The engine `engine`, its rollouts played as `section`'s episodes."""

    def __init__(self, engine: Any, section: AgentSection) -> None:
        missing = [name for name in _NEEDED if not hasattr(engine, name)]
        if missing:
            raise ValueError(f"the {type(engine).__name__} rollout engine cannot play agent episodes (it has no "
                             f"{', '.join(missing)}); remove `agent:` or use engine tiny, hf or vllm")
        self.engine = engine
        budget, turn_tokens = section.budget(engine.response_bound)
        self.loop = AgentLoop(section, generator=engine, renderer=engine.agent_renderer(),
                              group_size=engine.group_size, member=engine.member, seed=engine.sampling_seed,
                              budget=budget, turn_tokens=turn_tokens, version=lambda: self.engine.version,
                              rewards=getattr(engine, "rewards", ()))

    @property
    def version(self) -> int:
        return self.engine.version

    @version.setter
    def version(self, version: int) -> None:
        self.engine.version = version

    @property
    def group_size(self) -> int:
        return self.engine.group_size

    @property
    def rollout_metrics(self) -> dict[str, float]:
        """The last rollout's `agent/*` figures (and each data reward's mean)."""
        return self.loop.metrics

    def weight_buffers(self) -> dict[str, Any]:
        return self.engine.weight_buffers()

    def load_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        self.engine.load_weights(tensors, version)

    def rollout(self, tasks: Sequence[Task], *, explore_step: int,
                pause_point: PausePoint | None = None) -> list[Experience]:
        return self.loop.rollout(tasks, explore_step=explore_step, pause_point=pause_point)

    def __getattr__(self, name: str) -> Any:
        # the rest (generate for evals, serve_step, tensor_parallel_size, ...) is the engine's own
        engine = self.__dict__.get("engine")
        if engine is None:  # not built yet (copy, pickle probes)
            raise AttributeError(name)
        return getattr(engine, name)
