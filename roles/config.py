"""Job configuration: YAML in, typed frozen objects out, every error reported at once.

Field names follow the reference where it has them (`synchronizer.sync_method`, `sync_style`,
`sync_interval`, `sync_offset`, `sync_timeout`; `trainer.total_steps`, `save_interval`;
`buffer.batch_size`). See `examples/*.yaml` for complete files.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import yaml

from rolectl.bus.connection import parse_server_urls
from rolectl.bus.security import ClientSecurity
from rolectl.bus.subjects import check_name
from rolectl.sync_protocol import ConfigError, SyncConfig

__all__ = [
    "JobConfig",
    "TrainerConfig",
    "ExplorerConfig",
    "BufferConfig",
    "TransportConfig",
    "NatsConfig",
    "load_config",
    "parse_config",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    """The train loop: how many steps, how often to save, where."""

    total_steps: int = 40
    save_interval: int = 1
    checkpoint_dir: str | None = None  # default: <run_dir>/<job>/trainer
    keep_versions: int = 2  # published weight versions kept in the object store / checkpoint dir
    train_batch_tasks: int | None = None  # tasks per train step; default: buffer.batch_size
    # How long the trainer waits for explorers when every one of them is gone (expired, killed,
    # restarting) before it gives up and ends the job as incomplete (non-zero exit).
    explorer_grace_s: float = 300.0
    # What its process is given under `rolectl up --launcher ray` (its placement-group bundle);
    # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it reserved. Ignored by the local launcher.
    num_gpus: int = 0
    num_cpus: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ExplorerConfig:
    """The explorers: how many, how long, how many receiving ranks each brings to a rendezvous."""

    count: int = 2
    total_steps: int = 20  # explore steps per explorer (the size of its task set)
    engine_num: int = 1
    tensor_parallel_size: int = 1
    # Extra seconds per explore step, per explorer index (cycled): real rollout engines differ in
    # speed, and the examples/tests use this to run explorers of different speeds.
    step_delay_s: tuple[float, ...] = (0.0,)
    stop_with_trainer: bool = True  # stop exploring once the trainer has finished (nobody consumes)
    # A trainer that went silent (killed, restarting, expired) is waited for this long before an
    # explorer gives up (non-zero exit): long enough for a restart with imports and checkpoint load.
    trainer_grace_s: float = 300.0
    # Under `rolectl up --launcher ray`, each explorer's bundle: num_cpus CPUs and, with use_gpus,
    # engine_num x tensor_parallel_size GPUs (CUDA_VISIBLE_DEVICES set by Ray). Ignored locally.
    num_cpus: int = 1
    use_gpus: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferConfig:
    """Experiences: tasks per explore step, and how long the trainer may hold a batch unacked."""

    batch_size: int = 4
    ack_wait_s: float = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportConfig:
    """Weight-transport knobs."""

    checkpoint_dir: str | None = None  # shared directory for sync_method=checkpoint
    # Where the object store keeps weight chunks. "file" (default) keeps every version across a
    # nats-server restart, so a restart costs only a stall; "memory" fetched up to ~1.4x faster in
    # benchmarks.weights here, and after a restart its stream is re-created by the next publish
    # while a fetch of a version lost with it fails clearly (the explorer keeps its weights).
    object_store_storage: str = "file"
    bucket_size_mb: int = 512  # torch.distributed broadcast bucket size
    group_timeout_s: float = 60.0  # a dead peer mid-broadcast fails the transfer after this


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsConfig:
    """How the job uses its NATS servers (the URLs themselves are the top-level `nats_url`) and
    how clients reach them securely: paths of credential and TLS files (never secrets inline).
    Flags (--creds, --tls-ca, --tls-cert, --tls-key) and ROLECTL_NATS_* variables override them."""

    # Copies of the event, experience and weight streams: 1 on a single server, 3 on a 3-node
    # cluster (any one node may then be lost). An existing stream with more is accepted.
    replicas: int = 1
    creds: str | None = None  # <identity>.nk / .creds / .crt (+ .key), by extension
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @property
    def security(self) -> ClientSecurity:
        return ClientSecurity(creds=self.creds, tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobConfig:
    """One RL job: its name, where NATS is, and each role's settings."""

    job: str
    nats_url: str = "nats://127.0.0.1:4222"
    run_dir: str = "runs"
    log_level: str = "info"
    synchronizer: SyncConfig = field(default_factory=SyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    explorers: ExplorerConfig = field(default_factory=ExplorerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    nats: NatsConfig = field(default_factory=NatsConfig)
    model: Mapping[str, Any] = field(default_factory=dict)  # engine settings (roles.engines)
    data: Mapping[str, Any] | None = None  # task file and rewards (hf / vllm engines)
    algorithm: Mapping[str, Any] | None = None  # verl advantage estimator and policy loss (hf trainer)
    source: str | None = None  # the file it was loaded from

    @property
    def job_dir(self) -> Path:
        return Path(self.run_dir) / self.job

    @property
    def trainer_checkpoint_dir(self) -> Path:
        return Path(self.trainer.checkpoint_dir) if self.trainer.checkpoint_dir else self.job_dir / "trainer"

    @property
    def weights_checkpoint_dir(self) -> Path:
        return (
            Path(self.transport.checkpoint_dir)
            if self.transport.checkpoint_dir
            else self.job_dir / "weights"
        )

    def explorer_ids(self) -> list[str]:
        return [f"explorer-{i}" for i in range(self.explorers.count)]

    def with_overrides(self, **changes: Any) -> "JobConfig":
        return dataclasses.replace(self, **changes)

    def with_explorer_count(self, count: int) -> tuple["JobConfig", str | None]:
        """This job with `count` explorers, and a note for the user (None when nothing else changes).

        A round of exploration makes `count x buffer.batch_size` tasks. A config whose
        `trainer.train_batch_tasks` equals its own `explorers.count x buffer.batch_size` means "one
        train step per round" (the examples say so), so it is scaled with the count: left at the old
        value, 3 explorers on the quickstart made the trainer reach its last step on two thirds of
        what they produced, with ever staler batches. Any other value is kept, with a note of what it
        now means and how to change it.
        """
        if count < 1:
            raise ConfigError([("explorers.count", f"must be an integer > 0, got {count!r}")])
        old = self.explorers.count
        cfg = dataclasses.replace(self, explorers=dataclasses.replace(self.explorers, count=count))
        if count == old:
            return cfg, None
        batch = self.buffer.batch_size
        tasks = self.trainer.train_batch_tasks
        if tasks == old * batch:
            cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, train_batch_tasks=count * batch))
            return cfg, (f"trainer.train_batch_tasks {tasks} -> {count * batch} (= {count} explorers x "
                         f"{batch} tasks): still one train step per round of exploration, as with {old}")
        per_step = tasks or batch
        return cfg, (f"trainer.train_batch_tasks stays {per_step}"
                     f"{'' if tasks else ' (unset: one explorer batch)'}: a round of {count} explorers makes "
                     f"{count * batch} tasks, {count * batch / per_step:g} train steps' worth. For one train "
                     f"step per round set trainer.train_batch_tasks: {count * batch} in the config")


