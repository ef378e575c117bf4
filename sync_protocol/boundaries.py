"""When a role must sync, reload or drop data: small pure rules shared by the roles and the core.

The trainer and explorer roles call these instead of re-deriving the arithmetic, so a role and the
reducer can never disagree about where a sync boundary is or whether an offered version is new.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from .config import SyncConfig
from .enums import StalenessPolicy, SyncStyle

__all__ = ["explorer_needs_sync", "trainer_needs_sync", "needs_reload", "is_stale", "Staleness",
           "staleness_verdict", "verdict_of_age", "tally_verdicts"]

_INTERVAL_DRIVEN = frozenset({SyncStyle.FIXED, SyncStyle.TRAINER_DRIVEN, SyncStyle.FULLY_ASYNC})


def explorer_needs_sync(step: int, cfg: SyncConfig) -> bool:
    """Whether an explorer that just finished explore step `step` asks for a sync.

    The first `sync_offset` steps never sync (with offset 1 the explorer runs one step ahead:
    one-step off-policy); after that, every `sync_interval`-th step does.
    """
    return step > cfg.sync_offset and (step - cfg.sync_offset) % cfg.sync_interval == 0


def trainer_needs_sync(step: int, last_synced_step: int, cfg: SyncConfig) -> bool:
    """Whether the trainer, at train step `step`, moves weights on its own schedule.

    True on every `sync_interval`-th step not already synced (for fixed, trainer_driven and
    fully_async). Always False for explorer_driven: there the trainer syncs when cued by a round an
    explorer opened, not on a step count.
    """
    if cfg.sync_style not in _INTERVAL_DRIVEN:
        return False
    return step != last_synced_step and step % cfg.sync_interval == 0


def needs_reload(current_version: int, offered_version: int) -> bool:
    """Whether a member holding `current_version` must load `offered_version`.

    Only newer weights are loaded. A fresh member (-1) offered the base model (0) already has it:
    the engine loaded the base checkpoint at start.
    """
    if offered_version <= current_version:
        return False
    return not (current_version == -1 and offered_version == 0)


def is_stale(experience_version: int, trainer_version: int, max_staleness: int | None) -> bool:
    """Whether an experience generated with `experience_version` is too old to train on now."""
    return max_staleness is not None and trainer_version - experience_version > max_staleness


class Staleness(str, Enum):
    """The verdict on an experience the trainer takes: train it, drop it, or train it corrected."""

    FRESH = "fresh"  # within the bound (or no bound): trained
    DROPPED = "dropped"  # past the bound: acked untrained, counted
    CORRECTED = "corrected"  # past the bound, kept: trained with the off-policy correction, counted


def staleness_verdict(experience_version: int, trainer_version: int, cfg: SyncConfig) -> Staleness:
    """What the trainer at `trainer_version` does with an experience of `experience_version`
    (`max_staleness` and `staleness_policy`): a function of the experience's recorded version and
    the trainer's, so whoever holds both computes the same verdict."""
    return verdict_of_age(trainer_version - experience_version, cfg)


def verdict_of_age(age: int, cfg: SyncConfig) -> Staleness:
    """The verdict on an experience `age` versions behind the trainer that judges it: all a verdict
    depends on, so a record of ages (`StalenessTally`) lets a replay recompute every verdict."""
    if cfg.max_staleness is None or age <= cfg.max_staleness:
        return Staleness.FRESH
    return Staleness.CORRECTED if cfg.staleness_policy is StalenessPolicy.CORRECT else Staleness.DROPPED


def tally_verdicts(ages: Iterable[tuple[int, int]], cfg: SyncConfig) -> dict[Staleness, int]:
    """How many experiences each verdict takes, from `(age, experiences)` pairs."""
    counts = dict.fromkeys(Staleness, 0)
    for age, experiences in ages:
        counts[verdict_of_age(age, cfg)] += experiences
    return counts
