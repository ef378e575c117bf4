"""What reading one record of the event stream costs a process, stage by stage, in CPU µs.

    python -m benchmarks.reader_cost [--explorers 64] [--steps 100] [--repeat 3]

Every reader of a job (the synchronizer, each member's view, replay, the dashboard) pays this for
each record before it folds it. A real nats-server (file storage) is filled with the inputs of
`benchmarks.protocol`'s synthetic rendezvous job (1 trainer, `--explorers` explorers, `--steps`
steps: joins, requests, reports, step metrics), each published (acked) by the member it names, in
order; then the whole stream is read back through `bus.events.EventReader`:

- `transport`: every message passed over undecoded (`known`): nats-py's parsing and delivery plus
  the reader's own bookkeeping (consumer sequence, ack-subject parsing);
- `decode`: plus decoding and validating each event (`decode_all`) and building its `Recorded`;
- `decode+identity`: plus checking that the subject vouches for the payload (what roles do);
and `fold` adds the reducer over the records read (`sync_protocol.reduce`).

This is a backlog read: messages arrive many per socket read. Following a live job costs more per
record when records come one at a time (a wake-up, a read and three asyncio task steps each), which
`benchmarks.sync_latency` shows as CPU per round. Best of `--repeat`; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
from pathlib import Path

from benchmarks.protocol import build_job
from rolectl.bus.connection import connect
from rolectl.bus.events import EventPublisher, read_events
from rolectl.bus.server import NatsServer
from rolectl.bus.streams import ensure_event_stream
from rolectl.sync_protocol import State
from rolectl.sync_protocol.reducer import reduce_lenient

_IN_FLIGHT = 256  # publishes outstanding at once: sent in order on one connection, stored in order


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _fill(conn, explorers: int, steps: int) -> int:
    events = [rec.event for rec in build_job(explorers, steps)["nccl"]]
    publishers: dict[str, EventPublisher] = {}
    for i in range(0, len(events), _IN_FLIGHT):
        window = events[i:i + _IN_FLIGHT]
        for event in window:
            if event.member.key not in publishers:
                publishers[event.member.key] = EventPublisher(conn, event.member)
        await asyncio.gather(*(publishers[e.member.key].publish(e) for e in window))
    return len(events)


async def _read(conn, *, fold: bool, by_burst: bool = False, **options) -> tuple[float, int]:
    """CPU seconds to read the stream once, and the last sequence the reader consumed."""
    started, count, state, illegal = _cpu_s(), 0, State.initial(), 0
    async with read_events(conn, from_seq=1, stop_at_end=True, **options) as reader:
        if by_burst:
            while burst := await reader.next_burst():
                for rec in burst:
                    count += 1
                    state, _, error = reduce_lenient(state, rec)
                    illegal += error is not None
        async for rec in reader:
            count += 1
            if fold:
                state, _, error = reduce_lenient(state, rec)
                illegal += error is not None
    if illegal:
        raise RuntimeError(f"{illegal} of {count} records did not fold: the stream is not the job built")
    return _cpu_s() - started, reader.last_seq


async def measure(url: str, *, explorers: int, steps: int, repeat: int) -> dict:
    async with connect(url, job="reader-cost", role="observer", member="bench") as conn:
        await ensure_event_stream(conn.js, conn.names)
        stored = await _fill(conn, explorers, steps)
        ways = {
            "transport": dict(known=lambda seq: True, fold=False),
            "decode": dict(verify_identity=False, fold=False),
            "decode+identity": dict(fold=False),
            "fold": dict(fold=True),
            "fold by burst": dict(fold=True, by_burst=True),
        }
        out = {}
        for name, options in ways.items():
            runs = [await _read(conn, **options) for _ in range(repeat)]
            if any(last != stored for _, last in runs):
                raise RuntimeError(f"{name}: read up to {[last for _, last in runs]} of {stored} records stored")
            best = min(seconds for seconds, _ in runs)
            out[name] = round(best / stored * 1e6, 2)
            print(f"  {name:>16}: {out[name]:6.2f} µs CPU per record ({stored} records, best of {repeat})")
        return {"records": stored, "explorers": explorers, "steps": steps, "us_per_record": out}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explorers", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reader-cost-") as tmp:
        server = NatsServer(store_dir=str(Path(tmp) / "store"), log_file=str(Path(tmp) / "nats.log"))
        server.start()
        try:
            result = asyncio.run(measure(server.url, explorers=args.explorers, steps=args.steps,
                                         repeat=args.repeat))
        finally:
            server.stop()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
