"""What a new user meets first: bad input gets exit 2 and a message that says what and what to do,
the explorer count keeps the train batch one round, saved state resumes only on a restart, and the
documented exit-code table is the code's."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from rolectl.roles.cli import main
from rolectl.roles.config import load_config, parse_config
from rolectl.roles.resume import SavedState, StartMode, StartRefused, decide_resume
from rolectl.roles.runner import EXIT_CODES, EXIT_USAGE
from rolectl.sync_protocol import ConfigError, MemberRef, MemberState, Role

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


# -- config files ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, says", [
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("- job: a\n", "got a list"),
    ("quickstart\n", "got a string ('quickstart')"),
])
def test_a_config_that_is_not_a_mapping_says_what_it_is(tmp_path, text, says):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert says in str(info.value)
    assert "NoneType" not in str(info.value) and "examples/quickstart.yaml" in str(info.value)


def test_a_section_that_is_not_a_mapping_says_what_it_got():
    with pytest.raises(ConfigError) as info:
        parse_config({"job": "j", "trainer": [1, 2]})
    assert "trainer: must be a mapping (indented `key: value` lines), got a list" in str(info.value)


def test_up_with_an_empty_config_exits_2_naming_the_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    result = _run("up", "--config", str(path), "--no-dashboard")
    assert result.exit_code == EXIT_USAGE
    assert str(path) in result.output and "is empty" in result.output


# -- rolectl up --explorers ------------------------------------------------------------------------

def test_up_refuses_zero_explorers_before_starting_anything(tmp_path):
    result = _run("up", "--config", str(ROOT / "examples" / "quickstart.yaml"), "--explorers", "0",
                  "--run-dir", str(tmp_path))
    assert result.exit_code == EXIT_USAGE
    assert "--explorers" in result.output and "0 is not in the range x>=1" in result.output
    assert list(tmp_path.iterdir()) == []  # no run directory, no server store


def test_a_train_batch_of_one_round_is_scaled_with_the_explorer_count():
    cfg = load_config(ROOT / "examples" / "quickstart.yaml")
    assert (cfg.explorers.count, cfg.buffer.batch_size, cfg.trainer.train_batch_tasks) == (2, 32, 64)
    three, note = cfg.with_explorer_count(3)
    assert three.explorers.count == 3 and three.trainer.train_batch_tasks == 96
    assert "64 -> 96" in note and "one train step per round" in note
    one, _ = cfg.with_explorer_count(1)
    assert one.trainer.train_batch_tasks == 32


def test_another_train_batch_is_kept_with_a_note_saying_how_to_change_it():
    cfg = parse_config({"job": "j", "explorers": {"count": 2}, "buffer": {"batch_size": 4},
                        "trainer": {"train_batch_tasks": 4}})
    three, note = cfg.with_explorer_count(3)
    assert three.trainer.train_batch_tasks == 4
    assert "3 train steps' worth" in note and "train_batch_tasks: 12" in note
    unset = parse_config({"job": "j", "buffer": {"batch_size": 4}})
    assert "unset: one explorer batch" in unset.with_explorer_count(3)[1]


def test_the_same_explorer_count_changes_nothing():
    cfg = load_config(ROOT / "examples" / "quickstart.yaml")
    assert cfg.with_explorer_count(2) == (cfg, None)


# -- rolectl start ---------------------------------------------------------------------------------

def test_start_with_an_invalid_member_id_is_a_usage_error_not_a_traceback():
    result = _run("start", "explorer", "--config", str(ROOT / "examples" / "quickstart.yaml"), "--id", "explorer.1")
    assert result.exit_code == EXIT_USAGE
    assert "--id" in result.output and "'explorer.1'" in result.output and "letters, digits" in result.output
    assert "Traceback" not in result.output


def test_start_refuses_resume_with_fresh():
    result = _run("start", "trainer", "--config", str(ROOT / "examples" / "quickstart.yaml"), "--resume", "--fresh")
    assert result.exit_code == EXIT_USAGE and "give one" in result.output


def test_start_sync_refuses_resume_flags():
    result = _run("start", "sync", "--config", str(ROOT / "examples" / "quickstart.yaml"), "--fresh")
    assert result.exit_code == EXIT_USAGE and "saves no state" in result.output


_SAVED = SavedState(Path("runs/q/trainer/trainer_state.json"), 50)
_NOTHING = SavedState(Path("runs/q/trainer/trainer_state.json"), None)


def _recorded(*, finished: bool) -> MemberState:
    return MemberState(ref=MemberRef(role=Role.TRAINER, id="trainer", incarnation=0), step=12, finished=finished)


@pytest.mark.parametrize("mode, saved, recorded, resumes", [
    (StartMode.AUTO, _NOTHING, None, False),  # a first start
    (StartMode.AUTO, _SAVED, _recorded(finished=False), True),  # a restart after a crash
    (StartMode.RESUME, _SAVED, None, True),
    (StartMode.RESUME, _SAVED, _recorded(finished=True), True),
    (StartMode.FRESH, _SAVED, None, False),
    (StartMode.FRESH, _NOTHING, None, False),
])
def test_saved_state_is_resumed_on_a_restart_or_when_asked(mode, saved, recorded, resumes):
    assert decide_resume(mode, saved, recorded, job="q", member="trainer", where="nats://h:4222") is resumes


@pytest.mark.parametrize("mode, saved, recorded, says", [
    (StartMode.AUTO, _SAVED, None, "not a restart. Pass --fresh"),  # a re-run of the job name
    (StartMode.AUTO, _SAVED, _recorded(finished=True), "its work is done"),
    (StartMode.FRESH, _SAVED, _recorded(finished=False), "contradict the job's history"),
    (StartMode.RESUME, _NOTHING, None, "nothing to resume from"),
])
def test_a_start_that_would_not_do_what_was_meant_is_refused_saying_why(mode, saved, recorded, says):
    with pytest.raises(StartRefused) as info:
        decide_resume(mode, saved, recorded, job="q", member="trainer", where="nats://h:4222")
    assert says in str(info.value) and "trainer" in str(info.value)


# -- rolectl server / replay -----------------------------------------------------------------------

def test_server_store_dir_that_is_a_file_is_a_usage_error(tmp_path):
    store = tmp_path / "store"
    store.write_text("not a directory")
    result = _run("server", "--store-dir", str(store))
    assert result.exit_code == EXIT_USAGE
    assert "--store-dir" in result.output and "is a file" in result.output


def test_server_blames_the_monitoring_port_when_that_is_the_busy_one():
    with socket.socket() as busy, socket.socket() as free:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        free.bind(("127.0.0.1", 0))
        free_port = free.getsockname()[1]
        free.close()
        busy_port = busy.getsockname()[1]
        result = _run("server", "--port", str(free_port), "--http-port", str(busy_port))
    assert result.exit_code == EXIT_USAGE
    assert result.output.strip().startswith(f"Error: --http-port {busy_port}: 127.0.0.1:{busy_port} is already in use")
    assert f"--port {free_port}" not in result.output


def test_replay_of_an_empty_file_exits_2(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    from rolectl.roles.observe.replay import run_replay

    assert run_replay(job=None, nats="nats://127.0.0.1:4222", file=empty, until=None, check=True,
                      as_json=False) == EXIT_USAGE
    assert "holds no records" in capsys.readouterr().err


# -- one exit-code table ---------------------------------------------------------------------------

def test_the_documented_exit_code_table_is_the_codes():
    from rolectl.roles.exit_codes import exit_code_markdown

    doc = (ROOT / "docs" / "operations.md").read_text()
    section = doc.split("\n## Exit codes\n", 1)[1].split("\n#", 1)[0]
    documented = {int(code) for code in re.findall(r"^\| `(\d+)` \|", section, flags=re.M)}
    assert documented == set(EXIT_CODES)
    assert exit_code_markdown() in section, "regenerate the table from roles/exit_codes.exit_code_markdown()"



def test_a_role_started_by_the_cli_keeps_the_configured_stream_replicas(tmp_path):
    """`rolectl start` merges the credential flags into the nats section; it once rebuilt the section
    from them alone, so every role ran with `replicas: 1` and made the lease bucket and the weights
    stream with one copy: a cluster node loss took them with it (docs/fault-tolerance.md)."""
    from rolectl.roles.cli.options import load_job_config

    path = tmp_path / "job.yaml"
    path.write_text("job: replicated\nnats:\n  replicas: 3\n")
    no_flags = {"creds": None, "tls_ca": None, "tls_cert": None, "tls_key": None}
    cfg = load_job_config(str(path), "nats://127.0.0.1:4222", no_flags)
    assert cfg.nats.replicas == 3
    ca = tmp_path / "ca.pem"
    ca.write_text("not read here")
    cfg = load_job_config(str(path), None, {"creds": None, "tls_ca": str(ca), "tls_cert": None, "tls_key": None})
    assert (cfg.nats.replicas, cfg.nats.tls_ca) == (3, str(ca))


def test_a_synchronizer_starts_without_importing_an_engine(tmp_path, nats_url):
    """Its restart time is the job's stall: loading the config for `start sync` leaves the engine's
    sections to the roles that run one (importing them costs seconds of torch), and still checks
    the rest; a trainer's load checks the engine's sections."""
    import subprocess
    import sys

    path = tmp_path / "job.yaml"
    path.write_text(f"job: j\nnats_url: {nats_url}\nmodel:\n  engine: tiny\n  no_such_field: 1\n")
    # the whole start but the synchronizer's loop: config, the server asked, runner, class
    probe = ("import sys; from rolectl.roles.cli.options import load_job_config\n"
             "import rolectl.roles.runner, rolectl.roles.synchronizer\n"
             "async def run(self): pass\n"
             "rolectl.roles.synchronizer.Synchronizer.run = run\n"
             f"cfg = load_job_config({str(path)!r}, None, check_engines=False)\n"
             "assert rolectl.roles.runner.run_role('sync', cfg, log_json=True) == 0\n"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr
    with pytest.raises(ConfigError, match="no_such_field"):
        load_config(path)
    bad_sync = tmp_path / "bad.yaml"
    bad_sync.write_text("job: j\nsynchronizer:\n  sync_interval: -1\n")
    with pytest.raises(ConfigError, match="sync_interval"):
        load_config(bad_sync, check_engines=False)
