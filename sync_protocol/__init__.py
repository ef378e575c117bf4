"""The pure sync core: events in, state and decisions out. No I/O, no clock, no torch."""

from .codec import SCHEMA_VERSION, decode, encode, from_plain, to_plain
from .config import SyncConfig
from .enums import ReleaseReason, Role, RoundOutcome, RunningStatus, SyncMethod, SyncStyle
from .errors import ConfigError, DecodeError, IllegalEvent, ProtocolError
from .events import *  # noqa: F401,F403  (the event classes are the package's vocabulary)
from .events import __all__ as _event_names

__all__ = [
    "SCHEMA_VERSION",
    "decode",
    "encode",
    "from_plain",
    "to_plain",
    "SyncConfig",
    "ReleaseReason",
    "Role",
    "RoundOutcome",
    "RunningStatus",
    "SyncMethod",
    "SyncStyle",
    "ConfigError",
    "DecodeError",
    "IllegalEvent",
    "ProtocolError",
    *_event_names,
]
