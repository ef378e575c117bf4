"""Sync boundaries, reload and staleness rules the roles share with the core."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import SyncConfig, SyncStyle
from rolectl.sync_protocol.boundaries import explorer_needs_sync, is_stale, needs_reload, trainer_needs_sync


@pytest.mark.parametrize(
    "offset, interval, syncing_steps",
    [
        (0, 1, [1, 2, 3, 4, 5, 6]),
        (1, 1, [2, 3, 4, 5, 6]),  # one-step off-policy: step 1 never syncs
        (0, 2, [2, 4, 6]),
        (1, 2, [3, 5]),
        (3, 3, [6]),
    ],
)
def test_explorer_boundary_follows_offset_and_interval(offset, interval, syncing_steps):
    cfg = SyncConfig(sync_offset=offset, sync_interval=interval)
    assert [s for s in range(0, 7) if explorer_needs_sync(s, cfg)] == syncing_steps


@pytest.mark.parametrize("style", [SyncStyle.FIXED, SyncStyle.TRAINER_DRIVEN, SyncStyle.FULLY_ASYNC])
@pytest.mark.parametrize(
    "step, last_synced, interval, expected",
    [
        (2, 0, 2, True),
        (2, 2, 2, False),  # already synced at this step
        (3, 2, 2, False),
        (4, 2, 2, True),
        (0, 5, 1, True),
        (7, 6, 1, True),
    ],
)
def test_trainer_boundary_is_every_interval_not_already_synced(style, step, last_synced, interval,
                                                              expected):
    cfg = SyncConfig(sync_style=style, sync_interval=interval)
    assert trainer_needs_sync(step, last_synced, cfg) is expected


def test_explorer_driven_trainer_never_syncs_on_a_step_count():
    cfg = SyncConfig(sync_style=SyncStyle.EXPLORER_DRIVEN)
    assert not any(trainer_needs_sync(step, -1, cfg) for step in range(10))


@pytest.mark.parametrize(
    "current, offered, expected",
    [
        (-1, 0, False),  # base model already loaded at start
        (-1, 3, True),
        (2, 4, True),
        (3, 3, False),
        (4, 3, False),
        (0, 1, True),
    ],
)
def test_needs_reload_only_for_really_newer_weights(current, offered, expected):
    assert needs_reload(current, offered) is expected


@pytest.mark.parametrize(
    "experience, trainer, bound, expected",
    [
        (5, 5, 0, False),
        (4, 5, 0, True),
        (3, 5, 2, False),
        (2, 5, 2, True),
        (0, 100, None, False),  # unbounded
    ],
)
def test_is_stale_beyond_the_bound(experience, trainer, bound, expected):
    assert is_stale(experience, trainer, bound) is expected
