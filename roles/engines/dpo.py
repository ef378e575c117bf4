"""Direct preference optimisation: the DPO loss (sigmoid, or IPO) on batches of preference pairs.

A preference pair is a prompt and two responses, the preferred (`chosen`) and the other
(`rejected`). In a `TrainBatch` it is one group of two rows, `TrainBatch.chosen` marking the
preferred one (`preference_batch`), so the step's `keeps_groups` keeps a pair on one micro-batch and
one rank. The loss compares each response's sequence logprob under the policy (`π`) with the frozen
reference's (`ref`, the stage's starting weights) as TRL's `DPOTrainer.dpo_loss` does
(trl/trainer/dpo_trainer.py; Rafailov et al. 2023, eq. 7; Azar et al. 2023, eq. 17):

    h = (π_chosen − ref_chosen) − (π_rejected − ref_rejected)    (TRL's `logits`)
    sigmoid: −log σ(β·h)                                          (`loss_type="sigmoid"`, no label smoothing)
    ipo:     (h − 1/(2β))²                                        (`loss_type="ipo"`)

A sequence's logprob is the sum of its response tokens' logprobs (`loss_mask`); for IPO their mean,
as TRL divides by the response length under `loss_type="ipo"`. The reported rewards are TRL's:
`β·(π − ref)` of each response (`dpo/reward_chosen`, `dpo/reward_rejected`), their difference
(`dpo/reward_margin`) and the fraction of pairs whose margin is positive (`dpo/accuracy`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Task
from .losses import MicroBatch, TrainBatch
from .stage_sections import DPO_LOSSES

__all__ = ["DPOLoss", "TokenPair", "preference_batch", "load_pairs", "pair_words", "DPOData"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenPair:
    """One preference pair, tokenized: the prompt and the two responses that follow it."""

    id: str
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    chosen_mask: tuple[bool, ...] | None = None
    """Per `chosen` token: counted in its sequence logprob (None: every token; a chat template's
    tokens after the assistant's end of turn are not)."""
    rejected_mask: tuple[bool, ...] | None = None
    """The same for `rejected`."""


def preference_batch(pairs: Sequence[TokenPair]) -> TrainBatch:
    """The pairs as a `TrainBatch`: pair `i` is group `pairs[i].id`, its chosen response row `2i`
    and its rejected one row `2i + 1`; `chosen` marks the first. No sampler drew these tokens, so
    `old_logprobs`, `advantages` and `rewards` are zero."""
    if not pairs:
        raise ValueError("a preference batch needs at least one pair")
    ids = [pair.id for pair in pairs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"preference pairs need distinct ids (each is a group), got {ids}")
    responses = tuple(response for pair in pairs for response in (pair.chosen, pair.rejected))
    empty = [pair.id for pair in pairs if not pair.chosen or not pair.rejected]
    if empty:
        raise ValueError(f"preference pairs {empty[:5]}: a chosen or rejected response has no tokens")
    masks = [m for pair in pairs for m in (pair.chosen_mask, pair.rejected_mask)]
    width = max(len(r) for r in responses)
    mask = torch.zeros(len(responses), width, dtype=torch.bool)
    for row, (response, marks) in enumerate(zip(responses, masks)):
        mask[row, :len(response)] = True if marks is None else torch.tensor(marks, dtype=torch.bool)
    zeros = torch.zeros(len(responses), width)
    return TrainBatch(prompts=tuple(pair.prompt for pair in pairs for _ in range(2)), responses=responses,
                      groups=tuple(pair.id for pair in pairs for _ in range(2)), loss_mask=mask,
                      old_logprobs=zeros, advantages=zeros, rewards=torch.zeros(len(responses)),
                      chosen=torch.tensor([row % 2 == 0 for row in range(len(responses))]))


def _pair_rows(micro: MicroBatch) -> tuple[Tensor, Tensor]:
    """Positions in the micro-batch of each pair's chosen and rejected rows, pair by pair."""
    if micro.batch.chosen is None:
        raise ValueError("the DPO loss trains on preference pairs: build the batch with "
                         "roles.engines.dpo.preference_batch (TrainBatch.chosen is None)")
    chosen = micro.batch.chosen[micro.rows].tolist()
    rows: dict[str, list[int]] = {}
    for position, group in enumerate(micro.groups):
        rows.setdefault(group, []).append(position)
    chosen_at, rejected_at = [], []
    for group, positions in rows.items():
        marks = [chosen[p] for p in positions]
        if len(positions) != 2 or sorted(marks) != [False, True]:
            raise ValueError(f"group {group!r} is not a preference pair here: {len(positions)} rows, "
                             f"{sum(marks)} marked chosen (a pair is two rows, one chosen; the loss "
                             "keeps groups whole)")
        chosen_at.append(positions[marks.index(True)])
        rejected_at.append(positions[marks.index(False)])
    device = micro.logprobs.device
    return torch.tensor(chosen_at, device=device), torch.tensor(rejected_at, device=device)


class DPOLoss:
    """The DPO objective as a `LossFunction`: `loss` "sigmoid" (DPO) or "ipo", temperature `beta`.

    A micro-batch returns its pairs' summed losses over the minibatch's pairs (`num_sequences / 2`,
    every rank's), so micro-batches and ranks add up to the minibatch's mean pair loss.
    """

    needs_reference = True
    keeps_groups = True

    def __init__(self, *, beta: float, loss: Literal["sigmoid", "ipo"] = "sigmoid") -> None:
        if not beta > 0:
            raise ValueError(f"dpo beta must be > 0, got {beta}")
        if loss not in DPO_LOSSES:
            raise ValueError(f"dpo loss must be one of {DPO_LOSSES}, got {loss!r}")
        self.beta = float(beta)
        self.loss = loss

    def _sequence_logprobs(self, logprobs: Tensor, mask: Tensor) -> Tensor:
        total = (logprobs * mask).sum(-1)
        return total / mask.sum(-1).clamp(min=1.0) if self.loss == "ipo" else total

    def __call__(self, micro: MicroBatch) -> tuple[Tensor, dict[str, float]]:
        assert micro.ref_logprobs is not None  # the step computes them for a loss that needs them
        mask = micro.loss_mask.float()
        policy = self._sequence_logprobs(micro.logprobs, mask)
        reference = self._sequence_logprobs(micro.ref_logprobs.detach(), mask)
        chosen, rejected = _pair_rows(micro)
        chosen_ratio = policy[chosen] - reference[chosen]
        rejected_ratio = policy[rejected] - reference[rejected]
        h = chosen_ratio - rejected_ratio
        if self.loss == "sigmoid":
            losses = -F.logsigmoid(self.beta * h)
        else:
            losses = (h - 1.0 / (2.0 * self.beta)) ** 2
        pairs = micro.num_sequences / 2
        chosen_reward = self.beta * chosen_ratio.detach()
        rejected_reward = self.beta * rejected_ratio.detach()
        margin = chosen_reward - rejected_reward
        return losses.sum() / pairs, {
            "dpo/loss": float(losses.detach().mean()),
            "dpo/reward_chosen": float(chosen_reward.mean()),
            "dpo/reward_rejected": float(rejected_reward.mean()),
            "dpo/reward_margin": float(margin.mean()),
            "dpo/accuracy": float((margin > 0).float().mean()),
        }


# -- pair files ------------------------------------------------------------------------------------

def _format_of(table: Any, section: Any) -> str:
    """`messages` (TRL's conversational pairs: lists of `{role, content}`) or `text`."""
    if section.format != "auto":
        return section.format
    first = table[0].get(section.chosen_key) if section.chosen_key in table.column_names else None
    return "messages" if isinstance(first, list) else "text"


def _generation_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return [int(t) for t in (encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)]


def _prompt_ids(tokenizer: Any, prompt: Any, section: Any, *, kind: str, where: str) -> list[int]:
    """The prompt as the policy sees it before answering: as an RL task's prompt (through the chat
    template as a user turn when `chat_template` allows), or a chat's with the generation prompt."""
    from .sft import _checked_messages

    if kind == "messages":
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"{where}: messages pairs need the tokenizer's chat template, and this model's "
                             "tokenizer has none; use text pairs (prompt, chosen, rejected as text)")
        return _generation_prompt(tokenizer, _checked_messages(prompt, where=where))
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: {section.prompt_key!r} must be non-empty text, got {prompt!r}")
    template = section.chat_template
    if template is True or (template == "auto" and getattr(tokenizer, "chat_template", None)):
        return _generation_prompt(tokenizer, [{"role": "user", "content": prompt}])
    return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


