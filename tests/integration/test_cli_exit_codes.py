"""Commands that read a job agree on exit codes (roles.runner.EXIT_CODES) and speak the user's
words, against a real nats-server: a job the server does not have is 1 everywhere, with no internal
function name in the message; a wrong input file or path is 2."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from rolectl.roles.cli import main
from rolectl.roles.runner import EXIT_ERROR, EXIT_USAGE


@pytest.mark.parametrize("command", [["status"], ["export", "-o", "{tmp}/out.jsonl"], ["replay"]])
def test_a_job_the_server_does_not_have_is_exit_1_in_every_command(command, nats_url, job_name, tmp_path):
    args = [a.format(tmp=tmp_path) for a in command]
    result = CliRunner().invoke(main, [*args, "--job", job_name, "--nats", nats_url])
    assert result.exit_code == EXIT_ERROR, result.output
    assert f"no member of job '{job_name}' has started on this server yet; check the job name and --nats" in result.output
    assert "ensure_" not in result.output and "Traceback" not in result.output


def test_export_to_a_path_that_cannot_be_written_is_exit_2(nats_url, job_name, tmp_path):
    result = CliRunner().invoke(main, ["export", "--job", job_name, "--nats", nats_url, "-o", str(tmp_path / "out.txt")])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "unknown export format '.txt'" in result.output
