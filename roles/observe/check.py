"""Check a recording: every recorded decision must be exactly what the pure reducer recomputes
from the recorded inputs before it.

This is the strongest test of the core: the synchronizer is stateless, so its decisions must be a
pure function of the inputs before them. `check_decisions` folds the recorded inputs with the reducer
(skipping illegal ones as the synchronizer does), lines the recomputed decisions up with the recorded
ones by identity (kind, round, cause_seq, released member) and reports every difference. A record
whose subject does not vouch for its payload (`bus.subjects.identity_problem`: a member speaking for
another, a decision outside `.sync.`) is a failure too, named by its sequence; it is left out of the
fold, as the live reader leaves it out.

The trainer's staleness verdicts are checked the same way: each `StepFinished.staleness` records
how far behind every experience it took was, and the verdicts it acted on; `check_staleness`
recomputes the verdicts from those ages and the job's config (`boundaries.tally_verdicts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rolectl.roles.observe.timeline import verify_subjects
from rolectl.sync_protocol import Decision, JobConfigured, Recorded, StepFinished, decision_identity, to_plain
from rolectl.sync_protocol.boundaries import Staleness, tally_verdicts
from rolectl.sync_protocol.reducer import fold_lenient
from rolectl.sync_protocol.state import State

__all__ = ["Mismatch", "check_decisions", "check_staleness", "decision_identity"]


@dataclass(frozen=True)
class Mismatch:
    """One difference between recorded and recomputed decisions.

    `kind`: "field" (same decision, a field differs), "unexpected" (recorded, never recomputed),
    "missing" (recomputed, never recorded), "order" (both exist, recorded out of their round's order),
    "duplicate" (recorded twice), "subject" (a record whose subject does not vouch for its payload;
    `recorded` says why), "verdict" (a trainer's staleness verdict count the core computes otherwise
    from the ages it recorded; `identity` is ("staleness", step, seq, member)). `seq` is the recorded
    stream sequence (for "missing": the seq of the input that causes it). `warning` is True for a
    decision the recording was plausibly cut before (caused by one of the last inputs, no later
    decision recorded): not a failure.
    """

    kind: str
    seq: int
    identity: tuple[str, int, int, str]
    field: str | None = None
    recorded: Any = None
    recomputed: Any = None
    warning: bool = False

    def describe(self) -> str:
        kind, rnd, cause, released = self.identity
        who = f" for {released}" if released else ""
        name = f"{kind} of round {rnd}{who} (caused by seq {cause})"
        if self.kind == "verdict":
            return (f"seq {self.seq}: {released}'s step {rnd} recorded {self.recorded} experiences "
                    f"{self.field} as stale, but the core computes {self.recomputed} from the ages it recorded")
        if self.kind == "subject":
            return f"seq {self.seq}: {self.recorded} (a forged or misplaced record; readers reject it)"
        if self.kind == "field":
            return (f"seq {self.seq}: {name}: field {self.field!r} recorded {self.recorded!r} "
                    f"but the reducer computes {self.recomputed!r}")
        if self.kind == "unexpected":
            return f"seq {self.seq}: {name} was recorded but the reducer never computes it"
        if self.kind == "duplicate":
            return f"seq {self.seq}: {name} was recorded again (first at seq {self.recorded})"
        if self.kind == "order":
            return (f"seq {self.seq}: {name} was recorded out of order: after {self.recomputed}, which "
                    "the reducer computes later in the same round")
        if self.warning:
            return (f"after seq {self.seq}: {name} is computed but not recorded; the recording probably "
                    "ended before the synchronizer published it")
        return f"seq {self.seq}: {name} is computed but was never recorded"


def _diff_fields(recorded: Decision, computed: Decision) -> tuple[str, Any, Any] | None:
    a, b = to_plain(recorded), to_plain(computed)
    for key in b:
        if a.get(key) != b[key]:
            return key, a.get(key), b[key]
    for key in a:
        if key not in b:
            return key, a[key], None
    return None


def check_decisions(records: list[Recorded], start: State | None = None) -> list[Mismatch]:
    """Recompute every decision from the recorded inputs and compare with the recorded decisions.

    From a reducer snapshot `start` (a trimmed stream), only the records after it are folded, and
    recorded decisions caused by inputs the snapshot already holds are not checked.
    Returns the mismatches (and warnings) sorted by stream sequence; empty when all agree.
    """
    records = sorted(records, key=lambda r: r.seq)
    out: list[Mismatch] = []
    records, forged = verify_subjects(records)
    for rec, problem in forged:
        ev = rec.event
        out.append(Mismatch("subject", rec.seq, (ev.KIND, getattr(ev, "round", None) or 0, rec.seq, ""),
                            recorded=problem))
    if start is not None:
        records = [r for r in records if r.seq > start.last_seq and not (
            isinstance(r.event, Decision) and r.event.cause_seq <= start.last_seq)]
    # illegal inputs are skipped, as live
    _, computed, _ = fold_lenient((r for r in records if not isinstance(r.event, Decision)), start)
    recorded = [(r.seq, r.event) for r in records if isinstance(r.event, Decision)]

    index = {}
    for i, d in enumerate(computed):
        index.setdefault(decision_identity(d), i)
    seen: dict[tuple, int] = {}
    matched: list[tuple[int, int]] = []  # (recorded seq, computed index), in recorded order
    for seq, d in recorded:
        ident = decision_identity(d)
        if ident in seen:
            out.append(Mismatch("duplicate", seq, ident, recorded=seen[ident]))
            continue
        seen[ident] = seq
        i = index.get(ident)
        if i is None:
            out.append(Mismatch("unexpected", seq, ident))
            continue
        matched.append((seq, i))
        diff = _diff_fields(d, computed[i])
        if diff is not None:
            out.append(Mismatch("field", seq, ident, field=diff[0], recorded=diff[1], recomputed=diff[2]))
    # Order: each round's decisions must appear in the order the reducer computes them. Rounds are
    # held to nothing more: the decision log records all of them in computed order, but a build
    # before schema 4 guarded each round's subject alone, and a batch it had to retry (a lost ack, a
    # server restart) may have landed after a later round's, which changes nothing anyone reads.
    highest = -1
    highest_in_round: dict[int, int] = {}
    for seq, i in matched:
        round_id = computed[i].round
        before = highest_in_round.get(round_id, -1)
        if i < before:
            prev = decision_identity(computed[before])
            out.append(Mismatch("order", seq, decision_identity(computed[i]),
                                recomputed=f"{prev[0]} of round {prev[1]} (caused by seq {prev[2]})"))
        highest_in_round[round_id] = max(before, i)
        highest = max(highest, i)
    # Missing: a warning only when nothing after it was recorded (the recording was cut first).
    last_cause = max((d.cause_seq for _, d in recorded), default=0)
    for i, d in enumerate(computed):
        ident = decision_identity(d)
        if ident in seen:
            continue
        cut_off = i > highest and d.cause_seq >= last_cause
        out.append(Mismatch("missing", d.cause_seq, ident, recomputed=to_plain(d), warning=cut_off))
    out.extend(check_staleness(records, start))
    out.sort(key=lambda m: (m.seq, m.warning))
    return out


def check_staleness(records: list[Recorded], start: State | None = None) -> list[Mismatch]:
    """Recompute each trainer step's staleness verdicts from the ages it recorded (in seq order)."""
    config = start.config if start is not None else None
    out: list[Mismatch] = []
    for rec in records:
        ev = rec.event
        if isinstance(ev, JobConfigured) and config is None:
            config = ev.config  # the first is the job's (a different later one is illegal)
        if not isinstance(ev, StepFinished) or ev.staleness is None or config is None:
            continue
        counts = tally_verdicts(ev.staleness.ages, config)
        for verdict, recorded in ((Staleness.DROPPED, ev.staleness.dropped),
                                  (Staleness.CORRECTED, ev.staleness.corrected)):
            if counts[verdict] != recorded:
                out.append(Mismatch("verdict", rec.seq, ("staleness", ev.step, rec.seq, ev.member.id),
                                    field=verdict.value, recorded=recorded, recomputed=counts[verdict]))
    return out
