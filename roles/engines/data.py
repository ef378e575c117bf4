"""Task sets from local data files (JSONL, JSON, Parquet, CSV) read with `datasets`: the `data:` section.

Each row gives a prompt (`data.prompt_key`) and an answer (`data.answer_key`). Prompts are rendered with
the tokenizer's chat template when it has one (`data.chat_template: auto`), then tokenized once.

Order: explorer `k` of `K` takes rows `k, k+K, k+2K, ...` (its shard; every row when there are fewer
rows than explorers), and walks an endless sequence of epochs, each a permutation of its shard drawn
from `(data.shuffle_seed, k, epoch)`. Batch `i` is a function of `i` alone, so the whole position is
one integer and a restarted explorer resumes exactly where it stopped.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import Task
from .sections import TASK_FILES, DataSection

__all__ = ["DataConfig", "load_rows", "TextTaskSet"]



DataConfig = DataSection  # the `data:` section, as the engines use it


def load_rows(config: DataConfig, *, section: str = "data") -> list[tuple[str, str]]:
    """(prompt, answer) of every row, in file order; errors name the file, row and column (and the
    config `section` whose keys name the columns)."""
    import datasets

    kind = TASK_FILES[Path(config.path).suffix.lower()]
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(kind, data_files=str(config.path), split="train")
    except Exception as exc:  # datasets wraps each format's parser error in its own types
        cause = exc.__cause__ or exc
        raise ValueError(f"{config.path}: does not parse as {Path(config.path).suffix.lower()[1:]} "
                         f"({type(cause).__name__}: {cause}); fix the file or point {section}.path at "
                         "another") from None
    missing = [k for k in (config.prompt_key, config.answer_key) if k not in table.column_names]
    if missing:
        raise ValueError(f"{config.path}: no column {', '.join(map(repr, missing))}; it has "
                         f"{table.column_names} (set {section}.prompt_key / {section}.answer_key)")
    if len(table) == 0:
        raise ValueError(f"{config.path}: no rows")
    rows = []
    for i, (prompt, answer) in enumerate(zip(table[config.prompt_key], table[config.answer_key])):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{config.path} row {i}: {config.prompt_key!r} must be non-empty text, got {prompt!r}")
        if answer is None:
            raise ValueError(f"{config.path} row {i}: {config.answer_key!r} is empty")
        rows.append((prompt, str(answer)))
    return rows


class TextTaskSet:
    """Explorer `shard` of `num_shards`'s endless, seeded, resumable stream of tokenized tasks."""

    def __init__(self, config: DataConfig, tokenizer: Any, *, shard: int, num_shards: int, batch_size: int,
                 num_batches: int | None = None, rows: list[tuple[str, str]] | None = None) -> None:
        rows = load_rows(config) if rows is None else rows
        self.indices = list(range(shard % num_shards, len(rows), num_shards)) if len(rows) >= num_shards \
            else list(range(len(rows)))
        self.config = config
        self.shard = shard
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.next_index = 0
        use_template = config.chat_template is True or (
            config.chat_template == "auto" and getattr(tokenizer, "chat_template", None))
        self.tasks: dict[int, Task] = {}
        for row in self.indices:
            prompt, answer = rows[row]
            if use_template:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                    add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
            else:
                ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            if len(ids) > config.max_prompt_tokens:
                raise ValueError(f"{config.path} row {row}: prompt is {len(ids)} tokens, more than "
                                 f"data.max_prompt_tokens={config.max_prompt_tokens}")
            self.tasks[row] = Task(id=f"row{row}", prompt=tuple(int(t) for t in ids), answer=answer)
        self._epoch_order: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = list(self.indices)
            random.Random(f"data/{self.config.shuffle_seed}/{self.shard}/{epoch}").shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def next_batch(self) -> list[Task] | None:
        if self.num_batches is not None and self.next_index >= self.num_batches:
            return None
        n = len(self.indices)
        start = self.next_index * self.batch_size
        batch = []
        for position in range(start, start + self.batch_size):
            epoch, offset = divmod(position, n)
            batch.append(self.tasks[self._order(epoch)[offset]])
        self.next_index += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.config.shuffle_seed, "shard": self.shard, "next_index": self.next_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (state.get("seed"), state.get("shard")) != (self.config.shuffle_seed, self.shard):
            raise ValueError(f"task set state is for seed {state.get('seed')} shard {state.get('shard')}, "
                             f"this set has seed {self.config.shuffle_seed} shard {self.shard}")
        self.next_index = int(state["next_index"])
