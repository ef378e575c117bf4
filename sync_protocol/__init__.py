"""The pure sync core: events in, state and decisions out. No I/O, no clock, no torch."""

from .boundaries import explorer_needs_sync, is_stale, needs_reload, trainer_needs_sync
from .codec import (
    SCHEMA_VERSION,
    decode,
    decode_all,
    encode,
    encode_decisions,
    from_plain,
    member_from_plain,
    to_plain,
)
from .config import SyncConfig
from .describe import describe
from .enums import (
    ReleaseReason,
    ResumeReason,
    Role,
    RoundOutcome,
    RunningStatus,
    StalenessPolicy,
    SyncMethod,
    SyncStyle,
)
from .errors import ConfigError, DecodeError, IllegalEvent, ProtocolError, UnboundRendezvous
from .events import *  # noqa: F401,F403  (the event classes are the package's vocabulary)
from .events import __all__ as _event_names
from .reducer import fold, fold_lenient, reduce, reduce_lenient
from .state import GroupState, LatestVersion, MemberState, RoundPhase, RoundState, State

__all__ = [
    "SCHEMA_VERSION",
    "decode",
    "decode_all",
    "encode",
    "encode_decisions",
    "from_plain",
    "member_from_plain",
    "to_plain",
    "describe",
    "SyncConfig",
    "ReleaseReason",
    "ResumeReason",
    "Role",
    "RoundOutcome",
    "RunningStatus",
    "SyncMethod",
    "SyncStyle",
    "StalenessPolicy",
    "ConfigError",
    "DecodeError",
    "IllegalEvent",
    "ProtocolError",
    "UnboundRendezvous",
    *_event_names,
    "State",
    "MemberState",
    "RoundState",
    "RoundPhase",
    "GroupState",
    "LatestVersion",
    "reduce",
    "reduce_lenient",
    "fold",
    "fold_lenient",
    "explorer_needs_sync",
    "trainer_needs_sync",
    "needs_reload",
    "is_stale",
]
