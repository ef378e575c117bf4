"""Export, replay and check a job recorded on a real nats-server by the real synchronizer."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from rich.console import Console

from rolectl.bus.errors import BusError
from rolectl.roles.launch.up_view import summary_table
from rolectl.roles.observe.dashboard import Dashboard
from rolectl.roles.observe.observer import JobObserver
from rolectl.roles.observe.prometheus import JobCollector
from rolectl.roles.observe.replay import (
    ExportError,
    build_timeline,
    check_decisions,
    export_job,
    load_export,
    read_job,
    run_replay,
    summarize,
    write_export,
)
from rolectl.roles.observe.views import SUMMARY_MEANINGS
from rolectl.sync_protocol import Decision, MemberReleased, RoundClosed, VersionPublished, decision_identity
from rolectl.sync_protocol.reducer import fold_lenient
from tests.support.scripted_job import run_scripted_job


@pytest.fixture
def recorded(nats_url: str, job_name: str) -> str:
    """A job that ran to its end: 3 trainer steps, 2 explorers, decisions by the real synchronizer."""
    asyncio.run(run_scripted_job(nats_url, job_name, steps=3))
    return job_name


def _export(job: str, nats_url: str, path: Path) -> list:
    n = asyncio.run(export_job(job, nats_url, path))
    records = load_export(path)
    assert len(records) == n
    return records


@pytest.mark.parametrize("suffix", [".jsonl", ".msgpack"])
def test_export_then_load_gives_back_every_record(recorded, nats_url, tmp_path, suffix):
    path = tmp_path / f"job{suffix}"
    records = _export(recorded, nats_url, path)
    live = asyncio.run(read_job(recorded, nats_url))
    assert records == live
    assert any(isinstance(r.event, MemberReleased) for r in records)
    assert [r.seq for r in records] == sorted(r.seq for r in records)


def test_jsonl_export_has_seq_time_subject_and_event(recorded, nats_url, tmp_path):
    path = tmp_path / "job.jsonl"
    _export(recorded, nats_url, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(rows[0]) == {"seq", "time_ms", "subject", "event"}
    decision = next(r for r in rows if r["event"]["kind"] == "round_opened")
    assert decision["subject"] == f"rft.{recorded}.sync.log"
    assert rows[0]["subject"].startswith(f"rft.{recorded}.evt.")


def test_check_passes_on_a_real_recording(recorded, nats_url, tmp_path, capsys):
    path = tmp_path / "job.jsonl"
    records = _export(recorded, nats_url, path)
    assert [m for m in check_decisions(records) if not m.warning] == []
    assert run_replay(job=None, nats=nats_url, file=path, until=None, check=True, as_json=False) == 0
    assert "check OK" in capsys.readouterr().out


def test_check_reads_the_stream_directly(recorded, nats_url, capsys):
    assert run_replay(job=recorded, nats=nats_url, file=None, until=None, check=True, as_json=False) == 0
    assert "check OK" in capsys.readouterr().out


def test_a_changed_decision_fails_the_check_naming_its_seq_and_field(recorded, nats_url, tmp_path, capsys):
    path = tmp_path / "job.jsonl"
    _export(recorded, nats_url, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    target = [r for r in rows if r["event"]["kind"] == "member_released"][2]
    target["event"]["version"] += 7  # the synchronizer "released" the explorer with another version
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    mismatches = [m for m in check_decisions(load_export(path)) if not m.warning]
    assert len(mismatches) == 1
    assert (mismatches[0].kind, mismatches[0].seq, mismatches[0].field) == ("field", target["seq"], "version")

    assert run_replay(job=None, nats=nats_url, file=path, until=None, check=True, as_json=False) == 1
    out = capsys.readouterr().out
    assert f"first at recorded seq {target['seq']}" in out
    assert "'version'" in out


def test_a_decision_missing_mid_recording_fails_the_check(recorded, nats_url, tmp_path):
    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    dropped = next(r for r in records if isinstance(r.event, MemberReleased))
    mismatches = [m for m in check_decisions([r for r in records if r is not dropped]) if not m.warning]
    assert [(m.kind, m.identity[0]) for m in mismatches] == [("missing", "member_released")]
    assert mismatches[0].seq == dropped.event.cause_seq


def test_a_recording_cut_before_its_last_decision_only_warns(recorded, nats_url, tmp_path, capsys):
    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    last_decision = max(i for i, r in enumerate(records) if isinstance(r.event, Decision))
    assert isinstance(records[last_decision].event, RoundClosed)
    cut = records[:last_decision] + records[last_decision + 1:]
    mismatches = check_decisions(cut)
    assert [(m.kind, m.warning) for m in mismatches] == [("missing", True)]
    path = tmp_path / "cut.jsonl"
    write_export(cut, path)
    assert run_replay(job=None, nats=nats_url, file=path, until=None, check=True, as_json=False) == 0
    out = capsys.readouterr().out
    assert "warning:" in out and "check OK" in out


def test_a_decision_nobody_computes_fails_the_check(recorded, nats_url, tmp_path):
    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "job.jsonl").read_text().splitlines()]
    closed = next(r for r in rows if r["event"]["kind"] == "round_closed")
    closed["event"]["cause_seq"] = closed["event"]["cause_seq"] + 1  # a different decision identity
    path = tmp_path / "edited.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    errors = [m for m in check_decisions(load_export(path)) if not m.warning]
    # the recorded one is never computed, and the computed one was never recorded
    assert sorted((m.kind, m.seq) for m in errors) == [("missing", closed["event"]["cause_seq"] - 1),
                                                       ("unexpected", closed["seq"])]
    assert len(records) == len(rows)


def _swapped(records: list, first, second) -> list:
    """`records` with the record `first` moved to just after `second` (recorded later)."""
    out = [r for r in records if r is not first]
    out.insert(out.index(second) + 1, first)
    return out


def test_a_rounds_decisions_recorded_out_of_their_order_fail_the_check(recorded, nats_url, tmp_path):
    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    released = next(r for r in records if isinstance(r.event, MemberReleased))
    closed = next(r for r in records if isinstance(r.event, RoundClosed) and r.event.round == released.event.round)
    mismatches = check_decisions(_swapped(records, released, closed))
    assert [(m.kind, m.identity[0], m.identity[1]) for m in mismatches] == [
        ("order", "member_released", released.event.round)]
    assert "out of order: after round_closed of round" in mismatches[0].describe()


def test_the_decision_log_holds_every_decision_in_computed_order_across_rounds(recorded, nats_url, tmp_path):
    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    _, computed, _ = fold_lenient(r for r in records if not isinstance(r.event, Decision))
    recorded_order = [decision_identity(r.event) for r in records if isinstance(r.event, Decision)]
    assert len({d.round for d in computed}) > 1
    assert recorded_order == [decision_identity(d) for d in computed]


def test_rounds_are_independent_a_later_rounds_decision_recorded_first_passes(recorded, nats_url, tmp_path):
    """A build before schema 4 guarded each round's subject alone: a batch it had to retry may have
    landed after a later round's. Each round's own order is what the check holds it to."""
    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    decisions = [r for r in records if isinstance(r.event, Decision)]
    first = next(r for r in decisions if isinstance(r.event, RoundClosed))  # its round's last decision
    other = next(r for r in decisions[decisions.index(first):] if r.event.round != first.event.round)
    assert check_decisions(records) == []
    assert check_decisions(_swapped(records, first, other)) == []


def test_an_export_holds_a_decision_batch_as_rows_that_share_its_sequence(recorded, nats_url, tmp_path):
    path = tmp_path / "job.jsonl"
    records = _export(recorded, nats_url, path)
    batches = [seq for seq in {r.seq for r in records} if sum(r.seq == seq for r in records) > 1]
    assert batches, "the synchronizer recorded no decision batch"
    for seq in batches:
        held = [r.event for r in records if r.seq == seq]
        assert all(isinstance(d, Decision) for d in held)
    # two records of one sequence that are not decisions: not an export of a stream
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    i = next(i for i, r in enumerate(rows) if r["event"]["kind"] == "version_published")
    rows.insert(i + 1, dict(rows[i]))
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ExportError, match=f"sequence {rows[i]['seq']} follows {rows[i]['seq']}"):
        load_export(edited)


def test_the_observer_takes_each_decision_of_a_batch_once(recorded, nats_url, tmp_path):
    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    once = JobObserver().extend(records)
    again = JobObserver().extend(records).extend(records)  # a reader that started over gives nothing new
    assert once.decisions_recorded == sum(isinstance(r.event, Decision) for r in records)
    assert again.decisions_recorded == once.decisions_recorded
    assert once.round_outcomes == again.round_outcomes and sum(once.round_outcomes.values()) == 8


@pytest.mark.parametrize("by", ["seq", "time"])
def test_until_shows_the_state_at_that_point(recorded, nats_url, tmp_path, by, capsys):
    path = tmp_path / "job.jsonl"
    records = _export(recorded, nats_url, path)
    v2 = next(r for r in records if isinstance(r.event, VersionPublished) and r.event.version == 2)
    if by == "seq":
        until = str(v2.seq)
        kept = [r for r in records if r.seq <= v2.seq]
    else:
        until = dt.datetime.fromtimestamp(v2.time_ms / 1000, dt.timezone.utc).isoformat().replace("+00:00", "Z")
        kept = [r for r in records if r.time_ms <= v2.time_ms]  # the same millisecond may hold more
    expected = max(r.event.version for r in kept if isinstance(r.event, VersionPublished))
    assert expected >= 2
    timeline = build_timeline(records, until=until)
    assert timeline["last_seq"] == kept[-1].seq
    assert timeline["latest"]["version"] == expected
    trainer = next(m for m in timeline["members"] if m["role"] == "trainer")
    assert trainer["version"] == expected and trainer["status"] == "running"
    assert run_replay(job=None, nats=nats_url, file=path, until=until, check=False, as_json=True) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["latest"]["version"] == expected
    assert shown["last_seq"] == kept[-1].seq
    assert shown["until"] == until


def test_timeline_rounds_say_who_waited_for_what_and_how_long(recorded, nats_url, tmp_path):
    timeline = build_timeline(_export(recorded, nats_url, tmp_path / "job.jsonl"))
    assert timeline["decisions_source"] == "recorded"
    rounds = timeline["rounds"]
    assert len(rounds) == 2 + 2 * 3  # two initial pulls, then two per trainer step
    assert all(r["outcome"] == "completed" for r in rounds)
    waited = [r for r in rounds if r["waited_for"]]
    assert waited and all(r["opened_by"] == "explorer/explorer-1" for r in waited)
    assert all("trainer/trainer" in r["waited_for"][0] for r in waited)
    assert all(r["duration_ms"] is not None and r["duration_ms"] >= 0 for r in rounds)
    moved = [r for r in rounds if r["nbytes"]]
    assert len(moved) == 6 and all(r["gbps"] > 0 for r in moved)
    # members whose work is done read "finished", not just "stopped"
    assert {m["status"] for m in timeline["members"] if m["role"] != "synchronizer"} == {"finished"}


def test_replay_text_is_one_whole_line_a_round_without_a_terminal(recorded, nats_url, tmp_path):
    # a pipe or a file gets every line whole (rich alone would cut them at 80 columns)
    path = tmp_path / ("a-directory-name-long-enough-to-pass-80-columns" * 2) / "job.jsonl"
    path.parent.mkdir()
    records = _export(recorded, nats_url, path)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    shown = subprocess.run([sys.executable, "-m", "rolectl", "replay", "--file", str(path), "--check"],
                           capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2],
                           timeout=300)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert str(path) in lines[0] and "…" not in shown.stdout, shown.stdout
    timeline = build_timeline(records)
    round_ids = [int(line.split()[0]) for line in lines if re.match(r"\s*\d+ \d\d:\d\d:\d\d", line)]
    assert round_ids == [r["id"] for r in timeline["rounds"]]
    members = [line for line in lines if re.match(r"  (trainer|explorer|synchronizer) ", line)]
    assert len(members) == len(timeline["members"])
    assert len(lines) <= len(round_ids) + len(members) + 12, shown.stdout  # a few header lines, no more
    assert "check OK" in shown.stdout


@pytest.mark.parametrize("check", [False, True])
def test_replay_into_a_pipe_nobody_reads_ends_quietly(recorded, nats_url, tmp_path, check):
    """`rolectl replay | head`: the reader went away; nothing is said about it, the exit is 0 (the
    job completed, so --check's verdict is 0 too)."""
    path = tmp_path / "job.jsonl"
    _export(recorded, nats_url, path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: every write the command makes to its stdout fails (EPIPE)
    try:
        shown = subprocess.run([sys.executable, "-m", "rolectl", "replay", "--file", str(path),
                                *(["--check"] if check else [])], stdout=write_end, stderr=subprocess.PIPE,
                               text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    finally:
        os.close(write_end)
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr and "pipe" not in shown.stderr.lower(), shown.stderr


def test_summary_counts_a_sync_as_the_reducer_does_and_names_every_other_count(recorded, nats_url, tmp_path):
    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    summary = summarize(records, job=recorded)
    closed = [r.event for r in records if isinstance(r.event, RoundClosed)]
    completed = [d for d in closed if d.outcome.value == "completed"]
    assert summary["syncs"] == len(completed) == len(build_timeline(records)["rounds"])
    assert summary["rounds"] == {"completed": len(completed)}
    # every explorer wait is answered by a release: the count splits by answer and adds up
    waits = summary["sync_wait_ms"]
    assert waits["count"] == sum(waits["by_answer"].values()) == len(
        [r for r in records if isinstance(r.event, MemberReleased)])
    loaded = [r.event for r in records if type(r.event).__name__ == "WeightsLoaded" and r.event.nbytes > 0]
    assert summary["weight_loads"] == len(loaded) == 6  # one per trainer step per explorer
    assert summary["complete"] and summary["trainer_steps"] == 3
    # `rolectl up` prints each count beside what it counts, within 80 columns
    console = Console(width=80, file=io.StringIO(), record=True)
    console.print(summary_table(summary))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    for key in ("syncs", "rounds", "weight_loads", "sync_wait_ms"):
        row = next(line for line in lines if line.startswith(f"│ {key} "))
        assert SUMMARY_MEANINGS[key] in row, row


def test_the_dashboard_counts_every_closed_round_not_only_the_kept_ones(recorded, nats_url, tmp_path):
    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    dashboard = Dashboard(job=recorded, nats_url=nats_url, monitor_url=None)
    dashboard.observer = JobObserver(max_rounds=2).extend(records)  # keeps 2 of the 8 rounds
    assert len(dashboard.observer.rounds) == 2
    assert dashboard.snapshot()["rounds_summary"]["outcomes"] == {"completed": 8}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(dashboard))
    assert registry.get_sample_value("rolectl_sync_rounds_closed_total",
                                     {"job": recorded, "outcome": "completed"}) == 8


def test_replay_json_prints_the_check_result(recorded, nats_url, capsys):
    assert run_replay(job=recorded, nats=nats_url, file=None, until=None, check=True, as_json=True) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["check"]["ok"] is True
    assert len(shown["rounds"]) == 8


def test_load_export_names_file_and_line_of_bad_input(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"seq": 1, "time_ms": 5, "event": {"schema": 1, "kind": "round_timed_out",
                                               "member": {"role": "synchronizer", "id": "s", "inc": 0},
                                               "round": 1}}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "seq": 2}) + "\n{oops\n")
    with pytest.raises(ExportError, match=rf"{path}:3: not JSON"):
        load_export(path)
    path.write_text(json.dumps({**good, "event": {**good["event"], "kind": "weights_teleported"}}) + "\n")
    with pytest.raises(ExportError, match=rf"{path}:1 \(seq 1\): bad event: unknown event kind"):
        load_export(path)
    path.write_text(json.dumps({"seq": 1, "event": good["event"]}) + "\n")
    with pytest.raises(ExportError, match="missing time_ms"):
        load_export(path)
    with pytest.raises(ExportError, match="name the file"):
        load_export(tmp_path / "events.csv")


