"""Reducer throughput: fold a synthetic 1-trainer / 64-explorer job and report events per second.

    python -m benchmarks.protocol [--explorers 64] [--steps 150] [--repeat 5]

Two variants of the same job are folded back to back: `memory` (object-store pull, fixed style: half
the explorers ask before the trainer publishes and wait, half after and are released at once) and
`nccl` (rendezvous: the trainer and all explorers meet every step, then everyone reports). Events are
built before timing; only `fold` is timed. The best of `--repeat` runs is the
headline (other processes share the CPU); the median is printed too. The same events are also
encoded once and decoded (`decode_all`, the codec's whole validation) `--repeat` times: every reader
of the stream (the synchronizer, each member's view, replay) pays that per record before folding.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rolectl.sync_protocol import (
    JobConfigured,
    MemberJoined,
    MemberRef,
    Recorded,
    Role,
    RunningStatus,
    StatusChanged,
    StepFinished,
    SyncConfig,
    SyncMethod,
    SyncStyle,
    VersionPublished,
    WeightsBroadcast,
    WeightsLoaded,
    fold,
)
from rolectl.sync_protocol.codec import decode_all, encode

__all__ = ["build_job", "main"]

TRAINER = MemberRef(role=Role.TRAINER, id="trainer", incarnation=0)


def _explorers(count: int) -> list[MemberRef]:
    return [MemberRef(role=Role.EXPLORER, id=f"explorer-{i:03d}", incarnation=0) for i in range(count)]


class _Stream:
    def __init__(self) -> None:
        self.records: list[Recorded] = []

    def add(self, event) -> None:
        seq = len(self.records) + 1
        self.records.append(Recorded(seq=seq, time_ms=1_700_000_000_000 + 7 * seq, event=event))


def _start(stream: _Stream, method: SyncMethod, explorers: list[MemberRef]) -> None:
    stream.add(JobConfigured(member=TRAINER, config=SyncConfig(sync_method=method,
                                                               sync_style=SyncStyle.FIXED)))
    stream.add(MemberJoined(member=TRAINER, host="node-0", pid=1, step=0, version=0))
    for i, ref in enumerate(explorers):
        stream.add(MemberJoined(member=ref, host=f"node-{1 + i // 8}", pid=100 + i, step=0, version=-1,
                                ranks=1 + i % 2))


def _first_pull(stream: _Stream, explorers: list[MemberRef], first_round: int) -> int:
    """Each explorer's one pull before exploring (-1 -> base model 0); returns the next round id."""
    for i, ref in enumerate(explorers):
        stream.add(StatusChanged(member=ref, status=RunningStatus.REQUIRE_SYNC, step=0, version=-1))
        stream.add(WeightsLoaded(member=ref, version=0, round=first_round + i))
    return first_round + len(explorers)


def _memory_job(explorers: list[MemberRef], steps: int) -> list[Recorded]:
    stream = _Stream()
    _start(stream, SyncMethod.MEMORY, explorers)
    next_round = _first_pull(stream, explorers, 1)
    held = {ref: 0 for ref in explorers}
    metrics = {"reward": 0.5, "response_len": 312.0}
    for step in range(1, steps + 1):
        early = explorers[0::2]  # these reach the boundary before version `step` exists: they wait
        late = explorers[1::2]
        waiting_rounds = {}
        for ref in early:
            stream.add(StepFinished(member=ref, step=step, version=held[ref], metrics=metrics))
            stream.add(StatusChanged(member=ref, status=RunningStatus.REQUIRE_SYNC, step=step,
                                     version=held[ref]))
            waiting_rounds[ref] = next_round
            next_round += 1
        stream.add(StepFinished(member=TRAINER, step=step, version=step - 1, metrics={"loss": 1.0 / step}))
        stream.add(VersionPublished(member=TRAINER, version=step, step=step, method=SyncMethod.MEMORY,
                                    location=f"weights/v{step}", nbytes=2 * 10**9, digest=f"sha256:{step}"))
        for ref in early:
            stream.add(WeightsLoaded(member=ref, version=step, round=waiting_rounds[ref], nbytes=2 * 10**9,
                                     seconds=0.8))
            held[ref] = step
        for ref in late:  # a newer version exists by now: released at once
            stream.add(StepFinished(member=ref, step=step, version=held[ref], metrics=metrics))
            stream.add(StatusChanged(member=ref, status=RunningStatus.REQUIRE_SYNC, step=step,
                                     version=held[ref]))
            stream.add(WeightsLoaded(member=ref, version=step, round=next_round, nbytes=2 * 10**9,
                                     seconds=0.8))
            next_round += 1
            held[ref] = step
    return stream.records


