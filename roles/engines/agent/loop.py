"""The agent loop: a batch of tasks played as multi-turn episodes, turn by turn, into trajectories.

Engine-independent: it needs a `TurnGenerator` (the rollout engine's `generate_turns`), a `Renderer`
(messages to the model's tokens) and the job's `agent:` section. For each task, `group_size`
episodes, each against its own environment; all the episodes of a step advance together, one
batched `generate_turns` over the live ones per turn, then every live environment's `step` at once.

An episode is one `Experience`: `prompt` the rendered first messages, `response` the model's turns
with the environment's answers between them (`loss_mask` 1 on the sampled tokens, 0 on the others,
whose logprobs are 0.0), `token_versions` the weights version of each token, `model_version` the
oldest. It ends when the environment says done, after `max_turns` model turns, or when the token
budget is spent (a turn samples at most what is left; an observation that would fill it ends the
episode): the last two are counted `agent/truncated`.

An environment that raises, or runs past `step_timeout_s` (calls run on worker threads, each
bounded from its own start; a hung one is abandoned with its thread), costs its episode only: it
stays in its group (groups stay whole) with reward 0.0 and the tokens it has, counted
`agent/env_errors/<reason>` (`reset_failed`, `exception`, `timeout`) and logged with the task, the
episode and the turn. Sampling seeds derive from (member,
explore step, task, episode, turn): a replayed explore step plays the same episodes.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from rolectl.sync_protocol.experience import Experience, version_runs

from ..base import Task
from ..rewards import WeightedReward, score_all
from .config import AgentSection, resolve_environment
from .environment import StepResult, TurnGenerator, TurnOutput
from .render import Renderer, as_messages

__all__ = ["AgentLoop", "EnvCalls", "episode_seed", "ENV_ERRORS"]

ENV_ERRORS = ("reset_failed", "exception", "timeout")
"""Why an environment cost its episode, as counted in `agent/env_errors/<reason>`."""


def episode_seed(seed: int, member: str, explore_step: int, task_idx: int, k: int, turn: int) -> int:
    """The sampling seed of one model turn of one episode."""
    return zlib.crc32(f"{seed}/{member}/{explore_step}/{task_idx}/{k}/{turn}".encode())


@dataclass(eq=False)
class _Episode:
    """One episode as it is played: its environment and the trajectory so far."""

    task_idx: int
    k: int
    task: Task
    env: Any = None
    prompt: list[int] = field(default_factory=list)
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    last_text: str | None = None
    last_finished: bool = True
    ended: str | None = None  # "done", "truncated" or an env error's reason
    scores: dict[str, float] = field(default_factory=dict)  # each data reward's score of the last turn

    @property
    def live(self) -> bool:
        return self.ended is None

    def add_turn(self, out: TurnOutput) -> None:
        self.response += out.tokens
        self.mask += [1] * len(out.tokens)
        self.logprobs += out.logprobs
        self.versions += [out.version] * len(out.tokens)
        self.turn_versions.append(out.version)
        self.last_finished = out.finished

    def add_observation(self, tokens: Sequence[int]) -> None:
        # the environment's tokens carry the version of the turn they answer; never trained on
        self.response += tokens
        self.mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [self.turn_versions[-1]] * len(tokens)


@dataclass(frozen=True, slots=True)
class _Outcome:
    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


class _Batch:
    """One batch of calls: their outcomes as they come, and when each started."""

    def __init__(self, size: int) -> None:
        self.done = threading.Condition()
        self.outcomes: list[_Outcome | None] = [None] * size
        self.started: list[float | None] = [None] * size
        self.left = size

    def run(self, index: int, call: Callable[[], Any]) -> bool:
        """Run call `index` on this thread; False when it was abandoned meanwhile (past its time)."""
        with self.done:
            self.started[index] = time.monotonic()
        try:
            outcome = _Outcome(value=call())
        except BaseException as exc:  # an environment's failure is its episode's, whatever it is
            outcome = _Outcome(error=exc)
        with self.done:
            if self.outcomes[index] is not None:
                return False
            self.outcomes[index] = outcome
            self.left -= 1
            if not self.left:
                self.done.notify()
        return True


class EnvCalls:
    """Calls into environments on `workers` daemon threads, each call bounded by `timeout_s` from its
    own start. A call past it is abandoned with its thread (a daemon: it never holds the process up),
    and a new worker takes that thread's place; the abandoned one leaves if its call ever returns."""

    def __init__(self, workers: int = 64) -> None:
        self.workers = workers
        self._queue: queue.SimpleQueue[tuple[_Batch, int, Callable[[], Any]]] = queue.SimpleQueue()
        self._started = 0

    def _worker(self) -> None:
        while True:
            batch, index, call = self._queue.get()
            if not batch.run(index, call):
                return  # replaced while its call hung

    def _spawn(self, count: int) -> None:
        for _ in range(count):
            self._started += 1
            threading.Thread(target=self._worker, name=f"agent-env-{self._started}", daemon=True).start()

    def run(self, calls: Sequence[Callable[[], Any]], timeout_s: float) -> list[_Outcome]:
        """Every call's outcome: its value, its exception, or `timed_out`."""
        if self._started == 0:
            self._spawn(self.workers)
        batch = _Batch(len(calls))
        for index, call in enumerate(calls):
            self._queue.put((batch, index, call))
        with batch.done:
            while batch.left:
                running = [(started, i) for i, (started, outcome) in enumerate(zip(batch.started, batch.outcomes))
                           if started is not None and outcome is None]
                now = time.monotonic()
                late = [i for started, i in running if now - started >= timeout_s]
                for i in late:
                    batch.outcomes[i] = _Outcome(timed_out=True)
                    batch.left -= 1
                self._spawn(len(late))
                if batch.left:
                    earliest = min((started for started, i in running if i not in late), default=now)
                    batch.done.wait(max(0.001, earliest + timeout_s - now))
        return [outcome for outcome in batch.outcomes if outcome is not None]


