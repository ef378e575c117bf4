"""The environment variables the roles read (`ROLECTL_*`), declared and validated in one settings model.

Kept apart from `rolectl.roles.config` so that loading a job config (a synchronizer's restart)
does not import pydantic-settings.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from rolectl.sync_protocol import ConfigError

from .engines.config_errors import problems_of

__all__ = ["EnvSettings", "env_settings"]


class EnvSettings(BaseSettings):
    """Environment variables the roles read (prefix `ROLECTL_`); flags, where a command has one,
    win over them."""

    model_config = SettingsConfigDict(env_prefix="ROLECTL_", frozen=True, extra="ignore",
                                      use_attribute_docstrings=True)

    torch_threads: Annotated[int, Field(gt=0)] = 1  # not strict: a variable's value is text
    """Threads torch may use in each role process (`torch.set_num_threads`)."""
    advertise_host: str | None = None
    """The address explorers reach the trainer's rank 0 at for a collective (nccl) sync; default this
    host's IP. The launchers set it (127.0.0.1 locally, the node's IP under Ray)."""
    nats_creds: str | None = None
    """Credentials file for NATS (as `--creds` / `nats.creds`)."""
    nats_tls_ca: str | None = None
    """CA file that signed the server's certificate (as `--tls-ca` / `nats.tls_ca`)."""
    nats_tls_cert: str | None = None
    """Client certificate for mTLS (as `--tls-cert` / `nats.tls_cert`)."""
    nats_tls_key: str | None = None
    """Client certificate's key (as `--tls-key` / `nats.tls_key`)."""


def env_settings() -> EnvSettings:
    """The `ROLECTL_*` variables of this process, validated; a bad value raises `ConfigError`."""
    try:
        return EnvSettings()
    except ValidationError as exc:
        problems = [(f"ROLECTL_{name.upper()}", why) for name, why in problems_of(exc, EnvSettings)]
        raise ConfigError(problems, where="environment") from None
