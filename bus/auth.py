"""A secure deployment of one job: identities, least-privilege permissions, and `rolectl auth init`'s files.

One identity per member (``trainer``, ``explorer-<i>``, ``sync-<k>``) plus ``observer`` (read-only:
dashboard, status, export, replay) and ``admin`` (provisions streams). Each authenticates with an
nkey (``<identity>.nk``: the seed stays with the client, the server config holds the public key)
over TLS (a server certificate signed by a generated CA). Permissions follow what each role really
sends (subjects from `JobNames`, JetStream API subjects as nats-py spells them):

- a member publishes only its own events, heartbeat and (explorers) experiences; only synchronizer
  identities publish decisions; only the trainer publishes weights and CUDA IPC requests;
- JetStream API: stream info, message get and ephemeral consumers on the event stream for everyone;
  the trainer's durable consumer (create, next, ack) for the trainer only; weights direct get for
  members; weights purge (pruning old versions) for the trainer only; stream create/update/delete/
  purge and consumer delete for ``admin`` only;
- replies come on ``_INBOX.<job>.<identity>.>`` (each identity subscribes to its own prefix only) and
  requests are answered through ``allow_responses``;
- every subject is scoped to the job (``rft.<job>.…`` and the job's stream names).

`server_permissions()` and `render_server_conf()` are pure; `init_auth_dir()` writes the files.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .security import ADMIN_IDENTITY, ENV_VARS, ClientSecurity, inbox_prefix
from .subjects import JobNames, check_name

__all__ = [
    "OBSERVER_IDENTITY",
    "AuthDir",
    "identities",
    "server_permissions",
    "render_server_conf",
    "init_auth_dir",
    "read_auth_dir",
    "parse_nkeys",
    "with_tls_files",
]

OBSERVER_IDENTITY = "observer"
_API = "$JS.API"
_MANIFEST = "auth.json"


def identities(explorers: int, synchronizers: int) -> list[tuple[str, str]]:
    """(identity, role) for every identity of a job, in the order the server config lists them."""
    out = [("trainer", "trainer")]
    out += [(f"explorer-{i}", "explorer") for i in range(explorers)]
    out += [(f"sync-{k}", "synchronizer") for k in range(synchronizers)]
    out += [(OBSERVER_IDENTITY, "observer"), (ADMIN_IDENTITY, "admin")]
    return out


def _reader_api(n: JobNames) -> list[str]:
    """What anyone who reads the job needs: account info, stream info, recorded messages by
    sequence, and its own ephemeral pull consumers on the event stream."""
    ev, exp, w = n.event_stream, n.experience_stream, n.weights_stream
    snapshots = f"KV_{n.snapshot_bucket}"  # views start from the newest reducer snapshot
    return [
        f"{_API}.INFO",
        f"{_API}.STREAM.INFO.{ev}", f"{_API}.STREAM.INFO.{exp}", f"{_API}.STREAM.INFO.{w}",
        f"{_API}.STREAM.MSG.GET.{ev}",
        f"{_API}.CONSUMER.CREATE.{ev}.>",
        f"{_API}.CONSUMER.INFO.{ev}.*",
        f"{_API}.CONSUMER.MSG.NEXT.{ev}.*",
        f"{_API}.STREAM.INFO.{snapshots}", f"{_API}.STREAM.MSG.GET.{snapshots}",
        f"{_API}.DIRECT.GET.{snapshots}", f"{_API}.DIRECT.GET.{snapshots}.>",
    ]


def server_permissions(job: str, identity: str, role: str) -> dict[str, Any]:
    """The nats-server `permissions` block of one identity: {publish: [...], subscribe: [...]}."""
    n = JobNames(job)
    check_name(identity, "identity")
    w = n.weights_stream
    weights_read = [f"{_API}.DIRECT.GET.{w}", f"{_API}.DIRECT.GET.{w}.>"]
    inbox = f"{inbox_prefix(job, identity)}.>"
    if role == "admin":
        # admin provisions and repairs streams; it publishes no job subject (decisions come only
        # from synchronizer identities).
        return {"publish": [f"{_API}.>"], "subscribe": [f"{n.prefix}.>", inbox]}
    if role == "observer":
        return {"publish": _reader_api(n), "subscribe": [n.all_heartbeats, inbox]}
    own = [f"{n.prefix}.evt.{role}.{identity}.>", n.heartbeat(role, identity)]
    publish, subscribe = own + _reader_api(n), [n.all_heartbeats, inbox]
    if role == "trainer":
        exp, durable = n.experience_stream, n.trainer_experience_durable
        publish += [
            n.all_weights, f"{n.prefix}.ipc.*",
            f"{_API}.CONSUMER.CREATE.{exp}.{durable}", f"{_API}.CONSUMER.CREATE.{exp}.{durable}.>",
            f"{_API}.CONSUMER.INFO.{exp}.{durable}", f"{_API}.CONSUMER.MSG.NEXT.{exp}.{durable}",
            f"$JS.ACK.{exp}.{durable}.>",
            f"{_API}.STREAM.PURGE.{w}",  # prune old weight versions
            *weights_read,
        ]
    elif role == "explorer":
        publish += [n.experiences(identity), *weights_read]
        subscribe += [n.cuda_ipc(identity)]
    elif role == "synchronizer":
        lease = f"KV_{n.lease_bucket}"
        publish += [
            n.all_decisions,
            # the active/standby lease (read, create, renew, release) and writing snapshots
            f"$KV.{n.lease_bucket}.>", f"$KV.{n.snapshot_bucket}.>",
            f"{_API}.STREAM.INFO.{lease}", f"{_API}.STREAM.MSG.GET.{lease}",
            f"{_API}.DIRECT.GET.{lease}", f"{_API}.DIRECT.GET.{lease}.>",
        ]
    else:
        raise ValueError(f"unknown role {role!r} for identity {identity!r}")
    return {"publish": publish, "subscribe": subscribe}


def _quoted(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def render_server_conf(
    *,
    job: str,
    explorers: int,
    synchronizers: int,
    nkeys: dict[str, str],
    port: int = 4222,
    http_port: int = 8222,
    listen_host: str = "127.0.0.1",
    cert_file: str,
    key_file: str,
    store_dir: str,
    command: str,
) -> str:
    """The nats-server config for one job: TLS, JetStream, one nkey user per identity with its
    permissions. `nkeys` maps identity -> public nkey. Pure: same inputs, same text."""
    users = []
    for identity, role in identities(explorers, synchronizers):
        perms = server_permissions(job, identity, role)
        users.append(
            f"    # identity: {identity} ({role})\n"
            f"    {{ nkey: {nkeys[identity]},\n"
            f"      permissions: {{\n"
            f"        publish: {{ allow: {_quoted(perms['publish'])} }},\n"
            f"        subscribe: {{ allow: {_quoted(perms['subscribe'])} }},\n"
            f"        allow_responses: true\n"
            f"      }} }}"
        )
    users_text = "\n".join(users)
    return (
        f"# nats-server for rolectl job {job}: TLS, JetStream, one nkey identity per member.\n"
        f"# Written by: {command}\n"
        f"# Run:        rolectl server --config <this file>   (or nats-server -c <this file>)\n"
        f"# rolectl-auth: job={job} explorers={explorers} synchronizers={synchronizers}\n"
        f"listen: {json.dumps(f'{listen_host}:{port}')}\n"
        f"# Monitoring has no authentication: keep it on loopback.\n"
        f"http: {json.dumps(f'127.0.0.1:{http_port}')}\n"
        f"max_payload: 8MB\n"
        f"\n"
        f"tls {{\n"
        f"  cert_file: {json.dumps(cert_file)}\n"
        f"  key_file: {json.dumps(key_file)}\n"
        f"  timeout: 5\n"
        f"}}\n"
        f"\n"
        f"jetstream {{ store_dir: {json.dumps(store_dir)} }}\n"
        f"\n"
        f"authorization {{\n"
        f"  users = [\n"
        f"{users_text}\n"
        f"  ]\n"
        f"}}\n"
    )


_NKEY_LINE = re.compile(r"# identity: (?P<identity>[A-Za-z0-9_-]+) \([a-z]+\)\n\s*\{ nkey: (?P<nkey>U[A-Z0-9]{55}),")
_HEADER = re.compile(r"# rolectl-auth: job=(?P<job>\S+) explorers=(?P<e>\d+) synchronizers=(?P<s>\d+)")


def parse_nkeys(conf_text: str) -> dict[str, str]:
    """identity -> public nkey, as listed in a config `render_server_conf` wrote."""
    return {m["identity"]: m["nkey"] for m in _NKEY_LINE.finditer(conf_text)}


def parse_header(conf_text: str) -> tuple[str, int, int]:
    """(job, explorers, synchronizers) from a config `render_server_conf` wrote."""
    m = _HEADER.search(conf_text)
    if m is None:
        raise ValueError("not a config written by `rolectl auth init` (no '# rolectl-auth:' header)")
    return m["job"], int(m["e"]), int(m["s"])


def with_tls_files(conf_text: str, *, cert_file: str | Path, key_file: str | Path) -> str:
    """A config `render_server_conf` wrote, its server certificate and key moved to these files
    (a server started on another node, from copies written there)."""
    for key, path in (("cert_file", cert_file), ("key_file", key_file)):
        quoted = json.dumps(str(path))

        def keep_key(match: re.Match[str], quoted: str = quoted) -> str:  # a function: the path is not a template
            return match.group(1) + quoted

        conf_text, n = re.subn(rf"(?m)^(\s*{key}: ).*$", keep_key, conf_text)
        if n != 1:
            raise ValueError(f"not a nats-server.conf `rolectl auth init` wrote: no `{key}:` line")
    return conf_text


# -- files ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AuthDir:
    """What `rolectl auth init` wrote in `path` (read back by `read_auth_dir`)."""

    path: Path
    job: str
    explorers: int
    synchronizers: int
    url: str
    port: int
    http_port: int

    @property
    def server_conf(self) -> Path:
        return self.path / "nats-server.conf"

    @property
    def ca(self) -> Path:
        return self.path / "ca.pem"

    def server_conf_with_store(self, store_dir: str | Path) -> str:
        """The server config with its JetStream store moved to `store_dir` (one store per run)."""
        text = self.server_conf.read_text()
        new, n = re.subn(r'(?m)^jetstream \{ store_dir: .* \}$',
                         lambda _m: f"jetstream {{ store_dir: {json.dumps(str(store_dir))} }}", text)
        if n != 1:
            raise ValueError(f"{self.server_conf}: no `jetstream {{ store_dir: ... }}` line as auth init writes it")
        return new

    @property
    def monitor_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def credential(self, identity: str) -> Path:
        return self.path / f"{identity}.nk"

    def security(self, identity: str) -> ClientSecurity:
        """Client settings for `identity`: its nkey, and the CA to check the server with."""
        cred = self.credential(identity)
        if not cred.is_file():
            raise FileNotFoundError(
                f"{self.path} has no credential for {identity!r} ({cred.name}); it was made for job "
                f"{self.job!r} with {self.explorers} explorer(s) and {self.synchronizers} "
                f"synchronizer(s): run `rolectl auth init` again with enough of them"
            )
        return ClientSecurity(creds=str(cred), tls_ca=str(self.ca))


def read_auth_dir(path: str | Path) -> AuthDir:
    path = Path(path)
    manifest = path / _MANIFEST
    try:
        data = json.loads(manifest.read_text())
        return AuthDir(path=path, job=data["job"], explorers=int(data["explorers"]),
                       synchronizers=int(data["synchronizers"]), url=data["url"], port=int(data["port"]),
                       http_port=int(data["http_port"]))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(
            f"{path} is not a directory written by `rolectl auth init` ({manifest}: {exc}); "
            "run `rolectl auth init --dir DIR --job JOB --explorers N` first"
        ) from None


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    """Write `path` with 0600 (secret) or 0644 permissions from the start, never world-readable."""
    mode = 0o600 if secret else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)


def _new_nkey_seed() -> tuple[bytes, str]:
    """A fresh user nkey: (seed file contents, public key)."""
    import nkeys
    from nacl.signing import SigningKey  # nkeys is built on PyNaCl

    seed = bytes(nkeys.encode_seed(bytes(SigningKey.generate()), nkeys.PREFIX_BYTE_USER))
    kp = nkeys.from_seed(bytearray(seed))
    public = kp.public_key.decode()
    kp.wipe()
    return seed, public


def _certificates(hosts: list[str], days: int) -> tuple[bytes, bytes, bytes, bytes]:
    """(CA cert, CA key, server cert, server key) as PEM; the server cert names every host."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = _dt.datetime.now(_dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rolectl CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    pem = serialization.Encoding.PEM
    return ca.public_bytes(pem), key_pem(ca_key), server.public_bytes(pem), key_pem(server_key)