class AgentLoop:
    """Plays a batch of tasks as episodes (see the module's docstring). Built once per rollout engine;
    `metrics` are those of the last `rollout`."""

    def __init__(self, section: AgentSection, *, generator: TurnGenerator, renderer: Renderer, group_size: int,
                 member: str, seed: int, budget: int, turn_tokens: int, version: Callable[[], int],
                 rewards: Sequence[WeightedReward] = ()) -> None:
        self.section = section
        self.environment = resolve_environment(section.environment)
        self.generator = generator
        self.renderer = renderer
        self.group_size = group_size
        self.member = member
        self.seed = seed
        self.budget = budget
        self.turn_tokens = turn_tokens
        self.version = version
        self.rewards = tuple(rewards)
        self.metrics: dict[str, float] = {}
        self._counts: Counter[str] = Counter()
        self._calls = EnvCalls()
        self.log = structlog.get_logger("rolectl.agent").bind(member=member)

    def rollout(self, tasks: Sequence[Task], *, explore_step: int) -> list[Experience]:
        """`group_size` episodes per task; ids and groups as a single-turn rollout gives them."""
        self._counts = Counter()
        episodes = [_Episode(task_idx=i, k=k, task=task) for i, task in enumerate(tasks)
                    for k in range(self.group_size)]
        self._reset(episodes)
        for turn in range(self.section.max_turns):
            live = [e for e in episodes if e.live]
            if not live:
                break
            self._model_turn(live, explore_step=explore_step, turn=turn)
            self._environment_turn([e for e in live if e.live], turn=turn)
        experiences = [self._experience(e, explore_step) for e in episodes]
        self.metrics = self._metrics(episodes)
        return experiences

    # -- the turns ---------------------------------------------------------------------------------

    def _reset(self, episodes: list[_Episode]) -> None:
        def start(episode: _Episode) -> tuple[Any, Any]:
            env = self.environment(**self.section.args)
            return env, env.reset(episode.task)

        outcomes = self._calls.run([lambda e=e: start(e) for e in episodes], self.section.step_timeout_s)
        for episode, outcome in zip(episodes, outcomes):
            if outcome.error is not None or outcome.timed_out:
                self._env_error(episode, "reset_failed", outcome, turn=0)
                continue
            episode.env, first = outcome.value
            try:
                episode.prompt = self.renderer.prompt(as_messages(first), tools=getattr(episode.env, "tools", ()))
            except Exception as exc:
                self._env_error(episode, "reset_failed", _Outcome(error=exc), turn=0)

    def _model_turn(self, live: list[_Episode], *, explore_step: int, turn: int) -> None:
        """One turn of the model for every live episode; one with no token left is truncated."""
        asking = []
        for episode in live:
            left = min(self.turn_tokens, self.budget - len(episode.response))
            if left <= 0:
                episode.ended = "truncated"
            else:
                asking.append((episode, left))
        if not asking:
            return
        outputs = self.generator.generate_turns(
            [[*e.prompt, *e.response] for e, _ in asking], max_tokens=[left for _, left in asking],
            seeds=[episode_seed(self.seed, self.member, explore_step, e.task_idx, e.k, turn) for e, _ in asking])
        for (episode, _), out in zip(asking, outputs):
            episode.add_turn(out)
            episode.last_text = self.renderer.decode(out.tokens)

    def _environment_turn(self, live: list[_Episode], *, turn: int) -> None:
        """Every live environment's answer to the model's turn, at once; then each episode ends or
        gets the answer's tokens."""
        outcomes = self._calls.run([lambda e=e: e.env.step(e.last_text) for e in live],
                                   self.section.step_timeout_s)
        for episode, outcome in zip(live, outcomes):
            if outcome.error is not None or outcome.timed_out:
                self._env_error(episode, "timeout" if outcome.timed_out else "exception", outcome, turn=turn)
                continue
            try:
                self._answered(episode, outcome.value, turn=turn)
            except Exception as exc:  # an answer that is not a StepResult, or cannot be rendered
                self._env_error(episode, "exception", _Outcome(error=exc), turn=turn)

    def _answered(self, episode: _Episode, result: StepResult, *, turn: int) -> None:
        if not isinstance(result, StepResult):
            raise TypeError(f"step() returned {type(result).__name__}, not a StepResult")
        reward = float(result.reward)
        if not math.isfinite(reward):
            raise ValueError(f"step() returned a reward of {reward}")
        episode.rewards.append(reward)
        self._counts.update({str(key): float(value) for key, value in result.info.items()})
        if result.done:
            episode.ended = "done"
            return
        if turn + 1 >= self.section.max_turns:
            episode.ended = "truncated"
            return
        tokens = self.renderer.observation(as_messages(result.observation), turn_finished=episode.last_finished)
        if len(episode.response) + len(tokens) >= self.budget:
            episode.ended = "truncated"  # no token would be left for the model's answer
            return
        episode.add_observation(tokens)

    def _env_error(self, episode: _Episode, reason: str, outcome: _Outcome, *, turn: int) -> None:
        episode.ended = reason
        self.log.warning("agent_env_error", reason=reason, task=episode.task.id, episode=episode.k, turn=turn,
                         environment=self.section.environment,
                         error=("no answer within agent.step_timeout_s = "
                                f"{self.section.step_timeout_s:g} s (its thread is abandoned)")
                         if outcome.timed_out else f"{type(outcome.error).__name__}: {outcome.error}")

    # -- what an episode becomes -------------------------------------------------------------------

    def _reward(self, episode: _Episode) -> tuple[float, dict[str, float]]:
        """The episode's reward (0.0 when its environment failed), and each data reward's score."""
        if episode.ended not in ("done", "truncated"):
            return 0.0, {}
        discount = self.section.discount if self.section.reward == "discounted" else 1.0
        total = sum(reward * discount ** t for t, reward in enumerate(episode.rewards))
        if not self.rewards or episode.last_text is None:
            return total, {}
        scored, scores = score_all(self.rewards, episode.last_text, episode.task.answer)
        return total + scored, scores

    def _experience(self, episode: _Episode, explore_step: int) -> Experience:
        group = f"{self.member}-{explore_step}-{episode.task_idx}"
        reward, episode.scores = self._reward(episode)
        versions = episode.versions
        oldest = min(versions, default=self.version())
        runs = version_runs(versions)
        return Experience(id=f"{group}-{episode.k}", group=group, prompt=tuple(episode.prompt),
                          response=tuple(episode.response), logprobs=tuple(episode.logprobs), reward=reward,
                          model_version=oldest, loss_mask=tuple(episode.mask), token_versions=runs)

    def _metrics(self, episodes: list[_Episode]) -> dict[str, float]:
        turns = sum(len(e.turn_versions) for e in episodes)
        ended = Counter(e.ended for e in episodes)
        metrics = {"agent/episodes": float(len(episodes)), "agent/turns": float(turns),
                   "agent/turns_mean": turns / max(len(episodes), 1),
                   "agent/truncated": float(ended["truncated"]),
                   **{f"agent/env_errors/{reason}": float(ended[reason]) for reason in ENV_ERRORS if ended[reason]},
                   **{f"agent/{key}": value for key, value in sorted(self._counts.items())}}
        scored = [e.scores for e in episodes if e.scores]
        for reward in self.rewards:
            metrics[f"reward/{reward.name}"] = sum(s[reward.name] for s in scored) / max(len(scored), 1)
        return metrics

