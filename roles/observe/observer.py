"""The one fold of a job's recorded stream for everyone who watches it: `rolectl status`, `rolectl
replay`, `rolectl up`'s progress and summary, and the dashboard all read a `JobObserver`.

Theory of operation
-------------------
`JobObserver.apply(recorded)` takes the job's records one at a time, in stream order. Inputs are
folded with the pure reducer, skipping illegal ones exactly as the synchronizer does (they are
counted and kept with their reason). Recorded decisions build the sync rounds as they happened:
who opened a round, whom it waited for (taken from the reducer's own round state when the round
opened), every release, the outcome and its server times. Weight transfers (`WeightsLoaded`,
`WeightsBroadcast`) are attached to their round for bytes and GB/s. Nothing here does I/O or reads
a clock; callers pass `now_ms` where "how long ago" is wanted.

"A sync" means one thing here and everywhere it is shown: a round the reducer closed as
`completed`. Every other count has its own name (rounds by outcome, weight loads, sync waits), and
`views.SUMMARY_MEANINGS` says in words what each figure of the run summary counts. What the fold
builds (rounds, versions, transfers, log lines) and the rows it is shown in are in `views`.
"""

from __future__ import annotations

import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from typing import Any

from rolectl.roles.observe.views import (
    JobOutcome,
    LogLine,
    RoundView,
    Transfer,
    VersionView,
    member_rows,
    percentile,
)
from rolectl.sync_protocol import (
    Decision,
    EvalFinished,
    Event,
    IllegalEvent,
    MemberReleased,
    Recorded,
    RendezvousReady,
    Role,
    RoundClosed,
    RoundOpened,
    RoundOutcome,
    RoundPhase,
    RunningStatus,
    State,
    StatusChanged,
    StepFinished,
    StepsRolledBack,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
    decision_identity,
)
from rolectl.sync_protocol.describe import in_words
from rolectl.sync_protocol.reducer import reduce_lenient

__all__ = ["JobObserver", "StepCounts", "AgentCounts", "pace_view", "mismatch_view", "MISMATCH_ALARM"]


class StepCounts:
    """A total of per-step counts where a step reported again (a restart repeats the step after
    its last save) counts once, with its latest figure. Bounded: only the newest `window` steps of
    each member are remembered; a repeat is always one of them."""

    def __init__(self, window: int = 64):
        self.total = 0
        self._window = window
        self._recent: dict[str, OrderedDict[int, int]] = {}

    def add(self, member: str, step: int, n: int) -> None:
        recent = self._recent.setdefault(member, OrderedDict())
        if step in recent:
            self.total += n - recent[step]
            recent[step] = n
            return
        if recent and step < next(iter(recent)):
            return  # older than the window: a repeat of a step counted long ago
        self.total += n
        recent[step] = n
        while len(recent) > self._window:
            recent.popitem(last=False)

    def roll_back(self, member: str, to_step: int) -> None:
        """`member` went back to `to_step`: what its later steps counted no longer counts (a step
        trained again is counted by its new figure)."""
        recent = self._recent.get(member, OrderedDict())
        for step in [s for s in recent if s > to_step]:
            self.total -= recent.pop(step)

    def size(self) -> int:
        """How many step figures are remembered (for the bound's test)."""
        return sum(len(r) for r in self._recent.values())


