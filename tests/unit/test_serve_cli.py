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
