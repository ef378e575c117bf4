"""Client security settings: credential kind by extension, precedence, clear errors, redaction."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from rolectl.bus.auth import (
    identities,
    init_auth_dir,
    parse_header,
    parse_nkeys,
    server_permissions,
    with_tls_files,
)
from rolectl.bus.security import ClientSecurity, SecurityError, redact
from rolectl.bus.server import find_nats_server


@pytest.mark.parametrize("text, shown", [
    ("nats://user:s3cret@host:4222", "nats://user:***@host:4222"),
    ("tls://tok3n@host", "tls://***@host"),
    ("nats://a:p1@h1:4222,nats://b:p2@h2:4222", "nats://a:***@h1:4222,nats://b:***@h2:4222"),
    ("cannot reach nats://u:pw@h: refused", "cannot reach nats://u:***@h: refused"),
    ("nats://host:4222", "nats://host:4222"),
    ("mail me at a@b.org", "mail me at a@b.org"),
])
def test_redact_masks_the_userinfo_of_every_url(text, shown):
    assert redact(text) == shown


def test_logs_never_show_a_url_password(capsys):
    from rolectl.bus.logging import get_logger, setup_logging

    setup_logging("info")
    get_logger("t").warning("bus.error", url="nats://u:hunter2@h:4222", error="nats://u:hunter2@h refused")
    err = capsys.readouterr().err
    assert "hunter2" not in err and "nats://u:***@h:4222" in err


@pytest.mark.parametrize("name, kind, option", [
    ("trainer.nk", "nkey", "nkeys_seed"),
    ("trainer.creds", "jwt", "user_credentials"),
])
def test_the_credential_kind_comes_from_the_extension(tmp_path, name, kind, option):
    cred = tmp_path / name
    cred.write_text("x")
    security = ClientSecurity(creds=str(cred))
    security.check()
    assert security.kind == kind and security.identity == "trainer"
    options = security.connect_options("job1")
    assert options[option] == str(cred)
    assert options["inbox_prefix"] == "_INBOX.job1.trainer"


def test_a_client_certificate_credential_uses_its_key_next_to_it(tmp_path):
    made = init_auth_dir(tmp_path / "a", job="j", explorers=1)
    # A server certificate stands in for a client one: what matters is that cert and key load.
    (tmp_path / "me.crt").write_bytes((made.path / "server.pem").read_bytes())
    (tmp_path / "me.key").write_bytes((made.path / "server.key").read_bytes())
    security = ClientSecurity(creds=str(tmp_path / "me.crt"), tls_ca=str(made.ca))
    security.check()
    assert security.kind == "mtls"
    assert security.connect_options("j")["tls"] is not None


@pytest.mark.parametrize("settings, words", [
    ({"creds": "{d}/missing.nk"}, "no such file"),
    ({"creds": "{d}/x.txt"}, "unknown extension"),
    ({"creds": "{d}/alone.crt"}, "needs its key"),
    ({"tls_cert": "{d}/x.txt"}, "go together"),
])
def test_settings_that_cannot_work_say_what_to_do(tmp_path, settings, words):
    for name in ("x.txt", "alone.crt"):
        (tmp_path / name).write_text("x")
    security = ClientSecurity(**{k: v.format(d=tmp_path) for k, v in settings.items()})
    with pytest.raises(SecurityError, match=words):
        security.check()


def test_flags_win_over_environment_over_the_config_file(tmp_path, monkeypatch):
    from rolectl.roles.cli.options import client_security

    files = {n: tmp_path / n for n in ("flag.nk", "env.nk", "conf.nk", "env-ca.pem", "conf-ca.pem")}
    for f in files.values():
        f.write_text("x")
    monkeypatch.setenv("ROLECTL_NATS_CREDS", str(files["env.nk"]))
    monkeypatch.setenv("ROLECTL_NATS_TLS_CA", str(files["env-ca.pem"]))
    config = ClientSecurity(creds=str(files["conf.nk"]), tls_ca=str(files["conf-ca.pem"]))
    assert client_security(creds=str(files["flag.nk"]), config=config) == ClientSecurity(
        creds=str(files["flag.nk"]), tls_ca=str(files["env-ca.pem"]))
    monkeypatch.delenv("ROLECTL_NATS_CREDS")
    assert client_security(config=config).creds == str(files["conf.nk"])


def test_the_config_nats_section_takes_paths_relative_to_the_file(tmp_path):
    from rolectl.roles.config import load_config

    (tmp_path / "job.yaml").write_text("job: j\nnats: {creds: auth/trainer.nk, tls_ca: auth/ca.pem}\n")
    cfg = load_config(tmp_path / "job.yaml")
    assert cfg.nats.security == ClientSecurity(creds=str(tmp_path / "auth" / "trainer.nk"),
                                               tls_ca=str(tmp_path / "auth" / "ca.pem"))


# -- rolectl auth init ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def auth_dir(tmp_path_factory):
    return init_auth_dir(tmp_path_factory.mktemp("auth") / "d", job="demo", explorers=2, synchronizers=2,
                         port=14999, http_port=18999)


def test_auth_init_writes_every_file_and_keeps_secrets_private(auth_dir):
    expected_secret = ["ca.key", "server.key"] + [f"{i}.nk" for i, _ in identities(2, 2)]
    for name in expected_secret:
        mode = stat.S_IMODE(os.stat(auth_dir.path / name).st_mode)
        assert mode == 0o600, f"{name} has mode {oct(mode)}"
    for name in ("ca.pem", "server.pem", "nats-server.conf", "README", "auth.json"):
        assert (auth_dir.path / name).is_file(), name
    assert stat.S_IMODE(os.stat(auth_dir.path).st_mode) == 0o700
    readme = (auth_dir.path / "README").read_text()
    assert "admin.nk" in readme and "rolectl provision" in readme and "--tls-ca" in readme


def test_nats_server_accepts_the_config_auth_init_writes(auth_dir):
    result = subprocess.run([find_nats_server(), "-t", "-c", str(auth_dir.server_conf)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_config_moved_to_other_tls_files_names_them_and_still_loads(auth_dir, tmp_path):
    # a Ray head writes the server's certificate and key where it can: the config must follow them
    moved = tmp_path / "a dir\\with odd chars"
    moved.mkdir()
    cert, key = moved / "server.pem", moved / "server.key"
    cert.write_bytes((auth_dir.path / "server.pem").read_bytes())
    key.write_bytes((auth_dir.path / "server.key").read_bytes())
    conf_text = with_tls_files(auth_dir.server_conf.read_text(), cert_file=cert, key_file=key)
    assert str(auth_dir.path / "server.pem") not in conf_text and str(auth_dir.path / "server.key") not in conf_text
    conf = tmp_path / "nats-server.conf"
    conf.write_text(conf_text)
    result = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    with pytest.raises(ValueError, match="cert_file"):
        with_tls_files("port: 4222\n", cert_file=cert, key_file=key)


def test_the_config_lists_one_nkey_per_identity_matching_its_seed(auth_dir):
    import nkeys

    text = auth_dir.server_conf.read_text()
    assert parse_header(text) == ("demo", 2, 2)
    listed = parse_nkeys(text)
    assert sorted(listed) == sorted(i for i, _ in identities(2, 2))
    for identity, public in listed.items():
        seed = bytearray(auth_dir.credential(identity).read_bytes().strip())
        assert nkeys.from_seed(seed).public_key.decode() == public


def test_the_server_certificate_is_signed_by_the_ca_for_the_hosts(auth_dir):
    import ssl

    context = ssl.create_default_context(cafile=str(auth_dir.ca))
    assert context.cert_store_stats()["x509_ca"] == 1
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((auth_dir.path / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]


@pytest.mark.parametrize("identity, role", identities(2, 2))
def test_no_identity_but_admin_may_delete_purge_or_update_anything(identity, role):
    perms = server_permissions("demo", identity, role)
    publish = perms["publish"]
    dangerous = [p for p in publish if any(w in p for w in (".DELETE.", ".UPDATE.", "STREAM.CREATE", ".PURGE."))]
    if role == "admin":
        assert publish[0] == "$JS.API.>"
    elif role == "trainer":
        assert dangerous == ["$JS.API.STREAM.PURGE.RFT_DEMO_WEIGHTS"]  # pruning old weight versions
    else:
        assert dangerous == []
    # Scoped to the job: every subject names it, and replies come on the identity's own inbox.
    for subject in publish + perms["subscribe"]:
        assert subject == "$JS.API.>" or "demo" in subject or "DEMO" in subject or subject == "$JS.API.INFO", subject
    assert "_INBOX.>" not in perms["subscribe"]
    assert f"_INBOX.demo.{identity}.>" in perms["subscribe"]


def test_only_synchronizers_publish_decisions_and_each_member_only_its_own_events():
    for identity, role in identities(2, 2):
        publish = server_permissions("demo", identity, role)["publish"]
        assert ("rft.demo.sync.>" in publish) == (role == "synchronizer")
        own = [p for p in publish if p.startswith("rft.demo.evt.")]
        if role in ("observer", "admin"):
            assert own == []
        else:
            assert own == [f"rft.demo.evt.{role}.{identity}.>"]


# -- the README says what the code does --------------------------------------------------------------

def test_readme_secure_deployment_lists_every_identity_and_the_options_that_exist():
    import re
    from pathlib import Path

    from rolectl.roles.cli import main

    readme = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    section = readme.split("\n## Secure deployment\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z<>\-]+)` \|", section, flags=re.M)
    generic = {re.sub(r"-\d+$", "-<i>" if "explorer" in i else "-<k>", i) for i, _ in identities(2, 2)}
    assert set(rows) == generic
    for identity in generic:
        assert f"`{identity}.nk`" in section, f"the README does not name {identity}'s credential file"
    for command, flag in [("start", "--creds"), ("provision", "--creds"), ("status", "--tls-ca"),
                          ("export", "--tls-cert"), ("replay", "--tls-key"), ("dashboard", "--creds"),
                          ("up", "--auth-dir"), ("server", "--config")]:
        assert flag in {o for p in main.commands[command].params for o in p.opts}, (command, flag)
    auth_init = main.commands["auth"].commands["init"]
    for flag in re.findall(r"(--[a-z-]+)", section.split("rolectl auth init", 1)[1].split("\n", 1)[0]):
        assert flag in {o for p in auth_init.params for o in p.opts}, flag


async def test_a_member_whose_id_is_not_its_credential_identity_is_told_which_id_to_use(tmp_path):
    from rolectl.bus.connection import connect
    from rolectl.bus.errors import BusUnavailable

    made = init_auth_dir(tmp_path / "a", job="j", explorers=1)
    with pytest.raises(BusUnavailable, match="--id explorer-0"):
        await connect("tls://127.0.0.1:1", job="j", role="trainer", member="trainer",
                      security=made.security("explorer-0"), connect_timeout=1)
