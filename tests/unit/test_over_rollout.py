"""Over-rollout: a step takes the tasks done once (1 - ratio) of them are, without waiting for stragglers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_rollout_engine, make_taskset
from rolectl.roles.explorer import over_rollout
from rolectl.sync_protocol import ConfigError


class _Engine:
    """A rollout engine whose tasks finish when the test says (a straggler blocks on `release`)."""

    def __init__(self, inner, release: threading.Event | None = None):
        self.inner, self.release, self.calls = inner, release, []

    def rollout(self, tasks, *, explore_step):
        self.calls.append(tasks[0].id)
        if self.release is not None:
            assert self.release.wait(timeout=60), "the straggler was never released"
        return self.inner.rollout(tasks, explore_step=explore_step)


@pytest.fixture
def tiny():
    cfg = parse_config({"job": "over", "model": {"engine": "tiny", "group_size": 2}})
    return cfg, make_rollout_engine(cfg, "explorer-0"), make_taskset(cfg, seed=0, batch_size=8).next_batch()


def test_a_step_does_not_wait_for_a_straggling_engine(tiny):
    cfg, engine, tasks = tiny
    release = threading.Event()
    fast, slow = _Engine(engine), _Engine(make_rollout_engine(cfg, "explorer-0"), release)
    pools = [ThreadPoolExecutor(max_workers=1) for _ in range(2)]
    try:
        # tasks 0, 2, 4, 6 go to the fast engine, 1, 3, 5, 7 to the one that never finishes in time
        experiences, cut = over_rollout([fast, slow], pools, tasks, step=3, member="explorer-0", wait_for=4)
    finally:
        release.set()
        for pool in pools:
            pool.shutdown(wait=True)
    assert cut == 4
    assert sorted({e.group for e in experiences}) == [f"explorer-0-3-{i}" for i in (0, 2, 4, 6)]
    assert [e.id for e in experiences if e.group == "explorer-0-3-2"] == ["explorer-0-3-2-0", "explorer-0-3-2-1"]
    assert slow.calls == [tasks[1].id]  # the slow engine's other tasks were never started
    assert all(e.prompt == tasks[int(e.group.rsplit("-", 1)[1])].prompt for e in experiences)


def test_with_nothing_slow_every_task_is_kept_with_batch_ids(tiny):
    _, engine, tasks = tiny
    pools = [ThreadPoolExecutor(max_workers=1)]
    try:
        experiences, cut = over_rollout([engine], pools, tasks, step=1, member="explorer-0", wait_for=8)
    finally:
        pools[0].shutdown(wait=True)
    assert cut == 0 and len(experiences) == 16
    assert [e.id for e in experiences] == [f"explorer-0-1-{t}-{k}" for t in range(8) for k in range(2)]
    # each task samples from its own seed: two tasks with one prompt need not answer alike
    again, _ = over_rollout([engine], [ThreadPoolExecutor(max_workers=1)], tasks, step=1, member="explorer-0",
                            wait_for=8)
    assert [e.response for e in again] == [e.response for e in experiences]  # but a replay does


def test_a_ratio_that_starves_the_trainer_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        parse_config({"job": "j", "explorers": {"count": 2, "over_rollout_ratio": 0.25}, "buffer": {"batch_size": 8},
                      "trainer": {"train_batch_tasks": 16}})
    (path, why), = info.value.problems
    assert path == "explorers.over_rollout_ratio" and "keeps 6 of each step's 8 tasks, 12 per round" in why
    assert "set trainer.train_batch_tasks: 12" in why
    parse_config({"job": "j", "explorers": {"count": 2, "over_rollout_ratio": 0.25}, "buffer": {"batch_size": 8},
                  "trainer": {"train_batch_tasks": 12}})
    with pytest.raises(ConfigError, match="over_rollout_ratio"):
        parse_config({"job": "j", "explorers": {"over_rollout_ratio": 1.0}})