def _nccl_job(explorers: list[MemberRef], steps: int) -> list[Recorded]:
    stream = _Stream()
    _start(stream, SyncMethod.NCCL, explorers)
    held = {ref: -1 for ref in explorers}
    metrics = {"reward": 0.5}
    for step in range(1, steps + 1):
        stream.add(StatusChanged(member=TRAINER, status=RunningStatus.REQUIRE_SYNC, step=step,
                                 version=step, rendezvous="10.0.0.1:29500"))
        for ref in explorers:
            stream.add(StepFinished(member=ref, step=step, version=held[ref], metrics=metrics))
            stream.add(StatusChanged(member=ref, status=RunningStatus.REQUIRE_SYNC, step=step,
                                     version=held[ref]))
        stream.add(WeightsBroadcast(member=TRAINER, version=step, round=step, nbytes=2 * 10**9, seconds=0.3))
        for ref in explorers:
            stream.add(WeightsLoaded(member=ref, version=step, round=step, nbytes=2 * 10**9, seconds=0.3))
            held[ref] = step
        stream.add(StepFinished(member=TRAINER, step=step, version=step, metrics={"loss": 1.0 / step}))
    return stream.records


def build_job(explorers: int = 64, steps: int = 150) -> dict[str, list[Recorded]]:
    """The two synthetic streams, by variant name."""
    refs = _explorers(explorers)
    return {"memory": _memory_job(refs, steps), "nccl": _nccl_job(refs, steps)}


def _time_fold(records: list[Recorded]) -> tuple[float, int]:
    start = time.perf_counter()
    state, decisions = fold(records)
    elapsed = time.perf_counter() - start
    assert not state.rounds, "every round of the synthetic job closes"
    return elapsed, len(decisions)


def _time_decode(payloads: list[bytes]) -> float:
    start = time.perf_counter()
    for payload in payloads:
        decode_all(payload)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explorers", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    jobs = build_job(args.explorers, args.steps)
    events = sum(len(records) for records in jobs.values())
    print(f"reducer benchmark: 1 trainer, {args.explorers} explorers, {args.steps} steps, "
          f"{events} events ({', '.join(f'{k} {len(v)}' for k, v in jobs.items())})")
    runs = []
    per_variant: dict[str, list[float]] = {name: [] for name in jobs}
    decisions = 0
    for run in range(1, args.repeat + 1):
        total = 0.0
        decisions = 0
        for name, records in jobs.items():
            seconds, made = _time_fold(records)
            per_variant[name].append(seconds)
            total += seconds
            decisions += made
        runs.append(total)
        print(f"  run {run}: {total:.3f} s, {events / total:,.0f} events/s, {decisions} decisions")
    best = min(runs)
    for name, times in per_variant.items():
        print(f"  {name:>6}: best {len(jobs[name]) / min(times):,.0f} events/s")
    payloads = [encode(rec.event) for records in jobs.values() for rec in records]
    decode_times = [_time_decode(payloads) for _ in range(args.repeat)]
    print(f"  decode: best {len(payloads) / min(decode_times):,.0f} events/s "
          f"({sum(map(len, payloads)) / len(payloads):.0f} bytes each on average)")
    result = {
        "events": events,
        "decisions": decisions,
        "seconds": round(best, 4),
        "events_per_s": round(events / best),
        "median_events_per_s": round(events / statistics.median(runs)),
        "variants": {name: round(len(jobs[name]) / min(times)) for name, times in per_variant.items()},
        "decode_events_per_s": round(len(payloads) / min(decode_times)),
        "explorers": args.explorers,
        "steps": args.steps,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