def _response(tokenizer: Any, prompt: Any, response: Any, prompt_ids: list[int], section: Any, *, kind: str,
              where: str) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """A response's tokens after `prompt_ids` and which of them count (`sft.render_pair` /
    `render_chat`: the end of sequence, or the assistant's end of turn, included)."""
    from .sft import _checked_messages, render_chat, render_pair

    if kind == "messages":
        head, tail, mask = render_chat(tokenizer, [*_checked_messages(prompt, where=where),
                                                   *_checked_messages(response, where=where)], where=where)
        ids, marks = head + tail, [False] * len(head) + mask
    else:
        if not isinstance(response, str):
            raise ValueError(f"{where}: a response must be text, got {response!r}")
        head, tail, mask = render_pair(tokenizer, prompt, response, chat_template=section.chat_template)
        ids, marks = head + tail, [False] * len(head) + mask
    if ids[:len(prompt_ids)] != prompt_ids or not any(marks[len(prompt_ids):]):
        raise ValueError(f"{where}: the response does not follow the prompt's tokens (or has no assistant "
                         "tokens after it): a chat's chosen/rejected are the assistant's turns after the prompt")
    return tuple(ids[len(prompt_ids):]), tuple(marks[len(prompt_ids):])


def _pair(tokenizer: Any, row: Mapping[str, Any], prompt_ids: list[int], section: Any, *, kind: str, where: str,
          name: str, id: str) -> TokenPair:
    prompt = row[section.prompt_key]
    chosen, chosen_mask = _response(tokenizer, prompt, row[section.chosen_key], prompt_ids, section, kind=kind,
                                    where=f"{where} ({section.chosen_key})")
    rejected, rejected_mask = _response(tokenizer, prompt, row[section.rejected_key], prompt_ids, section, kind=kind,
                                        where=f"{where} ({section.rejected_key})")
    if chosen == rejected:
        raise ValueError(f"{where}: {section.chosen_key!r} and {section.rejected_key!r} are the same: nothing to "
                         "prefer; drop the row")
    length = len(prompt_ids) + max(len(chosen), len(rejected))
    if length > section.max_length:
        raise ValueError(f"{where}: {length} tokens (the prompt and the longer response), more than "
                         f"{name}.max_length = {section.max_length}: raise it, or shorten the row")
    return TokenPair(id=id, prompt=tuple(prompt_ids), chosen=chosen, rejected=rejected,
                     chosen_mask=chosen_mask, rejected_mask=rejected_mask)


