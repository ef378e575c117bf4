"""Commands that read a job agree on exit codes (roles.runner.EXIT_CODES) and speak the user's
words, against a real nats-server: a job the server does not have is 1 everywhere, with no internal
function name in the message; a wrong input file or path is 2."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rolectl.roles.cli import main
from rolectl.roles.exit_codes import ExitCode, exit_code_table
from rolectl.roles.runner import EXIT_ERROR, EXIT_USAGE


@pytest.mark.parametrize("command", [["status"], ["export", "-o", "{tmp}/out.jsonl"], ["replay"]])
def test_a_job_the_server_does_not_have_is_exit_1_in_every_command(command, nats_url, job_name, tmp_path):
    args = [a.format(tmp=tmp_path) for a in command]
    result = CliRunner().invoke(main, [*args, "--job", job_name, "--nats", nats_url])
    assert result.exit_code == EXIT_ERROR, result.output
    assert (f"no member of job '{job_name}' has started on this server yet; check the job name and --nats"
            in result.output)
    assert "ensure_" not in result.output and "Traceback" not in result.output


def test_track_of_a_job_the_server_does_not_have_is_exit_1(nats_url, job_name, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(f"job: {job_name}\nrun_dir: {tmp_path}\nmonitor: {{backends: [tensorboard]}}\n")
    result = CliRunner().invoke(main, ["track", "--config", str(config), "--nats", nats_url, "--once"])
    assert result.exit_code == EXIT_ERROR, result.output
    assert f"no member of job '{job_name}' has started on this server yet" in result.output
    assert "Traceback" not in result.output


def test_export_to_a_path_that_cannot_be_written_is_exit_2(nats_url, job_name, tmp_path):
    result = CliRunner().invoke(main, ["export", "--job", job_name, "--nats", nats_url,
                                       "-o", str(tmp_path / "out.txt")])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "unknown export format '.txt'" in result.output


# -- the one table (roles.exit_codes) ------------------------------------------------------------------



QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")


@pytest.mark.parametrize("command", [[], ["up"]])
def test_the_help_prints_the_one_table(command):
    result = CliRunner().invoke(main, [*command, "--help"])
    assert result.exit_code == ExitCode.OK
    shown = [" ".join(line.split()) for line in result.output.splitlines()]  # help indents it
    for line in exit_code_table().splitlines():
        assert " ".join(line.split()) in shown, line
    assert {int(c) for c in ExitCode} == {0, 1, 2, 3, 130}


@pytest.mark.parametrize("command", [
    ["status", "--job", "j"], ["export", "--job", "j", "-o", "{tmp}/out.jsonl"], ["replay", "--job", "j"],
    ["dashboard", "--job", "j"], ["provision", "--config", QUICKSTART],
    ["start", "trainer", "--config", QUICKSTART], ["up", "--config", QUICKSTART, "--launcher", "ray"],
    ["track", "--config", QUICKSTART],
])
@pytest.mark.parametrize("url", ["nats://127.0.0.1:notaport", "http://127.0.0.1:4222", "nats://:4222",
                                 "nats//localhost:4222", "nats://localhost:4222/path"])
def test_a_malformed_nats_url_is_a_usage_error_in_every_command(command, url, tmp_path):
    args = [a.format(tmp=tmp_path) for a in command]
    result = CliRunner().invoke(main, [*args, "--nats", url])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "is not a NATS server URL" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("command", [["dashboard", "--job", "j", "--nats", "{nats}", "--port", "{port}"],
                                     ["server", "--port", "{port}", "--http-port", "{free}"]])
def test_a_busy_port_is_the_same_code_for_every_server(command, nats_url, tmp_path):
    from rolectl.bus.server import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = [a.format(nats=nats_url, port=port, free=free_port()) for a in command]
        # a real process: `server` execs and `dashboard` runs its own event loop
        proc = subprocess.run([sys.executable, "-m", "rolectl", *args], capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert str(port) in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("member,said", [("explorer-5", "outside this job's 2 explorer(s) (explorer-0..explorer-1"),
                                         ("worker-1", "is not an explorer id: explorers are explorer-N"),
                                         ("explorer-01", "is not an explorer id")])
def test_an_explorer_id_outside_the_job_is_refused(member, said):
    result = CliRunner().invoke(main, ["start", "explorer", "--config", QUICKSTART, "--id", member])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert said in " ".join(result.output.split()), result.output


def test_a_yaml_syntax_error_names_the_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("job: x\ntrainer: {total_steps: 3\n")
    result = CliRunner().invoke(main, ["start", "trainer", "--config", str(broken)])
    assert result.exit_code == ExitCode.USAGE, result.output
    said = " ".join(result.output.split())
    assert str(broken) in said and "<unicode string>" not in said, result.output


def test_start_runs_the_config_as_another_job_with_job(nats_url, job_name, tmp_path):
    import asyncio

    import yaml

    from rolectl.bus.connection import connect
    from rolectl.bus.events import read_events
    from rolectl.sync_protocol import MemberJoined

    data = yaml.safe_load(Path(QUICKSTART).read_text())
    data["run_dir"] = str(tmp_path / "runs")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([sys.executable, "-m", "rolectl", "start", "trainer", "--config", str(config),
                             "--nats", nats_url, "--job", job_name], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)

    async def joined() -> MemberJoined:
        async with connect(nats_url, job=job_name, role="observer", member="test") as conn:
            from rolectl.bus.streams import ensure_event_stream

            await ensure_event_stream(conn.js, conn.names)
            async with read_events(conn, from_seq=1) as reader:
                async for rec in reader:
                    if isinstance(rec.event, MemberJoined):
                        return rec.event

    try:
        event = asyncio.run(asyncio.wait_for(joined(), timeout=120))
    finally:
        proc.kill()  # by PID: the process this test started
        proc.wait()
    assert event.member.id == "trainer"  # it joined the job named by --job, not the file's


def test_a_role_whose_server_does_not_answer_fails_before_it_builds_anything(tmp_path, capsys):
    """The server is asked first: a missing one costs its wait (said in the message), not a model
    load before it, and the role is never built."""
    from rolectl.bus.server import free_port
    from rolectl.roles.config import load_config
    from rolectl.roles.runner import run_role

    cfg = load_config(QUICKSTART).with_overrides(nats_url=f"nats://127.0.0.1:{free_port()}", run_dir=str(tmp_path))

    def never(*_args, **_kwargs):
        raise AssertionError("the explorer was built before its server answered")

    assert run_role("explorer", cfg, "explorer-0", make_runner=never) == ExitCode.ERROR
    said = capsys.readouterr().err
    assert "cannot reach a NATS server" in said and "within 5 s" in said and '"exit_code": 1' in said, said
