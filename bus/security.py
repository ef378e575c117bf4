"""How a client proves who it is to NATS and checks the server: one credential file, TLS files, redaction.

A credential is a file whose extension says its kind, as `rolectl auth init` writes them:

- ``<identity>.nk``    an nkey seed (the server config lists the public key): nats-py ``nkeys_seed``
- ``<identity>.creds`` NATS JWT + nkey seed (operator mode): nats-py ``user_credentials``
- ``<identity>.crt``   a client certificate, its key in ``<identity>.key`` next to it (mTLS, the
  server maps the certificate to a user with ``verify_and_map``)

The identity is the file name without its extension. Its replies come on the inbox prefix
``_INBOX.<job>.<identity>`` (not ``_INBOX``): the server lets each identity subscribe to its own
prefix only, so nobody reads another client's replies.

Secrets are read from files (paths from flags, the config's ``nats:`` section or ``ROLECTL_NATS_*``
variables), never from argv. `redact()` masks URL userinfo wherever a URL may be shown.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

__all__ = ["ClientSecurity", "SecurityError", "redact", "inbox_prefix", "ENV_VARS", "ADMIN_IDENTITY"]

ENV_VARS = {
    "creds": "ROLECTL_NATS_CREDS",
    "tls_ca": "ROLECTL_NATS_TLS_CA",
    "tls_cert": "ROLECTL_NATS_TLS_CERT",
    "tls_key": "ROLECTL_NATS_TLS_KEY",
}
"""Environment variable for each client security field: the one place these names are written (the
bus reads them when it connects; the roles' `EnvSettings` and the CLI's flags take them from here)."""

ADMIN_IDENTITY = "admin"
"""The one identity allowed to create, update, purge and delete streams and consumers."""

CREDENTIAL_KINDS = {".nk": "nkey", ".creds": "jwt", ".crt": "mtls", ".pem": "mtls"}

_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s,'\"]+)@")


def redact(text: str) -> str:
    """`text` with the userinfo of every URL in it masked: ``nats://u:pw@h`` → ``nats://u:***@h``,
    ``nats://token@h`` → ``nats://***@h``. Works on one URL, a comma-separated list, or a log line."""

    def mask(m: re.Match[str]) -> str:
        user, sep, _secret = m.group("userinfo").partition(":")
        return f"{m.group('scheme')}{user}:***@" if sep else f"{m.group('scheme')}***@"

    return _USERINFO.sub(mask, text) if isinstance(text, str) else text


class SecurityError(ValueError):
    """Client security settings that cannot work: a missing file, an unknown credential kind, a
    certificate without its key. The message names the setting and what to do."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientSecurity:
    """Paths of the files a client uses to authenticate and to check the server (all optional)."""

    creds: str | None = None  # .nk / .creds / .crt (+ .key)
    tls_ca: str | None = None  # CA that signed the server's certificate
    tls_cert: str | None = None  # client certificate (mTLS), with tls_key
    tls_key: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSecurity:
        env = os.environ if env is None else env
        return cls(**{name: (env.get(var) or None) for name, var in ENV_VARS.items()})

    def over(self, base: ClientSecurity | None) -> ClientSecurity:
        """These settings where set, `base`'s elsewhere (flags over env over the config file)."""
        if base is None:
            return self
        return replace(base, **{f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)})

    def as_env(self) -> dict[str, str]:
        """The ROLECTL_NATS_* variables that reproduce these settings in a child process."""
        return {ENV_VARS[f.name]: str(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name)}

    @property
    def is_set(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    @property
    def identity(self) -> str | None:
        """Who the credential says we are (its file name without extension), or None."""
        return Path(self.creds).stem if self.creds else None

    @property
    def kind(self) -> str | None:
        if not self.creds:
            return None
        return CREDENTIAL_KINDS.get(Path(self.creds).suffix.lower())

    @property
    def may_delete_consumers(self) -> bool:
        """Only admin (or a server without per-identity permissions) may delete consumers; other
        identities leave their readers' consumers to the server's inactivity cleanup."""
        return self.identity is None or self.identity == ADMIN_IDENTITY

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in ENV_VARS if getattr(self, name)]
        return ", ".join(parts) or "no credentials, no TLS files"

    def check(self) -> None:
        """Raise `SecurityError` naming every setting that cannot work."""
        problems = []
        for name, var in ENV_VARS.items():
            path = getattr(self, name)
            if path and not Path(path).is_file():
                problems.append(f"{name} ({'--' + name.replace('_', '-')} / {var} / nats.{name}): "
                                f"no such file {path}")
        if self.creds and self.kind is None:
            problems.append(
                f"creds: {self.creds} has an unknown extension; use an nkey seed (.nk), NATS JWT "
                "credentials (.creds) or a client certificate (.crt with its .key next to it), as "
                "`rolectl auth init` writes them"
            )
        if self.kind == "mtls" and not self._mtls_key().is_file():
            problems.append(f"creds: client certificate {self.creds} needs its key at {self._mtls_key()}")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("tls_cert and tls_key go together: give both (--tls-cert FILE --tls-key FILE) or neither")
        if problems:
            raise SecurityError("NATS client security settings:\n  " + "\n  ".join(problems))

    def _mtls_key(self) -> Path:
        assert self.creds is not None  # only called for mTLS settings, which come with creds
        return Path(self.creds).with_suffix(".key")

    def tls_context(self) -> ssl.SSLContext | None:
        """A TLS context trusting `tls_ca` (system CAs if not given) with our client certificate, or
        None when nothing asks for TLS (a ``tls://`` URL still gets nats-py's default context)."""
        cert, key = self.tls_cert, self.tls_key
        if self.kind == "mtls":
            cert, key = self.creds, str(self._mtls_key())
        if not (self.tls_ca or cert):
            return None
        context = ssl.create_default_context(cafile=self.tls_ca)
        if cert:
            context.load_cert_chain(cert, key)
        return context

    def connect_options(self, job: str) -> dict[str, Any]:
        """Keyword arguments for nats-py's `connect()` (after `check()`)."""
        options: dict[str, Any] = {}
        if self.kind == "nkey":
            options["nkeys_seed"] = self.creds
        elif self.kind == "jwt":
            options["user_credentials"] = self.creds
        context = self.tls_context()
        if context is not None:
            options["tls"] = context
        if self.identity:
            options["inbox_prefix"] = inbox_prefix(job, self.identity)
        return options


def inbox_prefix(job: str, identity: str) -> str:
    """Where `identity`'s replies arrive in `job` (the server allows it to subscribe there only)."""
    return f"_INBOX.{job}.{identity}"
