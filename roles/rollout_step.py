"""An explore step's rollout beyond one call per engine: over-rollout cuts the slowest tasks,
DAPO's dynamic sampling leaves out the groups whose rewards are all equal and generates more, and
streaming carries unfinished generations into the next step.

Dynamic sampling (`algorithm.dynamic_sampling`, verl's `filter_groups` on the reward): a group whose
responses all got the same reward has zero standard deviation, so every group-relative advantage in
it is zero and it trains nothing. The explorer filters it before publishing (the cheapest place:
its bytes never cross the bus, the trainer never waits for them to be acked, and the explorer is
the one that can generate replacements), counts it, and takes further batches of its task set until
the step holds `buffer.batch_size` groups that differ, or `algorithm.max_num_gen_batches`
generation batches were used (verl's bound). A step that reaches the bound publishes the groups it
kept; the trainer's batch fills from the next steps, and if the task sets run out first the trainer
ends short, naming the filtered groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

__all__ = ["GroupSampler", "SampledStep", "filter_groups", "over_rollout", "StreamingSteps", "engine_shares",
           "GEN_BATCH_STRIDE"]

GEN_BATCH_STRIDE = 1_000_000_000
"""The explore step a step's `n`-th generation batch is rolled out as: `step + (n - 1) x stride`, so
its sampling seed and its group names (engines name groups by explore step) are its own."""


def filter_groups(experiences: Sequence[Any]) -> tuple[list[Any], int, int]:
    """The experiences of the groups whose rewards differ, in order, and how many groups and
    experiences were left out. A group of one response is kept (verl keeps it: it has no spread to
    lose), one of several equal rewards is not."""
    rewards: dict[str, list[float]] = {}
    for exp in experiences:
        rewards.setdefault(exp.group, []).append(exp.reward)
    flat = {group for group, values in rewards.items() if len(values) > 1 and max(values) == min(values)}
    kept = [exp for exp in experiences if exp.group not in flat]
    return kept, len(flat), len(experiences) - len(kept)


@dataclasses.dataclass(frozen=True)
class SampledStep:
    """What one explore step's dynamic sampling gave: the experiences to publish, and the books."""

    experiences: list[Any]
    generated: int  # experiences generated, published or not
    groups_filtered: int
    experiences_filtered: int
    gen_batches: int  # generation batches the step used
    short: bool  # it ended before `batch_size` groups differed (the bound, or the task set's end)

    def metrics(self) -> dict[str, float]:
        return {"groups_filtered": float(self.groups_filtered),
                "experiences_filtered": float(self.experiences_filtered),
                "gen_batches": float(self.gen_batches), "dynamic_sampling_short": float(self.short)}


class GroupSampler:
    """Fills an explore step with `batch_size` groups whose rewards differ, from at most
    `max_gen_batches` generation batches of the task set."""

    def __init__(self, *, batch_size: int, max_gen_batches: int):
        self.batch_size = batch_size
        self.max_gen_batches = max_gen_batches

    def fill(self, tasks: list, step: int, *, rollout: Callable[[list, int], list],
             more: Callable[[], list | None]) -> SampledStep:
        """Roll out `tasks`, then batches from `more` (None: the task set is done) while fewer than
        `batch_size` groups differ and the bound allows; `rollout(tasks, explore_step)`."""
        kept: list[Any] = []
        generated = groups_filtered = experiences_filtered = 0
        groups_kept, batches = 0, 0
        while tasks is not None:
            batches += 1
            experiences = rollout(tasks, step + (batches - 1) * GEN_BATCH_STRIDE)
            signal, flat_groups, flat = filter_groups(experiences)
            kept.extend(signal)
            generated += len(experiences)
            groups_filtered += flat_groups
            experiences_filtered += flat
            groups_kept += len({exp.group for exp in signal})
            if groups_kept >= self.batch_size or batches >= self.max_gen_batches:
                break
            tasks = more()
        return SampledStep(experiences=kept, generated=generated, groups_filtered=groups_filtered,
                           experiences_filtered=experiences_filtered, gen_batches=batches,
                           short=groups_kept < self.batch_size)


