"""A nats-server killed and restarted on the same port and store: history survives, clients carry on."""

from __future__ import annotations

import asyncio

from rolectl.bus.connection import connect
from rolectl.bus.events import EventPublisher, EventReader, read_events
from rolectl.bus.experiences import ExperienceBatch, ExperiencePublisher, ExperienceReader
from rolectl.bus.streams import ensure_event_stream, ensure_experience_stream
from rolectl.sync_protocol import MemberRef, Role, StepFinished

ME = MemberRef(role=Role.TRAINER, id="t0", incarnation=0)


async def test_restart_keeps_history_and_clients_reconnect_and_carry_on(own_server):
    async with connect(own_server.url, job="restart", role="trainer", member="t0") as conn:
        await ensure_event_stream(conn.js, conn.names)
        await ensure_experience_stream(conn.js, conn.names)
        events = EventPublisher(conn, ME)
        before = [StepFinished(member=ME, step=s, version=0) for s in (1, 2, 3)]
        for e in before:
            await events.publish(e)
        for step in (1, 2):
            await ExperiencePublisher(conn, "e0").publish(
                ExperienceBatch(member="e0", explore_step=step, model_version=0))

        trainer = ExperienceReader(conn, ack_wait_s=30)
        [held] = await trainer.fetch(1, timeout=5)  # held, unacked, across the restart

        async with EventReader(conn, poll_s=0.5) as live:
            seen = [await asyncio.wait_for(live.__anext__(), 5) for _ in before]
            assert [r.event for r in seen] == before

            await asyncio.to_thread(own_server.kill)
            await conn.wait_disconnected(timeout=5)
            # Publish while the server is down: the publisher keeps retrying (same msg id) ...
            after = StepFinished(member=ME, step=4, version=0)
            pending = asyncio.create_task(events.publish(after))
            await asyncio.to_thread(own_server.start)
            await conn.wait_connected(timeout=15)
            assert conn.reconnects == 1
            # ... and succeeds once the server and its JetStream are back.
            seq = await asyncio.wait_for(pending, 30)
            # The live reader's in-memory consumer died with the server; it must notice and resume.
            resumed = await asyncio.wait_for(live.__anext__(), 10)
            assert (resumed.seq, resumed.event) == (seq, after)

        history = read_events(conn, stop_at_end=True)
        async with history:
            assert [r.event async for r in history] == [*before, after]

        # The consumer's state survived too: step 1 is still held, step 2 comes next, both ack.
        got = await trainer.fetch(10, timeout=5)
        assert (held.batch.explore_step, [r.batch.explore_step for r in got]) == (1, [2])
        for r in (held, *got):
            await r.ack()
        info = await conn.js.stream_info(conn.names.experience_stream)
        assert info.state.messages == 0
