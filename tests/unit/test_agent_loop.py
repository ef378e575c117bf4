"""The agent loop, engine-independent: episodes played turn by turn against environments, with a
scripted turn generator (a policy written as a rule) and the tiny renderer."""

from __future__ import annotations

import threading

import pytest
import structlog

from rolectl.roles.engines.agent.config import AgentSection
from rolectl.roles.engines.agent.environment import Message, StepResult
from rolectl.roles.engines.agent.loop import AgentLoop, EnvCalls, episode_seed
from rolectl.roles.engines.agent.render import TinyRenderer
from rolectl.roles.engines.base import Task
from rolectl.roles.engines.rewards import parse_reward_specs
from rolectl.roles.engines.task import BOS, EOS, PAD, QUERY, SEP, make_reverse_task
from tests.support.scripted_turns import ScriptedTurns

HERE = __name__


def asks_then_reverses(sequence: list[int]) -> list[int]:
    """The policy HiddenReverse rewards: ask first, then the revealed digits reversed."""
    if QUERY not in sequence:
        return [QUERY, EOS]
    revealed = sequence[sequence.index(QUERY) + 2:-1]  # after `QUERY EOS`, before the SEP
    return [*reversed(revealed), EOS]


def never_asks(sequence: list[int]) -> list[int]:
    return [1, 2, EOS]


def _loop(policy, *, generator=None, group_size=2, rewards=(), **agent) -> tuple[AgentLoop, ScriptedTurns]:
    section = AgentSection(**{"environment": "hidden_reverse", "max_tokens": 24, "max_tokens_per_turn": 5, **agent})
    generator = generator or ScriptedTurns(policy)
    loop = AgentLoop(section, generator=generator, renderer=TinyRenderer(), group_size=group_size, member="explorer-0",
                     seed=7, budget=section.budget(5)[0], turn_tokens=section.budget(5)[1],
                     version=lambda: generator.version, rewards=rewards)
    return loop, generator


TASKS = [make_reverse_task("t0", [3, 1, 4, 1]), make_reverse_task("t1", [5, 9, 2, 6])]


def test_an_episode_that_asks_then_answers_is_one_trajectory_masked_on_the_environments_tokens():
    loop, generator = _loop(asks_then_reverses)
    experiences = loop.rollout(TASKS, explore_step=4)
    first = experiences[0]
    assert first.prompt == (BOS, PAD, PAD, PAD, PAD, SEP)  # the digits are hidden
    assert first.response == (QUERY, EOS, 3, 1, 4, 1, SEP, 1, 4, 1, 3, EOS)
    assert first.loss_mask == (1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1)
    assert first.logprobs == (-0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5, -0.5, -0.5, -0.5, -0.5)
    assert (first.reward, first.turns, first.trained_tokens, first.model_version) == (1.0, 2, 7, 3)
    assert first.token_versions is None  # one version sampled it all
    # ids and groups as a single-turn rollout gives them: the trainer deduplicates on them
    assert [e.id for e in experiences] == ["explorer-0-4-0-0", "explorer-0-4-0-1", "explorer-0-4-1-0",
                                           "explorer-0-4-1-1"]
    assert {e.group for e in experiences[2:]} == {"explorer-0-4-1"}
    assert loop.metrics == {"agent/episodes": 4.0, "agent/turns": 8.0, "agent/turns_mean": 2.0,
                            "agent/truncated": 0.0, "agent/tool_calls/reveal/ok": 4.0}
    assert len(generator.calls) == 2  # the episodes advanced together: one batched call per turn


def test_a_policy_that_never_asks_is_answered_with_blanks_until_max_turns():
    loop, generator = _loop(never_asks, max_turns=3)
    [first, *_] = loop.rollout(TASKS, explore_step=1)
    assert first.response == (1, 2, EOS, PAD, SEP, 1, 2, EOS, PAD, SEP, 1, 2, EOS)
    assert (first.reward, first.turns) == (0.0, 3)
    assert loop.metrics["agent/truncated"] == 4.0 and loop.metrics["agent/turns_mean"] == 3.0
    assert "agent/tool_calls/reveal/ok" not in loop.metrics


def test_a_turn_samples_at_most_the_budget_left_and_an_observation_that_would_fill_it_ends_the_episode():
    # 5 + 3 tokens: after `QUERY EOS` and the digits (7 tokens) one is left for the answer's 5
    loop, generator = _loop(asks_then_reverses, max_tokens=8)
    [first, *_] = loop.rollout(TASKS, explore_step=1)
    assert [limits for _, limits, _ in generator.calls] == [[5, 5, 5, 5], [1, 1, 1, 1]]
    assert first.response == (QUERY, EOS, 3, 1, 4, 1, SEP, 1)  # the cut answer
    assert first.reward == 0.25 and loop.metrics["agent/truncated"] == 0.0
    # an observation that would leave nothing to answer with is not appended
    loop, generator = _loop(asks_then_reverses, max_tokens=7)
    [first, *_] = loop.rollout(TASKS, explore_step=1)
    assert first.response == (QUERY, EOS) and first.reward == 0.0
    assert loop.metrics["agent/truncated"] == 4.0 and len(generator.calls) == 1


def test_seeds_derive_from_member_step_task_episode_and_turn():
    loop, generator = _loop(asks_then_reverses)
    loop.rollout(TASKS, explore_step=9)
    again, generator_again = _loop(asks_then_reverses)
    again.rollout(TASKS, explore_step=9)
    assert generator.calls == generator_again.calls  # a replayed explore step samples the same episodes
    seeds = [seed for _, _, call_seeds in generator.calls for seed in call_seeds]
    assert len(set(seeds)) == len(seeds) == 8
    assert generator.calls[1][2][3] == episode_seed(7, "explorer-0", 9, 1, 1, 1)


