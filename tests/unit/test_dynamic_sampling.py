"""DAPO's dynamic sampling (`algorithm.dynamic_sampling`): the group filter (equal rewards carry no
group-relative signal), the explorer's over-sampling to fill a step and its bound
(`max_num_gen_batches`), the config that turns it on (any engine), and the books: filtered groups a
named share of what explorers produced, in the summary, `status` and /metrics."""

from __future__ import annotations

import pytest

from rolectl.roles.config import parse_config
from rolectl.roles.engines import dynamic_sampling_of
from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.rollout_step import GEN_BATCH_STRIDE, GroupSampler, filter_groups
from rolectl.sync_protocol import ConfigError, JobConfigured, Recorded, StepFinished, SyncConfig, SyncMethod
from rolectl.sync_protocol.experience import Experience
from tests.support.metrics import JOB, exported
from tests.support.reducer_scenario import E1, Job, T, join


def _group(name: str, *rewards: float) -> list[Experience]:
    return [Experience(id=f"{name}-{k}", group=name, prompt=(1,), response=(2,), logprobs=(0.0,), reward=r,
                       model_version=0) for k, r in enumerate(rewards)]


def test_groups_of_equal_rewards_are_filtered_the_rest_kept_in_order():
    experiences = [*_group("a", 1, 1, 1), *_group("b", 0, 1, 0), *_group("c", 0, 0, 0), *_group("d", 0.5)]
    kept, groups, filtered = filter_groups(experiences)
    assert [e.id for e in kept] == ["b-0", "b-1", "b-2", "d-0"]  # a group of one has no spread to lose (verl)
    assert (groups, filtered) == (2, 6)


class _Rollouts:
    """A rollout whose n-th call gives `flat[n]` groups of equal rewards and the rest that differ."""

    def __init__(self, *flat: int, tasks: int = 4):
        self.flat, self.tasks, self.calls = list(flat), tasks, []

    def __call__(self, tasks: list, explore_step: int) -> list[Experience]:
        flat = self.flat[len(self.calls)]
        self.calls.append(explore_step)
        return [e for i in range(len(tasks)) for e in
                _group(f"{explore_step}-{i}", *((1, 1) if i < flat else (0, 1)))]


def test_a_step_with_enough_signal_takes_one_batch():
    rollout = _Rollouts(0)
    step = GroupSampler(batch_size=4, max_gen_batches=3).fill(list(range(4)), 7, rollout=rollout, more=lambda: [0] * 4)
    assert rollout.calls == [7] and step.gen_batches == 1 and not step.short
    assert step.metrics() == {"groups_filtered": 0.0, "experiences_filtered": 0.0, "gen_batches": 1.0,
                              "dynamic_sampling_short": 0.0}


def test_filtered_groups_are_replaced_from_more_of_the_task_set():
    rollout = _Rollouts(3, 1)
    step = GroupSampler(batch_size=4, max_gen_batches=5).fill([0] * 4, 7, rollout=rollout, more=lambda: [0] * 4)
    # its own explore step for each generation batch: its own seed and group names
    assert rollout.calls == [7, 7 + GEN_BATCH_STRIDE]
    assert len({e.group for e in step.experiences}) == 4 and not step.short  # 1, then 3 more
    assert (step.generated, step.groups_filtered, step.experiences_filtered) == (16, 4, 8)


def test_the_bound_ends_a_step_short_with_what_it_kept():
    rollout = _Rollouts(4, 4, 3, 0)
    step = GroupSampler(batch_size=4, max_gen_batches=3).fill([0] * 4, 1, rollout=rollout, more=lambda: [0] * 4)
    assert len(rollout.calls) == 3 and step.gen_batches == 3 and step.short
    assert len({e.group for e in step.experiences}) == 1
    assert (step.generated, step.groups_filtered, step.experiences_filtered) == (24, 11, 22)


def test_the_task_set_ending_ends_the_step():
    rollout = _Rollouts(4, 4)
    step = GroupSampler(batch_size=4, max_gen_batches=10).fill([0] * 4, 1, rollout=rollout, more=lambda: None)
    assert rollout.calls == [1] and step.experiences == [] and step.short


def test_any_engine_may_turn_it_on_and_bad_values_say_where():
    tiny = parse_config({"job": "ds", "model": {"engine": "tiny"},
                         "algorithm": {"dynamic_sampling": True, "max_num_gen_batches": 4}})
    assert dynamic_sampling_of(tiny.algorithm).model_dump() == {"dynamic_sampling": True, "max_num_gen_batches": 4}
    assert not dynamic_sampling_of(parse_config({"job": "ds", "model": {"engine": "tiny"}}).algorithm).dynamic_sampling
    with pytest.raises(ConfigError, match=r"algorithm\.max_num_gen_batches"):
        parse_config({"job": "ds", "model": {"engine": "tiny"}, "algorithm": {"max_num_gen_batches": 0}})
    with pytest.raises(ConfigError, match="the tiny engine has its own task and loss \\(clip_ratio\\)"):
        parse_config({"job": "ds", "model": {"engine": "tiny"}, "algorithm": {"dynamic_sampling": True,
                                                                              "clip_ratio": 0.3}})
    with pytest.raises(ConfigError, match="serving explorers"):
        parse_config({"job": "ds", "model": {"engine": "tiny"}, "algorithm": {"dynamic_sampling": True},
                      "synchronizer": {"sync_method": "memory", "sync_style": "fully_async"},
                      "serve": {"enabled": True}})


def _records(*events) -> list[Recorded]:
    job = Job()
    for event in events:
        job.feed(event)
    return list(job.history)


def test_filtered_groups_are_a_named_share_of_what_was_produced():
    config = SyncConfig(sync_method=SyncMethod.MEMORY)
    explored = {"experiences": 32.0, "groups_filtered": 3.0, "experiences_filtered": 12.0}
    observer = JobObserver().extend(_records(
        JobConfigured(member=T, config=config), join(T), join(E1),
        StepFinished(member=E1, step=1, version=0, metrics=explored),
        StepFinished(member=E1, step=1, version=0, metrics=explored),  # a step reported twice counts once
        StepFinished(member=E1, step=2, version=0, metrics={**explored, "groups_filtered": 1.0,
                                                             "experiences_filtered": 4.0}),
        StepFinished(member=T, step=1, version=0, metrics={"num_experiences": 32.0})))
    s = observer.summary(job="j")
    assert (s["experiences_produced"], s["experiences_filtered"], s["groups_filtered"]) == (64, 16, 4)
    assert s["experiences_left_untrained"] == 64 - 32 - 16
    assert s["experiences_produced"] == (s["experiences_trained"] + s["experiences_dropped_stale"]
                                         + s["experiences_filtered"] + s["experiences_left_untrained"])
    dashboard, samples = exported(observer)
    assert samples[("rolectl_explorer_groups_filtered_total", JOB)] == 4
    assert dashboard.snapshot()["filtered"] == {"groups": 4, "experiences": 16}
