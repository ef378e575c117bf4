"""An agent job's figures seen everywhere: the run summary's `agent` block, `rolectl status`, the
dashboard's snapshot and `/metrics`, and the trackers, all from the explorers' `agent/*` and the
trainer's token counts in their recorded `StepFinished` events."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.observe.prometheus import agent_metrics
from rolectl.roles.observe.status import format_agent
from rolectl.roles.observe.trackers import Trackers
from rolectl.sync_protocol import Recorded, SyncConfig, SyncMethod
from tests.support.reducer_scenario import E1, E2, T, configured, join, step_done


def _explored(member, step: int, *, episodes: float, turns: float, **more: float):
    return step_done(member, step, 0, experiences=episodes, **{"agent/episodes": episodes, "agent/turns": turns,
                                                               "agent/turns_mean": turns / episodes, **more})


EVENTS = [
    configured(SyncConfig(sync_method=SyncMethod.MEMORY)), join(T), join(E1), join(E2),
    _explored(E1, 1, episodes=8, turns=16, **{"agent/truncated": 1, "agent/tool_calls/calculator/ok": 6,
                                               "agent/tool_calls/calculator/malformed": 2}),
    _explored(E2, 1, episodes=8, turns=12, **{"agent/truncated": 0, "agent/env_errors/timeout": 1,
                                               "agent/paid": 3}),
    # explorer-1 restarted and reported its step 1 again: it counts once, with its latest figures
    _explored(E1, 1, episodes=8, turns=16, **{"agent/truncated": 1, "agent/tool_calls/calculator/ok": 7,
                                               "agent/tool_calls/calculator/malformed": 1}),
    step_done(T, 1, 0, reward_mean=0.5, num_experiences=16, trained_tokens=120, masked_tokens=80),
]


def _observer() -> JobObserver:
    return JobObserver().extend(Recorded(seq=i + 1, time_ms=1000 + i, event=e) for i, e in enumerate(EVENTS))


def test_the_summary_has_an_agent_block_counted_once_per_step():
    agent = _observer().summary(job="j")["agent"]
    assert agent == {"episodes": 16, "turns_mean": 1.75, "truncated": 1,
                     "tool_calls": {"calculator": {"malformed": 1, "ok": 7}}, "env_errors": {"timeout": 1},
                     "trained_tokens": 120, "masked_tokens": 80, "counts": {"paid": 3}}


def test_a_single_turn_job_has_no_agent_block():
    observer = JobObserver().extend(Recorded(seq=i + 1, time_ms=i, event=e) for i, e in enumerate(
        [configured(SyncConfig()), join(T), step_done(T, 1, 0, reward_mean=0.1, num_experiences=4)]))
    assert "agent" not in observer.summary(job="j") and observer.agent.summary() is None


def test_status_says_it_in_a_line():
    assert format_agent(_observer().agent.summary()) == (
        "agent: 16 episodes, 1.75 turns each, 1 truncated; tool calls: calculator malformed 1, ok 7; "
        "env errors: timeout 1, trained tokens 120")


def test_prometheus_families_by_tool_outcome_and_reason():
    class Collector:
        def collect(self):
            return agent_metrics(_observer(), "j")

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    for line in ('rolectl_agent_episodes_total{job="j"} 16.0', 'rolectl_agent_turns_mean{job="j"} 1.75',
                 'rolectl_agent_tool_calls_total{job="j",outcome="ok",tool="calculator"} 7.0',
                 'rolectl_agent_env_errors_total{job="j",reason="timeout"} 1.0',
                 'rolectl_agent_truncated_total{job="j"} 1.0', 'rolectl_trainer_trained_tokens_total{job="j"} 120.0'):
        assert line in text, text


class Recording:
    name = "recording"

    def __init__(self) -> None:
        self.logged: list[tuple[dict, int, str]] = []

    def log_params(self, params) -> None:
        pass

    def log_metrics(self, metrics, *, step, axis) -> None:
        self.logged.append((metrics, step, axis))

    def close(self) -> None:
        pass


def test_the_trackers_get_every_agent_figure():
    tracker = Recording()
    trackers = Trackers([tracker])
    for i, event in enumerate(EVENTS):
        trackers.apply(Recorded(seq=i + 1, time_ms=i, event=event))
    by_axis = {(axis, step, key): value for metrics, step, axis in tracker.logged for key, value in metrics.items()}
    assert by_axis[("explore/step", 1, "explorer/e1/agent/turns_mean")] == 2.0
    assert by_axis[("explore/step", 1, "explorer/e2/agent/env_errors/timeout")] == 1.0
    assert by_axis[("trainer/step", 1, "trainer/trained_tokens")] == 120.0