# -- validation ------------------------------------------------------------------------------------

_POSITIVE_INT = ("total_steps", "count", "engine_num", "tensor_parallel_size", "batch_size",
                 "keep_versions", "bucket_size_mb", "replicas", "num_cpus")
_NON_NEGATIVE_INT = ("save_interval", "num_gpus")
_POSITIVE_FLOAT = ("ack_wait_s", "group_timeout_s", "trainer_grace_s", "explorer_grace_s")


def _check_field(section: str, f: dataclasses.Field, value: Any, problems: list) -> Any:
    where = f"{section}.{f.name}"
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if f.name in _POSITIVE_INT and not (is_int and value > 0):
        problems.append((where, f"must be an integer > 0, got {value!r}"))
    elif f.name in _NON_NEGATIVE_INT and not (is_int and value >= 0):
        problems.append((where, f"must be an integer >= 0, got {value!r}"))
    elif f.name in _POSITIVE_FLOAT and not (
        (is_int or isinstance(value, float)) and not isinstance(value, bool)
        and math.isfinite(value) and value > 0
    ):
        problems.append((where, f"must be a number > 0, got {value!r}"))
    elif f.name == "train_batch_tasks" and value is not None and not (is_int and value > 0):
        problems.append((where, f"must be null or an integer > 0, got {value!r}"))
    elif f.name in ("checkpoint_dir", "creds", "tls_ca", "tls_cert", "tls_key") and value is not None and not isinstance(value, str):
        problems.append((where, f"must be a path string or null, got {value!r}"))
    elif f.name == "object_store_storage" and value not in ("memory", "file"):
        problems.append((where, f"must be memory or file, got {value!r}"))
    elif f.name in ("stop_with_trainer", "use_gpus") and not isinstance(value, bool):
        problems.append((where, f"must be true or false, got {value!r}"))
    elif f.name == "step_delay_s":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = (float(value),)
        if (
            not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value)
        ):
            problems.append((where, f"must be a number >= 0 or a non-empty list of them, got {value!r}"))
        else:
            value = tuple(float(v) for v in value)
    return value