class AgentCounts:
    """An agent job's figures, totalled like `StepCounts` (a step reported twice counts once): the
    explorers' `agent/*` step metrics (episodes, turns, truncated, `tool_calls/<tool>/<outcome>`,
    `env_errors/<reason>`, and any other count an environment reports) and the trainer's
    `trained_tokens` / `masked_tokens`. Bounded: one total per metric name, names set by the job."""

    _TRAINER = ("trained_tokens", "masked_tokens")

    def __init__(self) -> None:
        self.totals: dict[str, StepCounts] = {}

    def add(self, event: StepFinished) -> None:
        if event.member.role is Role.EXPLORER:
            keys = [k for k in event.metrics if k.startswith("agent/") and k != "agent/turns_mean"]
        elif event.member.role is Role.TRAINER:
            keys = [k for k in self._TRAINER if k in event.metrics]
        else:
            return
        for key in keys:
            self.totals.setdefault(key, StepCounts()).add(event.member.id, event.step, round(event.metrics[key]))

    def total(self, key: str) -> int | None:
        return self.totals[key].total if key in self.totals else None

    def summary(self) -> dict[str, Any] | None:
        """The `agent` block of the run summary (None for a job that played no episode)."""
        episodes = self.total("agent/episodes")
        if not episodes:
            return None
        tool_calls: dict[str, dict[str, int]] = {}
        env_errors: dict[str, int] = {}
        counts: dict[str, int] = {}
        for key in sorted(self.totals):
            name = key.removeprefix("agent/")
            parts = name.split("/")
            if parts[0] == "tool_calls" and len(parts) == 3:
                tool_calls.setdefault(parts[1], {})[parts[2]] = self.totals[key].total
            elif parts[0] == "env_errors" and len(parts) == 2:
                env_errors[parts[1]] = self.totals[key].total
            elif key.startswith("agent/") and name not in ("episodes", "turns", "truncated"):
                counts[name] = self.totals[key].total
        return {"episodes": episodes, "turns_mean": round((self.total("agent/turns") or 0) / episodes, 4),
                "truncated": self.total("agent/truncated") or 0, "tool_calls": tool_calls, "env_errors": env_errors,
                "trained_tokens": self.total("trained_tokens"), "masked_tokens": self.total("masked_tokens"),
                **({"counts": counts} if counts else {})}

    def size(self) -> int:
        return sum(c.size() for c in self.totals.values())


class StageFigures:
    """A trainer-only stage's figures from its trainer's steps (`<stage>/epoch`, `/tokens`, `/rows`,
    `/eval_loss`, `/eval/<reward>` beside `loss` and `lr`, and the stage's own: DPO's
    `dpo/reward_margin`, `dpo/accuracy`, ... and their `dpo/eval_<figure>`): its name, the loss at
    the start and the end, how much was trained, its own figures at the last step, and the evals.
    Bounded like the observer's other series."""

    _COUNTS = ("epoch", "tokens", "rows", "loss")  # reported apart from the stage's own figures

    def __init__(self, max_points: int) -> None:
        self.name: str | None = None
        self.loss: deque[tuple[int, float]] = deque(maxlen=max_points)  # (step, loss)
        self.loss_first: list[float] = []
        self.evals: deque[dict[str, Any]] = deque(maxlen=max_points)
        self.last: dict[str, float] = {}

    @staticmethod
    def stage_of(metrics: Any) -> str | None:
        """The stage a trainer's step figures are of (the `<stage>/epoch` it reports), else None."""
        return next((key[:-len("/epoch")] for key in metrics if key.endswith("/epoch")), None)

    def add(self, name: str, step: int, metrics: Any) -> None:
        self.name, self.last = name, dict(metrics)
        self.loss.append((step, float(metrics.get("loss", 0.0))))
        if len(self.loss_first) < 5:
            self.loss_first.append(float(metrics.get("loss", 0.0)))
        prefix = f"{name}/eval"
        figures = {k[len(prefix) + 1:]: v for k, v in metrics.items() if k.startswith(prefix + "/")}
        own = {k[len(prefix) + 1:]: v for k, v in metrics.items()
               if k.startswith(prefix + "_") and k != f"{prefix}_loss"}  # dpo/eval_accuracy -> accuracy
        if f"{prefix}_loss" in metrics or figures:
            self.evals.append({"step": step, "loss": metrics.get(f"{prefix}_loss"), "rewards": figures,
                               "figures": own})

    def own_figures(self) -> dict[str, float]:
        """The stage's own figures at its last step (`dpo/reward_margin` -> `reward_margin`)."""
        prefix = f"{self.name}/"
        return {k[len(prefix):]: round(v, 4) for k, v in sorted(self.last.items())
                if k.startswith(prefix) and "/" not in k[len(prefix):] and not k[len(prefix):].startswith("eval")
                and k[len(prefix):] not in self._COUNTS}

    def summary(self) -> dict[str, Any]:
        last = [loss for _, loss in list(self.loss)[-5:]]
        name = self.name
        return {"name": name, "epochs": round(self.last.get(f"{name}/epoch", 0.0), 4),
                "rows_trained": int(self.last.get(f"{name}/rows", 0)),
                "tokens_trained": int(self.last.get(f"{name}/tokens", 0)),
                "loss_first": round(statistics.fmean(self.loss_first), 4) if self.loss_first else None,
                "loss_last": round(statistics.fmean(last), 4) if last else None,
                **({"last": self.own_figures()} if self.own_figures() else {}),
                "eval": [{"step": e["step"], "loss": None if e["loss"] is None else round(e["loss"], 4),
                          "rewards": {k: round(v, 4) for k, v in e["rewards"].items()},
                          **({"figures": {k: round(v, 4) for k, v in e["figures"].items()}}
                             if e["figures"] else {})} for e in self.evals]}


