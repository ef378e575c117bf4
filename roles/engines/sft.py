"""Supervised fine-tuning on the one training step: demonstrations as a `TrainBatch`, and the SFT loss.

A demonstration is a chat (a list of `{role, content}` messages) or a prompt/response pair, made into
the trajectory record's shape: `prompt` = the tokens before the first assistant turn, `response` =
everything after, and a mask that is 1 on the assistant's tokens (what is trained on) and 0 on the
rest (user, system and tool turns, the template's headers). A chat's masks come from rendering its
prefixes, as verl's multi-turn SFT dataset and TRL do: assistant message `i` spans the tokens between
`render(messages[:i], add_generation_prompt=True)` and `render(messages[:i + 1])`, so its own
end-of-turn token is trained on (the model learns to stop) and the next turn's header is not. A pair
is the prompt (through the chat template when the tokenizer has one and `chat_template` allows) and
the response followed by the tokenizer's end of sequence.

The loss (`SFTLoss`) is the negative log-likelihood of the masked tokens, aggregated by verl's
`agg_loss` modes over the whole minibatch, as the policy loss is. `MixedBatches` puts demonstrations
beside an RL step's experiences (`trainer.expert_data`): the SFT loss on them, the policy loss on
the experiences, one optimizer step.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .base import Task
from .losses import LossFunction, LossSum, MicroBatch, TrainBatch
from .sections import TASK_FILES

__all__ = ["Demonstration", "read_table", "render_chat", "render_pair", "load_demonstrations",
           "demonstration_batch", "concat_batches", "SFTLoss", "OnRows", "MixedBatches", "mixed_batches", "words_of",
           "SFTData"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Demonstration:
    """One demonstration, tokenized: what an SFT step trains on, and what its eval compares with."""

    id: str
    prompt: tuple[int, ...]
    response: tuple[int, ...]
    mask: tuple[bool, ...]
    """Per response token: trained on (an assistant's token) or context (another turn's)."""
    answer: str | None = None
    """The text a greedy generation from `prompt` is scored against (eval rows with answers)."""


def read_table(path: str | Path, *, section: str) -> Any:
    """A data file as a `datasets.Dataset` (JSONL, JSON, Parquet, CSV); errors name the file and the
    config `section` that points at it."""
    import datasets

    kind = TASK_FILES.get(Path(path).suffix.lower())
    if kind is None:
        raise ValueError(f"{path}: unknown file type; use one of {sorted(TASK_FILES)} ({section}.path)")
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as exc:  # datasets wraps each format's parser error in its own types
        cause = exc.__cause__ or exc
        raise ValueError(f"{path}: does not parse as {Path(path).suffix.lower()[1:]} ({type(cause).__name__}: "
                         f"{cause}); fix the file or point {section}.path at another") from None
    if len(table) == 0:
        raise ValueError(f"{path}: no rows ({section}.path)")
    return table


def _ids(encoded: Any) -> list[int]:
    """Token ids from `apply_chat_template(tokenize=True)`, a list or a mapping by transformers' version."""
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
    return [int(t) for t in ids]