def _yaml_kind(value: Any) -> str:
    """What a YAML value is, in YAML's words (not Python's: a user never wrote a "NoneType")."""
    if value is None:
        return "nothing (an empty value)"
    if isinstance(value, bool):
        return f"a boolean ({value!r})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def _section(cls, data: Any, name: str, problems: list) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, Mapping):
        problems.append((name, f"must be a mapping (indented `key: value` lines), got {_yaml_kind(data)}"))
        return cls()
    known = {f.name: f for f in fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in known:
            problems.append((f"{name}.{key}", f"unknown field; known: {sorted(known)}"))
            continue
        values[key] = _check_field(name, known[key], value, problems)
    try:
        return cls(**values)
    except TypeError as exc:  # only reachable with an invalid combination already reported
        problems.append((name, str(exc)))
        return cls()


def _engine_problems(model: Mapping[str, Any], data: Any, algorithm: Any, explorers: ExplorerConfig
                     ) -> list[tuple[str, str]]:
    # Each engine owns its sections (model, data, algorithm) and reports their problems by path.
    from rolectl.roles.engines import EngineSections, engine_config_problems

    return engine_config_problems(EngineSections(model=model, data=data, algorithm=algorithm,
                                                 explorer_count=explorers.count,
                                                 tensor_parallel_size=explorers.tensor_parallel_size))


def parse_config(data: Any, *, source: str | None = None, check_engines: bool = True) -> JobConfig:
    """Validate a mapping (parsed YAML) into a `JobConfig`; raise `ConfigError` listing every problem.

    `check_engines=False` leaves the engine's sections (model, data, algorithm) to the roles that
    run an engine: checking them imports the engines (torch, seconds), which a synchronizer, whose
    restart time is the job's stall, has no use for."""
    where = source or "config"
    problems: list[tuple[str, str]] = []
    if not isinstance(data, Mapping):
        if data is None:
            raise ConfigError([("(file)", "is empty: a job config is a YAML mapping with at least `job: NAME` "
                                          "(see examples/quickstart.yaml)")], where=where)
        raise ConfigError([("(top level)", f"must be a mapping of sections (`job: NAME`, `trainer:` ...), got "
                                           f"{_yaml_kind(data)} (see examples/quickstart.yaml)")], where=where)
    top_known = {f.name for f in fields(JobConfig)} - {"source"}
    for key in data:
        if key not in top_known:
            problems.append((str(key), f"unknown section; known: {sorted(top_known)}"))

    job = data.get("job")
    try:
        check_name(job, "job name")
    except ValueError as exc:
        problems.append(("job", str(exc)))
        job = "invalid"

    sync = SyncConfig()
    try:
        sync = SyncConfig.from_mapping(data.get("synchronizer") or {}, where="synchronizer")
    except ConfigError as exc:
        problems.extend(exc.problems)

    trainer = _section(TrainerConfig, data.get("trainer"), "trainer", problems)
    explorers = _section(ExplorerConfig, data.get("explorers"), "explorers", problems)
    buffer = _section(BufferConfig, data.get("buffer"), "buffer", problems)
    transport = _section(TransportConfig, data.get("transport"), "transport", problems)
    nats = _section(NatsConfig, data.get("nats"), "nats", problems)
    if isinstance(nats.replicas, int) and nats.replicas > 5:
        problems.append(("nats.replicas", f"must be at most 5 (JetStream's limit), got {nats.replicas}"))
    if source is not None:  # relative credential paths are relative to the config file
        base = Path(source).resolve().parent
        nats = dataclasses.replace(nats, **{
            f.name: str(base / getattr(nats, f.name)) for f in fields(NatsConfig) if f.name != "replicas" and getattr(nats, f.name)
        })

    model = data.get("model") or {}
    engine_sections = {key: data.get(key) for key in ("data", "algorithm")}
    for key, value in (("model", model), *engine_sections.items()):
        if value is not None and not isinstance(value, Mapping):
            problems.append((key, f"must be a mapping (indented `key: value` lines), got {_yaml_kind(value)}"))
    if check_engines and all(v is None or isinstance(v, Mapping) for v in (model, *engine_sections.values())):
        problems.extend(_engine_problems(model, engine_sections["data"], engine_sections["algorithm"], explorers))

    for key in ("nats_url", "run_dir", "log_level"):
        if key in data and not isinstance(data[key], str):
            problems.append((key, f"must be a string, got {data[key]!r}"))
    if isinstance(data.get("nats_url"), str):
        try:
            parse_server_urls(data["nats_url"])
        except ValueError as exc:
            problems.append(("nats_url", str(exc)))
    if isinstance(data.get("log_level"), str) and data["log_level"].lower() not in (
        "debug", "info", "warning", "error"
    ):
        problems.append(("log_level", f"must be debug, info, warning or error, got {data['log_level']!r}"))

    if problems:
        raise ConfigError(problems, where=where)
    extra = {k: data[k] for k in ("nats_url", "run_dir", "log_level") if k in data}
    return JobConfig(
        job=job,
        synchronizer=sync,
        trainer=trainer,
        explorers=explorers,
        buffer=buffer,
        transport=transport,
        nats=nats,
        model=dict(model),
        data=dict(engine_sections["data"]) if engine_sections["data"] is not None else None,
        algorithm=dict(engine_sections["algorithm"]) if engine_sections["algorithm"] is not None else None,
        source=source,
        **extra,
    )


def load_config(path: str | Path, *, check_engines: bool = True) -> JobConfig:
    """Read and validate a YAML job file; errors name the file and every bad field (see
    `parse_config` for `check_engines`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([("file", f"cannot read {path}: {exc.strerror}")], where=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # PyYAML names a string it parsed "<unicode string>": name the file instead
        raise ConfigError([("yaml", "not valid YAML: " + str(exc).replace('"<unicode string>"', f'"{path}"'))],
                          where=str(path)) from None
    return parse_config(data, source=str(path), check_engines=check_engines)
