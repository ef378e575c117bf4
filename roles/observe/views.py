"""What the job's one fold (`observer.JobObserver`) is made of and how it is shown: sync rounds,
versions, weight transfers and log lines as it builds them, one row per member, the job's
outcome, and what each figure of the run summary counts. Pure: no I/O, no clock."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rolectl.sync_protocol import Role, State

__all__ = [
    "RoundView",
    "Transfer",
    "VersionView",
    "LogLine",
    "JobOutcome",
    "SUMMARY_MEANINGS",
    "member_status",
    "member_rows",
    "member_counts",
    "page_members",
    "MEMBER_STATUSES",
    "progress_text",
    "version_text",
    "format_ago",
    "percentile",
]


@dataclass
class Transfer:
    """One member's part of moving weights: bytes, seconds and the rate they imply."""

    member: str
    version: int
    nbytes: int
    seconds: float
    seq: int
    time_ms: int
    kind: str  # "loaded" (explorer received) or "broadcast" (trainer sent)

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 and self.nbytes > 0 else None


@dataclass
class RoundView:
    """One sync round as it happened (or as far as the records go)."""

    id: int
    method: str
    opened_by: str
    version: int  # the version the opener held when it asked
    opened_seq: int  # stream seq of the input that opened it
    opened_at_ms: int  # server time of that input
    waited_for: list[str] = field(default_factory=list)
    participants: list[str] = field(default_factory=list)
    releases: list[dict[str, Any]] = field(default_factory=list)
    rendezvous: dict[str, Any] | None = None
    outcome: str | None = None
    closed_seq: int | None = None  # stream seq of the input that closed it
    closed_at_ms: int | None = None  # server time of that input
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def duration_ms(self) -> int | None:
        return None if self.closed_at_ms is None else self.closed_at_ms - self.opened_at_ms

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.kind == "loaded")

    @property
    def transfer_seconds(self) -> float | None:
        loaded = [t.seconds for t in self.transfers if t.kind == "loaded" and t.seconds > 0]
        return max(loaded) if loaded else None

    @property
    def gbps(self) -> float | None:
        # Aggregate rate: all bytes received over the slowest receiver's time (they overlap).
        seconds = self.transfer_seconds
        return self.nbytes / seconds / 1e9 if seconds and self.nbytes else None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "method": self.method,
            "opened_by": self.opened_by,
            "version": self.version,
            "opened_seq": self.opened_seq,
            "opened_at_ms": self.opened_at_ms,
            "waited_for": list(self.waited_for),
            "participants": list(self.participants),
            "releases": list(self.releases),
            "rendezvous": self.rendezvous,
            "outcome": self.outcome,
            "closed_seq": self.closed_seq,
            "closed_at_ms": self.closed_at_ms,
            "duration_ms": self.duration_ms,
            "nbytes": self.nbytes,
            "transfer_seconds": self.transfer_seconds,
            "gbps": self.gbps,
            "transfers": [{**asdict(t), "gbps": t.gbps} for t in self.transfers],
        }


@dataclass
class VersionView:
    """A published weights version."""

    version: int
    step: int
    method: str
    nbytes: int
    seq: int
    time_ms: int


@dataclass
class LogLine:
    """One line of the event log: what was recorded, by whom, and whether the reducer refused it."""

    seq: int
    time_ms: int
    kind: str
    who: str
    text: str
    decision: bool
    illegal: str | None = None


def member_status(member) -> str:
    """running / require_sync / stopped / expired (a dead member that did not say STOPPED expired),
    or finished: it stopped for good, its work done (a stopped one may come back)."""
    return "finished" if member.finished else member.condition


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of `values` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass(frozen=True)
class JobOutcome:
    """How a recorded job ended: `complete` (the trainer's final STOPPED after its last step),
    `incomplete` (the trainer is gone without finishing), or `running` (the trainer is alive)."""

    status: str
    reason: str

    @property
    def complete(self) -> bool:
        return self.status == "complete"


# What each figure of `JobObserver.summary()` counts: `rolectl up` prints it beside the figure, so
# no two counts that look alike (syncs, loads, waits) are read as the same thing.
SUMMARY_MEANINGS: dict[str, str] = {
    "syncs": "rounds completed",
    "rounds": "rounds closed, by outcome",
    "weight_loads": "explorer loads with bytes",
    "sync_wait_ms": "explorer ask → answer",
    "weights_bytes_moved": "bytes explorers loaded",
    "weights_bytes_per_sync": "bytes the trainer sent per version",
    "experiences_dropped_stale": "past the staleness bound",
    "experiences_corrected_stale": "past the bound, trained corrected",
    "experiences_filtered": "in groups of equal rewards, unpublished",
    "groups_filtered": "groups dynamic sampling filtered",
    "explorer_pauses": "explorers paused, running ahead",
    "mismatch_alarms": "steps past the rollout/trainer gap alarm",
    "eval": "eval set's reward means, by version",
    "over_rollout_tasks_cut": "tasks a step did not wait for",
    "partial_rollout_pauses": "weight loads inside a rollout",
    "partial_rollout_experiences": "experiences two versions sampled",
    "experiences_left_untrained": "produced, never trained nor dropped",
    "served_requests": "completions served (serve mode)",
    "rewarded": "served trajectories rewarded (trained on)",
    "expired": "served trajectories never rewarded",
    "agent": "episodes, turns, tools, tokens",
    "stage": "a trainer-only stage: loss, rows, evals",
    "expert_rows_trained": "demonstrations trained beside RL",
}


