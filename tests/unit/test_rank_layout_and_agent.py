"""A trainer of several ranks, the parts without processes: which ranks a host runs, what the CLI and
the config refuse (the processes themselves: tests/e2e/test_trainer_ranks.py)."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from rolectl.roles.cli import main
from rolectl.roles.config import parse_config
from rolectl.roles.launch.ranks import RANK_ENV, RankLayout
from rolectl.sync_protocol import ConfigError
from tests.support.e2e import ROOT


def test_one_host_runs_every_rank_and_rank_0_listens_on_loopback():
    layout = RankLayout(2)
    assert list(layout.ranks()) == [0, 1] and layout.master_addr == "127.0.0.1"
    env = layout.env(1, 29500)
    assert env[RANK_ENV] == "1" and env["RANK"] == "1" and env["LOCAL_RANK"] == "1"
    assert env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "29500"


def test_hosts_split_the_ranks_in_order():
    layout = RankLayout(4, nnodes=2, node_rank=1, master_addr="host0", master_port=29500)
    assert list(layout.ranks()) == [2, 3]
    assert layout.env(3, 29500)["LOCAL_RANK"] == "1" and layout.env(3, 29500)["MASTER_ADDR"] == "host0"


@pytest.mark.parametrize("kwargs,says", [
    ({"world_size": 3, "nnodes": 2, "master_addr": "h", "master_port": 1}, "do not divide"),
    ({"world_size": 2, "nnodes": 2, "node_rank": 2, "master_addr": "h", "master_port": 1}, "--node-rank 2"),
    ({"world_size": 2, "nnodes": 2}, "--master-addr and --master-port"),
])
def test_a_layout_that_cannot_work_is_refused_saying_why(kwargs, says):
    world_size = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=says):
        RankLayout(world_size, **kwargs)


def _fsdp_example(tmp_path, **trainer) -> dict:
    data = yaml.safe_load((ROOT / "examples" / "llm_quickstart_fsdp.yaml").read_text())
    data["trainer"].update(trainer)
    data["model"]["path"] = str(tmp_path / "model")
    return data


def test_ranks_need_the_fsdp_engine(tmp_path):
    data = _fsdp_example(tmp_path)
    data["model"]["engine"] = "hf"
    del data["model"]["fsdp"]
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert [path for path, _ in info.value.problems] == ["trainer.world_size"]
    assert "model.engine: fsdp" in info.value.problems[0][1]
    assert parse_config(_fsdp_example(tmp_path)).trainer.world_size == 2


def test_rank_flags_without_ranks_are_a_usage_error(tmp_path):
    data = _fsdp_example(tmp_path, world_size=1)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["start", "trainer", "--config", str(path), "--nnodes", "2"])
    assert result.exit_code == 2 and "trainer.world_size > 1" in result.output


def test_a_rank_layout_the_job_cannot_use_is_a_usage_error(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_fsdp_example(tmp_path)))
    result = CliRunner().invoke(main, ["start", "trainer", "--config", str(path), "--nnodes", "2"])
    assert result.exit_code == 2 and "--master-addr and --master-port" in result.output


# -- the agent, with scripted ranks (real processes; each reads its rank from the environment) -----

# Rank 1 writes its pid and exits (with the code in FOLLOWER_CODES for this attempt); rank 0 waits
# until that process is gone, then exits with LEADER_CODE: a follower always leaves first.
RANK_SCRIPT = """
import json, os, sys, time
from pathlib import Path
work = Path(sys.argv[1]); plan = json.loads((work / "plan.json").read_text())
rank = int(os.environ["RANK"]); attempt = len(list(work.glob(f"start-{rank}-*")))
(work / f"start-{rank}-{attempt}").write_text(" ".join(sys.argv[2:]))
if rank == 1:
    (work / f"pid-{attempt}").write_text(str(os.getpid()))
    sys.exit(plan["follower_codes"][min(attempt, len(plan["follower_codes"]) - 1)])
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    pid_file = work / f"pid-{attempt}"
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), 0)
        except ProcessLookupError:
            break
    time.sleep(0.05)
sys.exit(plan["leader_code"])
"""


class _Log:
    def __init__(self):
        self.events = []

    def __getattr__(self, level):
        return lambda event, **kw: self.events.append(event)


def _supervise(tmp_path, *, follower_codes, leader_code=0, max_restarts=3):
    import json
    import sys

    from rolectl.roles.launch.ranks import supervise_ranks

    (tmp_path / "plan.json").write_text(json.dumps({"follower_codes": follower_codes, "leader_code": leader_code}))
    log = _Log()
    code = supervise_ranks(RankLayout(2), [sys.executable, "-c", RANK_SCRIPT, str(tmp_path), "--fresh"],
                           max_restarts=max_restarts, log=log)
    starts = sorted(p.name for p in tmp_path.glob("start-0-*"))
    return code, log.events, starts


def test_a_follower_leaving_after_stop_is_no_failure(tmp_path):
    code, events, starts = _supervise(tmp_path, follower_codes=[0], leader_code=0)
    assert code == 0 and starts == ["start-0-0"] and "trainer_rank_died" not in events


def test_a_dead_rank_restarts_every_rank_together_without_fresh(tmp_path):
    # rank 1 dies (as by kill -9) on the first attempt; the second attempt ends normally
    code, events, starts = _supervise(tmp_path, follower_codes=[-9 % 256, 0])
    assert code == 0 and starts == ["start-0-0", "start-0-1"], events
    assert events.count("trainer_ranks_restarting") == 1
    assert (tmp_path / "start-0-0").read_text() == "--fresh" and (tmp_path / "start-0-1").read_text() == ""


def test_a_trainer_that_keeps_dying_fails_after_its_restarts(tmp_path):
    code, events, starts = _supervise(tmp_path, follower_codes=[1], max_restarts=1)
    assert code == 1 and len(starts) == 2 and events.count("trainer_rank_died") == 2


@pytest.mark.parametrize("leader_code", [2, 3])
def test_rank_0s_own_end_is_the_trainers_and_never_restarted(tmp_path, leader_code):
    code, events, starts = _supervise(tmp_path, follower_codes=[0], leader_code=leader_code)
    assert code == leader_code and starts == ["start-0-0"]
