"""Served completions waiting for their reward: sessions become trajectories, rewarded trajectories
become experiences in whole groups, unrewarded ones expire. No I/O; the caller passes the clock.

A trajectory is one completion, or every completion of one session (several calls sharing a session
id). Its turns are trained on as experiences whose prompt is what the model saw at that turn and
whose response is only what the model generated then, so the tokens of the user, tools or the
environment are context, never trained on. Every turn of a trajectory carries the trajectory's
reward. The trainer takes whole groups of `group_size` experiences, and group-relative advantages
are most informative when a group answers one prompt: turn k of trajectories that began with the same
prompt group together (an agent that tries a task several times makes GRPO's groups); experiences
that found no such company within `straggler_s` are grouped with others in arrival order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rolectl.sync_protocol.experience import Experience

__all__ = ["Turn", "RewardLedger", "UnknownCompletion", "BadReward"]


class UnknownCompletion(LookupError):
    """A reward names no completion or session that is waiting for one (unknown, expired, or rewarded)."""


class BadReward(ValueError):
    """A reward that is not a finite number."""


@dataclass(frozen=True, slots=True)
class Turn:
    completion_id: str
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int


@dataclass(slots=True)
class _Trajectory:
    key: str
    turns: list[Turn] = field(default_factory=list)
    last_s: float = 0.0


class RewardLedger:
    """Completions by id and by session, until rewarded (-> experiences) or expired (-> counted)."""

    def __init__(self, *, prefix: str, group_size: int, timeout_s: float, straggler_s: float = 5.0) -> None:
        self.prefix = prefix  # unique per process: group ids never collide across restarts
        self.group_size = group_size
        self.timeout_s = timeout_s
        self._open: dict[str, _Trajectory] = {}  # by trajectory key: the session id, or the completion id
        self._by_completion: dict[str, str] = {}  # completion id -> trajectory key
        self.straggler_s = straggler_s
        # rewarded, not yet in a full group: (same-prompt key, rewarded at, experience)
        self._ready: list[tuple[tuple, float, Experience]] = []
        self._groups = 0
        self.served = 0
        self.rewarded = 0
        self.expired = 0

    @staticmethod
    def _key(completion_id: str, session: str | None) -> str:
        return f"session:{session}" if session is not None else f"completion:{completion_id}"

    def record(self, turn: Turn, *, session: str | None, now_s: float) -> None:
        """A completion was served; it waits for a reward for itself or its session."""
        key = self._key(turn.completion_id, session)
        trajectory = self._open.setdefault(key, _Trajectory(key))
        trajectory.turns.append(turn)
        trajectory.last_s = now_s  # a session's clock restarts with each turn
        self._by_completion[turn.completion_id] = key
        self.served += 1

    def reward(self, value: float, *, completion_id: str | None = None, session: str | None = None,
               now_s: float = 0.0) -> int:
        """Reward the trajectory of a completion id or a session; return its number of turns."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadReward(f"reward must be a finite number, got {value!r}")
        if completion_id is not None:
            key = self._by_completion.get(completion_id)
            what = f"completion {completion_id!r}"
        elif session is not None:
            key = self._key("", session)
            what = f"session {session!r}"
        else:
            raise UnknownCompletion("a reward names a completion `id` or a `session`")
        trajectory = self._open.pop(key, None) if key is not None else None
        if trajectory is None:
            raise UnknownCompletion(f"{what} is not waiting for a reward (unknown, already rewarded, or expired "
                                    f"after {self.timeout_s:g} s: serve.reward_timeout_s)")
        self._forget(trajectory)
        self.rewarded += 1
        first = trajectory.turns[0].prompt
        self._ready.extend(
            ((first, k), now_s, Experience(id=t.completion_id, group="", prompt=t.prompt, response=t.response,
                                           logprobs=t.logprobs, reward=float(value), model_version=t.version))
            for k, t in enumerate(trajectory.turns))
        return len(trajectory.turns)

    def expire(self, now_s: float) -> int:
        """Drop trajectories idle longer than the timeout; return how many."""
        old = [t for t in self._open.values() if now_s - t.last_s > self.timeout_s]
        for trajectory in old:
            del self._open[trajectory.key]
            self._forget(trajectory)
        self.expired += len(old)
        return len(old)

    def _forget(self, trajectory: _Trajectory) -> None:
        for turn in trajectory.turns:
            self._by_completion.pop(turn.completion_id, None)

    def take_groups(self, now_s: float = 0.0) -> list[Experience]:
        """Every full group of rewarded experiences (possibly none), each tagged with its group id:
        same-prompt groups first, then stragglers older than `straggler_s` in arrival order."""
        by_key: dict[tuple, list[int]] = {}
        for i, (key, _, _) in enumerate(self._ready):
            by_key.setdefault(key, []).append(i)
        chunks = []
        for rows in by_key.values():
            full = len(rows) - len(rows) % self.group_size
            chunks += [rows[j:j + self.group_size] for j in range(0, full, self.group_size)]
        taken = {i for chunk in chunks for i in chunk}
        old = [i for i, (_, at, _) in enumerate(self._ready)
               if i not in taken and now_s - at >= self.straggler_s]
        full = len(old) - len(old) % self.group_size
        chunks += [old[j:j + self.group_size] for j in range(0, full, self.group_size)]
        taken |= set(old[:full])
        out = []
        for chunk in chunks:
            self._groups += 1
            group = f"{self.prefix}-g{self._groups}"
            out.extend(_with_group(self._ready[i][2], group) for i in chunk)
        self._ready = [r for i, r in enumerate(self._ready) if i not in taken]
        return out

    @property
    def waiting(self) -> int:
        return len(self._open)

    def counts(self) -> dict[str, float]:
        return {"served_requests": float(self.served), "rewarded": float(self.rewarded),
                "expired": float(self.expired), "awaiting_reward": float(self.waiting)}


def _with_group(e: Experience, group: str) -> Experience:
    return Experience(id=e.id, group=group, prompt=e.prompt, response=e.response, logprobs=e.logprobs,
                      reward=e.reward, model_version=e.model_version)