def load_pairs(path: str | Path, tokenizer: Any, section: Any, *, name: str, held_out: bool = False,
               limit: int | None = None) -> tuple[list[TokenPair], list[Task]]:
    """The preference pairs of a file read as `section` (`dpo:`) says, and, from a `held_out` file,
    the tasks a greedy generation is scored on (its rows with an answer, `answer_key`). A held-out
    row may lack a pair (`chosen`/`rejected` null): it is a task only. `name` is the section's
    path in the config, for errors."""
    from .sft import read_table

    table = read_table(path, section=name)
    keys = [section.prompt_key] + ([] if held_out else [section.chosen_key, section.rejected_key])
    missing = [key for key in keys if key not in table.column_names]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(map(repr, missing))}; it has {table.column_names} (set "
                         f"{name}.prompt_key / chosen_key / rejected_key)")
    has_pairs = section.chosen_key in table.column_names and section.rejected_key in table.column_names
    answers = section.answer_key if held_out and section.answer_key in table.column_names else None
    if held_out and not (has_pairs or answers):
        raise ValueError(f"{path}: held-out rows need pairs ({section.chosen_key!r}, {section.rejected_key!r}) "
                         f"or answers ({section.answer_key!r}) to be evaluated on; it has {table.column_names}")
    kind = _format_of(table, section)
    pairs, tasks = [], []
    for i, row in enumerate(table):
        if limit is not None and i >= limit:
            break
        where = f"{path} row {i}"
        prompt_ids = _prompt_ids(tokenizer, row[section.prompt_key], section, kind=kind, where=where)
        if has_pairs and (not held_out or (row[section.chosen_key] is not None
                                           and row[section.rejected_key] is not None)):
            pairs.append(_pair(tokenizer, row, prompt_ids, section, kind=kind, where=where, name=name, id=f"row{i}"))
        if answers is not None and row[answers] is not None:
            text = row[section.prompt_key] if kind == "text" else ""
            tasks.append(Task(id=f"eval-row{i}", prompt=tuple(prompt_ids), answer=str(row[answers]),
                              prompt_text=text, row=dict(row)))
    if not held_out and not pairs:
        raise ValueError(f"{path}: no pairs ({name}.path)")
    return pairs, tasks


def pair_words(path: str | Path, section: Any, *, name: str) -> set[str]:
    """Every whitespace-separated word of a pair file's text (prompts, responses, answers; a chat's
    contents): what a `model.build` word-level tokenizer must know."""
    from .sft import read_table

    table = read_table(path, section=name)
    words: set[str] = set()
    for key in (section.prompt_key, section.chosen_key, section.rejected_key, section.answer_key):
        for value in table[key] if key in table.column_names else ():
            messages = value if isinstance(value, list) else [{"content": value}]
            for message in messages:
                words.update(str((message or {}).get("content") or "").split())
    return words


class DPOData:
    """The `dpo:` stage's data (`roles.stage.StageData`): the training file's pairs, the held-out
    file's pairs and answered prompts, and the DPO loss."""

    def __init__(self, section: Any, tokenizer: Any) -> None:
        self.section = section
        self.train, _ = load_pairs(section.path, tokenizer, section, name="dpo")
        self.eval: list[TokenPair] = []
        self.tasks: list[Task] = []
        if section.eval_path is not None:
            self.eval, self.tasks = load_pairs(section.eval_path, tokenizer, section, name="dpo", held_out=True,
                                               limit=section.eval_max_rows)
        self.loss = DPOLoss(beta=section.beta, loss=section.loss)

    def __len__(self) -> int:
        return len(self.train)

    def batch(self, rows: Sequence[int]) -> TrainBatch:
        return preference_batch([self.train[row] for row in rows])

    def eval_batches(self, size: int) -> list[TrainBatch]:
        return [preference_batch(self.eval[i:i + size]) for i in range(0, len(self.eval), size)]

    def eval_tasks(self) -> list[Task]:
        return list(self.tasks)
