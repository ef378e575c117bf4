"""The engines' config sections: `model:` (one model per engine, selected by `model.engine`), `data:`
and `algorithm:`, on the base in `rolectl.roles.config_base`.

It lives with the engines, below the job config (`rolectl.roles.config`) that builds on it, and
imports neither torch nor NATS: a synchronizer loads the job config without either. What a section
names outside itself (a model directory, a data file, a reward function, a name in verl's registry)
is checked by its validators when the job is loaded with its engines (`config_base.checking`), once;
what an engine needs installed is its `EngineSpec.problems`. An engine of another package gets its
sections as written (`OpenModelSection`, `OpenSection`) and checks them in its own `problems`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    Strict,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rolectl.roles.config_base import (
    Name,
    NonNegativeInt,
    NonNegativeNumber,
    OpenSection,
    PositiveInt,
    PositiveNumber,
    Seconds,
    Section,
    StrictBool,
    checking,
    checking_trainer,
    invalid,
)

__all__ = [
    "TinyModelSection",
    "HFBuildSection",
    "LoRASection",
    "HFModelSection",
    "FSDPSection",
    "FSDPModelSection",
    "OpenModelSection",
    "BUILTIN_TRAINERS",
    "READS_DATA",
    "TableSection",
    "DataSection",
    "AlgorithmSection",
    "DynamicSamplingFields",
    "RolloutCorrectionSection",
    "ModelSection",
    "DataField",
    "AlgorithmField",
    "typed_unless_open",
    "TASK_FILES",
    "OUTCOME_ESTIMATORS",
    "LOSS_AGG_MODES",
    "TINY_LOSS_AGG_MODES",
    "KL_PENALTIES",
    "DTYPES",
]


TINY_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
"""verl's loss aggregation modes the tiny engine's own loss offers (the hf engines take all of verl's)."""


class TinyModelSection(Section):
    """`model:` for `engine: tiny`, the pure-PyTorch reference: a tiny transformer that learns to
    reverse digits with GRPO on CPU. The defaults take mean reward from ~0.07 to >0.7 in 40 trainer
    steps with one-step-stale weights (`benchmarks/learning.py`)."""

    engine: Literal["tiny"] = "tiny"
    """The trainer's engine (and the explorers', unless rollout_engine names another)."""
    rollout_engine: str | None = None
    """The explorers' engine; the tiny engine pairs only with itself."""
    seed: NonNegativeInt = 0
    """Seed of the version-0 weights and of the task stream."""
    task_length: PositiveInt = 4
    """Digits per task."""
    long_task_length: PositiveInt | None = None
    """Digits of a long task, for long-tailed response lengths (most short, a few much longer, as a
    reasoning model's are); more than `task_length`. Each task keeps its own prompt length (no padding)."""
    long_task_fraction: Annotated[float, Strict(), Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    """The share of tasks that are `long_task_length` digits long (drawn per task)."""
    group_size: Annotated[int, Strict(), Field(ge=2)] = 16
    """Responses sampled per task (advantages are group-relative)."""
    tasks_per_step: PositiveInt = 64
    """Tasks per explore step (buffer.batch_size overrides it in a job)."""
    n_heads: PositiveInt = 4
    """Attention heads."""
    d_model: PositiveInt = 64
    """Model width; a multiple of n_heads."""
    n_layers: PositiveInt = 2
    """Transformer layers."""
    d_ff: PositiveInt = 256
    """Feed-forward width."""
    lr: PositiveNumber = 3e-3
    """Adam learning rate."""
    minibatches: PositiveInt = 4
    """Optimizer steps per train step, each on a slice of the groups (reuses a batch like PPO epochs)."""
    clip_eps: PositiveNumber = 0.2
    """PPO clip range."""
    max_grad_norm: PositiveNumber = 1.0
    """Gradient-norm clip."""
    temperature: PositiveNumber = 1.0
    """Sampling temperature."""
    loss_agg_mode: Literal[TINY_LOSS_AGG_MODES] = "token-mean"  # type: ignore[valid-type]
    """How the loss adds up the trained tokens, as verl's `agg_loss`: token-mean weighs every token
    alike (long responses more), seq-mean-token-sum / seq-mean-token-mean each sequence alike."""

    @field_validator("d_model")
    @classmethod
    def _heads_divide_width(cls, d_model: int, info: ValidationInfo) -> int:
        heads = info.data.get("n_heads")
        if heads and d_model % heads:
            raise ValueError(f"must be divisible by n_heads ({heads}), got {d_model}")
        return d_model

    @model_validator(mode="after")
    def _long_tasks_longer(self) -> TinyModelSection:
        if self.long_task_fraction > 0 and (self.long_task_length or 0) <= self.task_length:
            raise ValueError(f"long_task_fraction {self.long_task_fraction} needs long_task_length more than "
                             f"task_length ({self.task_length}), got {self.long_task_length}")
        return self

    @property
    def longest_task(self) -> int:
        """Digits of the longest task (`long_task_length` when long tasks are drawn)."""
        return self.long_task_length if self.long_task_fraction > 0 and self.long_task_length else self.task_length

    @property
    def prompt_length(self) -> int:
        return self.longest_task + 2  # BOS digits SEP

    @property
    def max_response_length(self) -> int:
        return self.longest_task + 1  # digits EOS


class HFBuildSection(Section):
    """`model.build`: a small random-init model built at `model.path` when it is missing (tests,
    examples), its tokenizer made from the words of `data.path`."""

    family: Literal["qwen2", "llama", "gpt2"] = "qwen2"
    """Architecture family. qwen2 and llama know positions only through RoPE (relative); gpt2 has
    learned absolute position embeddings, with which a random-init model learns a task indexed by
    position (such as reversing digits) from rewards far sooner (docs/engines.md). gpt2 needs
    hidden_size = num_heads x head_dim."""
    hidden_size: PositiveInt = 64
    """Model width."""
    num_layers: PositiveInt = 2
    """Decoder layers."""
    num_heads: PositiveInt = 2
    """Attention heads."""
    head_dim: PositiveInt = 32
    """Width of each head."""
    intermediate_size: PositiveInt = 256
    """MLP width."""
    seed: NonNegativeInt = 0
    """Seed of the random weights."""
    max_position_embeddings: PositiveInt = 128
    """Longest sequence."""
    chat_template: StrictBool = False
    """Give the tokenizer a small chat template (system, user, assistant and tool messages, the tools
    list, and tool calls in the `compact` syntax: `<tool_call> calculator 37 + 45`), its words and the
    built-in tools' names in the vocabulary: what a multi-turn or tool-calling job on a built model
    needs (docs/tools.md). Off: no template, prompts are the data's text as it stands."""

    @model_validator(mode="after")
    def _gpt2_heads_fill_width(self) -> HFBuildSection:
        if self.family == "gpt2" and self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(f"family gpt2 splits hidden_size into num_heads heads: hidden_size "
                             f"({self.hidden_size}) must equal num_heads x head_dim "
                             f"({self.num_heads} x {self.head_dim})")
        return self


def _target_modules(value: Any) -> Any:
    if value == "all-linear" or (isinstance(value, list) and value
                                 and all(isinstance(v, str) and v for v in value)):
        return value
    raise ValueError(f"must be all-linear or a non-empty list of module names (e.g. [q_proj, v_proj]), got {value!r}")


class LoRASection(Section):
    """`model.lora`: train a LoRA adapter (peft) instead of every weight. The base model stays frozen;
    only the adapter's tensors are trained, checkpointed and sent to the explorers."""

    rank: PositiveInt = 8
    """Rank r of each adapter's A (r x in) and B (out x r) matrices."""
    alpha: PositiveNumber = 16.0
    """Scaling numerator: the adapter's update is scaled by alpha / rank."""
    dropout: Annotated[float, Strict(), Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    """Dropout on the adapter's input while training (0 <= dropout < 1)."""
    target_modules: Annotated[str | list[str], BeforeValidator(_target_modules)] = "all-linear"
    """Module names (or name suffixes) that get an adapter, e.g. [q_proj, v_proj]; `all-linear`:
    every linear layer but the output head."""
    merge_on_save: StrictBool = False
    """Also write the base model with the adapter merged in (`<export>/merged`) at each Hugging
    Face export, beside the adapter itself."""


DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _device(value: str) -> str:
    if not (value == "cpu" or value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit())):
        raise ValueError(f"must be cpu, cuda or cuda:N, got {value!r}")
    return value


class HFModelSection(Section):
    """`model:` for `engine: hf` (Hugging Face transformers: trainer and rollouts) and
    `rollout_engine: vllm`. Nothing is ever downloaded."""

    engine: Literal["hf"] = "hf"
    """The trainer's engine (and the explorers', unless rollout_engine names another)."""
    rollout_engine: str | None = None
    """The explorers' engine: hf (default) or vllm."""
    path: Name
    """A local Hugging Face model directory (config.json, safetensors weights, tokenizer)."""
    build: HFBuildSection | None = None
    """Build a random-init model at `path` when it is missing (see the `model.build` section)."""
    device: Annotated[str, Strict(), AfterValidator(_device)] = "cpu"
    """cpu, cuda or cuda:N."""
    dtype: Literal[DTYPES] = "float32"  # type: ignore[valid-type]
    """Weights' dtype."""
    seed: NonNegativeInt = 0
    """Sampling seed."""
    group_size: Annotated[int, Strict(), Field(ge=2)] = 8
    """Responses sampled per task (advantages are group-relative)."""
    max_new_tokens: PositiveInt = 16
    """Longest response, in tokens."""
    temperature: PositiveNumber = 1.0
    """Sampling temperature."""
    lr: PositiveNumber = 1e-3
    """AdamW learning rate."""
    weight_decay: NonNegativeNumber = 0.0
    """AdamW weight decay."""
    max_grad_norm: PositiveNumber = 1.0
    """Gradient-norm clip."""
    minibatches: PositiveInt = 1
    """Optimizer steps per train step, each on a slice of the groups."""
    micro_batch_size: PositiveInt = 64
    """Sequences per forward/backward (gradient accumulation)."""
    micro_batch_tokens: PositiveInt | None = None
    """Tokens per forward/backward, as a padded micro-batch costs them (rows x its longest row's
    prompt and response): each rank's rows sorted by length and packed up to it, at most
    `micro_batch_size` rows each, a longer row alone (verl's `use_dynamic_bsz`); rows dealt to ranks
    by length. The same loss and gradients, less padding on long-tailed batches; unset: rows in order."""
    gradient_checkpointing: StrictBool = False
    """Recompute activations in the backward pass (less memory, more time)."""
    vllm: Annotated[dict[str, Any], Strict()] = {}
    """Extra keyword arguments for vllm.LLM."""
    lora: LoRASection | None = None
    """Train a LoRA adapter instead of the whole model (see the `model.lora` section); unset: full
    fine-tuning."""
    init_from: Name | None = None
    """A trainer-only stage (`stage: sft|dpo`) starts from another job's trainer checkpoint: its
    directory (`<run_dir>/<job>/trainer`, whose last checkpoint is taken, or one `step-N` in it), of
    the `hf` or `fsdp` engine. Weights only: the optimizer, schedule and data position start fresh.
    The model's shape (and `lora`) must be that job's; `path` still gives the config and tokenizer.
    To start from a stage's Hugging Face export, name it as `path` instead."""

    @property
    def torch_dtype(self) -> Any:
        """The torch dtype `dtype` names (torch is the engines' import, made when they ask)."""
        import torch

        return getattr(torch, _DTYPE_ALIASES.get(self.dtype, self.dtype))

    @model_validator(mode="after")
    def _model_directory_exists(self, info: ValidationInfo) -> HFModelSection:
        if checking(info) and self.build is None and not (Path(self.path) / "config.json").is_file():
            raise invalid([("path", f"{self.path}: no config.json there (a local Hugging Face model directory "
                                    "is needed; nothing is downloaded), or give model.build to build one")])
        return self


class FSDPSection(Section):
    """`model.fsdp`: how an `fsdp` trainer shards the model over its ranks (FSDP2)."""

    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype the gathered parameters compute in (the optimizer keeps float32 weights); auto: bfloat16
    on CUDA, float32 on CPU."""
    reshard_after_forward: StrictBool = True
    """Free each layer's gathered parameters after its forward (less memory, one more all-gather)."""
    weight_bucket_bytes: PositiveInt = 256 << 20
    """Size of the buckets the weights are gathered and streamed in (a weight sync, the HF export)."""
    timeout_s: Seconds = 600.0
    """A collective waiting longer than this fails the rank (a peer died): the trainer stops as a whole."""


class FSDPModelSection(HFModelSection):
    """`model:` for `engine: fsdp`: the `hf` engine's model sharded over the trainer's ranks with
    FSDP2 (`trainer.world_size`). Explorers use the `hf` rollout (or `rollout_engine: vllm`).
    `micro_batch_size` counts sequences (`micro_batch_tokens` tokens) per rank per forward/backward;
    `dtype` is what the explorers load and what the weight stream and the Hugging Face export carry."""

    engine: Literal["fsdp"] = "fsdp"  # type: ignore[assignment]
    """The trainer's engine (its explorers use the hf rollout unless rollout_engine names another)."""
    fsdp: FSDPSection = FSDPSection()
    """How the model is sharded (see the `model.fsdp` section)."""

    @property
    def compute_dtype(self) -> Any:
        """The torch dtype the gathered parameters compute in (`fsdp.param_dtype`)."""
        import torch

        if self.fsdp.param_dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return getattr(torch, self.fsdp.param_dtype)


class OpenModelSection(OpenSection):
    """`model:` for an engine of another package (the `rolectl.engines` entry points): `engine` and
    `rollout_engine` are read here, every other key as written; the engine's `EngineSpec.problems`
    checks them. A job loaded without its engines (a synchronizer) reads every `model:` so."""

    engine: Name
    """The trainer's engine (and the explorers', unless rollout_engine names another)."""
    rollout_engine: Name | None = None
    """The explorers' engine."""


BUILTIN_TRAINERS = ("tiny", "hf", "fsdp")
"""The engines whose `model:` is typed here; any other engine's is an `OpenModelSection`."""
READS_DATA = ("hf", "fsdp")
"""The engines whose trainer reads `data:` and `algorithm:` (typed here); any other engine's are read as
written (the tiny engine refuses them, one of another package checks its own)."""


def _engine_of(value: Any) -> str:
    """The tag of a `model:` section: its engine (`tiny` when it names none), `other` for an engine
    of another package."""
    if isinstance(value, OpenModelSection):
        return "other"
    if isinstance(value, Mapping):
        engine = value.get("engine", "tiny")
        return engine if engine in BUILTIN_TRAINERS else "other"
    return getattr(value, "engine", "tiny")  # not a mapping: the tiny section says what it must be


ModelSection = Annotated[Annotated[TinyModelSection, Tag("tiny")]
                         | Annotated[HFModelSection, Tag("hf")]
                         | Annotated[FSDPModelSection, Tag("fsdp")]
                         | Annotated[OpenModelSection, Tag("other")],
                         Discriminator(_engine_of)]
"""A job's `model:` section, selected by `model.engine`."""


TASK_FILES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""Task files by suffix, and the `datasets` loader that reads each."""


class TableSection(Section):
    """Where a section's rows come from, read with `datasets` (`roles.engines.data.open_table`): local
    files, a directory saved with `save_to_disk`, or a Hugging Face dataset in the local cache.
    `data:` and `eval:` read rows so."""

    path: Name | Annotated[list[Name], Field(min_length=1)] | None = None
    """A local .jsonl, .json, .parquet or .csv file, a glob of them (`data/train-*.jsonl`), a list of
    files or globs (one format), or a directory saved with `datasets`' `save_to_disk`; relative
    paths are from the working directory. Give `path` or `dataset`."""
    dataset: Name | None = None
    """A Hugging Face dataset id (`openai/gsm8k`) read offline from the local datasets cache
    (`HF_DATASETS_CACHE`): nothing is downloaded; load it once with `datasets.load_dataset` where
    there is a network."""
    config: Annotated[Name | None, Field(validate_default=True)] = None
    """The `dataset`'s configuration (`main`); needed when the cache holds several."""
    split: Annotated[Name, Field(validate_default=True)] = "train"
    """The split to read: of a `dataset`, or of a directory saved from a DatasetDict. Files are one
    split, `train`."""
    prompt_key: Name = "prompt"
    """Column holding the prompt."""
    answer_key: Name = "answer"
    """Column holding the answer the rewards compare with."""

    # What the source names is checked field by field, so that every problem is reported at once.
    @field_validator("path", "dataset", "config", "split")
    @classmethod
    def _source_exists(cls, value: Any, info: ValidationInfo) -> Any:
        if checking(info):
            from .data import source_field_problems

            problems = source_field_problems(info.field_name, value, info.data)
            if problems:
                raise invalid(problems)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> TableSection:
        if self.path is not None and self.dataset is not None:
            raise invalid([("dataset", f"give path ({self.path!r}) or dataset ({self.dataset!r}), not both")])
        if self.config is not None and self.dataset is None:
            raise invalid([("config", "names a configuration of a Hugging Face `dataset`; files and saved "
                                      "directories have none: remove it")])
        return self

    @property
    def has_source(self) -> bool:
        return self.path is not None or self.dataset is not None


class DataSection(TableSection):
    """`data:` for the `hf` / `vllm` engines: where tasks come from and how responses are scored."""

    shuffle_seed: NonNegativeInt = 0
    """Seed of each epoch's order."""
    chat_template: Literal["auto", True, False] = "auto"
    """Render prompts with the tokenizer's chat template: auto (when it has one), true or false."""
    rewards: Any = "exact_match"
    """A reward name, `module:function` (from the working directory or the Python path),
    `path/to/file.py:function`, or a list of them / of {name, weight}. A function takes
    `(response, answer)`, or `(response, answer, *, prompt, row)` to see the prompt text and the
    whole data row (see `rolectl.roles.engines.rewards`)."""
    max_prompt_tokens: PositiveInt = 512
    """Prompts are cut to this many tokens."""

    @model_validator(mode="after")
    def _source_given(self) -> DataSection:
        if not self.has_source:
            raise invalid([("path", "required: a file, a glob, a list of files or a directory saved with "
                                    "save_to_disk; or give `dataset:`, a Hugging Face dataset id in the local cache")])
        return self

    @field_validator("rewards")
    @classmethod
    def _rewards_resolve(cls, rewards: Any, info: ValidationInfo) -> Any:
        # a `module:function` reward is imported to check it: only when the engines are checked
        if checking(info):
            from .rewards import reward_spec_problems

            problems = reward_spec_problems(rewards, where="")
            if problems:
                raise invalid(problems)
        return rewards


OUTCOME_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg",
                      "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""verl's estimators that work from outcome rewards + group index alone (no critic values, no
reward baselines, no per-token policy statistics)."""
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k3+", "low_var_kl+")


class RolloutCorrectionSection(Section):
    """`algorithm.rollout_correction`: off-policy correction of what explorers sampled with other
    weights (an older version, another precision), verl's rollout correction under verl's names.

    With this section the trainer runs decoupled PPO (verl's `bypass_mode: false`): one more
    forward pass, without gradient, gives the trainer's logprobs before the step's update (the
    proximal policy); PPO's ratio and clip are taken against them, and the gap between them and the
    sampler's (behaviour) logprobs is measured every step (`rollout_corr/*` metrics: k3 KL, the
    largest token gap, importance weights, tokens masked), corrected by truncated importance
    weights (`rollout_is`) and tokens or sequences past a bound masked out (`rollout_rs`). Without
    it, PPO's ratio is taken against the sampler's logprobs, as before."""

    rollout_is: Literal["token", "sequence"] | None = None
    """Truncated importance sampling of the proximal to the sampler's probabilities, a weight per
    token or per sequence, capped at `rollout_is_threshold` (TIS); null: no weights."""
    rollout_is_threshold: Annotated[float, Strict(), Field(gt=1, allow_inf_nan=False)] = 2.0
    """The cap on an importance weight."""
    rollout_rs: Name | None = None
    """Masked importance sampling (verl's rejection sampling): tokens or sequences whose divergence
    passes `rollout_rs_threshold` train nothing, e.g. `token_k1`, `seq_mean_k3`, or several
    comma-separated (verl's `SUPPORTED_ROLLOUT_RS_OPTIONS`); null: none masked."""
    rollout_rs_threshold: Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)] | Name | None = None
    """Required with `rollout_rs`: one bound per option, comma-separated; a `*_k1` option takes
    `lower_upper` ratio bounds (e.g. `0.5_2.0`)."""
    alarm_kl: NonNegativeNumber | None = 0.1
    """The mismatch alarm: a step whose k3 KL of the sampler's logprobs to the trainer's, over the
    trained tokens the version the trainer holds sampled (`rollout_corr/on_policy_k3_kl`; an older
    version's tokens differ by the policy's own change), passes it is flagged
    (`rollout_corr/mismatch_alarm`, `rolectl status`, the dashboard, the summary's
    `mismatch_alarms`): the sign of an explorer whose weights are not the version it says (a failed
    or wrong load); healthy steps read about 0 (numerics: more between bf16 and fp32); null: none."""

    @field_validator("rollout_rs")
    @classmethod
    def _rs_options_known(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and checking_trainer(info):
            from .algorithms import verl_import_problem

            if verl_import_problem() is None:
                from verl.trainer.ppo.rollout_corr_helper import SUPPORTED_ROLLOUT_RS_OPTIONS

                unknown = [o for o in value.split(",") if o.strip() not in SUPPORTED_ROLLOUT_RS_OPTIONS]
                if unknown:
                    raise ValueError(f"{', '.join(map(repr, unknown))} not among verl's rejection options "
                                     f"{sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}")
        return value

    @model_validator(mode="after")
    def _rs_bounded(self) -> RolloutCorrectionSection:
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            raise invalid([("rollout_rs_threshold", f"required with rollout_rs ({self.rollout_rs!r}): the bound "
                                                    "past which a token or sequence is masked, e.g. 2.0")])
        return self


class DynamicSamplingFields(Section):
    """`algorithm:`'s explorer-side fields, read for every engine (the tiny one's `algorithm:` may
    hold these alone): DAPO's dynamic sampling, verl's `algorithm.filter_groups`."""

    dynamic_sampling: StrictBool = False
    """DAPO's dynamic sampling: an explorer does not publish a group whose rewards are all equal (no
    group-relative signal: verl's `filter_groups` on the reward), counts it, and generates more of its
    task set until its step has `buffer.batch_size` groups that differ."""
    max_num_gen_batches: PositiveInt = 10
    """With `dynamic_sampling`: the generation batches (of `buffer.batch_size` tasks) one explore step
    may use to fill itself; past it the step publishes the groups it kept and the next step goes on
    (verl's `filter_groups.max_num_gen_batches`, which may be unbounded; here a bound, so a policy
    that gives every answer the same reward ends its task set instead of looping)."""


class AlgorithmSection(DynamicSamplingFields):
    """`algorithm:` for the `hf` trainer: verl's advantage estimator and policy loss, and the
    explorers' dynamic sampling."""

    advantage: Literal[OUTCOME_ESTIMATORS] = "grpo"  # type: ignore[valid-type]
    """One of verl's outcome-reward advantage estimators."""
    norm_adv_by_std_in_grpo: StrictBool = True
    """GRPO: divide advantages by the group's standard deviation."""
    policy_loss: Name = "vanilla"
    """A name in verl's policy-loss registry."""
    clip_ratio: NonNegativeNumber = 0.2
    """PPO clip range."""
    clip_ratio_low: NonNegativeNumber | None = None
    """Lower clip range; default clip_ratio."""
    clip_ratio_high: NonNegativeNumber | None = None
    """Upper clip range; default clip_ratio."""
    clip_ratio_c: Annotated[float, Strict(), Field(gt=1, allow_inf_nan=False)] = 3.0
    """Dual-clip lower bound for negative advantages."""
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"  # type: ignore[valid-type]
    """How token losses are aggregated."""
    kl_coef: NonNegativeNumber = 0.0
    """> 0: a KL loss against the version-0 model (kept frozen by the trainer)."""
    kl_penalty: Literal[KL_PENALTIES] = "low_var_kl"  # type: ignore[valid-type]
    """verl's KL estimator."""
    rollout_correction: RolloutCorrectionSection | None = None
    """Off-policy correction (decoupled PPO, truncated or masked importance sampling) and the
    rollout/trainer gap's metrics and alarm; null: PPO against the sampler's logprobs."""

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss_registered(cls, name: str, info: ValidationInfo) -> str:
        # verl (and torch) load only when the trainer's parts are checked; without verl the engine says so
        if checking_trainer(info):
            from .algorithms import verl_import_problem

            if verl_import_problem() is None:
                from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

                if name not in POLICY_LOSS_REGISTRY:
                    raise ValueError(f"not in verl's policy-loss registry {sorted(POLICY_LOSS_REGISTRY)}, got {name!r}")
        return name


def typed_unless_open(value: Any) -> str:
    """The tag of a section that is typed for the built-in engines, or kept as written (an open one)."""
    return "open" if isinstance(value, OpenSection) else "typed"


DataField = Annotated[Annotated[DataSection, Tag("typed")] | Annotated[OpenSection, Tag("open")],
                      Discriminator(typed_unless_open)]
"""A job's `data:`: typed for the engines that read it (`READS_DATA`), else as written."""
AlgorithmField = Annotated[Annotated[AlgorithmSection, Tag("typed")] | Annotated[OpenSection, Tag("open")],
                           Discriminator(typed_unless_open)]
"""A job's `algorithm:`: typed for the engines that read it (`READS_DATA`), else as written."""
