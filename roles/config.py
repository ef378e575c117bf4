"""Job configuration: YAML in, typed frozen objects out, every error reported at once.

One pydantic model per section, each field's constraint on its annotation; unknown keys are
refused. Field names follow the reference where it has them (`synchronizer.sync_method`,
`sync_style`, `sync_interval`, `sync_offset`, `sync_timeout`; `trainer.total_steps`,
`save_interval`; `buffer.batch_size`). The engine's sections (`model:`, `data:`, `algorithm:`)
are typed in `rolectl.roles.engines.sections`, `agent:` in `rolectl.roles.engines.agent.config`.
Rules across fields are model validators; what a section names outside itself (a file, an
installed library) is checked once, when the job is loaded with its engines
(`config_base.CHECK_ENGINES`). See `examples/*.yaml` for complete files and
`docs/configuration.md`, generated from these models by `python -m rolectl.roles.config_reference`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rolectl.bus.connection import parse_server_urls
from rolectl.bus.security import ENV_VARS, ClientSecurity
from rolectl.bus.server import go_gc_for_weights
from rolectl.bus.subjects import check_name
from rolectl.sync_protocol import ConfigError, JobConfigured, MemberRef, SyncConfig, SyncMethod

from .config_base import (
    CHECK_ENGINES,
    CHECK_ROLLOUT,
    SKIP_ENGINES,
    NonNegativeInt,
    OpenSection,
    PathStr,
    PositiveInt,
    Seconds,
    Section,
    StrictBool,
    checking,
    checking_trainer,
    invalid,
    problems_of,
    skipping,
    yaml_kind,
)
from .config_rules import cross_section_problems
from .engines.agent.config import AgentSection
from .engines.sections import (
    READS_DATA,
    AlgorithmField,
    DataField,
    ModelSection,
    OpenModelSection,
    TableSection,
    TinyModelSection,
)
from .engines.stage_sections import STAGES, DPOField, ExpertDataSection, SFTField

__all__ = [
    "ENGINE_SECTIONS",
    "JobConfig",
    "TrainerConfig",
    "ExplorerConfig",
    "BufferConfig",
    "TransportConfig",
    "NatsConfig",
    "EvalConfig",
    "MonitorConfig",
    "TRACKERS",
    "tracker_problems",
    "ServeConfig",
    "EnvSettings",
    "env_settings",
    "load_config",
    "parse_config",
]

ENGINE_SECTIONS = ("model", "data", "algorithm", *(stage for stage in STAGES if stage != "rl"))
"""The sections the engines read (a stage's too): typed for the engines that read them, else as written."""


class TrainerConfig(Section):
    """The train loop: how many steps, how often to save, where."""

    total_steps: PositiveInt = 40
    """Train steps; the job ends after the last one. A trainer-only stage counts its own (epochs x
    batches of its file, capped by its `max_steps`) and does not read this."""
    save_interval: NonNegativeInt = 1
    """Train steps between checkpoints (0 = never)."""
    checkpoint_dir: PathStr | None = None
    """Where the trainer saves its state; default `<run_dir>/<job>/trainer`."""
    keep_versions: PositiveInt = 2
    """Published weight versions kept in the object store / checkpoint directory."""
    train_batch_tasks: PositiveInt | None = None
    """Tasks per train step; default `buffer.batch_size`."""
    explorer_grace_s: Seconds = 300.0
    """How long the trainer waits for explorers when every one of them is gone (expired, killed,
    restarting) before it ends the job as incomplete (non-zero exit)."""
    num_gpus: NonNegativeInt = 0
    """GPUs of its bundle under `rolectl up --launcher ray` (Ray sets CUDA_VISIBLE_DEVICES); ignored
    by the local launcher."""
    num_cpus: PositiveInt = 1
    """CPUs of its bundle under `rolectl up --launcher ray`; ignored by the local launcher."""
    world_size: PositiveInt = 1
    """Ranks of the trainer (`model.engine: fsdp` when > 1): one member on the job's stream, rank 0
    speaking for all; `rolectl start trainer` starts them on this host, or its share of them with
    `--nnodes/--node-rank/--master-addr/--master-port` (docs/operations.md)."""
    max_restarts: NonNegativeInt = 3
    """A trainer of several ranks: how many times its ranks are restarted together, from the last
    checkpoint, after one of them dies (one host only; across hosts the launcher restarts them)."""
    export_dir: PathStr | None = None
    """Where the final Hugging Face export goes instead of `<run_dir>/<job>/hf/final`: a fixed path
    the next stage's `model.path` names (`rolectl up` gives each run a directory of its own). Built
    beside and renamed into place; an export already there is replaced."""
    expert_data: ExpertDataSection | None = None
    """Demonstrations mixed into each RL train step, trained with the SFT loss beside the policy
    loss (see the `trainer.expert_data` section); `hf` / `fsdp` trainers."""
    hf_save_interval: NonNegativeInt = 0
    """Train steps between Hugging Face `save_pretrained` exports in `<run_dir>/<job>/hf/step-N`
    (0: only the final one, `hf/final`); engines that can export (`hf`, `fsdp`). Under `model.lora`
    each export is the adapter in peft's format (and the merged model in `merged/` with
    `merge_on_save`)."""


def _as_tuple(value: Any) -> Any:
    """One number stands for a list of one."""
    return (value,) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


class ExplorerConfig(Section):
    """The explorers: how many, how long, how many receiving ranks each brings to a rendezvous."""

    count: PositiveInt = 2
    """Explorer processes."""
    total_steps: PositiveInt = 20
    """Explore steps per explorer (the size of its task set)."""
    engine_num: PositiveInt = 1
    """Rollout engines per explorer."""
    tensor_parallel_size: PositiveInt = 1
    """GPUs per rollout engine."""
    step_delay_s: Annotated[tuple[Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)], ...],
                            BeforeValidator(_as_tuple), Field(min_length=1)] = (0.0,)
    """Extra seconds per explore step, per explorer index (cycled; a number or a list): real rollout
    engines differ in speed, and the examples and tests run explorers of different speeds."""
    stop_with_trainer: StrictBool = True
    """Stop exploring once the trainer has finished (nobody consumes)."""
    trainer_grace_s: Seconds = 300.0
    """How long a silent trainer (killed, restarting, expired) is waited for before an explorer
    gives up (non-zero exit): long enough for a restart with imports and checkpoint load."""
    over_rollout_ratio: Annotated[float, Strict(), Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    """Over-rollout: an explore step completes once `ceil((1 - ratio) x buffer.batch_size)` of its
    tasks are done; tasks not started by then are cancelled (the ones running finish and are dropped),
    so a straggler does not hold the step. Tasks are then rolled out one by one per engine (rank),
    which is slower on the batched tiny engine; 0 (the default) rolls the batch out at once. Counted
    in the summary (`over_rollout_tasks_cut`)."""
    partial_rollout: StrictBool = False
    """Partial rollouts (`sync_style: fully_async` with a pull method; engines tiny, hf, vllm): a version
    that arrives while generations are in flight pauses them between two tokens, loads, and each
    goes on from the tokens it already has instead of finishing on the old weights. Each token keeps
    the version that sampled it (the experience's `token_versions`; its `model_version` is the
    oldest); counted per step and in the summary (`partial_rollout_pauses`,
    `partial_rollout_experiences`)."""
    streaming: StrictBool = False
    """Streaming rollouts (with `partial_rollout`; tiny and vllm engines): a step admits its tasks to the
    generations in flight and publishes the first `buffer.batch_size` groups to finish; the rest run
    on into the next step (a token keeps its version). Groups in flight at the stop are dropped
    unpublished (said in the log), and a restart does not explore them again."""
    num_cpus: PositiveInt = 1
    """CPUs of each explorer's bundle under `rolectl up --launcher ray`."""
    use_gpus: StrictBool = False
    """Under `rolectl up --launcher ray`, give each explorer engine_num x tensor_parallel_size GPUs."""


class BufferConfig(Section):
    """Experiences: tasks per explore step, and how long the trainer may hold a batch unacked."""

    batch_size: PositiveInt = 4
    """Tasks per explore step."""
    ack_wait_s: Seconds = 30.0
    """Seconds the trainer may hold a batch unacked before it is redelivered."""


class TransportConfig(Section):
    """Weight-transport knobs."""

    checkpoint_dir: PathStr | None = None
    """Shared directory for `sync_method: checkpoint`; default `<run_dir>/<job>/weights`."""
    object_store_storage: Literal["file", "memory"] = "file"
    """Where the object store keeps weight chunks: `file` keeps every version across a nats-server
    restart (a restart costs only a stall); `memory` fetches faster, and a version lost with a
    restart fails its fetch clearly (the explorer keeps its weights)."""
    fetch_connections: PositiveInt | None = None
    """Data connections one object-store fetch (`sync_method: memory`) is split over, each on its own
    thread. Unset: one on a plain connection; under TLS one per two CPUs of the explorer's host, 2
    to 4, since one TLS connection decrypts on one core (docs/weights-at-size.md)."""
    digest: Literal["xxh3-128", "blake3", "sha256"] = "xxh3-128"
    """Digest of every chunk a pull method (`memory`, `checkpoint`) publishes; receivers check each
    chunk with the algorithm its manifest names. `xxh3-128` detects corrupt and missing bytes at
    memory speed; `blake3` (a receiving core spends about 0.25 s per GiB on it) or `sha256` give
    each version a cryptographic content hash."""
    bucket_size_mb: PositiveInt = 512
    """torch.distributed broadcast bucket size, in MiB."""
    group_timeout_s: Seconds = 60.0
    """A dead peer mid-broadcast fails the transfer after this many seconds."""
    wire_dtype: Literal["bfloat16", "float16"] | None = None
    """Dtype the weights travel in with a pull method (`memory`, `checkpoint`): the trainer keeps its
    own (e.g. float32) master weights and casts floating-point tensors when it publishes; explorers
    receive and serve this dtype. Unset: the trainer's dtype. `bfloat16` halves a float32 model's
    bytes and makes delta sync (`keyframe_interval`) effective."""
    keyframe_interval: Annotated[int, Strict(), Field(ge=1)] = 1
    """Delta sync with a pull method: every this many versions a full copy (a keyframe), the versions
    between stored as the compressed XOR of their bytes with the version before. An explorer holding
    the previous version fetches only the delta; any other fetches the keyframe and the deltas after
    it. The result is digest-checked before it is used. Costs one model of memory (at the wire dtype)
    in the trainer and in each explorer. 1: every version is full (no deltas)."""


class ServeConfig(Section):
    """Serve mode: explorers answer OpenAI-compatible requests (`/v1/chat/completions`,
    `/v1/completions`, `/v1/models`) from agent applications instead of exploring the task set, and
    rewarded completions (`POST /v1/rewards`) become experiences. Needs `sync_style: fully_async`
    with a pull method (`memory` or `checkpoint`): weights are swapped in between two requests."""

    enabled: StrictBool = False
    """Explorers serve (as `rolectl start explorer --serve` does) instead of exploring."""
    host: Annotated[str, Strict()] = "127.0.0.1"
    """Address the endpoint listens on (`0.0.0.0` for every interface)."""
    port: Annotated[int, Strict(), Field(ge=0, le=65535)] = 0
    """Port of explorer-0; explorer-N listens on `port + N` (0: each takes a free port, written to
    `<run_dir>/<job>/<member>/serve_url`)."""
    model_name: Annotated[str, Strict(), Field(min_length=1)] | None = None
    """The model id clients pass as `model` (default: the job name); any other id gets 404."""
    api_key_env: Annotated[str, Strict(), Field(min_length=1)] | None = None
    """Environment variable holding the API key clients must send as `Authorization: Bearer`; unset:
    no key is asked for. The variable must be set where the explorer runs."""
    max_queue: PositiveInt = 16
    """Requests waiting for or in generation at once; one more is refused with 429 (retry later)."""
    reward_timeout_s: Seconds = 300.0
    """How long a completion waits for its reward; after that it expires, is counted and is never
    trained on."""
    max_trajectory_tokens: PositiveInt | None = None
    """A session's trajectory (its calls as one token sequence, docs/serve.md): tokens after the first
    call's prompt at most; a call that would pass it starts a new trajectory of the session (counted
    `trajectory_splits_budget`). The trainer takes responses this long. Default: the model's context
    length, which bounds a session anyway (each call's prompt and response fit it)."""
    reward: Literal["sum", "discounted"] = "sum"
    """A session's reward from per-turn rewards (`POST /v1/rewards` with `done: false`) and the final
    one: their sum, or their sum discounted by `discount` per turn."""
    discount: Annotated[float, Strict(), Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    """`reward: discounted`: turn t's reward counts `discount ** t` (t = 0 for the session's first call)."""
    agent: tuple[Annotated[str, Strict()], ...] | None = None
    """A command explorer-0 runs once it listens (an agent application), with `OPENAI_BASE_URL`,
    `OPENAI_API_KEY` and `ROLECTL_SERVE_MODEL` set; its output goes to the explorer's log. The
    explorer stops serving when the trainer finishes; an agent that fails fails the explorer."""


class NatsConfig(Section):
    """How the job uses its NATS servers (the URLs themselves are the top-level `nats_url`) and
    how clients reach them securely: paths of credential and TLS files (never secrets inline).
    Flags (--creds, --tls-ca, --tls-cert, --tls-key) and ROLECTL_NATS_* variables override them;
    relative paths are relative to the config file."""

    replicas: Annotated[int, Strict(), Field(gt=0, le=5)] = 1
    """Copies of the event, experience and weight streams: 1 on a single server, 3 on a 3-node
    cluster (any one node may then be lost); JetStream allows at most 5. An existing stream with
    more is accepted."""
    creds: PathStr | None = None
    """`<identity>.nk` / `.creds` / `.crt` (+ `.key`), by extension."""
    tls_ca: PathStr | None = None
    """CA file that signed the server's certificate."""
    tls_cert: PathStr | None = None
    """Client certificate (mTLS), with tls_key."""
    tls_key: PathStr | None = None
    """Client certificate's key."""

    @property
    def security(self) -> ClientSecurity:
        return ClientSecurity(creds=self.creds, tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key)


class EvalConfig(TableSection):
    """Evaluation on a held-out task set: the explorer runs the whole set with the weights it holds,
    after explore step `eval_interval`, `2 x eval_interval`, ... (then syncs) and, with
    `eval_on_startup`, before its first step; each eval is recorded as an `EvalFinished` event (the
    eval curve in `replay`, `status`, the summary and the dashboard) and trains nothing. Only the
    first explorer (`explorer-0`) evaluates: every explorer holds the same version at a boundary.
    `rolectl bench` evaluates saved versions on the same set. The set is read like `data:` (`path`
    or `dataset`, `split`, the keys); for the tiny engine each prompt's digits are the string to
    reverse (`{"prompt": "reverse 3 1 4 0 =", "answer": "0 4 1 3"}`)."""

    rewards: tuple[Annotated[str, Strict(), Field(min_length=1)], ...] | None = None
    """Reward names (built-ins, `module:function` or `path/to/file.py:function`, as in `data.rewards`)
    whose means are reported; default the names in `data.rewards`, or `positional_match` and
    `exact_match` for the tiny engine."""
    temperature: Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)] = 0.0
    """Sampling temperature; 0 is greedy (the default)."""
    samples: PositiveInt = 1
    """Responses per eval task."""
    max_tasks: PositiveInt | None = None
    """Evaluate only the set's first `max_tasks` rows (default all)."""
    eval_interval: NonNegativeInt = 0
    """Evaluate after every `eval_interval`-th explore step (0 = never during the run)."""
    eval_on_startup: StrictBool = False
    """Evaluate the starting weights before the first explore step (not on a resume)."""

    @property
    def enabled(self) -> bool:
        return self.has_source and (self.eval_interval > 0 or self.eval_on_startup)

    @model_validator(mode="after")
    def _source_when_evaluating(self) -> EvalConfig:
        if not self.has_source and (self.eval_interval or self.eval_on_startup):
            raise invalid([("path", "required when eval.eval_interval or eval.eval_on_startup is set: "
                                    "the held-out task file(s) to evaluate on (or `dataset:`, a cached dataset id)")])
        return self


TRACKERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""Experiment trackers by name, and the optional extra (`pip install 'rolectl[NAME]'`) each needs."""


def _known_trackers(value: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [name for name in value if name not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker {', '.join(map(repr, unknown))}; known: {sorted(TRACKERS)}")
    if len(set(value)) != len(value):
        raise ValueError(f"a tracker is named twice: {list(value)}")
    return value


def tracker_problems(backends: tuple[str, ...]) -> list[tuple[str, str]]:
    """Trackers whose package is not installed, by path, with the extra that installs each."""
    import importlib.util

    return [(f"monitor.backends[{i}]", f"{name} is not installed; pip install 'rolectl[{TRACKERS[name]}]'")
            for i, name in enumerate(backends) if importlib.util.find_spec(name) is None]


class MonitorConfig(Section):
    """Experiment trackers: each role logs its figures to them (the trainer's by train step, the
    explorers' and evals' by explore step, sync rounds by round, the job's config as
    hyper-parameters). A tracker that fails mid-run is logged once and counted; the job goes on."""

    backends: Annotated[tuple[str, ...], AfterValidator(_known_trackers)] = ()
    """Trackers to log to: `tensorboard`, `mlflow`, `wandb` (each an optional extra of that name)."""
    dir: PathStr | None = None
    """Where trackers write: TensorBoard event files, the local MLflow store and W&B's offline runs;
    default `<run_dir>/<job>/monitor`."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; default a local SQLite store, `<dir>/mlflow/mlflow.db` (open it with
    `mlflow ui --backend-store-uri sqlite:///<that path>`)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """W&B mode: `offline` writes runs under `dir` (sync them later with `wandb sync`)."""
    project: str | None = None
    """Project / experiment name in the trackers; default the job's name."""

    @field_validator("backends")
    @classmethod
    def _installed(cls, backends: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        problems = tracker_problems(backends) if checking(info) else []
        if problems:
            raise invalid((path.removeprefix("monitor.backends"), why) for path, why in problems)
        return backends


def _sync_config(value: Any) -> Any:
    """A `synchronizer:` mapping becomes the core's `SyncConfig`: its fields are checked there, each
    problem keeps its path."""
    if value is None:
        return SyncConfig()
    if isinstance(value, SyncConfig):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a mapping (indented `key: value` lines), got {yaml_kind(value)}")
    try:
        return SyncConfig.from_mapping(value, where="synchronizer")
    except ConfigError as exc:
        raise invalid((name.removeprefix("synchronizer."), why) for name, why in exc.problems) from None


def _job_name(value: str) -> str:
    return check_name(value, "job name")


def _server_urls(value: str) -> str:
    parse_server_urls(value)
    return value


def _lower_level(value: Any) -> Any:
    """Levels are read in any case; a bad one is reported as written."""
    known = ("debug", "info", "warning", "error")
    return value.lower() if isinstance(value, str) and value.lower() in known else value


class JobConfig(Section):
    """One RL job: its name, where NATS is, and each role's settings."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    job: Annotated[str, Strict(), AfterValidator(_job_name)]
    """The job's name: 1-64 letters, digits, `_` or `-` (it becomes part of NATS subjects)."""
    nats_url: Annotated[str, Strict(), AfterValidator(_server_urls)] = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma-separated; `--nats` overrides it."""
    run_dir: PathStr = "runs"
    """Where jobs keep their files: `<run_dir>/<job>/`."""
    archive_dir: PathStr | None = None
    """Where the active synchronizer archives the event stream's history (segments with digests)
    before it trims the stream to its newest snapshot; default `<run_dir>/<job>/archive`.
    `rolectl replay|export|status|dashboard --archive DIR` read it back with the stream's tail (the
    dashboard also finds it through `--config`, and `rolectl up`'s dashboard reads it). Members and
    synchronizer replicas that lag behind a trim read the trimmed records back from it."""
    log_level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(_lower_level)] = "info"
    """Log level of every role."""
    synchronizer: Annotated[SyncConfig, BeforeValidator(_sync_config)] = SyncConfig()
    """When and how weights move (see the `synchronizer` section)."""
    trainer: TrainerConfig = TrainerConfig()
    explorers: ExplorerConfig = ExplorerConfig()
    buffer: BufferConfig = BufferConfig()
    transport: TransportConfig = TransportConfig()
    nats: NatsConfig = NatsConfig()
    eval: EvalConfig = EvalConfig()
    monitor: MonitorConfig = MonitorConfig()
    serve: ServeConfig = ServeConfig()
    """Serve mode: an OpenAI-compatible endpoint on each explorer (off by default)."""
    model: ModelSection = Field(default_factory=TinyModelSection)
    """The engine's settings, selected by `model.engine` (see the engine sections)."""
    data: DataField | None = None
    """Task file and rewards (`hf` / `fsdp` / `vllm` engines)."""
    algorithm: AlgorithmField | None = None
    """verl advantage estimator and policy loss (`hf` / `fsdp` trainers)."""
    stage: Literal[STAGES] = "rl"  # type: ignore[valid-type]
    """What the job trains: `rl` (explorers sample, a synchronizer syncs, the trainer learns from
    rewards), or a trainer-only stage over a data file that `rolectl up` runs alone: `sft`
    (demonstrations, the `sft:` section) or `dpo` (preference pairs, the `dpo:` section).
    docs/stages.md: the pipeline from one stage to the next."""
    sft: SFTField | None = None
    """Supervised fine-tuning's data, schedule and eval (`stage: sft`; `hf` / `fsdp` engines)."""
    dpo: DPOField | None = None
    """Direct preference optimisation's pairs, beta, loss, schedule and eval (`stage: dpo`; `hf` /
    `fsdp` engines)."""
    agent: AgentSection | None = None
    """Multi-turn episodes against an environment (see the `agent` section); unset: single-turn."""
    source: str | None = Field(default=None, exclude=True)
    """The file it was loaded from (set by `load_config`, not written in a file)."""

    @model_validator(mode="before")
    @classmethod
    def _engine_sections_as_written(cls, values: Any, info: ValidationInfo) -> Any:
        """`data:` and `algorithm:` are typed for the engines that read them (`READS_DATA`); for any
        other engine they are read as written (it checks its own), and so are all three sections of a
        job loaded without its engines (`SKIP_ENGINES`)."""
        if not isinstance(values, Mapping):
            return values
        model = values.get("model")
        engine = model.get("engine", "tiny") if isinstance(model, Mapping) else getattr(model, "engine", "tiny")
        if engine in READS_DATA and not skipping(info):
            return values
        read = dict(values)
        if skipping(info) and isinstance(model, Mapping):
            try:
                read["model"] = OpenModelSection.model_validate(model)
            except ValidationError:
                pass  # not even that (no engine name): the field reports it
        for key in ENGINE_SECTIONS[1:]:
            if isinstance(values.get(key), Mapping):
                read[key] = OpenSection.model_validate(values[key])
        return read

    @model_validator(mode="after")
    def _sections_agree(self, info: ValidationInfo) -> JobConfig:
        """The rules across sections, every problem at once by its path; with the engines checked
        (`CHECK_ENGINES`), also what the engines need and the eval file."""
        problems = cross_section_problems(self, check_engines=checking(info), check_trainer=checking_trainer(info))
        if problems:
            raise invalid(problems)
        return self

    @property
    def job_dir(self) -> Path:
        return Path(self.run_dir) / self.job

    @property
    def hf_export_dir(self) -> Path:
        """Where the trainer writes its Hugging Face exports (`final`, `step-N`)."""
        return self.job_dir / "hf"

    @property
    def final_export_dir(self) -> Path:
        """The trainer's last Hugging Face export: `trainer.export_dir`, else `hf/final`."""
        return Path(self.trainer.export_dir) if self.trainer.export_dir else self.hf_export_dir / "final"

    @property
    def trainer_only(self) -> bool:
        """A stage that runs the trainer alone: no explorer, no synchronizer."""
        return self.stage != "rl"

    @property
    def event_archive_dir(self) -> Path:
        return Path(self.archive_dir) if self.archive_dir else self.job_dir / "archive"

    @property
    def trainer_checkpoint_dir(self) -> Path:
        return Path(self.trainer.checkpoint_dir) if self.trainer.checkpoint_dir else self.job_dir / "trainer"

    @property
    def server_go_gc(self) -> int | None:
        """The embedded nats-server's GOGC for this job (`bus.server.go_gc_for_weights`): tight when
        weight versions sit in its memory (`sync_method: memory` with `object_store_storage: memory`),
        loose when they sit in its file storage, Go's default without weights in it."""
        in_server = self.synchronizer.sync_method is SyncMethod.MEMORY
        return go_gc_for_weights(self.transport.object_store_storage if in_server else None)

    @property
    def weights_checkpoint_dir(self) -> Path:
        return (
            Path(self.transport.checkpoint_dir)
            if self.transport.checkpoint_dir
            else self.job_dir / "weights"
        )

    @property
    def monitor_dir(self) -> Path:
        return Path(self.monitor.dir) if self.monitor.dir else self.job_dir / "monitor"

    def explorer_ids(self) -> list[str]:
        """The explorers the job runs: none for a trainer-only stage."""
        return [] if self.trainer_only else [f"explorer-{i}" for i in range(self.explorers.count)]

    def job_configured(self, member: MemberRef) -> JobConfigured:
        """What a member of this job announces first: its sync config and, when explorers are paced
        (`synchronizer.max_ahead`), the tasks a train step takes (the bound's unit)."""
        paced = self.synchronizer.max_ahead is not None
        unit = (self.trainer.train_batch_tasks or self.buffer.batch_size) if paced else None
        return JobConfigured(member=member, config=self.synchronizer, train_batch_tasks=unit)

    def with_overrides(self, **changes: Any) -> JobConfig:
        """This job with `changes` (sections or top-level values), validated like the file was."""
        try:
            return self.model_validate({**dict(self), **changes})
        except ValidationError as exc:
            raise ConfigError(problems_of(exc, JobConfig), where=self.source or "config") from None

    def with_explorer_count(self, count: int) -> tuple[JobConfig, str | None]:
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
        cfg = self.with_overrides(explorers=self.explorers.replace(count=count))
        if count == old:
            return cfg, None
        batch = self.buffer.batch_size
        tasks = self.trainer.train_batch_tasks
        if tasks == old * batch:
            cfg = cfg.with_overrides(trainer=cfg.trainer.replace(train_batch_tasks=count * batch))
            return cfg, (f"trainer.train_batch_tasks {tasks} -> {count * batch} (= {count} explorers x "
                         f"{batch} tasks): still one train step per round of exploration, as with {old}")
        per_step = tasks or batch
        return cfg, (f"trainer.train_batch_tasks stays {per_step}"
                     f"{'' if tasks else ' (unset: one explorer batch)'}: a round of {count} explorers makes "
                     f"{count * batch} tasks, {count * batch / per_step:g} train steps' worth. For one train "
                     f"step per round set trainer.train_batch_tasks: {count * batch} in the config")


ENV_PREFIX = "ROLECTL_"


def _variable(field: str) -> str:
    """A setting's variable, `ROLECTL_<FIELD>`; the NATS client's are the bus's names (`ENV_VARS`: it
    reads them itself when it connects)."""
    nats = field.removeprefix("nats_")
    return ENV_VARS[nats] if field != nats and nats in ENV_VARS else f"{ENV_PREFIX}{field.upper()}"


class EnvSettings(Section):
    """Environment variables (prefix `ROLECTL_`): those the roles read, a command's flag winning over
    its variable (`rolectl COMMAND --help` names the variable beside the flag), and those rolectl
    sets for the processes it starts. Other `ROLECTL_*` names are ignored."""

    model_config = ConfigDict(extra="ignore", alias_generator=_variable)

    torch_threads: Annotated[int, Field(gt=0)] = 1  # not strict: a variable's value is text
    """Threads torch may use in each role process (`torch.set_num_threads`)."""
    advertise_host: str | None = None
    """The address explorers reach the trainer's rank 0 at for a collective (nccl) sync; default this
    host's IP. The launchers set it (127.0.0.1 locally, the node's IP under Ray)."""
    nats_creds: str | None = None
    """Credentials file for NATS (as `--creds` / `nats.creds`)."""
    nats_tls_ca: str | None = None
    """CA file that signed the server's certificate (as `--tls-ca` / `nats.tls_ca`)."""
    nats_tls_cert: str | None = None
    """Client certificate for mTLS (as `--tls-cert` / `nats.tls_cert`)."""
    nats_tls_key: str | None = None
    """Client certificate's key (as `--tls-key` / `nats.tls_key`)."""
    trainer_rank: Annotated[int, Field(ge=0)] | None = None
    """Set by `rolectl start trainer` in each rank it starts (`trainer.world_size` > 1): this process's
    rank; not for users."""
    serve_model: str | None = None
    """Set by explorer-0 for the agent it runs (`serve.agent`): the model id to ask the endpoint for."""

    @classmethod
    def variable(cls, field: str) -> str:
        """The environment variable that sets `field`."""
        return str(cls.model_fields[field].alias)

    @property
    def nats_security(self) -> ClientSecurity:
        """The NATS client's files these variables name."""
        return ClientSecurity(creds=self.nats_creds, tls_ca=self.nats_tls_ca, tls_cert=self.nats_tls_cert,
                              tls_key=self.nats_tls_key)


def env_settings(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """The `ROLECTL_*` variables of this process (or of `environ`), validated; a bad value raises
    `ConfigError` naming the variable."""
    environ = os.environ if environ is None else environ
    try:
        return EnvSettings.model_validate({name: value for name, value in environ.items()
                                           if name.startswith(ENV_PREFIX)})
    except ValidationError as exc:
        raise ConfigError(problems_of(exc, EnvSettings), where="environment") from None


# -- loading ---------------------------------------------------------------------------------------

def parse_config(data: Any, *, source: str | None = None, check_engines: bool = True,
                 rollout_only: bool = False) -> JobConfig:
    """Validate a mapping (parsed YAML) into a `JobConfig`; raise `ConfigError` listing every problem.

    `check_engines=False` leaves the engine's sections (model, data, algorithm) to the roles that
    run an engine, read as written: checking them imports the engines (torch, seconds), which a
    synchronizer, whose restart time is the job's stall, has no use for. `rollout_only` checks the
    engines but not what only a trainer reads (an explorer's load, `CHECK_ROLLOUT`)."""
    where = source or "config"
    if not isinstance(data, Mapping):
        if data is None:
            raise ConfigError([("(file)", "is empty: a job config is a YAML mapping with at least `job: NAME` "
                                          "(see examples/quickstart.yaml)")], where=where)
        raise ConfigError([("(top level)", f"must be a mapping of sections (`job: NAME`, `trainer:` ...), got "
                                           f"{yaml_kind(data)} (see examples/quickstart.yaml)")], where=where)
    values = {key: value for key, value in data.items() if value is not None or key in ("data", "algorithm")}
    if source is not None:
        values["source"] = source
    try:
        context = (CHECK_ROLLOUT if rollout_only else CHECK_ENGINES) if check_engines else SKIP_ENGINES
        cfg = JobConfig.model_validate(values, context=context)
    except ValidationError as exc:
        order = {str(key): i for i, key in enumerate(data)}
        problems = sorted(problems_of(exc, JobConfig, top_level="section"),
                          key=lambda problem: order.get(problem[0].split(".")[0].split("[")[0], len(order)))
        raise ConfigError(problems, where=where) from None
    return _relative_to(cfg, source)


def _relative_to(cfg: JobConfig, source: str | None) -> JobConfig:
    """Credential paths written relative to the config file, made absolute."""
    if source is None:
        return cfg
    base = Path(source).resolve().parent
    paths = {name: str(base / getattr(cfg.nats, name))
             for name in ("creds", "tls_ca", "tls_cert", "tls_key") if getattr(cfg.nats, name)}
    return cfg.with_overrides(nats=cfg.nats.replace(**paths)) if paths else cfg


def load_config(path: str | Path, *, check_engines: bool = True, rollout_only: bool = False) -> JobConfig:
    """Read and validate a YAML job file; errors name the file and every bad field (see
    `parse_config` for `check_engines` and `rollout_only`)."""
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
    return parse_config(data, source=str(path), check_engines=check_engines, rollout_only=rollout_only)
