"""Served completions waiting for their reward: sessions become trajectories, rewarded trajectories
become experiences in whole groups, unrewarded ones expire. No I/O; the caller passes the clock.

A trajectory is one completion, or the completions of one session (several calls sharing a session
id) as ONE token sequence: `prompt` is the first call's prompt; the response is each call's sampled
tokens (loss mask 1, with the weights version that sampled them) and, between them, what the client
added to the conversation (mask 0: the user's, tools' or environment's tokens, and the chat
template's), computed as the delta between consecutive calls' prompts. A call's prompt must extend
the trajectory so far; it may leave out the previous call's last token when that call stopped by
itself (a client that re-renders the conversation from text, without the end-of-turn token, drops
that token from the trajectory: the model did not see it). A call whose prompt does not extend the
trajectory (the client rewrote the history) or whose tokens would pass the token budget
(`serve.max_trajectory_tokens`) starts a new trajectory of the same session, counted
(`trajectory_splits_history`, `trajectory_splits_budget`).

Rewards: a reward ends its trajectory's session (every trajectory of it carries the session's
reward), or, sent as per-turn (`done: false`), is kept for the turn it names (a completion id, or the
session's latest turn) while the session goes on; the session's reward is the sum of its turns'
rewards, or their discounted sum (turn t counts `discount ** t`, t = 0 for the first call).

The trainer takes whole groups of `group_size` experiences, and group-relative advantages are most
informative when a group answers one prompt: trajectories that began with the same prompt group
together (an agent that tries a task several times makes GRPO's groups); experiences that found no
such company within `straggler_s` are grouped with others in arrival order.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from itertools import groupby

from rolectl.sync_protocol.experience import Experience

__all__ = ["Turn", "RewardLedger", "UnknownCompletion", "BadReward"]


class UnknownCompletion(LookupError):
    """A reward names no completion or session that is waiting for one (unknown, expired, or rewarded)."""


class BadReward(ValueError):
    """A reward that is not a finite number."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One served call: its prompt, what the model sampled (`stopped`: it ended with its end-of-turn
    token), the logprobs and the weights version."""

    completion_id: str
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    stopped: bool = False


@dataclass(slots=True)
class _Trajectory:
    """One token sequence: the first call's prompt, then responses and the deltas between them."""

    prompt: tuple[int, ...]
    first_id: str
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stopped: bool = False

    def add(self, turn: Turn, context: tuple[int, ...] = (), *, drop_last: bool = False) -> None:
        """`turn` after the client's `context`; `drop_last`: the previous call's end-of-turn token is not
        in this call's prompt, so it leaves the trajectory (the model did not see it)."""
        if drop_last:
            for kept in (self.response, self.mask, self.logprobs, self.versions):
                kept.pop()
        # the client's tokens carry the version of the turn they answer; never trained on
        self.response += context
        self.mask += [0] * len(context)
        self.logprobs += [0.0] * len(context)
        self.versions += [self.versions[-1] if self.versions else turn.version] * len(context)
        self.response += turn.response
        self.mask += [1] * len(turn.response)
        self.logprobs += turn.logprobs
        self.versions += [turn.version] * len(turn.response)
        self.stopped = turn.stopped

    def context_of(self, turn: Turn) -> tuple[tuple[int, ...], bool] | None:
        """What the client added before `turn` (its prompt past this trajectory) and whether it left out
        the last call's end-of-turn token; None when the prompt does not extend the trajectory."""
        sequence = (*self.prompt, *self.response)
        if turn.prompt[:len(sequence)] == sequence:
            return turn.prompt[len(sequence):], False
        if self.stopped and self.mask[-1:] == [1] and turn.prompt[:len(sequence) - 1] == sequence[:-1]:
            return turn.prompt[len(sequence) - 1:], True
        return None

    def experience(self, reward: float, group: str = "") -> Experience:
        oldest = min((v for v, m in zip(self.versions, self.mask) if m), default=0)
        runs = None if all(v == oldest for v in self.versions) else \
            tuple((sum(1 for _ in run), v) for v, run in groupby(self.versions))
        # one call (every token sampled, one version) is a single-turn record, byte for byte
        return Experience(id=self.first_id, group=group, prompt=self.prompt, response=tuple(self.response),
                          logprobs=tuple(self.logprobs), reward=reward, model_version=oldest,
                          loss_mask=None if all(self.mask) else tuple(self.mask), token_versions=runs)


@dataclass(slots=True)
class _Session:
    key: str
    trajectories: list[_Trajectory] = field(default_factory=list)
    turn_ids: list[str] = field(default_factory=list)
    rewards: dict[int, float] = field(default_factory=dict)  # per-turn rewards by turn index
    last_s: float = 0.0