def format_ago(ms: int | None) -> str:
    if ms is None:
        return "never"
    seconds = max(0.0, ms / 1000)
    if seconds < 60:
        return f"{seconds:.1f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min ago"
    return f"{seconds / 3600:.1f} h ago"


MEMBER_STATUSES = ("running", "require_sync", "paused", "finished", "stopped", "expired")
"""Every status a member row can show (see `member_status`; `paused`: an explorer the core paused
for running ahead of the trainer), in the order the counts are shown."""

# Within a role the stragglers come first: gone without finishing (expired, then stopped), then the
# furthest behind in version and step, the silent longest first; those done with their work last.
_STRAGGLING = {"expired": 0, "stopped": 1, "require_sync": 2, "running": 2, "paused": 2, "finished": 3}
_ROLE_ORDER = {Role.TRAINER.value: 0, Role.EXPLORER.value: 1, Role.SYNCHRONIZER.value: 2}


_SILENCE_BUCKET_MS = 5000  # silences are compared in these: members beating as they should keep their order


def _straggler_key(row: dict[str, Any]) -> tuple:
    ago = row["last_seen_ago_ms"]
    silent_for = ago // _SILENCE_BUCKET_MS if ago is not None else float("inf")
    return (_ROLE_ORDER.get(row["role"], 9), _STRAGGLING.get(row["status"], 2), row["version"], row["step"],
            -silent_for, row["id"])


def member_counts(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """How many members of each role are in each status: `{"explorer": {"running": 1000, ...,
    "total": 1024}}`, every status present (0 when none), roles in table order."""
    counts: dict[str, dict[str, int]] = {}
    for row in sorted(rows, key=lambda r: _ROLE_ORDER.get(r["role"], 9)):
        role = counts.setdefault(row["role"], {**dict.fromkeys(MEMBER_STATUSES, 0), "total": 0})
        role[row["status"]] = role.get(row["status"], 0) + 1
        role["total"] += 1
    return counts


def page_members(rows: list[dict[str, Any]], limit: int | None) -> tuple[list[dict[str, Any]], int]:
    """The rows to show and how many are left out: every trainer and synchronizer row, and the first
    `limit` explorers (the stragglers, as `member_rows` orders them); all of them with no limit."""
    if limit is None:
        return rows, 0
    shown, explorers = [], 0
    for row in rows:
        if row["role"] == Role.EXPLORER.value:
            explorers += 1
            if explorers > limit:
                continue
        shown.append(row)
    return shown, len(rows) - len(shown)


def progress_text(row: dict[str, Any]) -> str:
    """A member row's progress for people: `17/50 (34%)` when the member reported its total, else
    its step; for a synchronizer, which has no steps, what was decided (`12 decisions, round 5`)."""
    if row["role"] == Role.SYNCHRONIZER.value:
        if not row.get("decisions"):
            return "—"
        last = row.get("last_round")
        return f"{row['decisions']} decisions" + (f", round {last}" if last is not None else "")
    if row.get("total_steps"):
        return f"{row['step']}/{row['total_steps']} ({row['fraction']:.0%})"
    return str(row["step"])


def version_text(row: dict[str, Any]) -> str:
    """A member row's weights version; "—" for a synchronizer, which holds none."""
    return "—" if row["role"] == Role.SYNCHRONIZER.value else str(row["version"])


def member_rows(state: State, heartbeats: dict[str, int] | None = None, now_ms: int | None = None
                ) -> list[dict[str, Any]]:
    """One row per member: the trainer, the explorers, the synchronizers; within a role the
    stragglers first (gone without finishing, then furthest behind in version and step, the silent
    longest first), those that finished last, then by id. An explorer the core paused for running
    ahead of the trainer (`synchronizer.max_ahead`) is `paused`.

    `heartbeats` maps member key -> server-independent receive time (ms) of its last heartbeat;
    `last_seen_ms` is the later of that and its last recorded event.
    """
    heartbeats = heartbeats or {}
    trainer = state.trainer_state
    latest = max(state.latest.version, trainer.version if trainer else 0)
    rows = []
    for m in state.members.values():
        last_seen = max(m.last_time_ms, heartbeats.get(m.key, 0)) or None
        total = int(m.metrics["total_steps"]) if m.metrics and m.metrics.get("total_steps") else None
        rows.append({
            "key": m.key,
            "role": m.ref.role.value,
            "id": m.ref.id,
            "incarnation": m.ref.incarnation,
            "status": "paused" if m.alive and m.key in state.paused else member_status(m),
            "alive": m.alive,
            "step": m.step,
            "total_steps": total,  # as the member reports it with each step (None before its first)
            "fraction": round(min(m.step / total, 1.0), 4) if total else None,
            "version": m.version,
            "host": m.host,
            "last_seen_ms": last_seen,
            "last_seen_ago_ms": (now_ms - last_seen) if (now_ms is not None and last_seen) else None,
            "has_latest": m.version >= latest and m.ref.role is not Role.SYNCHRONIZER,
            "metrics": dict(m.metrics),
        })
    rows.sort(key=_straggler_key)
    return rows