def _readme(job: str, d: Path, explorers: int, synchronizers: int, url: str) -> str:
    rows = [f"  {i + '.nk':<16} {role}" for i, role in identities(explorers, synchronizers)]
    return f"""rolectl secure deployment of job {job} (written by `rolectl auth init`)

Server side (the NATS host only):
  nats-server.conf  TLS + JetStream + one nkey user per identity   rolectl server --config {d}/nats-server.conf
  server.pem        server certificate (signed by ca.pem)
  server.key        its private key (0600)
  ca.key            the CA's private key (0600): keep it offline; only needed to sign new certificates

Every client:
  ca.pem            the CA that signed the server certificate: --tls-ca ca.pem ({ENV_VARS['tls_ca']})

One credential per identity, an nkey seed (0600), given to that member only:
  --creds FILE ({ENV_VARS['creds']}, or nats.creds in the job config)
{chr(10).join(rows)}

Order of operations:
  rolectl server --config {d}/nats-server.conf
  rolectl provision --config job.yaml --nats {url} --creds {d}/admin.nk --tls-ca {d}/ca.pem
  rolectl start sync     --config job.yaml --nats {url} --id sync-0     --creds {d}/sync-0.nk     --tls-ca {d}/ca.pem
  rolectl start trainer  --config job.yaml --nats {url} --id trainer    --creds {d}/trainer.nk    --tls-ca {d}/ca.pem
  rolectl start explorer --config job.yaml --nats {url} --id explorer-0 --creds {d}/explorer-0.nk --tls-ca {d}/ca.pem
  rolectl status --job {job} --nats {url} --creds {d}/observer.nk --tls-ca {d}/ca.pem
Or all of it on one machine: rolectl up --config job.yaml --auth-dir {d}

A member's --id must be its identity's name: the server lets it publish only under that name.
"""


