"""What the `rolectl` commands share: their input error, NATS and credential flags, loading the job's
config, the exit-code table, and `--run` as a job source."""

from __future__ import annotations

from contextlib import contextmanager

import click


class InputError(click.ClickException):
    """The command did not start: a bad config, input file or port (exit 2, as click's usage errors)."""

    exit_code = 2


def port_taken(host: str, port: int) -> bool:
    """True when `port` on `host` cannot be bound now (another process listens there)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def check_nats_url(_ctx, param, value: str | None) -> str | None:
    """--nats: one or more comma-separated server URLs; a malformed one is a usage error (exit 2),
    said before anything starts."""
    if value is None:
        return None
    from rolectl.bus.connection import parse_server_urls

    try:
        parse_server_urls(value)
    except ValueError as exc:
        raise click.BadParameter(f"{exc}; several servers are separated by commas", param=param) from None
    return value


def nats_option(default: str | None, help: str):
    return click.option("--nats", default=default, show_default=default is not None, callback=check_nats_url,
                        help=help)


def client_options(command):
    """--creds / --tls-ca / --tls-cert / --tls-key: files, never secrets on the command line; each read
    from its ROLECTL_NATS_* variable when not given (click's `envvar`, shown in --help)."""
    from rolectl.bus.security import ENV_VARS

    file = click.Path(exists=True, dir_okay=False)
    for field, text in reversed([
        ("creds", "Credential file of this identity: nkey seed (.nk), NATS JWT creds (.creds) or client "
                  "certificate (.crt, key in .key)."),
        ("tls_ca", "CA file that signed the server's certificate."),
        ("tls_cert", "Client certificate (mTLS), with --tls-key."),
        ("tls_key", "Client certificate's key."),
    ]):
        command = click.option(f"--{field.replace('_', '-')}", type=file, default=None, envvar=ENV_VARS[field],
                               show_envvar=True, help=text)(command)
    return command


def client_security(creds=None, tls_ca=None, tls_cert=None, tls_key=None, *, config=None):
    """Flags over ROLECTL_NATS_* variables over the config's `nats:` section; checked now. (Under
    click the flags already hold the variables; a caller outside click gets them here.)"""
    from rolectl.bus.security import ClientSecurity, SecurityError
    from rolectl.roles.config import env_settings
    from rolectl.sync_protocol import ConfigError

    try:
        environment = env_settings().nats_security
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    resolved = ClientSecurity(creds=creds, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key).over(
        environment.over(config)
    )
    try:
        resolved.check()
    except SecurityError as exc:
        raise InputError(str(exc)) from None
    return resolved


def load_job_config(config_path: str, nats: str | None, security_flags: dict | None = None, *,
                    check_engines: bool = True, rollout_only: bool = False):
    """The job's config with the command's --nats and credential flags over it; a bad one exits 2."""
    import dataclasses

    from rolectl.roles.config import load_config
    from rolectl.sync_protocol import ConfigError

    try:
        cfg = load_config(config_path, check_engines=check_engines, rollout_only=rollout_only)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    if nats:
        cfg = cfg.with_overrides(nats_url=nats)
    if security_flags is not None:
        security = client_security(**security_flags, config=cfg.nats.security)
        # only the credential paths: the rest of the nats section (replicas) stays as configured
        cfg = cfg.with_overrides(nats=cfg.nats.replace(**dataclasses.asdict(security)))
    return cfg


def exit_codes_epilog() -> str:
    from rolectl.roles.exit_codes import exit_code_table

    # \b keeps click from rewrapping the table
    return "\b\nExit codes (every command):\n" + exit_code_table()


run_option = click.option(
    "--run", "run_dir", type=click.Path(exists=True, file_okay=False), default=None,
    help="A run directory of `rolectl up` (runs/JOB-TIME-PID): its job, record and archive, read with no server to "
         "start (a private one opens the run's store), instead of --job/--nats/--archive.")


@contextmanager
def job_source_of_flags(job: str | None, nats: str | None, archive: str | None, run_dir: str | None,
                others: tuple[str, ...] = ()):
    """(job, NATS URL, archive dir, monitoring URL or None) to read, from --job/--nats/--archive or --run."""
    from click.core import ParameterSource

    from rolectl.roles.observe.run_store import RunError, job_source

    ctx = click.get_current_context()
    given = [f"--{name.replace('_', '-')}" for name in ("job", "nats", "archive", *others) if run_dir
             and ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)]
    if given:
        raise click.UsageError(f"--run reads the job, its record and archive from the run: drop {' and '.join(given)}")
    try:
        with job_source(job, nats, archive, run_dir) as source:
            yield source
    except RunError as exc:  # raised on opening: the commands' own errors are not RunErrors
        raise InputError(str(exc)) from None