def _render(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
    return _ids(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt))


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, where: str
                ) -> tuple[list[int], list[int], list[bool]]:
    """(prompt, response, mask) of a chat: the mask 1 on every assistant message's tokens.

    Raises ValueError (naming `where`) when the chat has no assistant message, a message is not
    `{role, content}`, or the template renders a prefix that is not the start of the whole chat
    (a template that rewrites earlier turns, e.g. drops past reasoning, cannot be masked this way)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{where}: a chat row needs the tokenizer's chat template, and this model's tokenizer "
                         "has none; use prompt/response rows, or a model whose tokenizer has a template")
    chat = _checked_messages(messages, where=where)
    full = _render(tokenizer, chat, generation_prompt=False)
    mask = [False] * len(full)
    first_start = None
    for i, message in enumerate(chat):
        if message["role"] != "assistant":
            continue
        start = len(_prefix(tokenizer, chat[:i], full, where=where, generation_prompt=True))
        end = len(_prefix(tokenizer, chat[:i + 1], full, where=where, generation_prompt=False))
        mask[start:end] = [True] * (end - start)
        first_start = start if first_start is None else first_start
    if first_start is None:
        raise ValueError(f"{where}: no assistant message: nothing to train on")
    return full[:first_start], full[first_start:], mask[first_start:]


def _checked_messages(messages: Any, *, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}, got {messages!r}")
    chat = []
    for j, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {j} must be {{role: text, content: text}}, got {message!r}")
        chat.append({k: v for k, v in message.items() if v is not None})  # datasets fills absent keys with None
    return chat


def _prefix(tokenizer: Any, messages: list[dict[str, Any]], full: list[int], *, where: str,
            generation_prompt: bool) -> list[int]:
    ids = _render(tokenizer, messages, generation_prompt=generation_prompt) if messages else []
    if full[:len(ids)] != ids:
        raise ValueError(f"{where}: the chat template renders the first {len(messages)} messages as tokens that "
                         "do not start the whole chat's, so assistant turns cannot be masked by prefix (a template "
                         "that rewrites earlier turns); give prompt/response rows instead")
    return ids


def render_pair(tokenizer: Any, prompt: str, response: str, *, chat_template: bool | str
                ) -> tuple[list[int], list[int], list[bool]]:
    """(prompt, response, mask) of a pair: the prompt as an RL task's (through the chat template as
    a user turn when it applies), the response's tokens and the end of sequence, all trained on."""
    use_template = chat_template is True or (chat_template == "auto" and getattr(tokenizer, "chat_template", None))
    if use_template:
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return render_chat(tokenizer, chat, where="a prompt/response pair")
    prompt_ids = [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
    response_ids = [int(t) for t in tokenizer(response, add_special_tokens=False)["input_ids"]]
    if tokenizer.eos_token_id is not None:
        response_ids.append(int(tokenizer.eos_token_id))
    return prompt_ids, response_ids, [True] * len(response_ids)


def _format_of(table: Any, section: Any) -> str:
    if section.format != "auto":
        return section.format
    return "messages" if section.messages_key in table.column_names else "prompt_response"


def load_demonstrations(path: str | Path, tokenizer: Any, section: Any, *, name: str,
                        answer_key: str | None = None, limit: int | None = None) -> list[Demonstration]:
    """The demonstrations of a file, read as `section` (an `sft:` or `trainer.expert_data` section)
    says; `name` is the section's path in the config, for errors. With `answer_key`, each row's answer
    (for eval by generation), when the column is there."""
    table = read_table(path, section=name)
    kind = _format_of(table, section)
    needed = [section.messages_key] if kind == "messages" else [section.prompt_key, section.response_key]
    missing = [key for key in needed if key not in table.column_names]
    if missing:
        keys = "messages_key" if kind == "messages" else "prompt_key / response_key"
        raise ValueError(f"{path}: no column {', '.join(map(repr, missing))} for {kind} rows; it has "
                         f"{table.column_names} (set {name}.{keys}, or {name}.format)")
    answers = answer_key if answer_key in table.column_names else None
    out = []
    for i, row in enumerate(table):
        if limit is not None and i >= limit:
            break
        where = f"{path} row {i}"
        if kind == "messages":
            prompt, response, mask = render_chat(tokenizer, row[section.messages_key], where=where)
        else:
            pair = [row[section.prompt_key], row[section.response_key]]
            if not all(isinstance(text, str) and text for text in pair):
                raise ValueError(f"{where}: {section.prompt_key!r} and {section.response_key!r} must be non-empty "
                                 f"text, got {pair!r}")
            prompt, response, mask = render_pair(tokenizer, *pair, chat_template=getattr(section, "chat_template",
                                                                                            "auto"))
        if len(prompt) + len(response) > section.max_length:
            raise ValueError(f"{where}: {len(prompt) + len(response)} tokens, more than {name}.max_length = "
                             f"{section.max_length}: raise it, or shorten the row")
        answer = None if answers is None or row[answers] is None else str(row[answers])
        out.append(Demonstration(id=f"row{i}", prompt=tuple(prompt), response=tuple(response), mask=tuple(mask),
                                 answer=answer))
    return out


def words_of(path: str | Path, section: Any, *, name: str) -> set[str]:
    """Every whitespace-separated word of a demonstration file's text (its messages' contents, or its
    prompts and responses): what a `model.build` word-level tokenizer must know."""
    table = read_table(path, section=name)
    kind = _format_of(table, section)
    words: set[str] = set()
    if kind == "messages" and section.messages_key in table.column_names:
        for messages in table[section.messages_key]:
            for message in messages or ():
                words.update(str(message.get("content") or "").split())
        return words
    for key in (section.prompt_key, section.response_key, getattr(section, "answer_key", None)):
        if key and key in table.column_names:
            for text in table[key]:
                words.update(str(text or "").split())
    return words


def demonstration_batch(demos: Sequence[Demonstration]) -> TrainBatch:
    """Demonstrations as a `TrainBatch`: row `i` is `demos[i]` (its own group), `loss_mask` its mask,
    padded on the right; no sampler drew these tokens, so old logprobs, advantages and rewards are 0;
    `demonstration` marks every row."""
    if not demos:
        raise ValueError("a demonstration batch needs at least one row")
    width = max(1, max(len(d.response) for d in demos))
    mask = torch.zeros(len(demos), width, dtype=torch.bool)
    for row, demo in enumerate(demos):
        mask[row, :len(demo.response)] = torch.tensor(demo.mask, dtype=torch.bool)
    zeros = torch.zeros(len(demos), width)
    return TrainBatch(prompts=tuple(d.prompt for d in demos), responses=tuple(d.response for d in demos),
                      groups=tuple(d.id for d in demos), loss_mask=mask, old_logprobs=zeros, advantages=zeros.clone(),
                      rewards=torch.zeros(len(demos)), demonstration=torch.ones(len(demos), dtype=torch.bool))


def _padded(tensor: Tensor, width: int) -> Tensor:
    if tensor.dim() < 2 or tensor.shape[1] == width:
        return tensor
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))