class FailsAt:
    """HiddenReverse whose step raises, or hangs until released, at turn `turn` of task `task`."""

    tools = ()
    release = threading.Event()

    def __init__(self, how: str, task: str = "t0", turn: int = 1) -> None:
        from rolectl.roles.engines.agent.examples import HiddenReverse

        self.inner, self.how, self.task, self.turn, self.turns = HiddenReverse(), how, task, turn, 0

    def reset(self, task: Task):
        if self.how == "reset" and task.id == self.task:
            raise RuntimeError("no world to reset")
        self.task_id = task.id
        return self.inner.reset(task)

    def step(self, model_text: str) -> StepResult:
        self.turns += 1
        if self.task_id == self.task and self.turns == self.turn + 1:
            if self.how == "raise":
                raise KeyError("the checker broke")
            FailsAt.release.wait(60)  # hangs past the step timeout; the test releases it
        return self.inner.step(model_text)


@pytest.mark.parametrize(("how", "reason", "response"), [
    ("raise", "exception", (QUERY, EOS, 3, 1, 4, 1, SEP, 1, 4, 1, 3, EOS)),
    ("hang", "timeout", (QUERY, EOS, 3, 1, 4, 1, SEP, 1, 4, 1, 3, EOS)),
    ("reset", "reset_failed", ()),
])
def test_an_environment_that_fails_costs_its_episode_only_counted_and_logged(how, reason, response):
    loop, _ = _loop(asks_then_reverses, environment=f"{HERE}:FailsAt", args={"how": how}, step_timeout_s=0.5)
    FailsAt.release = threading.Event()
    try:
        with structlog.testing.capture_logs() as logs:
            experiences = loop.rollout(TASKS, explore_step=2)
    finally:
        FailsAt.release.set()
    failed, *others = [e for e in experiences if e.group.endswith("-0")]
    assert (failed.response, failed.reward) == (response, 0.0)
    assert failed.loss_mask == (1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1)[:len(response)]
    assert len(experiences) == 4 and {e.reward for e in experiences[2:]} == {1.0}  # the groups stay whole
    assert loop.metrics[f"agent/env_errors/{reason}"] == 2.0
    [logged, _] = [entry for entry in logs if entry["event"] == "agent_env_error"]
    assert (logged["reason"], logged["task"], logged["episode"], logged["turn"]) == (
        reason, "t0", 0, 0 if how == "reset" else 1)
    assert {"raise": "KeyError", "hang": "step_timeout_s = 0.5 s", "reset": "no world"}[how] in logged["error"]


class Paying:
    """Rewards every turn with 1, done after three."""

    tools = ()

    def reset(self, task):
        self.turns = 0
        return [Message(role="system", content="_"), Message(role="user", content="_ _")]

    def step(self, model_text):
        self.turns += 1
        return StepResult(observation="_", reward=1.0, done=self.turns == 3, info={"paid": 1})


def test_rewards_sum_or_discount_per_turn():
    loop, _ = _loop(never_asks, environment=f"{HERE}:Paying")
    [first, *_] = loop.rollout(TASKS, explore_step=1)
    assert first.prompt == (BOS, PAD, PAD, PAD, SEP)
    assert first.reward == 3.0 and loop.metrics["agent/paid"] == 12.0
    loop, _ = _loop(never_asks, environment=f"{HERE}:Paying", reward="discounted", discount=0.5)
    [first, *_] = loop.rollout(TASKS, explore_step=1)
    assert first.reward == 1.0 + 0.5 + 0.25


def test_the_jobs_reward_functions_score_the_final_turn_and_are_added():
    rewards = parse_reward_specs([{"name": "positional_match", "weight": 2.0}])
    text_task = Task(id="q", prompt=(BOS, SEP), answer="1 4 1 3", target=(1, 4, 1, 3))
    loop, _ = _loop(asks_then_reverses, rewards=rewards)
    [first, *_] = loop.rollout([text_task], explore_step=1)
    assert first.reward == 1.0 + 2.0
    assert loop.metrics["reward/positional_match"] == 1.0


class Versioned(ScriptedTurns):
    """Weights that change between turns (a partial rollout): each call one version newer."""

    def generate_turns(self, sequences, *, max_tokens, seeds):
        self.version += 1
        return super().generate_turns(sequences, max_tokens=max_tokens, seeds=seeds)


def test_each_token_carries_the_version_that_sampled_its_turn_and_the_oldest_is_the_experiences():
    loop, _ = _loop(asks_then_reverses, generator=Versioned(asks_then_reverses, version=4))
    [first, *_] = loop.rollout(TASKS, explore_step=1)
    assert first.model_version == 5
    assert first.token_versions == ((7, 5), (5, 6))  # the digits carry the version of the turn they answer
    assert [s.version for s in first.segments()] == [5, 5, 6]


def test_env_calls_bound_each_call_from_its_own_start_and_replace_a_hung_worker():
    calls = EnvCalls(workers=2)
    hang = threading.Event()
    # two workers: the third call starts only when the first is done, and has its own bound
    outcomes = calls.run([lambda: 1, lambda: hang.wait(60), lambda: 3, lambda: 1 / 0], timeout_s=0.5)
    try:
        assert [o.value for o in outcomes] == [1, None, 3, None]
        assert outcomes[1].timed_out and isinstance(outcomes[3].error, ZeroDivisionError)
        # the hung worker's place was taken: the next batch still has two workers that answer
        assert [o.value for o in calls.run([lambda: 5] * 6, timeout_s=0.5)] == [5] * 6
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("agent-env-"))
    finally:
        hang.set()
