"""Scenario helpers for the reducer's tests: event builders, a stepping job, and one-line summaries.

A test feeds a job one input at a time and compares, after each step, the whole relevant state (a
one-line `snapshot`) and the exact decisions (one line each, `describe`). Fields that one line leaves
out are checked on every step by `Job.feed` itself: each decision's `cause_seq`, a RoundOpened's time
and method, a release's location/digest/size, and that every decision survives the codec.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rolectl.sync_protocol import (
    Decision,
    JobConfigured,
    MemberExpired,
    MemberJoined,
    MemberRef,
    MemberReleased,
    NoNewVersion,
    Recorded,
    ReleaseReason,
    RendezvousReady,
    Role,
    RoundClosed,
    RoundOpened,
    RoundTimedOut,
    RunningStatus,
    State,
    StatusChanged,
    StepFinished,
    SyncConfig,
    SyncFailed,
    SyncMethod,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
    decode,
    encode,
    reduce,
)
from rolectl.sync_protocol.describe import Phrasebook
from rolectl.sync_protocol.state import RoundPhase

__all__ = [
    "T", "E1", "E2", "E3", "SYNC", "RDV", "T_AGAIN", "E1_AGAIN", "E2_AGAIN",
    "configured", "join", "req", "run", "stop", "publish", "loaded", "broadcast", "failed",
    "no_new", "step_done", "expired", "timed_out",
    "Job", "snapshot", "describe", "run_script",
]

T = MemberRef(role=Role.TRAINER, id="t", incarnation=0)
E1 = MemberRef(role=Role.EXPLORER, id="e1", incarnation=0)
E2 = MemberRef(role=Role.EXPLORER, id="e2", incarnation=0)
E3 = MemberRef(role=Role.EXPLORER, id="e3", incarnation=0)
SYNC = MemberRef(role=Role.SYNCHRONIZER, id="sync", incarnation=0)
# the same members restarted: their next incarnation
T_AGAIN = MemberRef(role=Role.TRAINER, id="t", incarnation=1)
E1_AGAIN = MemberRef(role=Role.EXPLORER, id="e1", incarnation=1)
E2_AGAIN = MemberRef(role=Role.EXPLORER, id="e2", incarnation=1)
RDV = "10.0.0.1:29500"  # the trainer's offered rendezvous


# ------------------------------------------------------------------------------------------------
# event builders (short, so scripts read as a timeline)


def configured(cfg: SyncConfig, by: MemberRef = T) -> JobConfigured:
    return JobConfigured(member=by, config=cfg)


def join(ref: MemberRef, version: int | None = None, step: int = 0, ranks: int = 1) -> MemberJoined:
    if version is None:
        version = 0 if ref.role is Role.TRAINER else -1
    return MemberJoined(member=ref, host=f"host-{ref.id}", pid=100, step=step, version=version,
                        ranks=ranks)


def req(ref: MemberRef, step: int, version: int, rendezvous: str | None = None) -> StatusChanged:
    if rendezvous is None and ref.role is Role.TRAINER:
        rendezvous = RDV
    return StatusChanged(member=ref, status=RunningStatus.REQUIRE_SYNC, step=step, version=version,
                         rendezvous=rendezvous)


def run(ref: MemberRef, step: int, version: int) -> StatusChanged:
    return StatusChanged(member=ref, status=RunningStatus.RUNNING, step=step, version=version)


def stop(ref: MemberRef, step: int, version: int) -> StatusChanged:
    """A STOPPED that is not final: Ctrl-C or a crash-time cleanup; a restart may follow."""
    return StatusChanged(member=ref, status=RunningStatus.STOPPED, step=step, version=version)


def finish(ref: MemberRef, step: int, version: int) -> StatusChanged:
    """The member's last STOPPED: its work is done (the trainer trained its last step)."""
    return StatusChanged(member=ref, status=RunningStatus.STOPPED, step=step, version=version, final=True)


def publish(version: int, method: SyncMethod = SyncMethod.MEMORY, by: MemberRef = T) -> VersionPublished:
    return VersionPublished(member=by, version=version, step=version, method=method,
                            location=f"weights/v{version}", nbytes=1000 + version,
                            digest=f"sha256:{version:04d}")


def loaded(ref: MemberRef, version: int, round: int | None = None) -> WeightsLoaded:
    return WeightsLoaded(member=ref, version=version, round=round, nbytes=1000, seconds=0.5)


def broadcast(version: int, round: int, by: MemberRef = T) -> WeightsBroadcast:
    return WeightsBroadcast(member=by, version=version, round=round, nbytes=1000, seconds=0.5)


def failed(ref: MemberRef, version: int, round: int | None) -> SyncFailed:
    return SyncFailed(member=ref, version=version, round=round, reason="nccl: connection reset")


def no_new(version: int, step: int, by: MemberRef = T) -> NoNewVersion:
    return NoNewVersion(member=by, version=version, step=step)


