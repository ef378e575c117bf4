"""The shipped deploy files are valid: nats-server accepts its configs, the manifests parse."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from bus.server import find_nats_server

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _nats_config_test(conf: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True,
                          env=env, timeout=30)


@pytest.mark.parametrize("name", ["single.conf", "cluster/node1.conf", "cluster/node2.conf", "cluster/node3.conf"])
def test_nats_server_accepts_the_shipped_config(name):
    result = _nats_config_test(DEPLOY / "nats" / name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is valid" in result.stdout + result.stderr


def test_nats_server_accepts_the_tls_and_per_role_users_config(tmp_path):
    # The config points at /etc/nats/tls; make a throwaway CA-signed pair and point it here.
    key, crt = tmp_path / "server.key", tmp_path / "server.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True, timeout=60)
    text = (DEPLOY / "nats" / "auth-tls.conf").read_text()
    text = (text.replace("/etc/nats/tls/server.crt", str(crt))
                .replace("/etc/nats/tls/server.key", str(key))
                .replace("/etc/nats/tls/ca.crt", str(crt)))
    conf = tmp_path / "auth-tls.conf"
    conf.write_text(text)
    env = {"TRAINER_PASSWORD": "t", "EXPLORER_PASSWORD": "e", "SYNC_PASSWORD": "s", "OBSERVER_PASSWORD": "o",
           "PATH": "/usr/bin:/bin"}
    result = _nats_config_test(conf, env)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_manifest_runs_every_role_with_rolectl():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "rolectl.yaml").read_text()) if d]
    commands = " ".join(
        " ".join(c.get("command", [])) for d in docs
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    )
    for role in ("start sync", "start trainer", "start explorer"):
        assert role in commands


def test_systemd_unit_starts_a_role_and_stops_it_with_sigint():
    unit = (DEPLOY / "systemd" / "rolectl@.service").read_text()
    assert "rolectl start %i" in unit
    assert "KillSignal=SIGINT" in unit