def init_auth_dir(
    directory: str | Path,
    *,
    job: str,
    explorers: int,
    synchronizers: int = 1,
    hosts: list[str] | tuple[str, ...] = ("127.0.0.1", "localhost"),
    port: int = 4222,
    http_port: int = 8222,
    store_dir: str | None = None,
    days: int = 365,
    command: str = "rolectl auth init",
) -> AuthDir:
    """Write CA, server certificate, one nkey per identity, nats-server.conf and README into `directory`."""
    check_name(job, "job name")
    if explorers < 1 or synchronizers < 1:
        raise ValueError("a job needs at least one explorer and one synchronizer (--explorers, --synchronizers)")
    hosts = list(hosts) or ["127.0.0.1", "localhost"]
    d = Path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    ca_pem, ca_key, server_pem, server_key = _certificates(hosts, days)
    _write(d / "ca.pem", ca_pem, secret=False)
    _write(d / "ca.key", ca_key, secret=True)
    _write(d / "server.pem", server_pem, secret=False)
    _write(d / "server.key", server_key, secret=True)
    public: dict[str, str] = {}
    for identity, _role in identities(explorers, synchronizers):
        seed, public[identity] = _new_nkey_seed()
        _write(d / f"{identity}.nk", seed + b"\n", secret=True)
    loopback = all(h in ("localhost",) or _is_loopback(h) for h in hosts)
    conf = render_server_conf(
        job=job, explorers=explorers, synchronizers=synchronizers, nkeys=public, port=port,
        http_port=http_port, listen_host="127.0.0.1" if loopback else "0.0.0.0",
        cert_file=str(d / "server.pem"), key_file=str(d / "server.key"),
        store_dir=store_dir or str(d / "jetstream"), command=command,
    )
    _write(d / "nats-server.conf", conf.encode(), secret=False)
    url = f"tls://{hosts[0]}:{port}"
    _write(d / "README", _readme(job, d, explorers, synchronizers, url).encode(), secret=False)
    manifest = {"job": job, "explorers": explorers, "synchronizers": synchronizers, "url": url,
                "port": port, "http_port": http_port, "hosts": hosts}
    _write(d / _MANIFEST, json.dumps(manifest, indent=2).encode(), secret=False)
    return read_auth_dir(d)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
