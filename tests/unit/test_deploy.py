"""The shipped deploy files are valid: nats-server accepts its configs, the manifests parse."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rolectl.bus.server import find_nats_server

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
    from rolectl.bus.auth import parse_header, parse_nkeys, render_server_conf

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
    from rolectl.bus.auth import init_auth_dir

    made = init_auth_dir(tmp_path / "auth", job="demo", explorers=1)
    text = (DEPLOY / "nats" / "auth-tls.conf").read_text()
    text = text.replace(_AUTH_DIR, str(made.path)).replace("/var/lib/nats/jetstream", str(tmp_path / "js"))
    conf = tmp_path / "auth-tls.conf"
    conf.write_text(text)
    result = _nats_config_test(conf)
    assert result.returncode == 0, result.stdout + result.stderr


def test_systemd_and_kubernetes_files_pass_credentials_by_file_in_the_environment():
    from rolectl.bus.security import ENV_VARS

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


# -- every rolectl command in deploy/ is one the CLI accepts ------------------------------------------

def _rolectl_commands() -> list[tuple[str, list[str]]]:
    """(file, argv) of every `rolectl ...` command line in the k8s manifests, the systemd unit and
    the Ray cluster example, with shell placeholders ($(POD_NAME), ${ROLECTL_ID}) left as values."""
    import shlex

    found = []

    def add(where: str, text: str) -> None:
        words = shlex.split(text.replace("exec ", ""))
        for i, word in enumerate(words):
            if word == "rolectl" or word.endswith("/rolectl"):
                found.append((where, words[i:]))
                break

    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
            if doc.get("kind") == "RayJob":
                add(path.name, doc["spec"]["entrypoint"])
            for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                command = c.get("command", [])
                add(path.name, command[-1] if command[:2] == ["sh", "-c"] else shlex.join(command))
    unit = (DEPLOY / "systemd" / "rolectl@.service").read_text()
    add("rolectl@.service", next(line for line in unit.splitlines() if line.startswith("ExecStart="))[10:])
    for line in (DEPLOY / "ray" / "cluster.yaml").read_text().splitlines():
        if "ray job submit" in line:
            add("cluster.yaml", line.lstrip("# "))
    return found


def test_every_rolectl_command_in_deploy_is_accepted_by_the_cli():
    import click

    from rolectl.roles.cli import main

    commands = _rolectl_commands()
    assert {where for where, _ in commands} >= {"rolectl.yaml", "rayjob.yaml", "rolectl@.service"}
    for where, argv in commands:
        command, rest = main, argv[1:]
        while isinstance(command, click.Group):
            assert rest and rest[0] in command.commands, f"{where}: {argv}: no such command"
            command, rest = command.commands[rest[0]], rest[1:]
        params = {opt: p for p in command.params for opt in (*p.opts, *p.secondary_opts)}
        for i, word in enumerate(rest):
            if not word.startswith("--"):
                continue
            assert word in params, f"{where}: `{' '.join(argv)}`: {command.name} has no option {word}"
            param = params[word]
            if isinstance(param.type, click.Choice):
                assert rest[i + 1] in param.type.choices, f"{where}: {word} {rest[i + 1]}"
        for param in command.params:
            if param.required:
                assert any(opt in rest for opt in param.opts) or not param.opts[0].startswith("-"), (
                    f"{where}: `{' '.join(argv)}` lacks {param.opts[0]}")


def test_kuberay_rayjob_runs_up_on_ray_and_tears_the_cluster_down():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "rayjob.yaml").read_text()) if d]
    (job,) = docs
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert "up --launcher ray" in job["spec"]["entrypoint"]
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert all(g["template"]["spec"]["containers"] for g in cluster["workerGroupSpecs"])


def test_ray_cluster_example_passes_rays_schema():
    import json

    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)  # what `ray up` checks first: unknown fields, wrong types
    config["head_node"] = []
    with pytest.raises(jsonschema.ValidationError):  # the check can fail
        jsonschema.validate(config, schema)
    assert any("rolectl[ray]" in c for c in config["setup_commands"])
