"""The job's figures for Prometheus (`/metrics`), read from the dashboard's observer at scrape time.

`JobCollector` is a prometheus-client custom collector: each scrape turns the `JobObserver`'s fold and
the last server poll into metric families, so there are no metric objects to keep in step with the
stream. Names start `rolectl_`, and every family has a `job` label.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rolectl.roles.observe.observer import JobObserver, mismatch_view, pace_view

if TYPE_CHECKING:
    from rolectl.roles.observe.dashboard import Dashboard

__all__ = ["JobCollector", "agent_metrics"]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class JobCollector:
    """Reads the dashboard's model at scrape time (no metric objects to keep in step)."""

    def __init__(self, dashboard: Dashboard):
        self.d = dashboard

    def collect(self):
        obs, job = self.d.observer, self.d.job
        yield from _member_metrics(obs, job, _now_ms())
        yield from _sync_metrics(obs, job)
        yield from _trainer_metrics(obs, job)
        yield from agent_metrics(obs, job)
        yield from _stream_metrics(obs, job)
        yield from _nats_metrics(self.d.nats, job)


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"rolectl_{name}", doc, labels=("job", *labels))


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(f"rolectl_{name}", doc, labels=("job", *labels))


def _member_metrics(obs: JobObserver, job: str, now: int):
    labels = ("role", "member")
    step = _gauge("member_step", "Last step a member reported", labels)
    version = _gauge("member_version", "Weights version a member holds (-1: none yet)", labels)
    alive = _gauge("member_alive", "1 while a member is in the job (not stopped or expired)", labels)
    status = _gauge("member_status", "1 for the member's current status", (*labels, "status"))
    seen = _gauge("member_last_seen_seconds", "Seconds since a member's last event or heartbeat", labels)
    total = _gauge("member_total_steps", "Steps a member runs in all (as it reports them)", labels)
    fraction = _gauge("member_progress_ratio", "Steps done / total steps of a member (0..1)", labels)
    for row in obs.members(now):
        lv = (job, row["role"], row["id"])
        step.add_metric(lv, row["step"])
        version.add_metric(lv, row["version"])
        alive.add_metric(lv, 1 if row["alive"] else 0)
        status.add_metric((*lv, row["status"]), 1)
        if row["last_seen_ago_ms"] is not None:
            seen.add_metric(lv, row["last_seen_ago_ms"] / 1000)
        if row["total_steps"]:
            total.add_metric(lv, row["total_steps"])
            fraction.add_metric(lv, row["fraction"])
    yield from (step, version, alive, status, seen, total, fraction)


def _sync_metrics(obs: JobObserver, job: str):
    """Versions published, rounds open and closed, and the weight bytes the rounds moved."""
    state = obs.state
    latest = _gauge("latest_version", "Newest weights version the trainer published")
    latest.add_metric((job,), state.latest.version)
    yield latest
    published = _counter("versions_published", "Weights versions published")
    published.add_metric((job,), state.versions_published)
    yield published

    rounds_open = _gauge("sync_rounds_open", "Sync rounds open now")
    rounds_open.add_metric((job,), len(state.rounds))
    yield rounds_open
    closed = _counter("sync_rounds_closed", "Sync rounds closed, by outcome", ("outcome",))
    last_closed = None
    for r in obs.rounds.values():
        if r.outcome is not None:
            last_closed = r
    # a counter never goes down: every round closed since the start, not the kept ones only
    for outcome, n in sorted(obs.round_outcomes.items()):
        closed.add_metric((job, outcome), n)
    yield closed
    if last_closed is not None and last_closed.duration_ms is not None:
        duration = _gauge("sync_round_last_duration_seconds", "Open-to-close time of the last closed round")
        duration.add_metric((job,), last_closed.duration_ms / 1000)
        yield duration
    moved = _counter("sync_bytes", "Weight bytes loaded by explorers")
    moved.add_metric((job,), obs.bytes_loaded_total)
    yield moved
    rate = next((r.gbps for r in reversed(obs.rounds.values()) if r.gbps), None)
    if rate is not None:
        g = _gauge("sync_last_gbps", "Aggregate GB/s of the last round that moved weights")
        g.add_metric((job,), rate)
        yield g


def _trainer_metrics(obs: JobObserver, job: str):
    if obs.reward:
        g = _gauge("trainer_reward_mean", "reward_mean of the trainer's last step")
        g.add_metric((job,), obs.reward[-1][1])
        yield g
    if obs.staleness:
        _, mean, dropped = obs.staleness[-1]
        g = _gauge("trainer_mean_staleness", "Mean staleness (versions) of the last train batch")
        g.add_metric((job,), mean)
        yield g
        c = _counter("trainer_dropped_stale", "Experiences the trainer dropped as too stale")
        c.add_metric((job,), dropped)
        yield c
        c = _counter("trainer_corrected_stale", "Experiences past max_staleness trained with the correction")
        c.add_metric((job,), obs.corrected_stale)
        yield c
    if obs.groups_filtered.total:
        c = _counter("explorer_groups_filtered", "Groups of equal rewards dynamic sampling filtered")
        c.add_metric((job,), obs.groups_filtered.total)
        yield c
    yield from _pace_metrics(obs, job)
    yield from _mismatch_metrics(obs, job)


