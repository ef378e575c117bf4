"""`rolectl up --launcher ray` before any cluster: the bundles it asks for, the config fields they
come from, the flags it refuses, the message when Ray is not installed, and, secured, what each
actor is handed: its own identity's files only, written where only it can read them."""

from __future__ import annotations

import shutil
import sys

import pytest
from click.testing import CliRunner

from rolectl.bus.auth import init_auth_dir
from rolectl.roles.cli import main
from rolectl.roles.config import load_config, parse_config
from rolectl.roles.launch.base import Launcher, RoleHandle
from rolectl.roles.launch.local import LocalLauncher
from rolectl.roles.launch.ray import INSTALL_HINT, RayLauncher, _private_dir, _write_private, actor_name, role_bundles
from rolectl.sync_protocol import ConfigError

QUICKSTART = "examples/quickstart.yaml"


def _cfg(**sections):
    return parse_config({"job": "j", "model": {"engine": "tiny"}, **sections})


def test_bundles_follow_the_config_in_start_order():
    cfg = _cfg(trainer={"num_gpus": 2, "num_cpus": 4},
               explorers={"count": 2, "num_cpus": 2, "use_gpus": True, "engine_num": 2, "tensor_parallel_size": 2})
    assert role_bundles(cfg) == [
        ("sync", "sync-0", {"CPU": 1.0}),
        ("trainer", "trainer", {"CPU": 4.0, "GPU": 2.0}),
        ("explorer", "explorer-0", {"CPU": 2.0, "GPU": 4.0}),  # engine_num x tensor_parallel_size
        ("explorer", "explorer-1", {"CPU": 2.0, "GPU": 4.0}),
    ]


def test_cpu_only_job_asks_for_no_gpu():
    bundles = role_bundles(load_config(QUICKSTART))
    assert [b for _, _, b in bundles] == [{"CPU": 1.0}] * 4


@pytest.mark.parametrize("section, field, value, says", [
    ("trainer", "num_gpus", -1, "integer >= 0"),
    ("trainer", "num_cpus", 0, "integer > 0"),
    ("explorers", "num_cpus", 1.5, "integer > 0"),
    ("explorers", "use_gpus", "yes", "true or false"),
])
def test_bad_resource_fields_are_named(section, field, value, says):
    with pytest.raises(ConfigError) as info:
        _cfg(**{section: {field: value}})
    assert f"{section}.{field}" in str(info.value) and says in str(info.value)


def test_actor_names_are_per_job():
    assert actor_name("quickstart", "trainer") != actor_name("other", "trainer")


def test_the_local_launcher_is_behind_the_seam(tmp_path):
    launcher = LocalLauncher(config_path=tmp_path / "job.yaml", nats_url="nats://127.0.0.1:1", logs=tmp_path)
    assert isinstance(launcher, Launcher) and launcher.name == "local"


def test_missing_ray_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as on a machine without it
    result = CliRunner().invoke(main, ["up", "--launcher", "ray", "--config", QUICKSTART, "--no-dashboard"])
    assert result.exit_code == 1, result.output
    assert INSTALL_HINT in result.output and "--launcher ray needs Ray" in result.output


@pytest.mark.parametrize("args, says", [
    (["--ray-address", "auto"], "--ray-address apply to --launcher ray only"),
    (["--nats", "nats://x:4222"], "--nats apply to --launcher ray only"),
])
def test_flags_that_do_not_fit_the_launcher_are_refused(args, says):
    result = CliRunner().invoke(main, ["up", "--config", QUICKSTART, *args])
    assert result.exit_code == 2, result.output
    assert says in result.output


def test_up_help_documents_the_launchers():
    text = CliRunner().invoke(main, ["up", "--help"]).output
    for flag in ("--launcher [local|ray]", "--ray-address", "--nats", "--max-restarts"):
        assert flag in text


def test_role_handle_protocol_is_what_the_supervisor_uses():
    import inspect

    from rolectl.roles.launch import local

    source = inspect.getsource(local.supervise) + inspect.getsource(local._Supervision)
    assert ".proc" not in source  # the supervisor sees RoleHandles only, whatever the launcher
    assert {"poll", "returncode", "restarts", "tail", "name"} <= set(dir(RoleHandle))


@pytest.fixture(scope="module")
def auth(tmp_path_factory):
    return init_auth_dir(tmp_path_factory.mktemp("auth") / "auth", job="j", explorers=2, synchronizers=1)


def test_each_actor_is_handed_its_own_identity_and_the_ca_only(auth, tmp_path):
    launcher = RayLauncher(cfg=_cfg(explorers={"count": 2}), placement_group=None, config_path=tmp_path / "job.yaml",
                           logs=tmp_path, max_restarts=0, auth=auth)
    for member in ("trainer", "explorer-0", "explorer-1", "sync-0"):
        files = launcher._identity(member)
        assert files == {f"{member}.nk": auth.credential(member).read_bytes(), "ca.pem": auth.ca.read_bytes()}
    assert RayLauncher(cfg=_cfg(), placement_group=None, config_path=tmp_path, logs=tmp_path,
                       max_restarts=0)._identity("trainer") is None  # not secured: nothing handed out


def test_an_actor_writes_its_identity_where_only_its_user_can_read_it(auth):
    private = _private_dir("rolectl-test-")
    try:
        written = _write_private(private, {"explorer-0.nk": b"SUSECRET", "ca.pem": b"CA", "../escape": b"x"})
        assert (private.stat().st_mode & 0o777) == 0o700
        assert all(path.parent == private and (path.stat().st_mode & 0o777) == 0o600 for path in written.values())
        assert written["explorer-0.nk"].read_bytes() == b"SUSECRET"
    finally:
        shutil.rmtree(private)


def test_identities_made_for_another_job_are_refused_before_anything_starts(tmp_path):
    other = init_auth_dir(tmp_path / "other", job="another-job", explorers=2, synchronizers=1)
    result = CliRunner().invoke(main, ["up", "--launcher", "ray", "--config", QUICKSTART, "--no-dashboard",
                                       "--auth-dir", str(other.path)])
    assert result.exit_code == 1, result.output
    assert "its identities are for job 'another-job'" in result.output