# the serve-mode figures of `summary()` (see views.SUMMARY_MEANINGS)
_SERVED = ("served_requests", "rewarded", "expired")

MISMATCH_ALARM = "rollout_corr/mismatch_alarm"
"""The trainer's step metric that is 1 when the step's rollout/trainer logprob gap passed
`algorithm.rollout_correction.alarm_kl` (`roles.engines.algorithms.MISMATCH_ALARM`; a test keeps
the two equal: this module loads no engine)."""

_CAUSE_TIMES_KEPT = 20_000
"""Server times of the newest inputs kept, to time the decisions they cause (a decision's cause is
among the last few hundred records even with 64 explorers)."""


class JobObserver:
    """Folds a job's records into what people want to see. Pure: no I/O, no clock.

    `apply_computed=True` builds rounds from the reducer's own decisions instead of recorded ones
    (for recordings that hold inputs only). Bounded: at most `max_rounds` rounds, `max_points`
    points per series and `log_tail` log lines are kept (rolling windows), beside totals for the
    run's counts, so a dashboard or `up` can follow a job of any length; what grows is per member,
    never per step (`size()` says how much is held).
    """

    def __init__(self, *, apply_computed: bool = False, log_tail: int = 200, max_rounds: int = 2000,
                 max_points: int = 5000, start: State | None = None):
        self.apply_computed = apply_computed
        self.state = start or State.initial()  # a reducer snapshot, for a stream trimmed before it
        self.rounds: OrderedDict[int, RoundView] = OrderedDict()
        self.versions: deque[VersionView] = deque(maxlen=max_points)
        self.log: deque[LogLine] = deque(maxlen=log_tail)
        self.illegal: deque[tuple[int, str]] = deque(maxlen=max_points)
        self.illegal_total = 0
        self.records = 0
        self.decisions_recorded = 0
        self.first_time_ms: int | None = None
        self.last_time_ms: int | None = None
        self.reward: deque[tuple[int, float, int]] = deque(maxlen=max_points)  # (step, reward, time)
        self.staleness: deque[tuple[int, float, float]] = deque(maxlen=max_points)  # (step, mean, dropped)
        self.background_transfers: deque[Transfer] = deque(maxlen=max_points)
        self.evals: deque[dict[str, Any]] = deque(maxlen=max_points)  # EvalFinished, in stream order
        self.bytes_loaded_total = 0
        # what the trainer sent: each version published (pull) or broadcast (rendezvous) once
        self.bytes_sent_total = 0
        self.versions_sent = 0
        self._last_sent_version = -1
        self.heartbeats: dict[str, int] = {}
        # run figures (what `summary()` reports)
        self.round_outcomes: Counter[str] = Counter()  # outcome -> rounds closed with it
        self.sync_waits: deque[tuple[str, str, int]] = deque(maxlen=max_points)  # (member, answer, ms)
        self.sync_wait_answers: Counter[str] = Counter()  # answer -> waits (all, not only the window)
        self.weight_loads = 0
        self.final_version = 0
        self.trainer_steps = 0
        self.explorer_steps: dict[str, int] = {}
        self.rewards_first: list[tuple[int, float]] = []  # the first five trainer (step, reward)s (the last: `reward`)
        self.trainer_interrupted = False  # the trainer's last STOPPED came from a stop signal
        self.experiences_produced = StepCounts()  # a step reported twice counts once
        self.experiences_trained = StepCounts()
        self.expert_rows_trained = StepCounts()  # demonstrations mixed into RL steps (trainer.expert_data)
        self.stage = StageFigures(max_points)  # a trainer-only stage's (no name: an RL job)
        # serve mode: each serving explorer incarnation's latest traffic counts (they only grow)
        self.served: dict[tuple[str, int], dict[str, float]] = {}
        self.served_times: deque[tuple[int, int]] = deque(maxlen=64)  # (time, served so far), for a rate
        self.dropped_stale = 0
        self.corrected_stale = 0  # past max_staleness, trained with the correction (staleness_policy: correct)
        # dynamic sampling (algorithm.dynamic_sampling): groups of equal rewards explorers did not publish
        self.groups_filtered = StepCounts()
        self.experiences_filtered = StepCounts()
        self.mismatch_alarms = StepCounts()  # trainer steps that raised the rollout/trainer mismatch alarm
        self.tasks_cut = StepCounts()  # tasks over-rollout cut, a step reported twice counts once
        # partial rollouts: weight loads inside a rollout, and experiences two or more versions sampled
        self.rollout_pauses, self.resumed_experiences = StepCounts(), StepCounts()
        self.agent = AgentCounts()  # an agent job's episodes, turns, tool calls, errors, trained tokens
        self._asked_at: dict[str, int] = {}  # explorer key -> time it went require_sync
        # the decisions taken from the message at last_seq: a decision batch gives several records
        # that share its sequence, a reader that restarted gives none of them twice
        self._at_last_seq: set[tuple] = set()
        self._max_rounds = max_rounds
        self._round_info: OrderedDict[int, dict[str, Any]] = OrderedDict()  # round -> reducer's view
        self._tracking: set[int] = set()  # rounds still open in the reducer's state
        self._times: OrderedDict[int, int] = OrderedDict()  # input seq -> server time (recent only)

    # -- feeding ---------------------------------------------------------------------------------

    def apply(self, rec: Recorded) -> IllegalEvent | None:
        """Take the next record (in stream order); returns the reducer's refusal, if any."""
        if rec.seq <= self.state.last_seq and not self._rest_of_batch(rec):
            return None  # already seen (a reader that restarted)
        self.records += 1
        if self.first_time_ms is None:
            self.first_time_ms = rec.time_ms
        self.last_time_ms = rec.time_ms
        event = rec.event
        if isinstance(event, Decision):
            if isinstance(event, RendezvousReady):  # its ranks are the group this fold holds
                event = self.state.group.bind(event)
            self.decisions_recorded += 1
            if rec.seq != self.state.last_seq:
                self._at_last_seq = {decision_identity(event)}
            self.state, _, _ = reduce_lenient(self.state, rec)  # only advances last_seq
            self._log(rec, None)
            if not self.apply_computed:
                self._on_decision(event, rec.seq, rec.time_ms)
            return None
        self._times[rec.seq] = rec.time_ms
        if len(self._times) > _CAUSE_TIMES_KEPT:
            self._times.popitem(last=False)
        self.state, computed, error = reduce_lenient(self.state, rec)
        if error is not None:
            self.illegal_total += 1
            self.illegal.append((rec.seq, str(error)))
        self._log(rec, str(error) if error else None)
        self._note_rounds(computed)
        if self.apply_computed:
            for decision in computed:
                self._on_decision(decision, None, rec.time_ms)
        if error is None:
            self._on_input(event, rec)
        return error

    def _rest_of_batch(self, rec: Recorded) -> bool:
        """`rec` shares the sequence of the last record: the next decision of the same batch, or
        one already seen? (Noted as seen when it is new.)"""
        event = rec.event
        if rec.seq != self.state.last_seq or not isinstance(event, Decision):
            return False
        identity = decision_identity(event)
        if identity in self._at_last_seq:
            return False
        self._at_last_seq.add(identity)
        return True

    def extend(self, records: Iterable[Recorded]) -> JobObserver:
        for rec in records:
            self.apply(rec)
        return self

    def heartbeat(self, key: str, received_ms: int) -> None:
        """A member's heartbeat arrived at `received_ms` (the caller's clock)."""
        self.heartbeats[key] = received_ms

    # -- internals -------------------------------------------------------------------------------

    def _log(self, rec: Recorded, illegal: str | None) -> None:
        event = rec.event
        who = "synchronizer" if isinstance(event, Decision) else event.member.key
        self.log.append(LogLine(seq=rec.seq, time_ms=rec.time_ms, kind=event.KIND, who=who,
                                text=in_words(event), decision=isinstance(event, Decision), illegal=illegal))

    def _note_rounds(self, computed: tuple[Decision, ...]) -> None:
        # The reducer's round state says whom a round waits for; keep it from when the round
        # opened, updated while it stays open (explorers joining or leaving change a rendezvous).
        for decision in computed:
            if isinstance(decision, RoundOpened):
                self._tracking.add(decision.round)
                self._round_info[decision.round] = {"waited_for": [], "participants": [decision.opened_by.key]}
                while len(self._round_info) > self._max_rounds:
                    self._round_info.popitem(last=False)
        for rid in list(self._tracking):
            rnd = self.state.rounds.get(rid)
            if rnd is None:
                self._tracking.discard(rid)  # closed: its last known waiting list stays
                continue
            if rnd.is_rendezvous:
                participants = list(rnd.participants)
                # once everyone arrived (transferring) nobody is waited for any more
                waited_for = ([k for k in rnd.participants if k not in rnd.waiting]
                              if rnd.phase is RoundPhase.WAITING else [])
            else:
                trainer = self.state.trainer or "trainer"
                participants = list(rnd.waiting)
                waited_for = [f"{trainer} (a version newer than v{rnd.version})"]
            info = self._round_info.setdefault(rid, {})
            info["participants"] = participants
            if rnd.is_rendezvous:
                # whom it waited for: the union over its life (members arriving shrink the list)
                waited_for = list(dict.fromkeys([*info.get("waited_for", []), *waited_for]))
            info["waited_for"] = waited_for
            view = self.rounds.get(rid)
            if view is not None:
                view.waited_for, view.participants = list(info["waited_for"]), list(participants)

    def _cause_time(self, seq: int, fallback: int) -> int:
        return self._times.get(seq, fallback)

    def _on_decision(self, d: Decision, seq: int | None, time_ms: int) -> None:
        # `time_ms`: when the decision was recorded (or, recomputed, when its cause was): an
        # explorer waits until the synchronizer answers, not until the reducer could have
        if isinstance(d, RoundClosed):
            self.round_outcomes[d.outcome.value] += 1
        elif isinstance(d, MemberReleased):
            self._answered(d.released.key, d.reason.value, time_ms)
        elif isinstance(d, RendezvousReady):
            for p in (d.participants if d.is_bound else ()):  # unbound: a group this fold never held
                self._answered(p.member.key, "rendezvous", time_ms)
        if isinstance(d, RoundOpened):
            info = self._round_info.get(d.round, {})
            view = RoundView(id=d.round, method=d.method.value, opened_by=d.opened_by.key, version=d.version,
                             opened_seq=d.cause_seq, opened_at_ms=d.opened_at_ms,
                             waited_for=list(info.get("waited_for", [])),
                             participants=list(info.get("participants", [d.opened_by.key])))
            self.rounds[d.round] = view
            while len(self.rounds) > self._max_rounds:
                self.rounds.popitem(last=False)
            return
        view = self.rounds.get(d.round)
        if view is None:
            return  # its opening is before the records we have
        at = self._cause_time(d.cause_seq, time_ms)
        if isinstance(d, MemberReleased):
            view.releases.append({"member": d.released.key, "reason": d.reason.value, "version": d.version,
                                  "reload": d.reload, "cause_seq": d.cause_seq, "seq": seq, "at_ms": at,
                                  "waited_ms": at - view.opened_at_ms})
        elif isinstance(d, RendezvousReady):
            view.rendezvous = {"version": d.version, "epoch": d.epoch, "world_size": d.world_size,
                               "master": f"{d.master_addr}:{d.master_port}", "cause_seq": d.cause_seq,
                               "at_ms": at, "waited_ms": at - view.opened_at_ms,
                               "participants": [p.member.key for p in d.participants] if d.is_bound else []}
            if d.is_bound:
                view.participants = [p.member.key for p in d.participants]
        elif isinstance(d, RoundClosed):
            view.outcome = d.outcome.value
            view.closed_seq = d.cause_seq
            view.closed_at_ms = at

    def _answered(self, key: str, answer: str, time_ms: int) -> None:
        asked = self._asked_at.pop(key, None)
        if asked is not None:
            self.sync_waits.append((key, answer, time_ms - asked))
            self.sync_wait_answers[answer] += 1

    def _on_input(self, event: Event, rec: Recorded) -> None:
        if isinstance(event, (VersionPublished, WeightsLoaded, WeightsBroadcast)):
            self.final_version = max(self.final_version, event.version)
        if isinstance(event, StatusChanged) and event.member.role is Role.EXPLORER:
            if event.status is RunningStatus.REQUIRE_SYNC:
                self._asked_at[event.member.key] = rec.time_ms
            else:
                self._asked_at.pop(event.member.key, None)  # withdrew its ask (gave up, stopped)
        if isinstance(event, StatusChanged) and event.member.role is Role.TRAINER:
            self.trainer_interrupted = event.status is RunningStatus.STOPPED and event.interrupted
        if isinstance(event, StepsRolledBack):
            self._roll_back(event)
        if isinstance(event, StepFinished):
            self._count_step(event)
            if "served_requests" in event.metrics:
                self.served_times.append((rec.time_ms, self.served_total("served_requests")))
        elif (isinstance(event, StatusChanged) and event.member.role is Role.TRAINER
              and event.status is RunningStatus.STOPPED):
            # drops after the trainer's last StepFinished (it stopped while filling a step)
            self.dropped_stale = max(self.dropped_stale, int(event.metrics.get("dropped_stale_total", 0)))
        if isinstance(event, EvalFinished):
            self.evals.append({"version": event.version, "step": event.step, "rewards": dict(event.rewards),
                               "tasks": event.tasks, "responses": event.responses,
                               "seconds": round(event.seconds, 3), "member": event.member.key,
                               "time_ms": rec.time_ms})
        if isinstance(event, VersionPublished):
            self.versions.append(VersionView(version=event.version, step=event.step, method=event.method.value,
                                             nbytes=event.nbytes, seq=rec.seq, time_ms=rec.time_ms))
            self._count_sent(event.version, event.nbytes)
        elif isinstance(event, (WeightsLoaded, WeightsBroadcast)):
            kind = "loaded" if isinstance(event, WeightsLoaded) else "broadcast"
            if kind == "broadcast":
                self._count_sent(event.version, event.nbytes)
            t = Transfer(member=event.member.key, version=event.version, nbytes=event.nbytes,
                         seconds=event.seconds, seq=rec.seq, time_ms=rec.time_ms, kind=kind)
            if kind == "loaded":
                self.bytes_loaded_total += event.nbytes
                self.weight_loads += 1 if event.nbytes > 0 else 0
            view = self.rounds.get(event.round) if event.round is not None else None
            if view is not None:
                view.transfers.append(t)
            elif kind == "loaded" and event.nbytes:
                self.background_transfers.append(t)
        elif isinstance(event, StepFinished) and event.member.role is Role.TRAINER:
            m = event.metrics
            if "reward_mean" in m:
                self.reward.append((event.step, m["reward_mean"], rec.time_ms))
            if "mean_staleness" in m or "dropped_stale_total" in m:
                self.staleness.append((event.step, m.get("mean_staleness", 0.0), m.get("dropped_stale_total", 0.0)))

    def _count_sent(self, version: int, nbytes: int) -> None:
        if version > self._last_sent_version and nbytes > 0:
            self._last_sent_version = version
            self.bytes_sent_total += nbytes
            self.versions_sent += 1

    def size(self) -> int:
        """How many items the observer holds in all (the bound's test watches it)."""
        return (len(self.rounds) + len(self.versions) + len(self.log) + len(self.illegal) + len(self.reward)
                + len(self.staleness) + len(self.background_transfers) + len(self.heartbeats)
                + len(self.sync_waits) + len(self.sync_wait_answers) + len(self.explorer_steps)
                + self.experiences_produced.size() + self.experiences_trained.size() + len(self._asked_at)
                + self.mismatch_alarms.size() + self.groups_filtered.size() + self.experiences_filtered.size()
                + self.expert_rows_trained.size() + len(self.stage.loss) + len(self.stage.evals)
                + len(self._round_info) + len(self._tracking) + len(self._times) + len(self._at_last_seq)
                + len(self.state.members) + len(self.state.rounds) + self.agent.size())

    # -- views -----------------------------------------------------------------------------------

    def members(self, now_ms: int | None = None) -> list[dict[str, Any]]:
        """`views.member_rows`; a synchronizer's row also says what the job's synchronizers decided
        (`decisions` recorded, the `last_round`): it has no step nor version of its own."""
        rows = member_rows(self.state, self.heartbeats, now_ms)
        last_round = max(self.rounds) if self.rounds else None
        for row in rows:
            if row["role"] == Role.SYNCHRONIZER.value:
                row.update(decisions=self.decisions_recorded, last_round=last_round)
        return rows

    def latest(self) -> dict[str, Any]:
        """The newest weights: the last published version, or for rendezvous methods (which move
        weights by broadcast, never publishing) the version the trainer holds."""
        latest = self.state.latest
        trainer = self.state.trainer_state
        version = max(latest.version, trainer.version if trainer else 0)
        holders = [m.key for m in self.state.members.values()
                   if m.ref.role is not Role.SYNCHRONIZER and m.version >= version]
        return {"version": version, "step": latest.step if version == latest.version else trainer.step,
                "method": latest.method.value if latest.method else None, "nbytes": latest.nbytes,
                "location": latest.location, "digest": latest.digest, "held_by": holders}

    def _count_step(self, event: StepFinished) -> None:
        m = event.metrics
        self.agent.add(event)
        if event.member.role is Role.TRAINER:
            self.trainer_steps = max(self.trainer_steps, event.step)
            if "reward_mean" in m and len(self.rewards_first) < 5:
                self.rewards_first.append((event.step, m["reward_mean"]))
            self.experiences_trained.add(event.member.id, event.step, int(m.get("num_experiences", 0)))
            if "expert_rows" in m:
                self.expert_rows_trained.add(event.member.id, event.step, int(m["expert_rows"]))
            stage = StageFigures.stage_of(m)
            if stage is not None:
                self.stage.add(stage, event.step, m)
            self.dropped_stale = max(self.dropped_stale, int(m.get("dropped_stale_total", 0)))
            self.corrected_stale = max(self.corrected_stale, int(m.get("corrected_stale_total", 0)))
            self.mismatch_alarms.add(event.member.id, event.step, 1 if m.get(MISMATCH_ALARM, 0.0) >= 1 else 0)
        elif event.member.role is Role.EXPLORER:
            self.explorer_steps[event.member.id] = max(self.explorer_steps.get(event.member.id, 0), event.step)
            self.experiences_produced.add(event.member.id, event.step, int(m.get("experiences", 0)))
            if "groups_filtered" in m:
                self.groups_filtered.add(event.member.id, event.step, int(m["groups_filtered"]))
                self.experiences_filtered.add(event.member.id, event.step, int(m.get("experiences_filtered", 0)))
            if "over_rollout_tasks_cut" in m:
                self.tasks_cut.add(event.member.id, event.step, int(m["over_rollout_tasks_cut"]))
            if "partial_rollout_pauses" in m:
                self.rollout_pauses.add(event.member.id, event.step, int(m["partial_rollout_pauses"]))
                self.resumed_experiences.add(event.member.id, event.step, int(m["partial_rollout_experiences"]))
            if "served_requests" in m:
                self.served[(event.member.id, event.member.incarnation)] = {k: m.get(k, 0.0) for k in _SERVED}

    def _roll_back(self, event: StepsRolledBack) -> None:
        """The trainer trains `to_step + 1 ..` again: their first figures stop counting, so each
        step is counted once, by the figures of its training that stands."""
        after = event.to_step
        self.trainer_steps = min(self.trainer_steps, after)
        self.rewards_first = [(step, r) for step, r in self.rewards_first if step <= after]
        self.reward = deque((p for p in self.reward if p[0] <= after), maxlen=self.reward.maxlen)
        self.staleness = deque((p for p in self.staleness if p[0] <= after), maxlen=self.staleness.maxlen)
        self.experiences_trained.roll_back(event.member.id, after)
        self.mismatch_alarms.roll_back(event.member.id, after)

    def eval_curve(self) -> list[dict[str, Any]]:
        """The evals as recorded: version, explore step, each reward's mean, tasks, responses."""
        keep = ("version", "step", "rewards", "tasks", "responses", "seconds")
        return [{k: e[k] for k in keep} for e in self.evals]

    def served_total(self, key: str) -> int:
        """A serve-mode count over every serving explorer incarnation (0 when nobody serves)."""
        return int(sum(c[key] for c in self.served.values()))

    def served_view(self) -> dict[str, Any] | None:
        """Served traffic for the dashboard: the counts and requests/s over the last reports."""
        if not self.served:
            return None
        times = list(self.served_times)
        span = (times[-1][0] - times[0][0]) / 1000 if len(times) > 1 else 0.0
        rate = (times[-1][1] - times[0][1]) / span if span > 0 else None
        return {**{key: self.served_total(key) for key in _SERVED}, "per_s": rate}

    def outcome(self) -> JobOutcome:
        """How the job stands or ended, by the trainer's record (only its final STOPPED ends a job)."""
        trainer = self.state.trainer_state
        if trainer is None:
            return JobOutcome("incomplete", "no trainer joined the job")
        if trainer.finished:
            return JobOutcome("complete", f"the trainer finished its last step ({trainer.step})")
        if trainer.alive:
            return JobOutcome("running", f"the trainer is running (step {trainer.step})")
        if trainer.status is RunningStatus.STOPPED and self.trainer_interrupted:
            return JobOutcome("incomplete", f"interrupted: the trainer was stopped (Ctrl-C or SIGTERM) after step "
                                            f"{trainer.step}; a restart resumes it")
        how = ("stopped before its last step (see its log for why)" if trainer.status is RunningStatus.STOPPED
               else "was expired (killed, or cut off) and did not come back")
        return JobOutcome("incomplete", f"the trainer {how}, after step {trainer.step}")

    def summary(self, *, job: str) -> dict[str, Any]:
        """The run's figures (see `SUMMARY_MEANINGS`), from the records alone: a replay gives the same."""
        outcome = self.outcome()
        waits = [ms for _, _, ms in self.sync_waits]
        last = [r for _, r, _ in list(self.reward)[-5:]]
        return {
            "job": job,
            "complete": outcome.complete,
            "end_reason": outcome.reason,
            "trainer_steps": self.trainer_steps,
            "explorer_steps": dict(self.explorer_steps),
            "syncs": self.round_outcomes.get(RoundOutcome.COMPLETED.value, 0),
            "rounds": dict(sorted(self.round_outcomes.items())),
            "weight_loads": self.weight_loads,
            "final_version": self.final_version,
            "reward_first": (round(statistics.fmean(r for _, r in self.rewards_first), 4)
                             if self.rewards_first else None),
            "reward_last": round(statistics.fmean(last), 4) if last else None,
            "weights_bytes_moved": self.bytes_loaded_total,
            "weights_bytes_per_sync": (round(self.bytes_sent_total / self.versions_sent)
                                       if self.versions_sent else None),
            # every experience produced is trained, dropped as too stale, filtered by dynamic sampling
            # (never published), or left untrained: produced after the trainer had what it needed (it
            # stays in the experience stream; a test checks that the stream holds exactly this many at
            # the end of a run)
            "experiences_produced": self.experiences_produced.total,
            "experiences_trained": self.experiences_trained.total,
            "experiences_dropped_stale": self.dropped_stale,
            "experiences_filtered": self.experiences_filtered.total,
            "experiences_left_untrained": (self.experiences_produced.total - self.experiences_trained.total
                                           - self.dropped_stale - self.experiences_filtered.total),
            "experiences_corrected_stale": self.corrected_stale,
            "groups_filtered": self.groups_filtered.total,
            "explorer_pauses": self.state.explorer_pauses,
            "mismatch_alarms": self.mismatch_alarms.total,
            "over_rollout_tasks_cut": self.tasks_cut.total,
            "partial_rollout_pauses": self.rollout_pauses.total,
            "partial_rollout_experiences": self.resumed_experiences.total,
            # percentiles of the newest `max_points` waits; the counts are of every wait
            "sync_wait_ms": {"p50": percentile(waits, 0.5), "p99": percentile(waits, 0.99),
                             "count": sum(self.sync_wait_answers.values()),
                             "by_answer": dict(sorted(self.sync_wait_answers.items()))},
            "eval": [{"version": e["version"], "step": e["step"],
                      "rewards": {k: round(v, 4) for k, v in e["rewards"].items()}, "tasks": e["tasks"]}
                     for e in self.evals],
            **({key: self.served_total(key) for key in _SERVED} if self.served else {}),
            **({"agent": self.agent.summary()} if self.agent.summary() else {}),
            **({"expert_rows_trained": self.expert_rows_trained.total} if self.expert_rows_trained.total else {}),
            **({"stage": self.stage.summary()} if self.stage.name else {}),
            "events": self.records,
        }


def pace_view(obs: JobObserver) -> dict[str, Any]:
    """The explorers paused now for running ahead of the trainer (`synchronizer.max_ahead`), the
    pauses so far, and the tasks behind them: what `rolectl status` and the page flag."""
    state = obs.state
    return {"paused": list(state.paused), "pauses": state.explorer_pauses, "produced": state.tasks_produced,
            "consumed": state.tasks_consumed, "limit": state.ahead_limit()}


def mismatch_view(obs: JobObserver) -> dict[str, Any]:
    """The rollout/trainer logprob gap of the trainer's last step (`algorithm.rollout_correction`),
    whether it raised the mismatch alarm, and the steps that did so far: what `rolectl status` and
    the page flag."""
    trainer = obs.state.trainer_state
    metrics = dict(trainer.metrics) if trainer else {}
    return {"step": trainer.step if trainer else None, "alarm": metrics.get(MISMATCH_ALARM, 0.0) >= 1,
            "alarms": obs.mismatch_alarms.total, "k3_kl": metrics.get("rollout_corr/k3_kl"),
            "log_gap_max": metrics.get("rollout_corr/log_gap_max")}