def step_done(ref: MemberRef, step: int, version: int, **metrics: float) -> StepFinished:
    return StepFinished(member=ref, step=step, version=version, metrics=metrics)


def expired(ref: MemberRef) -> MemberExpired:
    return MemberExpired(member=SYNC, expired=ref, silent_for=6.0)


def timed_out(round: int) -> RoundTimedOut:
    return RoundTimedOut(member=SYNC, round=round)


# ------------------------------------------------------------------------------------------------
# one-line summaries


def _ids(keys: Iterable[str]) -> str:
    return ",".join(k.split("/", 1)[1] for k in keys)


def snapshot(state: State) -> str:
    """Members (status@version), latest version, group epoch and open rounds, on one line.

    A member that left shows as `stopped@v` or `expired@v`. A rendezvous round shows who is waiting
    and `/of[...]` everyone it expects; a transferring one its version and who reported.
    """
    members = []
    for m in state.members.values():
        if m.alive:
            status = m.status.value
        else:
            status = "stopped" if m.status is RunningStatus.STOPPED else "expired"
        members.append(f"{m.ref.id}={status}@{m.version}")
    rounds = []
    for r in state.rounds.values():
        if r.phase is RoundPhase.WAITING:
            text = f"r{r.id}:waiting[{_ids(r.waiting)}]"
        else:
            text = f"r{r.id}:transferring@{r.version}[reported:{_ids(r.reported)}]"
        if r.method.is_rendezvous:
            text += f"/of[{_ids(r.participants)}]"
        rounds.append(text)
    group = f"epoch={state.group.epoch}{'!broken' if state.group.broken else ''}"
    return (f"{' '.join(members) or '-'} | latest={state.latest.version} | {group} | "
            f"{' '.join(rounds) or '-'}")


def _ready(d: RendezvousReady) -> str:
    ranks = " ".join(f"{p.member.id}:{p.rank_offset}+{p.ranks}" for p in d.participants)
    return (f"ready r{d.round} @{d.version} epoch={d.epoch} world={d.world_size} {ranks} "
            f"at {d.master_addr}:{d.master_port}")


# A decision on one line (cause_seq and the fields Job.feed checks itself left out): the core's
# phrasebook with the scripts' short notation, so a timeline reads as one line per decision.
describe = Phrasebook({
    RoundOpened: lambda d: f"opened r{d.round} by {d.opened_by.id} @{d.version}",
    MemberReleased: lambda d: (f"released r{d.round} {d.released.id} {d.reason.value} @{d.version}"
                               f"{' reload' if d.reload else ''}"),
    RoundClosed: lambda d: f"closed r{d.round} {d.outcome.value}",
    RendezvousReady: _ready,
})


# ------------------------------------------------------------------------------------------------
# a job that steps through inputs


class Job:
    """Folds inputs one at a time with increasing seq/time, checking every decision's plumbing."""

    def __init__(self, state: State | None = None):
        self.state = state if state is not None else State.initial()
        self.seq = 0
        self.time_ms = 1_000_000
        self.history: list[Recorded] = []

    def record(self, event) -> Recorded:
        self.seq += 1
        self.time_ms += 250
        rec = Recorded(seq=self.seq, time_ms=self.time_ms, event=event)
        self.history.append(rec)
        return rec

    def feed(self, event) -> tuple[Decision, ...]:
        rec = self.record(event)
        self.state, decisions = reduce(self.state, rec)
        for d in decisions:
            assert d.cause_seq == rec.seq, d
            assert decode(encode(d)) == d, d  # built without validation: the codec validates it
            if isinstance(d, RendezvousReady):
                # its group is not on the wire: a reader that folded the same records binds it
                assert self.state.group.bind(decode(encode(d))).participants == d.participants, d
            if isinstance(d, RoundOpened):
                assert d.opened_at_ms == rec.time_ms
                assert d.method is self.state.config.sync_method
            if isinstance(d, MemberReleased):
                latest = self.state.latest
                if d.reason is ReleaseReason.NEW_VERSION:
                    assert (d.location, d.digest, d.nbytes) == (latest.location, latest.digest,
                                                                latest.nbytes), d
                else:
                    assert (d.location, d.digest, d.nbytes, d.reload) == (None, None, 0, False), d
        return decisions

    def lines(self, event) -> list[str]:
        return [describe(d) for d in self.feed(event)]


Step = tuple[object, Sequence[str], str]


def run_script(script: Sequence[Step], job: Job | None = None) -> Job:
    """Feed each (input, expected decision lines, expected snapshot) in turn and compare both."""
    job = job or Job()
    for index, (event, expected_lines, expected_snapshot) in enumerate(script, 1):
        where = f"step {index} ({type(event).__name__})"
        got = job.lines(event)
        assert got == list(expected_lines), f"{where}: decisions\n got {got}\nwant {list(expected_lines)}"
        state = snapshot(job.state)
        assert state == expected_snapshot, f"{where}: state\n got {state}\nwant {expected_snapshot}"
    return job
