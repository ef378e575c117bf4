"""A member's record refused because it landed after the member's expiry, on a real nats-server
(found by the chaos soak: a trainer SIGSTOPped past the expiry reported its step as the expired
incarnation, so that step's 64 experiences were counted neither trained nor left): the incarnation
it rejoins as records it again."""

from __future__ import annotations

from rolectl.bus.events import EventPublisher, read_all
from rolectl.roles.config import parse_config
from rolectl.roles.observe.timeline import summarize
from rolectl.roles.session import MemberSession
from rolectl.sync_protocol import MemberExpired, MemberRef, Role, StepFinished


async def test_a_step_recorded_after_the_members_expiry_is_recorded_again_by_its_new_incarnation(
        nats_url, job_name, tmp_path):
    cfg = parse_config({"job": job_name, "nats_url": nats_url, "run_dir": str(tmp_path),
                        "synchronizer": {"sync_method": "memory", "heartbeat_expiry": 600}})
    async with MemberSession(cfg, Role.TRAINER, "trainer") as session:
        await session.view.start()
        await session.join(step=0, version=0)
        old = session.me
        clock = MemberRef(role=Role.SYNCHRONIZER, id="sync-0", incarnation=1)
        await EventPublisher(session.conn, clock).publish(MemberExpired(member=clock, expired=old, silent_for=5.0))
        # the step this process trained while the synchronizer could not hear it, reported after
        # its expiry: the fold refuses it (an expired incarnation), yet the experiences were used
        session.step = 1
        await session.publisher.publish(StepFinished(member=old, step=1, version=0,
                                                     metrics={"num_experiences": 64.0}))

        def counted(view):
            member = view.state.members.get(session.key)
            return member is not None and member.alive and member.ref.incarnation != old.incarnation \
                and member.metrics.get("num_experiences") == 64.0

        await session.view.wait_for(counted, timeout=30, what="the step recorded again by the new incarnation")
        assert session.rejoins == 1
        summary = summarize(await read_all(session.conn), job=job_name)
        assert summary["experiences_trained"] == 64, summary
