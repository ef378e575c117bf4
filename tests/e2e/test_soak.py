"""The chaos soak, short: `python -m benchmarks.soak` for 3 minutes with a fault every ~10 s (kill -9
and SIGSTOP of roles, nats-server kill -9 and restart, seeded) loses, duplicates and hangs nothing,
and `replay --check` is clean over archive and tail; and on a 3-node cluster, losing nodes. The long
run's figures are in the docs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.e2e import ROOT

pytestmark = pytest.mark.e2e


def soak_without_losses(tmp_path, *, seed: int, timeout: int, extra: tuple[str, ...] = ()) -> dict:
    """Run a 3-minute soak (2 explorers, a fault every ~10 s) and check what every soak must show:
    ten faults or more, steps trained, and nothing lost, duplicated, hung or replayed differently."""
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--minutes", "3", "--explorers", "2", "--fault-every", "10",
         "--seed", str(seed), *extra, "--json", str(out), "--workdir", str(tmp_path / "soak")],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["faults_injected"] >= 10, result
    assert result["trainer_steps"] > 0, result
    for key in ("experiences_lost", "experiences_duplicated", "hangs", "replay_check_mismatches",
                "trainer_steps_reported_twice", "trainer_steps_missing", "unexpected_exits"):
        assert result[key] == 0, _finding(key, result, tmp_path / "soak", proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return result


def _finding(key: str, result: dict, workdir, stdout: str) -> str:
    """What a failed check needs to be understood from CI's output alone: the figure, the soak's
    own account (its fault and EXIT lines) and the end of every log of a member that exited."""
    lines = [f"{key} = {result[key]}", json.dumps({k: v for k, v in result.items() if k.endswith("_first")}),
             "--- soak output", *stdout.splitlines()[-40:]]
    for exit_line in result.get("unexpected_exits_first", []):
        member = exit_line.split()[0]
        log = workdir / "logs" / f"{member}.log"
        if log.exists():
            lines += [f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-40:]]
    return "\n".join(lines)


def test_a_three_minute_soak_with_ten_faults_or_more_loses_nothing(tmp_path):
    soak_without_losses(tmp_path, seed=7, timeout=600)


def test_a_three_minute_soak_on_a_three_node_cluster_losing_nodes_loses_nothing(tmp_path):
    """The same soak on a local 3-node cluster (`nats.replicas: 3`), where the server fault is a node
    lost (kill -9, back after the heartbeat expiry; half the time the event stream's leader). Seed 27
    draws node faults as the 4th and 8th faults."""
    result = soak_without_losses(tmp_path, seed=27, timeout=900, extra=("--cluster",))
    assert result["cluster"] and result["faults"].get("node", 0) >= 1, result
