"""Junk on the event subjects must not starve a member's heartbeats: measure the longest heartbeat gap.

    python -m benchmarks.junk_flood [--junk 10000] [--period 0.5]

One process plays a member as the roles do: it follows the job's event stream live (an `EventReader`
folding what it reads, like `JobView`) and beats every `--period` seconds on the same event loop. A
second connection publishes `--junk` messages on the member's event subjects, half random bytes
and half well-formed events forged for another member, while a third records when each heartbeat
arrives. Reports the longest gap between heartbeats while the junk is read (the synchronizer
expires a member after `heartbeat_expiry`, 5 s in the shipped configs), how long the reader took to
get through it, and how many log lines it wrote. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time

from rolectl.bus.connection import connect
from rolectl.bus.events import publish_heartbeat, read_events, subscribe_heartbeats
from rolectl.bus.logging import setup_logging
from rolectl.bus.server import NatsServer
from rolectl.bus.streams import ensure_event_stream
from rolectl.sync_protocol import (
    Decision,
    MemberRef,
    Role,
    RunningStatus,
    StepFinished,
    SyncMethod,
    VersionPublished,
    encode,
)
from rolectl.sync_protocol.reducer import reduce_lenient
from rolectl.sync_protocol.state import State

__all__ = ["main"]

JOB = "junk"
ME = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=1)
TRAINER = MemberRef(role=Role.TRAINER, id="trainer", incarnation=1)


def _junk(n: int, seed: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = "step_finished" if i % 4 else "version_published"
        subject = f"rft.{JOB}.evt.explorer.explorer-0.{kind}"
        if i % 2:
            out.append((subject, rng.randbytes(rng.randint(1, 2000))))
        elif kind == "version_published":
            out.append((subject, encode(VersionPublished(member=TRAINER, version=10**6 + i, step=i,
                                                         method=SyncMethod.MEMORY, location="x", nbytes=1,
                                                         digest="x"))))
        else:
            out.append((subject, encode(StepFinished(member=TRAINER, step=i, version=0))))
    return out


async def _measure(url: str, junk: int, period: float, seed: int) -> dict:
    log = io.StringIO()
    setup_logging("info", stream=log)
    arrivals: list[float] = []
    async with connect(url, job=JOB, role="explorer", member="explorer-0") as member, \
            connect(url, job=JOB, role="observer", member="watch") as watch, \
            connect(url, job=JOB, role="observer", member="flood") as flood:
        await ensure_event_stream(member.js, member.names)
        for subject, payload in _junk(junk, seed):  # stored first: the member meets them all at once
            await flood.js.publish(subject, payload)
        end_seq = (await flood.js.stream_info(flood.names.event_stream)).state.last_seq
        sub = await subscribe_heartbeats(watch, lambda hb: arrivals.append(time.monotonic()))
        stop = asyncio.Event()

        async def beat() -> None:
            while not stop.is_set():
                await publish_heartbeat(member, ME, step=0, version=0, status=RunningStatus.RUNNING, host="h")
                try:
                    await asyncio.wait_for(stop.wait(), period)
                except asyncio.TimeoutError:
                    pass

        async def follow(reader) -> None:
            state = State.initial()
            async for rec in reader:  # what JobView does with what it reads
                if not isinstance(rec.event, Decision):
                    state, _, _ = reduce_lenient(state, rec)

        beating = asyncio.create_task(beat())
        await asyncio.sleep(3 * period)  # beats before the flood: the gap measured is the reader's doing
        started = time.monotonic()
        reader = read_events(member, from_seq=1)
        async with reader:
            following = asyncio.create_task(follow(reader))
            while reader.last_seq < end_seq:
                await asyncio.sleep(0.01)
            read_s = time.monotonic() - started
            await asyncio.sleep(3 * period)  # beats after
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
        stop.set()
        await beating
        await sub.aclose()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    lines = log.getvalue().count("\n")
    return {
        "junk": junk,
        "heartbeat_period_s": period,
        "max_heartbeat_gap_s": round(max(gaps), 3),
        "read_s": round(read_s, 3),
        "malformed": reader.malformed,
        "rejected": getattr(reader, "rejected", None),
        "log_lines": lines,
        "log_bytes": len(log.getvalue()),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junk", type=int, default=10_000)
    parser.add_argument("--period", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with NatsServer() as server:
        result = asyncio.run(_measure(server.url, args.junk, args.period, args.seed))
    for key, value in result.items():
        print(f"{key:>20}: {value}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
