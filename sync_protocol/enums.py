"""Named values of the sync protocol: member roles, running statuses, sync methods and styles.

Values match the reference (Trinity-RFT) spelling; parsing is case-insensitive and accepts the
reference's aliases, so a config written for the reference loads here unchanged.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing.Self is 3.11+; the project supports 3.10
    from typing_extensions import Self

__all__ = [
    "Role",
    "RunningStatus",
    "SyncMethod",
    "SyncStyle",
    "StalenessPolicy",
    "ReleaseReason",
    "RoundOutcome",
    "ResumeReason",
    "RENDEZVOUS_METHODS",
    "PULL_METHODS",
]


class _ParsableEnum(str, Enum):
    """A str-valued enum that parses its values and aliases case-insensitively."""

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {}

    @classmethod
    def _lookup(cls, text: str) -> Self | None:
        key = text.strip().lower()
        key = cls._aliases().get(key, key)
        return next((member for member in cls if member.value == key), None)

    @classmethod
    def parse(cls, text: str | _ParsableEnum) -> Self:
        if isinstance(text, cls):
            return text
        if not isinstance(text, str):
            raise ValueError(f"expected one of {cls.choices()}, got {text!r}")
        found = cls._lookup(text)
        if found is None:
            raise ValueError(f"{text!r} is not a {cls.__name__}; expected one of {cls.choices()}")
        return found

    @classmethod
    def choices(cls) -> list[str]:
        return [m.value for m in cls] + sorted(cls._aliases())

    def __str__(self) -> str:
        return str(self.value)


class Role(_ParsableEnum):
    """What a member of a job is."""

    TRAINER = "trainer"
    EXPLORER = "explorer"
    SYNCHRONIZER = "synchronizer"
    OBSERVER = "observer"  # read-only tools (dashboard, status, replay, `up`); never publishes events


class RunningStatus(_ParsableEnum):
    """A member's status, as in the reference: running, waiting for a weight sync, or stopped."""

    RUNNING = "running"
    REQUIRE_SYNC = "require_sync"
    STOPPED = "stopped"


class _ConfigEnum(_ParsableEnum):
    """An enum a config names: a value in any case, or one of the reference's aliases, is read as the
    member it names by `Enum()` and by msgspec alike (both call `_missing_`). The wire's other enums
    (roles, statuses) stay exact."""

    @classmethod
    def _missing_(cls, value: object) -> Self | None:
        return cls._lookup(value) if isinstance(value, str) else None


class SyncMethod(_ConfigEnum):
    """How weight bytes move. `memory` is the JetStream object store here."""

    NCCL = "nccl"
    CHECKPOINT = "checkpoint"
    MEMORY = "memory"
    CUDA_IPC = "cuda_ipc"

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {"object_store": "memory", "online": "nccl", "offline": "checkpoint"}

    @property
    def is_rendezvous(self) -> bool:
        """True when every participant must meet (a collective), False when explorers pull."""
        return self in RENDEZVOUS_METHODS


class SyncStyle(_ConfigEnum):
    """Who decides when weights move."""

    FIXED = "fixed"
    TRAINER_DRIVEN = "trainer_driven"
    EXPLORER_DRIVEN = "explorer_driven"
    FULLY_ASYNC = "fully_async"

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {"dynamic_by_trainer": "trainer_driven", "dynamic_by_explorer": "explorer_driven"}


class StalenessPolicy(_ConfigEnum):
    """What becomes of an experience past `max_staleness`: dropped (counted), or trained with the
    off-policy correction (`algorithm.rollout_correction`) and counted as corrected."""

    DROP = "drop"
    CORRECT = "correct"


class ResumeReason(_ParsableEnum):
    """Why explorers paused for running ahead of the trainer may explore again."""

    CAUGHT_UP = "caught_up"  # the trainer took enough of what they produced
    TRAINER_FINISHED = "trainer_finished"  # the trainer trained its last step: nothing will take more


class ReleaseReason(_ParsableEnum):
    """Why a waiting member was let go."""

    NEW_VERSION = "new_version"
    NO_NEW_VERSION = "no_new_version"
    TRAINER_STOPPED = "trainer_stopped"
    TIMED_OUT = "timed_out"


class RoundOutcome(_ParsableEnum):
    """How a sync round ended. Every round ends exactly once."""

    COMPLETED = "completed"
    NO_NEW_VERSION = "no_new_version"
    TRAINER_STOPPED = "trainer_stopped"
    TIMED_OUT = "timed_out"
    FAILED = "failed"
    ABANDONED = "abandoned"  # every waiting participant left (stopped or expired)


RENDEZVOUS_METHODS = frozenset({SyncMethod.NCCL, SyncMethod.CUDA_IPC})
PULL_METHODS = frozenset({SyncMethod.CHECKPOINT, SyncMethod.MEMORY})
