"""The embedded nats-server runs with a tighter Go GC (GOGC=25) unless the environment chooses one:
memory storage keeps weight versions in the Go heap, which the default lets grow to twice the stored bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolectl.bus.server import NatsServer, free_port


def _server_environ(server: NatsServer) -> dict[str, str]:
    raw = Path(f"/proc/{server.pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.parametrize(("environment", "expected"), [(None, "25"), ("80", "80")])
def test_the_server_gets_gogc_25_unless_the_environment_sets_it(tmp_path, monkeypatch, environment, expected):
    if environment is None:
        monkeypatch.delenv("GOGC", raising=False)
    else:
        monkeypatch.setenv("GOGC", environment)
    server = NatsServer(store_dir=str(tmp_path / "store"), port=free_port(), log_file=str(tmp_path / "nats.log"))
    server.start()
    try:
        assert _server_environ(server)["GOGC"] == expected
    finally:
        server.stop()


def test_go_gc_none_leaves_the_environment_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("GOGC", raising=False)
    server = NatsServer(store_dir=str(tmp_path / "store"), port=free_port(), go_gc=None)
    server.start()
    try:
        assert "GOGC" not in _server_environ(server)
    finally:
        server.stop()
