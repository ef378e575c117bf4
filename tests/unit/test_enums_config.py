"""Enum parsing (case-insensitive, reference aliases) and config validation (every problem at once)."""

from __future__ import annotations

import pytest

from rolectl.sync_protocol import ConfigError, RunningStatus, SyncConfig, SyncMethod, SyncStyle


@pytest.mark.parametrize(
    "enum_cls, text, expected",
    [
        (SyncMethod, "nccl", SyncMethod.NCCL),
        (SyncMethod, "NCCL", SyncMethod.NCCL),
        (SyncMethod, " Checkpoint ", SyncMethod.CHECKPOINT),
        (SyncMethod, "memory", SyncMethod.MEMORY),
        (SyncMethod, "Object_Store", SyncMethod.MEMORY),
        (SyncMethod, "online", SyncMethod.NCCL),
        (SyncMethod, "OFFLINE", SyncMethod.CHECKPOINT),
        (SyncMethod, "cuda_ipc", SyncMethod.CUDA_IPC),
        (SyncStyle, "Fixed", SyncStyle.FIXED),
        (SyncStyle, "dynamic_by_trainer", SyncStyle.TRAINER_DRIVEN),
        (SyncStyle, "DYNAMIC_BY_EXPLORER", SyncStyle.EXPLORER_DRIVEN),
        (SyncStyle, "fully_async", SyncStyle.FULLY_ASYNC),
        (RunningStatus, "Require_Sync", RunningStatus.REQUIRE_SYNC),
    ],
)
def test_enums_parse_case_insensitively_with_aliases(enum_cls, text, expected):
    assert enum_cls.parse(text) is expected


@pytest.mark.parametrize("enum_cls, text", [(SyncMethod, "rdma"), (SyncStyle, ""), (SyncStyle, 3)])
def test_unknown_enum_value_lists_the_choices(enum_cls, text):
    with pytest.raises(ValueError, match="expected one of"):
        enum_cls.parse(text)


def test_method_knows_whether_it_is_a_rendezvous():
    assert [m.value for m in SyncMethod if m.is_rendezvous] == ["nccl", "cuda_ipc"]


def test_config_defaults_follow_the_reference():
    cfg = SyncConfig()
    assert (cfg.sync_method, cfg.sync_style, cfg.sync_interval, cfg.sync_offset, cfg.sync_timeout) == (
        SyncMethod.NCCL, SyncStyle.FIXED, 1, 0, 3600.0)


def test_config_from_mapping_accepts_aliases_and_round_trips():
    cfg = SyncConfig.from_mapping({"sync_method": "online", "sync_style": "dynamic_by_explorer",
                                   "sync_interval": 4, "max_staleness": 2})
    assert (cfg.sync_method, cfg.sync_style) == (SyncMethod.NCCL, SyncStyle.EXPLORER_DRIVEN)
    assert SyncConfig.from_mapping(cfg.to_mapping()) == cfg


def test_config_validation_lists_every_bad_field():
    with pytest.raises(ConfigError) as info:
        SyncConfig.from_mapping({
            "sync_method": "pigeon",
            "sync_style": "whenever",
            "sync_interval": 0,
            "sync_offset": -1,
            "sync_timeout": "soon",
            "heartbeat_period": 2.0,
            "heartbeat_expiry": 1.0,
            "max_staleness": -3,
            "colour": "blue",
        }, where="synchronizer")
    names = [name for name, _ in info.value.problems]
    assert sorted(names) == sorted(f"synchronizer.{n}" for n in (
        "sync_method", "sync_style", "sync_interval", "sync_offset", "sync_timeout",
        "heartbeat_expiry", "max_staleness", "colour"))
    assert "8 problem(s)" in str(info.value)


def test_config_constructor_validates_too():
    with pytest.raises(ConfigError) as info:
        SyncConfig(sync_interval=-2, sync_offset=1.5)  # type: ignore[arg-type]
    assert [name for name, _ in info.value.problems] == ["sync_interval", "sync_offset"]


def test_config_is_a_value_error_for_callers_that_catch_those():
    with pytest.raises(ValueError):
        SyncConfig.from_mapping(["not", "a", "mapping"])  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_durations_must_be_finite(value):
    with pytest.raises(ConfigError) as info:
        SyncConfig.from_mapping({"sync_timeout": value})
    assert info.value.problems == [("synchronizer.sync_timeout", f"must be a finite number > 0, got {value!r}")]


def test_a_large_fleet_beats_less_often_but_four_times_an_expiry_window():
    config = SyncConfig(heartbeat_period=1.0, heartbeat_expiry=30.0)
    assert config.beat_period(64) == 1.0  # the configured period, up to 256 members a second
    assert config.beat_period(1025) == pytest.approx(1025 / 256)  # the synchronizer hears 256 a second
    assert config.beat_period(100_000) == 7.5  # never past a quarter of the expiry
    assert SyncConfig(heartbeat_period=1.0, heartbeat_expiry=5.0).beat_period(4096) == 1.25
    assert SyncConfig(heartbeat_period=3.0, heartbeat_expiry=5.0).beat_period(4096) == 3.0  # never under it
