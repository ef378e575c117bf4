"""The sections of the trainer-only stages: `stage: sft` and `dpo`, and the demonstrations an RL
trainer mixes in (`trainer.expert_data`). Like `sections`, it imports neither torch nor NATS."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Discriminator, Field, Strict, Tag, ValidationInfo, field_validator

from rolectl.roles.config_base import (
    Name,
    NonNegativeInt,
    OpenSection,
    PositiveInt,
    PositiveNumber,
    Section,
    checking,
)

from .sections import LOSS_AGG_MODES, TASK_FILES, typed_unless_open

__all__ = [
    "STAGES",
    "LR_SCHEDULES",
    "SFT_FORMATS",
    "StageSection",
    "SFTSection",
    "ExpertDataSection",
    "SFTField",
    "DPO_LOSSES",
    "DPO_FORMATS",
    "DPOSection",
    "DPOField",
]

STAGES = ("rl", "sft", "dpo")
"""What a job trains: `rl` (explorers, a synchronizer, `algorithm:`), or a trainer-only stage over a
data file: `sft` (demonstrations, the `sft:` section) or `dpo` (preference pairs, the `dpo:`
section). A new stage adds its name here and its section beside `sft:` (a `StageSection`), and
registers with the stage runner (`roles.stage`)."""
LR_SCHEDULES = ("constant", "linear", "cosine")


def _stage_file(path: str, info: ValidationInfo) -> str:
    """A stage's data file: a known suffix, and (when the job is loaded with its engines) there."""
    if not checking(info):
        return path
    if Path(path).suffix.lower() not in TASK_FILES:
        raise ValueError(f"{path}: unknown file type; use one of {sorted(TASK_FILES)}")
    if not Path(path).is_file():
        raise ValueError(f"{path}: no such file (relative paths are from the working directory {Path.cwd()})")
    return path


