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
from tests.support.wait import wait_until


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


async def test_a_rejoin_whose_ack_was_lost_is_tried_again_and_the_stored_join_is_ours(
        nats_url, job_name, tmp_path, monkeypatch):
    """The rejoin's MemberJoined is stored but its ack never comes back (the server went away
    after storing it): the rejoin task survives the error, tries again as the same incarnation
    (stored once, deduplicated), and does not take its own join for a replacement."""
    import rolectl.roles.session as session_module

    failures = []

    class AckLostOnce(EventPublisher):
        async def publish(self, event, **kw):
            seq = await super().publish(event, **kw)
            if type(event).__name__ == "MemberJoined" and not failures:
                failures.append(seq)
                raise TimeoutError("nats: timeout (the ack of a stored publish, lost)")
            return seq

    cfg = parse_config({"job": job_name, "nats_url": nats_url, "run_dir": str(tmp_path),
                        "synchronizer": {"sync_method": "memory", "heartbeat_expiry": 600,
                                         "heartbeat_period": 0.2}})
    async with MemberSession(cfg, Role.TRAINER, "trainer") as session:
        await session.view.start()
        await session.join(step=3, version=2)
        old = session.me
        monkeypatch.setattr(session_module, "EventPublisher", AckLostOnce)  # the rejoin's publisher only
        clock = MemberRef(role=Role.SYNCHRONIZER, id="sync-0", incarnation=1)
        await EventPublisher(session.conn, clock).publish(MemberExpired(member=clock, expired=old, silent_for=5.0))

        await wait_until(lambda: session.rejoins == 1, timeout=30, what="the rejoin, tried twice")
        assert failures, "the first try's ack was not lost: the test did not test anything"
        assert session.replaced_by is None
        member = session.view.state.members[session.key]
        assert member.alive and member.ref == session.me and member.ref.incarnation != old.incarnation
        assert member.step == 3
        await session.fence()  # our own join is not a replacement
        joins = [r for r in await read_all(session.conn)
                 if type(r.event).__name__ == "MemberJoined" and r.event.member == session.me]
        assert [r.seq for r in joins] == failures  # the second try's join was the same message