class RewardLedger:
    """Completions by id and by session, until rewarded (-> experiences) or expired (-> counted)."""

    def __init__(self, *, prefix: str, group_size: int, timeout_s: float, straggler_s: float = 5.0,
                 max_response_tokens: int | None = None, discount: float = 1.0) -> None:
        self.prefix = prefix  # unique per process: group ids never collide across restarts
        self.group_size = group_size
        self.timeout_s = timeout_s
        self.max_response_tokens = max_response_tokens  # a trajectory's tokens after its prompt (None: any)
        self.discount = discount
        self._open: dict[str, _Session] = {}  # by key: the session id, or the completion id
        self._by_completion: dict[str, str] = {}  # completion id -> session key
        self.straggler_s = straggler_s
        # rewarded, not yet in a full group: (same-prompt key, rewarded at, experience)
        self._ready: list[tuple[tuple, float, Experience]] = []
        self._groups = 0
        self.served = 0
        self.rewarded = 0
        self.expired = 0
        self.splits = {"history": 0, "budget": 0}

    @staticmethod
    def _key(completion_id: str, session: str | None) -> str:
        return f"session:{session}" if session is not None else f"completion:{completion_id}"

    def record(self, turn: Turn, *, session: str | None, now_s: float) -> None:
        """A completion was served; it waits for a reward for itself or its session."""
        key = self._key(turn.completion_id, session)
        entry = self._open.setdefault(key, _Session(key))
        self._extend(entry, turn)
        entry.turn_ids.append(turn.completion_id)
        entry.last_s = now_s  # a session's clock restarts with each turn
        self._by_completion[turn.completion_id] = key
        self.served += 1

    def _extend(self, entry: _Session, turn: Turn) -> None:
        """The turn joins the session's last trajectory, or starts a new one (a split, counted)."""
        if entry.trajectories:
            last = entry.trajectories[-1]
            extends = last.context_of(turn)
            if extends is None:
                self.splits["history"] += 1
            elif self._fits(len(last.response) - extends[1] + len(extends[0]) + len(turn.response)):
                last.add(turn, extends[0], drop_last=extends[1])
                return
            else:
                self.splits["budget"] += 1
        trajectory = _Trajectory(prompt=turn.prompt, first_id=turn.completion_id)
        trajectory.add(turn)
        entry.trajectories.append(trajectory)

    def _fits(self, tokens: int) -> bool:
        return self.max_response_tokens is None or tokens <= self.max_response_tokens

    def reward(self, value: float, *, completion_id: str | None = None, session: str | None = None,
               now_s: float = 0.0, done: bool = True) -> int:
        """Reward the turn a completion id names, or a session's latest turn; `done` (the default)
        ends the session and makes its trajectories experiences. Return the session's turns so far."""
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
        entry = self._open.get(key) if key is not None else None
        if entry is None:
            raise UnknownCompletion(f"{what} is not waiting for a reward (unknown, already rewarded, or expired "
                                    f"after {self.timeout_s:g} s: serve.reward_timeout_s)")
        turn = entry.turn_ids.index(completion_id) if completion_id is not None else len(entry.turn_ids) - 1
        entry.rewards[turn] = entry.rewards.get(turn, 0.0) + float(value)
        entry.last_s = now_s
        if not done:
            return len(entry.turn_ids)
        del self._open[key]  # type: ignore[arg-type]
        self._forget(entry)
        self.rewarded += 1
        total = sum(r * self.discount ** t for t, r in entry.rewards.items())
        self._ready.extend((t.prompt, now_s, t.experience(total)) for t in entry.trajectories)
        return len(entry.turn_ids)

    def expire(self, now_s: float) -> int:
        """Drop sessions idle longer than the timeout; return how many."""
        old = [s for s in self._open.values() if now_s - s.last_s > self.timeout_s]
        for entry in old:
            del self._open[entry.key]
            self._forget(entry)
        self.expired += len(old)
        return len(old)

    def _forget(self, entry: _Session) -> None:
        for completion_id in entry.turn_ids:
            self._by_completion.pop(completion_id, None)

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

    @property
    def ungrouped(self) -> int:
        """Rewarded experiences not yet in a full group."""
        return len(self._ready)

    def counts(self) -> dict[str, float]:
        return {"served_requests": float(self.served), "rewarded": float(self.rewarded),
                "expired": float(self.expired), "awaiting_reward": float(self.waiting),
                "trajectory_splits_history": float(self.splits["history"]),
                "trajectory_splits_budget": float(self.splits["budget"])}


def _with_group(e: Experience, group: str) -> Experience:
    return dataclasses.replace(e, group=group)
