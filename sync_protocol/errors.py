"""The protocol's exception tree: every bad input surfaces as one of these, never as anything else."""

from __future__ import annotations

__all__ = ["ProtocolError", "DecodeError", "IllegalEvent", "ConfigError", "UnboundRendezvous"]


class ProtocolError(Exception):
    """Base of every error the sync protocol raises on bad input."""


class DecodeError(ProtocolError):
    """Bytes on the wire are not a valid event: not msgpack, unknown kind, missing or mistyped field,
    or a newer schema than this build understands."""


class IllegalEvent(ProtocolError):
    """A well-formed event that is not allowed in the current state. State is left unchanged.

    The message names the member's role, the relevant state and the event, so a log line alone is
    enough to see what went wrong.
    """

    def __init__(
        self,
        message: str,
        *,
        role: str = "",
        state: str = "",
        event: object = None,
        seq: int | None = None,
    ):
        super().__init__(message)
        self.role = role
        self.state = state
        self.event = event
        self.seq = seq  # stream sequence of the offending input, when the reducer knows it


class ConfigError(ProtocolError, ValueError):
    """One or more config fields are invalid. `problems` lists every one as (field, why)."""

    def __init__(self, problems: list[tuple[str, str]], *, where: str = "config"):
        self.problems = list(problems)
        self.where = where
        lines = "\n".join(f"  - {name}: {why}" for name, why in self.problems)
        super().__init__(f"invalid {where} ({len(self.problems)} problem(s)):\n{lines}")


class UnboundRendezvous(ProtocolError, LookupError):
    """A `RendezvousReady`'s rank assignments were asked for, but it holds none: it was read from
    the wire and not bound to the group it names (`GroupState.bind`), or the group this reader
    folded is not the one decided. The message says which."""
