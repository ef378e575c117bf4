"""A whole job secured by `rolectl auth init` (TLS, one nkey identity per member, least privilege),
attacked while it runs by the explorer and observer identities: every forbidden action is denied by
the server, the job still trains every step, and its recorded decisions replay exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rolectl.bus.auth import init_auth_dir
from rolectl.bus.connection import connect
from rolectl.bus.server import free_port
from tests.support.e2e import ROOT, LiveJob, assert_decisions_replay, job_config, run_up, trainer_steps
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e

JOB = "sec"
TOTAL_STEPS = 6
DENIAL_WAIT_S = 5.0


@pytest.fixture
def auth_dir(tmp_path):
    return init_auth_dir(tmp_path / "auth", job=JOB, explorers=2, synchronizers=1,
                         port=free_port(), http_port=free_port())


def _forbidden(names, identity: str) -> list[tuple[str, str, bytes]]:
    """(what, subject, payload) for every action `identity` (explorer-0 or observer) must not take."""
    ev, exp, w = names.event_stream, names.experience_stream, names.weights_stream
    api = "$JS.API"
    update = json.dumps({"name": ev, "subjects": names.event_stream_subjects, "max_msgs": 1}).encode()
    actions = [
        ("delete the event stream", f"{api}.STREAM.DELETE.{ev}", b""),
        ("delete the experience stream", f"{api}.STREAM.DELETE.{exp}", b""),
        ("delete the weights stream", f"{api}.STREAM.DELETE.{w}", b""),
        ("purge the event stream", f"{api}.STREAM.PURGE.{ev}", b"{}"),
        ("purge the experience stream", f"{api}.STREAM.PURGE.{exp}", b"{}"),
        ("purge the weights stream", f"{api}.STREAM.PURGE.{w}", b"{}"),
        ("update the event stream to max_msgs=1", f"{api}.STREAM.UPDATE.{ev}", update),
        ("create a stream", f"{api}.STREAM.CREATE.JUNK", b'{"name": "JUNK", "subjects": ["junk.>"]}'),
        ("delete the trainer's durable consumer", f"{api}.CONSUMER.DELETE.{exp}.trainer", b""),
        ("update the trainer's durable consumer",
         f"{api}.CONSUMER.CREATE.{exp}.trainer", b'{"stream_name": "%s", "config": {}}' % exp.encode()),
        ("pull from the trainer's durable consumer", f"{api}.CONSUMER.MSG.NEXT.{exp}.trainer", b'{"batch": 1}'),
        ("ack the trainer's experiences", f"$JS.ACK.{exp}.trainer.1.1.1.1.0", b""),
        ("publish as another explorer", names.event(
            "explorer", "explorer-1", "status"), b"x"),
        ("publish as the trainer", names.event("trainer", "trainer", "version"), b"x"),
        ("send a heartbeat as the trainer", names.heartbeat("trainer", "trainer"), b"x"),
        ("publish experiences as another explorer", names.experiences("explorer-1"), b"x"),
        ("publish a decision", names.decision(999), b"x"),
        ("publish weights", names.weights_manifest(999), b"x"),
        ("read another job's stream info", f"{api}.STREAM.INFO.RFT_OTHER_EVENTS", b""),
        ("read another job's events", f"{api}.CONSUMER.CREATE.RFT_OTHER_EVENTS.x", b"{}"),
        ("publish in another job", "rft.other.evt.trainer.trainer.version", b"x"),
        ("take the synchronizers' lease", f"$KV.{names.lease_bucket}.synchronizer", b"explorer-0#1"),
        ("write a reducer snapshot", f"$KV.{names.snapshot_bucket}.latest", b"x"),
        ("delete the lease bucket", f"{api}.STREAM.DELETE.KV_{names.lease_bucket}", b""),
        ("purge the snapshot bucket", f"{api}.STREAM.PURGE.KV_{names.snapshot_bucket}", b"{}"),
    ]
    if identity == "observer":  # read-only: not even its "own" subjects
        actions += [
            ("publish experiences", names.experiences("explorer-0"), b"x"),
            ("publish an event", names.event("observer", "observer", "status"), b"x"),
        ]
    return actions


async def _denied(conn, subject: str) -> str | None:
    """The server's permission-violation message for `subject`, waited for (bounded)."""
    try:
        # a flush is a round trip: the server's error for what was sent before it has arrived after it
        return await wait_until(lambda: conn.denied(subject), timeout=DENIAL_WAIT_S, what=f"a denial of {subject}",
                                changed=lambda: conn.nc.flush(timeout=1))
    except AssertionError:  # not denied: the caller lists it
        return None