class StageSection(Section):
    """What every trainer-only stage shares (`sft:`, `dpo:`): its data file and how it is walked
    (epochs of a seeded order, `batch_size` rows per train step), the learning-rate schedule, and
    the held-out file it is evaluated on. One train step is one batch; the model's `lr`,
    `max_grad_norm` (gradient clipping), `micro_batch_size` and `minibatches` apply as in RL."""

    path: Name
    """The training rows: a local .jsonl, .json, .parquet or .csv file (relative paths are from the
    working directory)."""
    epochs: PositiveInt = 1
    """Passes over the rows; the stage's train steps are `epochs x ceil(rows / batch_size)`."""
    max_steps: PositiveInt | None = None
    """Stop after this many train steps (fewer than the epochs make; `trainer.total_steps` is RL's)."""
    batch_size: PositiveInt = 16
    """Rows per train step (the last batch of an epoch may be smaller)."""
    shuffle_seed: NonNegativeInt = 0
    """Seed of each epoch's order (a permutation drawn from the seed and the epoch)."""
    max_length: PositiveInt = 1024
    """Longest row in tokens (prompt and response); a longer row is an error naming it."""
    lr_schedule: Literal[LR_SCHEDULES] = "cosine"  # type: ignore[valid-type]
    """Learning rate over the stage's optimizer steps (torch schedulers through transformers'
    `get_scheduler`): `constant`, `linear` decay to `min_lr_ratio x lr`, or `cosine` to it; each
    after the warm-up."""
    warmup_steps: NonNegativeInt | None = None
    """Optimizer steps of linear warm-up from 0 to `model.lr`; default `warmup_ratio` of them all."""
    warmup_ratio: Annotated[float, Strict(), Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    """Share of the optimizer steps spent warming up, when `warmup_steps` is not set."""
    min_lr_ratio: Annotated[float, Strict(), Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    """Where `linear` and `cosine` end, as a share of `model.lr`."""
    eval_path: Name | None = None
    """A held-out file in the training file's format: its loss (and, where its rows have answers,
    the reward of greedy generations) is reported every `eval_interval` steps and after the last."""
    eval_interval: NonNegativeInt = 0
    """Train steps between evaluations on `eval_path` (0: only after the last step)."""
    eval_max_rows: PositiveInt | None = None
    """Evaluate on the eval file's first rows only (default all)."""

    @field_validator("path", "eval_path")
    @classmethod
    def _files_there(cls, path: str | None, info: ValidationInfo) -> str | None:
        return path if path is None else _stage_file(path, info)


SFT_FORMATS = ("auto", "messages", "prompt_response")


class SFTSection(StageSection):
    """`sft:` for `stage: sft`: supervised fine-tuning on demonstrations, the loss (negative
    log-likelihood) on the assistant's tokens only. A row is a chat (`messages_key`: a list of
    `{role, content}`, rendered with the tokenizer's chat template; every assistant message is
    trained on, the rest is context) or a prompt/response pair (the response trained on, then the
    tokenizer's end of sequence). Rows are padded per batch (no packing)."""

    format: Literal[SFT_FORMATS] = "auto"  # type: ignore[valid-type]
    """`messages`, `prompt_response`, or `auto`: messages when the file has the `messages_key` column."""
    messages_key: Name = "messages"
    """Column holding a chat: a list of `{role: system|user|assistant|tool, content: text}`."""
    prompt_key: Name = "prompt"
    """Column holding a pair's prompt."""
    response_key: Name = "response"
    """Column holding a pair's response (what is trained on)."""
    answer_key: Name | None = None
    """Column of the eval file holding the answer the eval rewards compare greedy generations with;
    default the response column of prompt/response rows (messages rows are scored on loss only)."""
    eval_rewards: tuple[Name, ...] | None = None
    """Reward names (built-ins or `module:function`) of the eval by generation; default those of
    `data.rewards` when the job has `data:`, else `exact_match`."""
    chat_template: Literal["auto", True, False] = "auto"
    """Render prompt/response pairs with the tokenizer's chat template (a user turn, an assistant
    turn): auto (when it has one), true or false; as `data.chat_template` renders RL prompts."""
    loss_agg_mode: Literal[LOSS_AGG_MODES] = "token-mean"  # type: ignore[valid-type]
    """How token losses are aggregated (verl's `agg_loss` modes, as `algorithm.loss_agg_mode`)."""


class ExpertDataSection(Section):
    """`trainer.expert_data`: demonstrations mixed into every RL train step (the reference system's
    mixed sample strategy): the demonstration rows are trained with the SFT loss beside the policy
    loss on the experiences, in the same optimizer step."""

    path: Name
    """Demonstrations, read as `sft:` reads them (chat messages or prompt/response pairs)."""
    ratio: Annotated[float, Strict(), Field(gt=0, lt=1, allow_inf_nan=False)] = 0.25
    """Share of each train batch's rows that are demonstrations: `round(ratio / (1 - ratio) x
    experiences)` rows beside a step's experiences (at least one)."""
    weight: PositiveNumber = 1.0
    """Weight of the SFT loss beside the policy loss (loss = policy + weight x SFT)."""
    format: Literal[SFT_FORMATS] = "auto"  # type: ignore[valid-type]
    """As `sft.format`."""
    messages_key: Name = "messages"
    """As `sft.messages_key`."""
    prompt_key: Name = "prompt"
    """As `sft.prompt_key`."""
    response_key: Name = "response"
    """As `sft.response_key`."""
    shuffle_seed: NonNegativeInt = 0
    """Seed of each pass's order over the demonstrations."""
    max_length: PositiveInt = 1024
    """Longest demonstration in tokens; a longer row is an error naming it."""

    @field_validator("path")
    @classmethod
    def _file_there(cls, path: str, info: ValidationInfo) -> str:
        return _stage_file(path, info)


SFTField = Annotated[Annotated[SFTSection, Tag("typed")] | Annotated[OpenSection, Tag("open")],
                     Discriminator(typed_unless_open)]
"""A job's `sft:`: typed for the engines that train stages (`READS_DATA`), else as written."""


DPO_LOSSES = ("sigmoid", "ipo")
DPO_FORMATS = ("auto", "text", "messages")


class DPOSection(StageSection):
    """`dpo:` for `stage: dpo`: direct preference optimisation on pairs (a prompt, the preferred
    `chosen` response and the `rejected` one) against a frozen reference, the weights the stage
    starts from (`model.path`, or `model.init_from`'s; under `model.lora` the base with the adapter
    disabled). A pair is text (the prompt rendered as an RL task's, through the chat template when
    it applies; each response followed by the end of sequence) or TRL's conversational form
    (`prompt` a list of `{role, content}`, `chosen` / `rejected` the assistant's messages after
    it). `batch_size` counts pairs; `micro_batch_size` rows (a pair is two, never split)."""

    beta: PositiveNumber = 0.1
    """How far from the reference the policy may move: the loss is on `beta` x the difference of the
    two responses' log-ratios to the reference (TRL's `beta`; IPO's 1 / (2 tau))."""
    loss: Literal[DPO_LOSSES] = "sigmoid"  # type: ignore[valid-type]
    """`sigmoid` (DPO: -log sigmoid(beta x h)) or `ipo` ((h - 1/(2 beta))^2 on mean token
    logprobs), as TRL's `loss_type`."""
    format: Literal[DPO_FORMATS] = "auto"  # type: ignore[valid-type]
    """`text`, `messages`, or `auto`: messages when the chosen column holds lists."""
    prompt_key: Name = "prompt"
    """Column holding the prompt."""
    chosen_key: Name = "chosen"
    """Column holding the preferred response."""
    rejected_key: Name = "rejected"
    """Column holding the other response."""
    answer_key: Name = "answer"
    """Column of the eval file holding the answer greedy generations are scored against (rows
    without it, or null, are scored on the pairs' loss only)."""
    eval_rewards: tuple[Name, ...] | None = None
    """Reward names (built-ins or `module:function`) of the eval by generation; default those of
    `data.rewards` when the job has `data:`, else `exact_match`."""
    chat_template: Literal["auto", True, False] = "auto"
    """Render text prompts with the tokenizer's chat template: auto (when it has one), true or false."""


DPOField = Annotated[Annotated[DPOSection, Tag("typed")] | Annotated[OpenSection, Tag("open")],
                     Discriminator(typed_unless_open)]
"""A job's `dpo:`: typed for the engines that train stages (`READS_DATA`), else as written."""
