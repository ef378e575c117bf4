"""`rolectl start explorer --serve`: what it refuses up front, before any process starts, and why."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rolectl.roles.cli import main
from rolectl.roles.config import load_config
from rolectl.roles.serve import serve_problems

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "serve_quickstart.yaml"


def _run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _variant(tmp_path: Path, **sections) -> Path:
    data = yaml.safe_load(EXAMPLE.read_text())
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_example_can_serve_and_its_section_loads():
    cfg = load_config(EXAMPLE, check_engines=False)
    assert cfg.serve.enabled and cfg.serve.agent[1] == "examples/agent_digits.py"
    assert serve_problems(cfg) == []


@pytest.mark.parametrize("args, says", [
    (("start", "trainer", "--serve"), "--serve and --port are for `rolectl start explorer`"),
    (("start", "sync", "--port", "8400"), "--serve and --port are for `rolectl start explorer`"),
])
def test_serve_flags_belong_to_an_explorer(args, says):
    result = _run(*args, "--config", str(EXAMPLE))
    assert result.exit_code == 2 and says in result.output


def test_a_port_without_serving_is_refused(tmp_path):
    result = _run("start", "explorer", "--port", "8400", "--config", str(_variant(tmp_path, serve={"enabled": False})))
    assert result.exit_code == 2 and "give --serve too" in result.output


@pytest.mark.parametrize("sections, where, says", [
    ({"synchronizer": {"sync_style": "fixed"}}, "synchronizer.sync_style", "needs sync_style fully_async"),
    ({"synchronizer": {"sync_method": "nccl"}}, "synchronizer.sync_style", "with a pull method"),
    ({"serve": {"api_key_env": "ROLECTL_TEST_UNSET_KEY"}}, "serve.api_key_env", "ROLECTL_TEST_UNSET_KEY is not set"),
])
def test_a_job_that_cannot_serve_says_what_to_change(tmp_path, monkeypatch, sections, where, says):
    monkeypatch.delenv("ROLECTL_TEST_UNSET_KEY", raising=False)
    result = _run("start", "explorer", "--serve", "--config", str(_variant(tmp_path, **sections)))
    assert result.exit_code == 2, result.output
    assert where in result.output and says in " ".join(result.output.split())


@pytest.mark.parametrize("serve, says", [
    ({"port": 70000}, "serve.port"),
    ({"max_queue": 0}, "serve.max_queue"),
    ({"reward_timeout_s": float("inf")}, "serve.reward_timeout_s"),
    ({"bogus": 1}, "serve.bogus"),
])
def test_bad_serve_values_are_reported_by_path(tmp_path, serve, says):
    from rolectl.sync_protocol import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(_variant(tmp_path, serve=serve), check_engines=False)
    assert says in str(info.value)


class _RemoteHandle:
    """A role handle whose launcher reads the URL where the role runs (as `RayRole.serve_url` does)."""

    def __init__(self, member_id: str, answers: list[str | None]) -> None:
        self.member_id = member_id
        self.answers = answers
        self.asked: list[str] = []

    def serve_url(self, path: str) -> str | None:
        self.asked.append(path)
        return self.answers.pop(0)


def test_up_prints_each_serving_url_once_local_or_read_where_the_explorer_runs(tmp_path, capsys):
    from rolectl.roles.config import parse_config
    from rolectl.roles.launch.local import _print_serve_urls, read_serve_url

    cfg = parse_config({"job": "urls", "run_dir": str(tmp_path), "explorers": {"count": 2}})
    local = cfg.job_dir / "explorer-0" / "serve_url"
    local.parent.mkdir(parents=True)
    local.write_text("{not json")  # being written: not printed yet
    assert read_serve_url(local) is None
    remote = _RemoteHandle("explorer-1", [None, "http://10.0.0.7:8400/v1"])
    printed: set[str] = set()
    _print_serve_urls(cfg, printed, [remote])
    assert printed == set()
    local.write_text('{"url": "http://127.0.0.1:8400/v1", "model": "urls"}')
    _print_serve_urls(cfg, printed, [remote])
    _print_serve_urls(cfg, printed, [remote])  # each once
    out = " ".join(capsys.readouterr().err.split())  # up's console writes to stderr
    assert printed == {"explorer-0", "explorer-1"}
    assert out.count("serving: explorer-0 http://127.0.0.1:8400/v1") == 1
    assert out.count("serving: explorer-1 http://10.0.0.7:8400/v1") == 1
    assert remote.asked == [str(cfg.job_dir / "explorer-1" / "serve_url")] * 2
