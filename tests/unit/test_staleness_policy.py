"""`synchronizer.staleness_policy`: an experience past `max_staleness` is dropped (the default) or
kept and trained with the off-policy correction; the verdict is the core's (`staleness_verdict`), the
config says what it needs, and the books count both."""

from __future__ import annotations

import pytest

from rolectl.roles import config_rules
from rolectl.roles.config import parse_config
from rolectl.roles.observe.check import check_staleness
from rolectl.roles.observe.observer import JobObserver
from rolectl.sync_protocol import (
    ConfigError,
    JobConfigured,
    Recorded,
    StalenessPolicy,
    StalenessTally,
    StepFinished,
    SyncConfig,
    SyncMethod,
    decode,
    encode,
    to_plain,
)
from rolectl.sync_protocol.boundaries import Staleness, staleness_verdict, tally_verdicts
from tests.support.metrics import JOB, exported
from tests.support.reducer_scenario import Job, T, join


@pytest.mark.parametrize(("max_staleness", "policy", "lag", "verdict"), [
    (None, "drop", 9, Staleness.FRESH),  # unbounded: nothing is stale
    (None, "correct", 9, Staleness.FRESH),
    (1, "drop", 1, Staleness.FRESH),  # at the bound: fresh
    (1, "drop", 2, Staleness.DROPPED),
    (1, "correct", 1, Staleness.FRESH),
    (1, "correct", 2, Staleness.CORRECTED),
    (0, "correct", 1, Staleness.CORRECTED),
])
def test_the_verdict_on_an_experience_by_its_lag(max_staleness, policy, lag, verdict):
    cfg = SyncConfig(max_staleness=max_staleness, staleness_policy=StalenessPolicy(policy))
    assert staleness_verdict(10 - lag, 10, cfg) is verdict


def test_the_policy_on_the_wire_is_left_out_at_its_default():
    assert "staleness_policy" not in SyncConfig(max_staleness=1).to_mapping()  # earlier builds read it
    keep = SyncConfig.from_mapping({"max_staleness": 1, "staleness_policy": "Correct"})
    assert keep.staleness_policy is StalenessPolicy.CORRECT
    assert SyncConfig.from_mapping(keep.to_mapping()) == keep
    with pytest.raises(ConfigError, match=r"synchronizer\.staleness_policy: must be one of \['drop', 'correct'\]"):
        SyncConfig.from_mapping({"staleness_policy": "keep"})


def _job(**synchronizer) -> dict:
    return {"job": "stale", "model": {"engine": "tiny"}, "synchronizer": {"sync_method": "memory", **synchronizer}}


def test_correct_needs_a_bound_to_apply_to():
    with pytest.raises(ConfigError, match="correct applies to experiences past synchronizer.max_staleness"):
        parse_config(_job(staleness_policy="correct"), check_engines=False)


def test_correct_needs_the_off_policy_correction():
    with pytest.raises(ConfigError, match="add algorithm.rollout_correction"):
        parse_config(_job(max_staleness=1, staleness_policy="correct"))
    hf = parse_config({"job": "stale", "model": {"engine": "hf", "path": "m"},
                       "synchronizer": {"sync_method": "memory", "max_staleness": 1, "staleness_policy": "correct"},
                       "algorithm": {"rollout_correction": {"rollout_is": "token"}}}, check_engines=False)
    assert config_rules._correction_problems(hf) == []


def test_stale_experiences_kept_are_counted_in_the_summary_and_metrics():
    config = SyncConfig(sync_method=SyncMethod.MEMORY, max_staleness=1, staleness_policy=StalenessPolicy.CORRECT)
    job = Job()
    for event in (JobConfigured(member=T, config=config), join(T),
                  StepFinished(member=T, step=1, version=0, metrics={
                      "num_experiences": 8.0, "corrected_stale": 3.0, "corrected_stale_total": 3.0,
                      "dropped_stale_total": 0.0, "mean_staleness": 1.5}),
                  StepFinished(member=T, step=2, version=1, metrics={
                      "num_experiences": 8.0, "corrected_stale": 2.0, "corrected_stale_total": 5.0,
                      "dropped_stale_total": 0.0, "mean_staleness": 1.0})):
        job.feed(event)
    observer = JobObserver().extend(list(job.history))
    s = observer.summary(job="j")
    assert (s["experiences_corrected_stale"], s["experiences_dropped_stale"], s["experiences_trained"]) == (5, 0, 16)
    dashboard, samples = exported(observer)
    assert samples[("rolectl_trainer_corrected_stale_total", JOB)] == 5
    assert dashboard.snapshot()["staleness"]["corrected_total"] == 5


def _trainer_step(seq: int, tally: StalenessTally) -> Recorded:
    return Recorded(seq=seq, time_ms=seq, event=StepFinished(member=T, step=seq, version=5, staleness=tally))


@pytest.mark.parametrize("policy", ["drop", "correct"])
def test_replay_recomputes_each_steps_staleness_verdicts_from_the_ages_it_recorded(policy):
    cfg = SyncConfig(max_staleness=1, staleness_policy=StalenessPolicy(policy))
    ages = ((0, 5), (1, 2), (2, 3), (4, 1))  # 4 experiences past the bound of 1
    counts = tally_verdicts(ages, cfg)
    assert counts == {Staleness.FRESH: 7, Staleness.DROPPED: 4 if policy == "drop" else 0,
                      Staleness.CORRECTED: 4 if policy == "correct" else 0}
    honest = StalenessTally(ages=ages, dropped=counts[Staleness.DROPPED], corrected=counts[Staleness.CORRECTED])
    lying = StalenessTally(ages=ages, dropped=0, corrected=0)  # a trainer that trained stale data silently
    configured = Recorded(seq=1, time_ms=1, event=JobConfigured(member=T, config=cfg))
    assert check_staleness([configured, _trainer_step(2, honest)]) == []
    [mismatch] = check_staleness([configured, _trainer_step(2, honest), _trainer_step(3, lying)])
    assert (mismatch.kind, mismatch.seq, mismatch.recorded, mismatch.recomputed) == ("verdict", 3, 0, 4)
    assert "step 3 recorded 0 experiences" in mismatch.describe()


def test_a_step_with_its_staleness_tally_round_trips_and_one_without_is_unchanged_on_the_wire():
    tally = StalenessTally(ages=((0, 3), (2, 1)), dropped=1)
    step = StepFinished(member=T, step=4, version=3, staleness=tally)
    assert decode(encode(step)) == step
    assert "staleness" not in to_plain(StepFinished(member=T, step=4, version=3))  # earlier builds read it