async def _attack(job: LiveJob, identity: str) -> list[str]:
    """Try every forbidden action as `identity`; return those the server did NOT deny."""
    role = "observer" if identity == "observer" else "explorer"
    not_denied = []
    async with connect(job.url, job=JOB, role=role, member=f"{identity}" if role == "explorer" else "attacker",
                       security=job.security(identity)) as conn:
        for what, subject, payload in _forbidden(conn.names, identity):
            conn.permission_denials.clear()
            await conn.nc.publish(subject, payload, reply=conn.nc.new_inbox())
            if not await _denied(conn, subject):
                not_denied.append(f"{identity}: {what} ({subject})")
        for what, subject in [("sniff every reply", "_INBOX.>"), ("read every job", "rft.>"),
                              ("read another job", "rft.other.>"),
                              ("read the trainer's replies", f"_INBOX.{JOB}.trainer.>")]:
            conn.permission_denials.clear()
            sub = await conn.nc.subscribe(subject)
            if not await _denied(conn, subject):
                not_denied.append(f"{identity}: {what} (subscribe {subject})")
            await conn.unsubscribe_quietly(sub)
    return not_denied


async def _streams_intact(job: LiveJob) -> dict:
    """What admin sees of the streams and the trainer's consumer after the attacks."""
    async with connect(job.url, job=JOB, role="observer", member="admin-check", security=job.security("admin")) as conn:
        n = conn.names
        events = await conn.js.stream_info(n.event_stream)
        consumer = await conn.js.consumer_info(n.experience_stream, n.trainer_experience_durable)
        weights = await conn.js.stream_info(n.weights_stream)
        return {"event_max_msgs": events.config.max_msgs, "events": events.state.messages,
                "consumer": consumer.name, "weights_stream": weights.config.name,
                "streams": sorted(s.config.name for s in await conn.js.streams_info())}


async def test_a_secured_job_denies_every_forbidden_action_and_still_finishes(tmp_path, auth_dir):
    config = job_config(tmp_path, job=JOB, synchronizer={"sync_method": "memory"},
                        trainer={"total_steps": TOTAL_STEPS})
    async with LiveJob(tmp_path, config, auth=auth_dir) as job:
        job.start_all()
        await job.wait_for(lambda recs: trainer_steps(recs), timeout=90, what="the trainer's first step")
        not_denied = await _attack(job, "explorer-0") + await _attack(job, "observer")
        assert not not_denied, "the server let these through:\n" + "\n".join(not_denied)
        intact = await _streams_intact(job)
        codes = await job.wait_exits(["trainer", "explorer-0", "explorer-1"], timeout=150)
        assert codes == {"trainer": 0, "explorer-0": 0, "explorer-1": 0}, job.all_logs()
        await job.stream_caught_up()
        records = list(job.records)

        # The CLI, as observer, over TLS: replay --check reads the live stream and agrees; status
        # and export read it too.
        observer = ["--nats", job.url, "--creds", str(auth_dir.credential("observer")), "--tls-ca", str(auth_dir.ca)]

        def cli(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "rolectl", *args, *observer],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60)

        replay = cli("replay", "--job", JOB, "--check")
        status = cli("status", "--job", JOB, "--json")
        export = cli("export", "--job", JOB, "-o", str(tmp_path / "export.jsonl"))
    assert intact["event_max_msgs"] in (-1, 0, None) and intact["events"] > 0
    assert intact["consumer"] == "trainer"
    # exactly what admin provisioned: the three streams and the two key-value buckets (lease,
    # snapshots); nothing an attacker created, nothing deleted
    assert intact["streams"] == sorted([f"RFT_{JOB.upper()}_EVENTS", f"RFT_{JOB.upper()}_EXP",
                                        f"RFT_{JOB.upper()}_WEIGHTS", f"KV_rft_{JOB}_lease",
                                        f"KV_rft_{JOB}_snapshots"])
    assert trainer_steps(records)[-1] == TOTAL_STEPS
    assert sorted(set(trainer_steps(records))) == list(range(1, TOTAL_STEPS + 1))
    assert_decisions_replay(records)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert status.returncode == 0, status.stdout + status.stderr
    assert "trainer" in status.stdout
    assert export.returncode == 0, export.stdout + export.stderr
    assert len((tmp_path / "export.jsonl").read_text().splitlines()) >= len(records)


def test_rolectl_up_with_an_auth_dir_runs_the_job_secured(tmp_path, auth_dir):
    config = job_config(tmp_path, job=JOB, trainer={"total_steps": 4}, explorers={"total_steps": 4})
    run = run_up(config, tmp_path, extra=("--auth-dir", str(auth_dir.path)))
    assert run.rc == 0, run.output[-3000:] + run.role_logs()
    assert run.summary["secured"] is True and run.summary["nats_url"].startswith("tls://")
    assert run.summary["trainer_steps"] == 4
    assert_decisions_replay(run.records)
    logs = run.role_logs(lines=400)
    assert "permission_denied" not in logs, logs  # least privilege still lets every role work