def _pace_metrics(obs: JobObserver, job: str):
    """The explorers paused for running ahead of the trainer (`synchronizer.max_ahead`), and the pauses."""
    view = pace_view(obs)
    paused = _gauge("explorers_paused", "Explorers paused now for running ahead of the trainer (max_ahead)")
    paused.add_metric((job,), len(view["paused"]))
    pauses = _counter("explorer_pauses", "Explorer pauses for running ahead of the trainer (max_ahead)")
    pauses.add_metric((job,), view["pauses"])
    yield from (paused, pauses)


def _mismatch_metrics(obs: JobObserver, job: str):
    """The rollout/trainer logprob gap of the trainer's last step and its alarm (rollout_correction)."""
    view = mismatch_view(obs)
    for key, name, doc in (("k3_kl", "trainer_rollout_k3_kl", "k3 KL of the sampler's logprobs to the trainer's, "
                                                               "last step"),
                           ("log_gap_max", "trainer_rollout_log_gap_max",
                            "Largest |trainer - sampler| token logprob gap, last step")):
        if view[key] is not None:
            g = _gauge(name, doc)
            g.add_metric((job,), view[key])
            yield g
    alarm = _gauge("trainer_mismatch_alarm", "1 when the trainer's last step passed the rollout/trainer gap alarm")
    alarm.add_metric((job,), 1 if view["alarm"] else 0)
    alarms = _counter("trainer_mismatch_alarms", "Trainer steps that passed the rollout/trainer gap alarm")
    alarms.add_metric((job,), view["alarms"])
    yield from (alarm, alarms)


def agent_metrics(obs: JobObserver, job: str):
    """An agent job's episodes, turns, tool calls, environment errors and trained tokens (none else)."""
    agent = obs.agent.summary()
    if agent is None:
        return
    for name, doc in (("episodes", "Episodes the explorers played"), ("truncated", "Episodes cut at max_turns or "
                      "the token budget")):
        c = _counter(f"agent_{name}", doc)
        c.add_metric((job,), agent[name])
        yield c
    turns = _gauge("agent_turns_mean", "Model turns per episode, over the whole job")
    turns.add_metric((job,), agent["turns_mean"])
    yield turns
    calls = _counter("agent_tool_calls", "Tool calls, by tool and outcome", ("tool", "outcome"))
    for tool, outcomes in agent["tool_calls"].items():
        for outcome, n in outcomes.items():
            calls.add_metric((job, tool, outcome), n)
    yield calls
    errors = _counter("agent_env_errors", "Episodes an environment cost, by reason", ("reason",))
    for reason, n in agent["env_errors"].items():
        errors.add_metric((job, reason), n)
    yield errors
    if agent["trained_tokens"] is not None:
        trained = _counter("trainer_trained_tokens", "Sampled tokens the trainer trained on")
        trained.add_metric((job,), agent["trained_tokens"])
        yield trained


def _stream_metrics(obs: JobObserver, job: str):
    records = _counter("stream_records", "Records (events and decisions) the dashboard folded")
    records.add_metric((job,), obs.records)
    yield records
    illegal = _counter("illegal_events", "Inputs the reducer refused (skipped)")
    illegal.add_metric((job,), obs.illegal_total)
    yield illegal
    last_seq = _gauge("stream_last_seq", "Last stream sequence folded")
    last_seq.add_metric((job,), obs.state.last_seq)
    yield last_seq


def _nats_metrics(nats: dict, job: str):
    """The nats-server's health as the dashboard last polled it."""
    up = _gauge("nats_up", "1 when the nats-server monitoring endpoint answered the last poll")
    up.add_metric((job,), 1 if nats.get("ok") else 0)
    yield up
    if not nats.get("ok"):
        return
    server = nats["server"]
    for key, doc, cls in (("connections", "Client connections", _gauge),
                          ("slow_consumers", "Slow consumers", _counter),
                          ("in_msgs", "Messages received by the server", _counter),
                          ("out_msgs", "Messages sent by the server", _counter),
                          ("in_bytes", "Bytes received by the server", _counter),
                          ("out_bytes", "Bytes sent by the server", _counter)):
        if server.get(key) is not None:
            m = cls(f"nats_{key}", doc)
            m.add_metric((job,), server[key])
            yield m
    msgs = _gauge("nats_stream_messages", "Messages stored in a stream", ("stream",))
    size = _gauge("nats_stream_bytes", "Bytes stored in a stream", ("stream",))
    for s in nats["streams"]:
        msgs.add_metric((job, s["name"]), s["messages"])
        size.add_metric((job, s["name"]), s["bytes"])
    yield from (msgs, size)
    storage = _gauge("nats_jetstream_storage_bytes", "JetStream file storage in use")
    storage.add_metric((job,), nats["jetstream"].get("storage") or 0)
    yield storage


# --------------------------------------------------------------------------------------------------
# HTTP