def test_replay_of_a_bad_file_exits_2_with_the_reason(tmp_path, nats_url, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("[1, 2]\n")
    assert run_replay(job=None, nats=nats_url, file=path, until=None, check=True, as_json=False) == 2
    assert f"{path}:1: expected an object" in capsys.readouterr().err


def test_export_of_a_job_without_stream_is_a_clear_error(nats_url, job_name, tmp_path):
    with pytest.raises(BusError, match="does not exist"):
        asyncio.run(export_job(job_name, nats_url, tmp_path / "x.jsonl"))


@pytest.mark.parametrize("ending", ["stopped_early", "expired"])
def test_check_fails_a_job_whose_trainer_never_finished(recorded, nats_url, tmp_path, capsys, ending):
    """Every decision matches, yet the trainer's last STOPPED is not final (or it was expired and
    never came back): the job ended short of its last step, and --check says so with exit 1."""
    from rolectl.sync_protocol import MemberExpired, MemberRef, Recorded, Role, StatusChanged

    records = _export(recorded, nats_url, tmp_path / "job.jsonl")
    trainer_stop = next(r for r in records if isinstance(r.event, StatusChanged)
                        and r.event.member.role is Role.TRAINER and r.event.final)
    if ending == "stopped_early":
        changed = Recorded(seq=trainer_stop.seq, time_ms=trainer_stop.time_ms,
                           event=StatusChanged(member=trainer_stop.event.member, status=trainer_stop.event.status,
                                               step=trainer_stop.event.step, version=trainer_stop.event.version))
    else:
        clock = MemberRef(role=Role.SYNCHRONIZER, id="sync-x", incarnation=1)
        changed = Recorded(seq=trainer_stop.seq, time_ms=trainer_stop.time_ms,
                           event=MemberExpired(member=clock, expired=trainer_stop.event.member, silent_for=9.0))
    edited = [changed if r.seq == trainer_stop.seq else r for r in records]
    path = tmp_path / "short.jsonl"
    write_export(edited, path, job=recorded)
    assert run_replay(job=None, nats=nats_url, file=path, until=None, check=True, as_json=False) == 1
    assert "job incomplete: the trainer" in capsys.readouterr().err
    # the unedited recording is a complete job
    assert run_replay(job=None, nats=nats_url, file=tmp_path / "job.jsonl", until=None, check=True,
                      as_json=False) == 0


# -- a job recorded by an older build (schema 3 or 4): a RendezvousReady listed its whole group ---

def _old_rendezvous_inputs(explorers: int) -> list:
    """The inputs of a finished nccl job: trainer and `explorers` explorers, two rendezvous rounds."""
    from rolectl.sync_protocol import MemberRef, Role, SyncConfig, SyncMethod, SyncStyle
    from tests.support.reducer_scenario import T, broadcast, configured, finish, join, loaded, req

    fleet = [MemberRef(role=Role.EXPLORER, id=f"explorer-{i}", incarnation=1) for i in range(explorers)]
    inputs = [configured(SyncConfig(sync_method=SyncMethod.NCCL, sync_style=SyncStyle.FIXED)), join(T),
              *(join(e, ranks=1 + i % 2) for i, e in enumerate(fleet))]
    for version in (1, 2):
        inputs += [*(req(e, version, version - 1) for e in fleet), req(T, version, version)]
        inputs += [*(loaded(e, version, round=version) for e in fleet), broadcast(version, round=version)]
    return inputs + [*(finish(e, 3, 2) for e in fleet), finish(T, 2, 2)]


def _as_recorded_by(schema: int, item) -> bytes:
    import msgpack

    from rolectl.sync_protocol import RendezvousReady, to_plain

    plain = {**to_plain(item), "schema": schema}
    if isinstance(item, RendezvousReady):  # the list schema 5 replaced by a count and a digest
        del plain["explorers"], plain["membership"]
        plain["participants"] = [
            {"member": {"role": p.member.role.value, "id": p.member.id, "inc": p.member.incarnation},
             "rank_offset": p.rank_offset, "ranks": p.ranks} for p in item.participants]
    return msgpack.packb(plain, use_bin_type=True)


async def _record_as_an_old_build(conn, schema: int, inputs: list) -> int:
    """Publish `inputs` and, after each, the decisions a synchronizer of that build recorded (the
    reducer's, computed from the recorded sequence and server time): schema 3 on each round's own
    subject, 4 on the decision log. Returns how many messages."""
    from rolectl.sync_protocol import Recorded, State, reduce

    names, state, count = conn.names, State.initial(), 0
    for event in inputs:
        ack = await conn.js.publish(names.event(event.member.role, event.member.id, event.KIND),
                                    _as_recorded_by(schema, event))
        stored = await conn.js.get_msg(names.event_stream, ack.seq)
        time_ms = (stored.time - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)) // dt.timedelta(milliseconds=1)
        state, decisions = reduce(state, Recorded(seq=ack.seq, time_ms=time_ms, event=event))
        for d in decisions:
            await conn.js.publish(names.decision(d.round) if schema == 3 else names.decision_log,
                                  _as_recorded_by(schema, d))
        count += 1 + len(decisions)
    return count


