"""The embedded nats-server's Go GC: Go's default unless asked (`go_gc`), the environment's GOGC
first; `rolectl up` asks for MEMORY_STORAGE_GOGC when weight versions sit in the server's memory (the
tighter GC trims memory storage's heap) and FILE_STORAGE_GOGC when they sit in its file storage (a
looser GC fetches faster there), Go's default otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolectl.bus.server import FILE_STORAGE_GOGC, MEMORY_STORAGE_GOGC, NatsServer, free_port
from rolectl.roles.config import load_config
from tests.support.e2e import job_config


def _server_environ(server: NatsServer) -> dict[str, str]:
    raw = Path(f"/proc/{server.pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.parametrize(("environment", "expected"), [(None, "25"), ("80", "80")])
def test_go_gc_sets_gogc_unless_the_environment_does(tmp_path, monkeypatch, environment, expected):
    if environment is None:
        monkeypatch.delenv("GOGC", raising=False)
    else:
        monkeypatch.setenv("GOGC", environment)
    server = NatsServer(store_dir=str(tmp_path / "store"), port=free_port(), log_file=str(tmp_path / "nats.log"),
                        go_gc=25)
    server.start()
    try:
        assert _server_environ(server)["GOGC"] == expected
    finally:
        server.stop()


def test_by_default_the_environment_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("GOGC", raising=False)
    server = NatsServer(store_dir=str(tmp_path / "store"), port=free_port())
    server.start()
    try:
        assert "GOGC" not in _server_environ(server)
    finally:
        server.stop()


@pytest.mark.parametrize(("sync_method", "storage", "expected"), [
    ("memory", "memory", MEMORY_STORAGE_GOGC),
    ("memory", "file", FILE_STORAGE_GOGC),
    ("checkpoint", "memory", None),
    ("nccl", "file", None),
])
def test_a_job_gets_a_gc_for_where_its_weights_sit_in_the_server(tmp_path, sync_method, storage, expected):
    path = job_config(tmp_path, synchronizer={"sync_method": sync_method}, transport={"object_store_storage": storage})
    assert load_config(path).server_go_gc == expected