def concat_batches(first: TrainBatch, second: TrainBatch) -> TrainBatch:
    """`first`'s rows, then `second`'s, in one `TrainBatch` (token tensors padded to the wider; an
    optional per-row field one of them lacks is False / 0 on its rows)."""
    width = max(first.loss_mask.shape[1], second.loss_mask.shape[1])
    merged: dict[str, Any] = {}
    for field in dataclasses.fields(TrainBatch):
        a, b = getattr(first, field.name), getattr(second, field.name)
        if isinstance(a, tuple):
            merged[field.name] = a + b
        elif a is None and b is None:
            merged[field.name] = None
        else:
            like = a if a is not None else b
            a = a if a is not None else torch.zeros(len(first), *like.shape[1:], dtype=like.dtype)
            b = b if b is not None else torch.zeros(len(second), *like.shape[1:], dtype=like.dtype)
            merged[field.name] = torch.cat([_padded(a, width), _padded(b, width)])
    return TrainBatch(**merged)


class SFTLoss:
    """Negative log-likelihood of the masked tokens (`loss_mask`), aggregated over the minibatch by
    verl's `agg_loss` mode (`token-mean`: the mean over every trained token of the minibatch)."""

    needs_reference = False
    keeps_groups = False

    def __init__(self, loss_agg_mode: str = "token-mean") -> None:
        from verl.trainer.ppo.core_algos import agg_loss

        self.loss_agg_mode = loss_agg_mode
        self._agg_loss = agg_loss

    def __call__(self, micro: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        mask = micro.loss_mask.float()
        loss = self._agg_loss(-micro.logprobs, mask, self.loss_agg_mode, dp_size=1,
                              batch_num_tokens=micro.num_tokens, global_batch_size=micro.num_sequences)
        # the mean token NLL of this micro-batch: a figure, not the minibatch's share
        nll = float((-micro.logprobs.detach() * mask).sum() / mask.sum().clamp(min=1.0))
        return loss, {"sft/nll": nll}


class OnRows:
    """A loss on some rows of a batch only (`demonstration` rows, or the others), normalised by the
    minibatch's count of those rows' tokens and sequences: two losses over a mixed batch each see
    their own rows as a whole minibatch."""

    def __init__(self, loss: LossFunction, *, demonstrations: bool) -> None:
        self.loss = loss
        self.demonstrations = demonstrations
        self.needs_reference = loss.needs_reference
        self.keeps_groups = loss.keeps_groups

    def __call__(self, micro: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        batch = micro.batch
        marked = batch.demonstration if batch.demonstration is not None else torch.zeros(len(batch), dtype=torch.bool)
        keep = marked if self.demonstrations else ~marked
        mask = batch.loss_mask & keep[:, None]
        minibatch = list(micro.minibatch) or micro.rows
        tokens, sequences = int(mask[minibatch].sum()), int(keep[minibatch].sum())
        if not bool(keep[micro.rows].any()) or tokens == 0:
            return micro.logprobs.sum() * 0.0, {}  # none of ours here: a zero that keeps the graph
        mine = dataclasses.replace(micro, batch=dataclasses.replace(batch, loss_mask=mask), num_tokens=tokens,
                                   num_sequences=sequences)
        return self.loss(mine)

    def __str__(self) -> str:
        return f"{self.loss} on {'demonstrations' if self.demonstrations else 'experiences'}"


class MixedBatches:
    """Demonstrations beside each RL train step's experiences (`trainer.expert_data`): step `s`
    takes the next `count(experiences)` rows of an endless, seeded walk over the file (a pass is a
    permutation drawn from `(shuffle_seed, pass)`), so the rows of a step are a function of the
    step alone and a restart mixes in the same ones. The loss: the RL loss on the experiences plus
    `weight` x the SFT loss on the demonstrations."""

    def __init__(self, demos: Sequence[Demonstration], *, ratio: float, weight: float, shuffle_seed: int,
                 rl_loss: LossFunction) -> None:
        if not demos:
            raise ValueError("trainer.expert_data: the file has no demonstrations")
        self.demos = list(demos)
        self.ratio = ratio
        self.shuffle_seed = shuffle_seed
        self._walk: tuple[int, list[int]] | None = None
        self.loss = LossSum(OnRows(rl_loss, demonstrations=False), (weight, OnRows(SFTLoss(), demonstrations=True)))

    def count(self, experiences: int) -> int:
        """Demonstration rows beside `experiences` experiences: `ratio` of the mixed batch, at least one."""
        return max(1, round(self.ratio / (1 - self.ratio) * experiences))

    def rows(self, step: int, count: int) -> list[Demonstration]:
        """The demonstrations of train step `step` (0-based), `count` of them."""
        out = []
        for position in range(step * count, (step + 1) * count):
            walk, offset = divmod(position, len(self.demos))
            out.append(self.demos[self._order(walk)[offset]])
        return out

    def _order(self, walk: int) -> list[int]:
        if self._walk is None or self._walk[0] != walk:
            order = list(range(len(self.demos)))
            random.Random(f"expert/{self.shuffle_seed}/{walk}").shuffle(order)
            self._walk = (walk, order)
        return self._walk[1]

    def batch(self, rl: TrainBatch, step: int) -> TrainBatch:
        """`rl`'s rows, then the demonstrations of train step `step` (ids unique within the batch)."""
        demos = [dataclasses.replace(d, id=f"expert-{step}-{i}-{d.id}")
                 for i, d in enumerate(self.rows(step, self.count(len(rl))))]
        return concat_batches(rl, demonstration_batch(demos))


def mixed_batches(section: Any, tokenizer: Any, *, rl_loss: LossFunction) -> MixedBatches:
    """`trainer.expert_data`'s demonstrations, tokenized, ready to mix into RL steps."""
    demos = load_demonstrations(section.path, tokenizer, section, name="trainer.expert_data")
    return MixedBatches(demos, ratio=section.ratio, weight=section.weight, shuffle_seed=section.shuffle_seed,
                        rl_loss=rl_loss)


class SFTData:
    """The `sft:` stage's data (`roles.stage.StageData`): the training file's demonstrations, the
    eval file's (with answers: the response column of prompt/response rows, or `answer_key`), and
    the SFT loss."""

    def __init__(self, section: Any, tokenizer: Any) -> None:
        self.section = section
        self.train = load_demonstrations(section.path, tokenizer, section, name="sft")
        self.eval: list[Demonstration] = []
        if section.eval_path is not None:
            self.eval = load_demonstrations(section.eval_path, tokenizer, section, name="sft",
                                            answer_key=section.answer_key or section.response_key,
                                            limit=section.eval_max_rows)
        self.loss = SFTLoss(section.loss_agg_mode)

    def __len__(self) -> int:
        return len(self.train)

    def batch(self, rows: Sequence[int]) -> TrainBatch:
        return demonstration_batch([self.train[row] for row in rows])

    def eval_batches(self, size: int) -> list[TrainBatch]:
        return [demonstration_batch(self.eval[i:i + size]) for i in range(0, len(self.eval), size)]

    def eval_tasks(self) -> list[Task]:
        return [Task(id=f"eval-{d.id}", prompt=d.prompt, answer=d.answer) for d in self.eval if d.answer is not None]