@pytest.mark.parametrize("schema", [3, 4])
def test_a_rendezvous_job_recorded_by_an_older_build_decodes_and_replays(nats_url, job_name, schema, capsys):
    """Decisions listed every participant until schema 5: such a stream, recorded on a real server
    where its build put it (schema 3: each round's own subject; 4: the decision log), still reads,
    and `replay --check` recomputes every decision, the rendezvous ones included, as equal."""
    from rolectl.bus.connection import connect
    from rolectl.bus.streams import ensure_event_stream
    from rolectl.sync_protocol import RendezvousReady

    async def record() -> int:
        async with connect(nats_url, job=job_name, role="observer", member="old-build") as conn:
            await ensure_event_stream(conn.js, conn.names)
            return await _record_as_an_old_build(conn, schema, _old_rendezvous_inputs(explorers=40))

    published = asyncio.run(record())
    records = asyncio.run(read_job(job_name, nats_url))
    ready = [r.event for r in records if isinstance(r.event, RendezvousReady)]
    assert len(ready) == 2 and all(d.is_bound and d.explorers == 40 for d in ready)
    assert len(records) == published and check_decisions(records) == []
    assert run_replay(job=job_name, nats=nats_url, file=None, until=None, check=True, as_json=True) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["check"]["ok"] is True and shown["outcome"]["status"] == "complete"
