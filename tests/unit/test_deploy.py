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


_AUTH_DIR = "/etc/rolectl/auth"


def test_the_shipped_secure_config_is_what_auth_init_writes():
    """deploy/nats/auth-tls.conf is `rolectl auth init`'s output (the command is in its header):
    re-rendering it with its own public nkeys gives the same text, so permissions cannot drift."""
    from bus.auth import parse_header, parse_nkeys, render_server_conf

    text = (DEPLOY / "nats" / "auth-tls.conf").read_text()
    job, explorers, synchronizers = parse_header(text)
    command = next(line for line in text.splitlines() if line.startswith("# Written by: "))[len("# Written by: "):]
    rendered = render_server_conf(
        job=job, explorers=explorers, synchronizers=synchronizers, nkeys=parse_nkeys(text),
        port=4222, http_port=8222, listen_host="0.0.0.0", cert_file=f"{_AUTH_DIR}/server.pem",
        key_file=f"{_AUTH_DIR}/server.key", store_dir="/var/lib/nats/jetstream", command=command,
    )
    assert text == rendered


def test_nats_server_accepts_the_shipped_secure_config(tmp_path):
    # The config points at /etc/rolectl/auth; make real certificates with auth init and point it here.
    from bus.auth import init_auth_dir

    made = init_auth_dir(tmp_path / "auth", job="demo", explorers=1)
    text = (DEPLOY / "nats" / "auth-tls.conf").read_text()
    text = text.replace(_AUTH_DIR, str(made.path)).replace("/var/lib/nats/jetstream", str(tmp_path / "js"))
    conf = tmp_path / "auth-tls.conf"
    conf.write_text(text)
    result = _nats_config_test(conf)
    assert result.returncode == 0, result.stdout + result.stderr


def test_systemd_and_kubernetes_files_pass_credentials_by_file_in_the_environment():
    from bus.security import ENV_VARS

    for path in (DEPLOY / "systemd" / "rolectl@.service", DEPLOY / "k8s" / "rolectl.yaml"):
        text = path.read_text()
        for var in (ENV_VARS["creds"], ENV_VARS["tls_ca"]):
            assert var in text, f"{path.name} does not say how to pass {var}"


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
