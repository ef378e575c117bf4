"""The shipped deploy files are valid: nats-server accepts its configs, the manifests parse."""

from __future__ import annotations

import json
import re
import shutil
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


# -- Prometheus alerts and the Grafana dashboard -------------------------------------------------

PROMETHEUS = DEPLOY / "prometheus"

# nats-server's own metrics as prometheus-nats-exporter names them (`-varz`, `-jsz=all`; its
# README and v0.8.0 release notes), the ones the shipped rules and dashboard use
NATS_EXPORTER_METRICS = {
    "gnatsd_varz_connections", "gnatsd_varz_slow_consumers", "gnatsd_varz_in_msgs", "gnatsd_varz_out_msgs",
    "gnatsd_varz_cpu", "gnatsd_varz_mem", "jetstream_stream_total_bytes", "jetstream_stream_total_messages",
    "jetstream_server_total_message_bytes", "jetstream_server_max_storage",
}
# PromQL's own words: functions, aggregations, keywords
_PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "quantile", "topk", "bottomk", "by", "without", "and", "or", "unless",
    "rate", "increase", "changes", "quantile_over_time", "offset", "on", "ignoring", "group_left", "bool",
}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: `apt-get install prometheus` (.ci/run does)"
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=PROMETHEUS)


def test_promtool_accepts_the_alert_rules_and_the_scrape_config():
    for args in (("check", "rules", "rolectl-alerts.yml"), ("check", "config", "prometheus.yml")):
        result = _promtool(*args)
        assert result.returncode == 0, result.stdout + result.stderr


def test_each_alert_fires_when_it_should_and_not_before():
    result = _promtool("test", "rules", "rolectl-alerts.test.yml")  # the cases are in that file
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    cases = yaml.safe_load((PROMETHEUS / "rolectl-alerts.test.yml").read_text())["tests"]
    tested = {case["alertname"] for test in cases for case in test["alert_rule_test"]}
    assert {"RolectlTrainerStalled", "RolectlMemberExpired", "RolectlSyncSlowerThanItsP99",
            "RolectlRolloutMismatch"} <= tested


def _rolectl_metrics() -> set[str]:
    """Every sample name the dashboard's /metrics gives for a job that trained, synced, refused an
    input and whose nats-server answered (a job folded from records, no server needed)."""
    from prometheus_client import CollectorRegistry

    from rolectl.roles.observe.dashboard import Dashboard
    from rolectl.roles.observe.observer import JobObserver
    from rolectl.roles.observe.prometheus import JobCollector
    from rolectl.sync_protocol import Recorded, StepFinished, SyncConfig, SyncMethod
    from tests.support.reducer_scenario import E1, Job, T, configured, join, loaded, publish, req

    job, records = Job(), []
    for event in (configured(SyncConfig(sync_method=SyncMethod.MEMORY)), join(T), join(E1), req(E1, 0, -1),
                  loaded(E1, 0, round=1), req(E1, 1, 0),
                  StepFinished(member=T, step=1, version=0, metrics={"reward_mean": 0.5, "mean_staleness": 0.2,
                                                                      "dropped_stale_total": 1.0}),
                  publish(1), loaded(E1, 1, round=2)):
        decisions = job.feed(event)
        records.append(job.history[-1])
        for d in decisions:  # recorded right after their cause, as the synchronizer does
            job.seq += 1
            records.append(Recorded(seq=job.seq, time_ms=job.time_ms, event=d))
    records.append(job.record(publish(1)))  # not newer than the latest: the reducer refuses it
    dashboard = Dashboard(job="demo", nats_url="nats://127.0.0.1:4222", monitor_url=None)
    dashboard.observer = JobObserver().extend(records)
    dashboard.nats = {"ok": True, "server": {k: 1 for k in ("connections", "slow_consumers", "in_msgs", "out_msgs",
                                                             "in_bytes", "out_bytes")},
                      "streams": [{"name": "RFT_DEMO_EVENTS", "messages": 1, "bytes": 1}], "jetstream": {"storage": 1}}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(dashboard))
    return {sample.name for family in registry.collect() for sample in family.samples}


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its words, less label matchers, strings,
    durations and PromQL's own words."""
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)  # label matchers and `by (...)` lists are labels, not metrics
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = re.sub(r"\boffset\s+\w+", "", bare)
    bare = re.sub(r"(?<![\w.])\d[\d.]*(e[+-]?\d+)?", "", bare)  # numbers: 0.99, 1e9
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare) if w not in _PROMQL_WORDS}


def _exprs() -> dict[str, str]:
    """Every PromQL expression shipped: the alert rules' and the Grafana dashboard's panels'."""
    out = {}
    for group in yaml.safe_load((PROMETHEUS / "rolectl-alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            out[f"alert {rule['alert']}"] = rule["expr"]
    dashboard = json.loads((DEPLOY / "grafana" / "rolectl.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    return out


def test_every_shipped_expression_reads_metrics_that_rolectl_or_nats_server_export():
    exported = _rolectl_metrics() | NATS_EXPORTER_METRICS
    assert {"rolectl_member_status", "rolectl_sync_round_last_duration_seconds",
            "rolectl_sync_rounds_closed_total", "rolectl_illegal_events_total",
            "rolectl_trainer_mismatch_alarms_total"} <= exported  # the check can fail
    exprs = _exprs()
    assert len(exprs) > 20
    unknown = {where: sorted(_metric_names(expr) - exported) for where, expr in exprs.items()
               if _metric_names(expr) - exported}
    assert unknown == {}


def test_the_grafana_dashboard_is_one_job_at_a_time_and_says_where_its_figures_come_from():
    dashboard = json.loads((DEPLOY / "grafana" / "rolectl.json").read_text())
    assert dashboard["uid"] == "rolectl-job"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["job"]["query"]["query"] == "label_values(rolectl_latest_version, job)"
    rolectl_exprs = [e for where, e in _exprs().items() if where.startswith("panel") and "rolectl_" in e]
    assert all('job="$job"' in e for e in rolectl_exprs)  # one job's figures, never several mixed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
