"""Experiment trackers, read back with each library's own reader: TensorBoard's event accumulator,
MLflow's client, W&B's offline run files."""

from __future__ import annotations

import json

import pytest

from rolectl.roles.config import parse_config
from rolectl.roles.observe.trackers import Trackers, flat_params, mlflow_local_uri
from rolectl.sync_protocol import (
    ConfigError,
    EvalFinished,
    MemberRef,
    Recorded,
    Role,
    RoundClosed,
    RoundOutcome,
    StepFinished,
    WeightsLoaded,
)
from tests.support.wait import wait_until_sync

T = MemberRef(role=Role.TRAINER, id="trainer", incarnation=0)
E = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=0)


def _records() -> list[Recorded]:
    events = [
        EvalFinished(member=E, version=0, step=0, rewards={"positional_match": 0.1}, tasks=4, responses=4, seconds=0.1),
        StepFinished(member=E, step=1, version=0, metrics={"reward_mean": 0.2}),
        StepFinished(member=T, step=1, version=1, metrics={"loss": 0.5, "reward_mean": 0.2}),
        RoundClosed(round=1, cause_seq=3, outcome=RoundOutcome.COMPLETED),
        WeightsLoaded(member=E, version=1, round=1, nbytes=1000, seconds=0.01),
        StepFinished(member=E, step=2, version=1, metrics={"reward_mean": 0.4}),
        StepFinished(member=T, step=2, version=2, metrics={"loss": 0.25, "reward_mean": 0.4, "bad": float("nan")}),
        EvalFinished(member=E, version=1, step=2, rewards={"positional_match": 0.6}, tasks=4, responses=4, seconds=0.1),
    ]
    records = [Recorded(seq=i + 1, time_ms=1000 + i, event=e) for i, e in enumerate(events)]
    return records + records[:3]  # a reader that restarted sends some again: logged once


def _job(tmp_path, *backends):
    return parse_config({"job": "track", "run_dir": str(tmp_path / "runs"), "trainer": {"total_steps": 2},
                         "monitor": {"backends": list(backends)}})


def _run(cfg, warnings=None) -> Trackers:
    trackers = Trackers.start(cfg, "run-1", warn=(warnings.append if warnings is not None else print))
    for rec in _records():
        trackers.apply(rec)
    trackers.close()
    return trackers


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _job(tmp_path, "tensorboard")
    assert _run(cfg).failures == {}
    logdir = cfg.monitor_dir / "tensorboard" / "run-1"
    acc = EventAccumulator(str(logdir)).Reload()
    scalars = acc.Tags()["scalars"]
    assert [(s.step, s.value) for s in acc.Scalars("trainer/loss")] == [(1, 0.5), (2, 0.25)]
    assert [(s.step, round(s.value, 4)) for s in acc.Scalars("eval/positional_match")] == [(0, 0.1), (2, 0.6)]
    assert [s.step for s in acc.Scalars("explorer/explorer-0/reward_mean")] == [1, 2]
    assert [(s.step, s.value) for s in acc.Scalars("sync/bytes")] == [(1, 1000.0)]
    assert "trainer/bad" not in scalars  # not finite: left out
    assert "config/text_summary" in acc.Tags()["tensors"]


def test_mlflow_run_reads_back_through_its_client(tmp_path):
    from mlflow.tracking import MlflowClient

    cfg = _job(tmp_path, "mlflow")
    assert _run(cfg).failures == {}
    client = MlflowClient(tracking_uri=mlflow_local_uri(cfg.monitor_dir))
    experiment = client.get_experiment_by_name("track")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run-1"
    history = client.get_metric_history(run.info.run_id, "trainer/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.25)]
    evals = client.get_metric_history(run.info.run_id, "eval/positional_match")
    assert sorted((m.step, round(m.value, 4)) for m in evals) == [(0, 0.1), (2, 0.6)]
    assert run.data.params["trainer.total_steps"] == "2" and run.data.params["job"] == "track"


def _wandb_log_records(data: bytes):
    """The records of a W&B run file: a 7-byte header, then LevelDB-log framing (32 KiB blocks of
    records, each `crc32, length (2 bytes, little-endian), type`; FULL=1, FIRST=2, MIDDLE=3, LAST=4).
    wandb itself reads these files in its Go core only."""
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32 * 1024, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def test_wandb_offline_run_keeps_the_history(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    cfg = _job(tmp_path, "wandb")
    assert _run(cfg).failures == {}
    (run_dir,) = (cfg.monitor_dir / "wandb").glob("offline-run-*")
    from wandb.proto import wandb_internal_pb2

    run_file = next(run_dir.glob("*.wandb"))

    def records():  # wandb's service process writes the file: the run is complete with its exit record
        parsed = []
        for data in _wandb_log_records(run_file.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            parsed.append(record)
        return parsed if any(r.WhichOneof("record_type") == "exit" for r in parsed) else None

    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in wait_until_sync(records, timeout=60, what="the W&B run's exit record")
               if r.WhichOneof("record_type") == "history"]
    losses = [(h["trainer/step"], h["trainer/loss"]) for h in history if "trainer/loss" in h]
    assert losses == [(1, 0.5), (2, 0.25)], history
    evals = [(h["explore/step"], h["eval/positional_match"]) for h in history if "eval/positional_match" in h]
    assert [(s, round(v, 4)) for s, v in evals] == [(0, 0.1), (2, 0.6)]


def test_a_tracker_that_fails_mid_run_is_logged_once_and_counted(tmp_path):
    cfg = _job(tmp_path, "tensorboard")
    warnings: list[str] = []
    trackers = Trackers.start(cfg, "run-1", warn=warnings.append)
    tb = trackers.trackers[0]

    def broken(*args, **kwargs):
        raise OSError("disk full")

    tb.log_metrics = broken  # the tracker's storage goes away mid-run
    for rec in _records():
        trackers.apply(rec)
    trackers.close()
    assert trackers.failures["tensorboard"] >= 5
    assert len(warnings) == 1 and "tensorboard" in warnings[0] and "disk full" in warnings[0]


def test_an_unknown_tracker_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        _job(tmp_path, "tensorboard", "comet")
    (path, why), = info.value.problems
    assert path == "monitor.backends" and "unknown tracker 'comet'" in why and "mlflow" in why


def test_a_tracker_not_installed_names_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        _job(tmp_path, "tensorboard", "mlflow")
    assert dict(info.value.problems) == {
        "monitor.backends[1]": "mlflow is not installed; pip install 'rolectl[mlflow]'"}


def test_the_config_is_logged_flat():
    params = flat_params(parse_config({"job": "j", "trainer": {"total_steps": 3}}))
    assert params["trainer.total_steps"] == "3" and params["synchronizer.sync_style"] == "fixed"