def over_rollout(engines, pools, tasks, *, step: int, member: str, wait_for: int) -> tuple[list, int]:
    """The experiences of the tasks done once at least `wait_for` are, and how many tasks were cut.

    Tasks go round-robin to the engines, one at a time each (`pools`: one worker per engine); once
    `wait_for` are done, those not started are cancelled and those still running are dropped when
    they finish. Each task is its own rollout call: its sampling seed is drawn from (step, task) and
    its experiences get the ids a whole-batch rollout would give it (`member-step-task-k`)."""
    futures = {}
    for i, task in enumerate(tasks):
        engine = engines[i % len(engines)]
        # a distinct explore_step per task: engines seed their sampling from it
        futures[pools[i % len(pools)].submit(engine.rollout, [task], explore_step=step * 1_000_003 + i)] = i
    done_tasks: dict[int, list] = {}
    pending = set(futures)
    while len(done_tasks) < wait_for and pending:
        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
        for future in finished:
            done_tasks[futures[future]] = future.result()  # an engine's error ends the step, as without
    for future in pending:
        future.cancel()  # not started: never runs; running: its result is ignored
    experiences = []
    for i in sorted(done_tasks):  # every task done by now is kept, in task order
        group = f"{member}-{step}-{i}"
        experiences.extend(dataclasses.replace(e, group=group, id=f"{group}-{e.id.rsplit('-', 1)[1]}")
                           for e in done_tasks[i])
    kept = len({e.group for e in experiences})
    return experiences, len(tasks) - kept


class StreamingSteps:
    """Explore steps that stream (`explorers.streaming`): each engine admits its share of a step's
    tasks to the generations it has in flight and gives back as many groups as it was given, the
    first to finish, whichever step admitted them (AReaL's and verl's streaming rollout: a long
    generation holds no step; a later step publishes it). Shares are split as a whole-batch rollout
    splits them; engines name each group after the step that admitted it (`member-step-task`).

    An engine that collects as many groups as it holds waits for the slowest of them, so a step
    that finds less than a step's worth in flight (the first, or the first after a restart) also
    admits the next batch of the task set (`more`), as explore step `step + GEN_BATCH_STRIDE`: from
    then on each step collects a step's worth out of two, and what is left runs on."""

    def __init__(self, engines: Sequence[Any]):
        self.engines = engines
        self._last: dict[str, float] = {}

    def rollout(self, tasks: Sequence[Any], step: int, *, pause_point: Any = None,
                more: Callable[[], Sequence[Any] | None] = lambda: None) -> list:
        lookahead = more() if self.in_flight() < len(tasks) else None
        shares = engine_shares(self.engines, tasks)
        for engine, share in shares:
            engine.admit(share, explore_step=step)
        for engine, share in engine_shares(self.engines, lookahead or ()):
            engine.admit(share, explore_step=step + GEN_BATCH_STRIDE)
        experiences = [e for engine, share in shares for e in engine.collect(len(share), pause_point=pause_point)]
        carried = {e.group for e in experiences if int(e.group.rsplit("-", 2)[-2]) % GEN_BATCH_STRIDE != step}
        self._last = {"streaming_carried_groups": float(len(carried)), "streaming_in_flight_groups": float(
            self.in_flight())}
        return experiences

    def in_flight(self) -> int:
        """Groups admitted and not yet taken, over the engines."""
        return sum(engine.in_flight_groups() for engine in self.engines)

    def metrics(self) -> dict[str, float]:
        """The last step's: groups it published that an earlier step admitted, and groups left in flight."""
        return self._last

    def drop(self) -> int:
        """Drop every generation in flight (the explorer stops); how many groups were."""
        return sum(engine.abandon() for engine in self.engines)


def engine_shares(engines, tasks):
    """(engine, its tasks) for each engine given any: consecutive shares, as even as they go."""
    per = -(-len(tasks) // len(engines))
    shares = ((engine, tasks[i * per:(i + 1) * per]) for i, engine in enumerate(engines))
    return [(engine, share) for engine, share in shares if share]
