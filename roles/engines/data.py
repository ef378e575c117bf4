"""Rows from wherever a user keeps them, read with `datasets` (`open_table`), and the explorers' task
sets built from them (`TextTaskSet`): the `data:` section (`eval:` reads its rows the same way).

A source (`sections.TableSection`) is local files (a file, a glob, a list of files or globs: .jsonl,
.json, .parquet, .csv, one format), a directory saved with `save_to_disk` (a Dataset, or a
DatasetDict and a split), or a Hugging Face dataset id read offline from the local datasets cache.
Each row gives a prompt (`prompt_key`) and an answer (`answer_key`); a task keeps the whole row too,
for rewards that take it. Prompts are rendered with the tokenizer's chat template when it has one
(`data.chat_template: auto`), then tokenized once.

Order: explorer `k` of `K` takes rows `k, k+K, k+2K, ...` (its shard; every row when there are fewer
rows than explorers), and walks an endless sequence of epochs, each a permutation of its shard drawn
from `(data.shuffle_seed, k, epoch)`. Batch `i` is a function of `i` alone, so the whole position is
one integer and a restarted explorer resumes exactly where it stopped.
"""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base import Task
from .sections import TASK_FILES, DataSection, TableSection

if TYPE_CHECKING:
    import datasets

__all__ = [
    "DataConfig",
    "SourceError",
    "TaskRow",
    "open_table",
    "load_rows",
    "describe_source",
    "source_field_problems",
    "path_problems",
    "dataset_problem",
    "config_problem",
    "split_problem",
    "TextTaskSet",
]


DataConfig = DataSection  # the `data:` section, as the engines use it
_SAVED = ("dataset_dict.json", "state.json")  # what save_to_disk writes: a DatasetDict, a Dataset
_GLOB = set("*?[")


class SourceError(ValueError):
    """A source that cannot be read, or whose rows do not fit the section: `field` is the key at fault
    (`path`, `dataset`, `split`), `why` what was looked for, where, and what to write instead."""

    def __init__(self, where: str, field: str, why: str) -> None:
        super().__init__(f"{where}.{field}: {why}")
        self.field = field
        self.why = why


@dataclass(frozen=True, slots=True)
class TaskRow:
    """One row of a source: its prompt and answer as text, and every column by name."""

    prompt: str
    answer: str
    columns: dict[str, Any]


def describe_source(section: TableSection) -> str:
    """The source in a user's words, for messages: `data/*.jsonl`, `dataset openai/gsm8k (main, test)`."""
    if section.dataset is not None:
        return f"dataset {section.dataset} ({section.config + ', ' if section.config else ''}{section.split})"
    return _describe_path(section.path) if section.path is not None else "(no source)"


# -- what a source names: checked when a job is loaded with its engines, and again when opened --------

def _expand(path: str | list[str]) -> tuple[list[Path], Path | None, list[tuple[str, str]]]:
    """The files a path (or a list of them, each maybe a glob) names, or the saved directory it is,
    and the problems (relative location, why) when it names neither."""
    items = path if isinstance(path, list) else [path]
    files: list[Path] = []
    problems = []
    for i, item in enumerate(items):
        where = f"[{i}]" if isinstance(path, list) else ""
        if _GLOB & set(item):
            matched = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not matched:
                problems.append((where, f"{item}: no file matches (relative paths are from the working directory "
                                        f"{Path.cwd()})"))
            files += matched
        elif Path(item).is_dir():
            if isinstance(path, list):
                problems.append((where, f"{item} is a directory: a directory saved with save_to_disk is "
                                        "`path` alone, not an item of a list of files"))
            else:
                return [], Path(item), _saved_directory_problems(Path(item))
        elif Path(item).is_file() or Path(item).suffix.lower() not in (*TASK_FILES, ""):
            files.append(Path(item))  # a missing file of an unknown type: its type is the problem to fix
        else:
            problems.append((where, f"{item}: no such file or directory (relative paths are from the working "
                                    f"directory {Path.cwd()})"))
    suffixes = sorted({f.suffix.lower() for f in files})
    unknown = [s for s in suffixes if s not in TASK_FILES]
    if unknown:
        problems.append(("", f"{_describe_path(path)}: unknown file type {', '.join(unknown) or '(no suffix)'}; "
                             f"use one of {sorted(TASK_FILES)}, or a directory saved with save_to_disk"))
    elif len({TASK_FILES[s] for s in suffixes}) > 1:
        problems.append(("", f"{_describe_path(path)}: files of several formats ({', '.join(suffixes)}); one source "
                             "is read by one loader: convert them to one format"))
    return files, None, problems


def _describe_path(path: str | list[str]) -> str:
    return "[" + ", ".join(path) + "]" if isinstance(path, list) else path


def _saved_directory_problems(directory: Path) -> list[tuple[str, str]]:
    if any((directory / name).is_file() for name in _SAVED):
        return []
    return [("", f"{directory} is a directory but not one saved with `datasets`' save_to_disk (it has no "
                 f"{' or '.join(_SAVED)}); point path at its files instead (e.g. {directory}/*.jsonl)")]


def path_problems(path: str | list[str]) -> list[tuple[str, str]]:
    """Problems with what `path` names, each at its relative location ("" or "[i]")."""
    return _expand(path)[2]


def _cache_root() -> Path:
    import datasets.config

    return Path(os.path.expanduser(str(datasets.config.HF_DATASETS_CACHE)))


def _cached_configs(dataset: str) -> tuple[Path, list[str]]:
    """Where `datasets` keeps `dataset` in the local cache, and the configurations it holds there."""
    from datasets.naming import camelcase_to_snakecase

    *namespace, name = dataset.split("/")
    directory = _cache_root() / "___".join([*namespace, camelcase_to_snakecase(name)])
    configs = sorted(p.name for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []
    return directory, configs


def dataset_problem(dataset: str) -> str | None:
    """Why `dataset` cannot be read offline from the local cache, or None."""
    if dataset.count("/") > 1 or dataset.startswith(("/", ".")):
        return (f"{dataset!r} is not a Hugging Face dataset id (`name` or `namespace/name`); for files or a "
                "directory saved with save_to_disk use `path:`")
    directory, configs = _cached_configs(dataset)
    if configs:
        return None
    cached = sorted(p.name.replace("___", "/") for p in _cache_root().glob("*___*") if p.is_dir())
    return (f"{dataset} is not in the local datasets cache ({directory} is missing; HF_DATASETS_CACHE sets where "
            f"it is) and nothing is downloaded: load it once where there is a network (python -c \"import "
            f"datasets; datasets.load_dataset('{dataset}', CONFIG)\") with the same cache, or save it with "
            f"save_to_disk and give `path:`" + (f"; cached datasets: {cached}" if cached else ""))


def config_problem(dataset: str, config: str | None) -> str | None:
    """Why `config` of a cached `dataset` cannot be read, or None (also when the dataset is not cached:
    `dataset_problem` says so)."""
    directory, configs = _cached_configs(dataset)
    if not configs or (config is None and len(configs) == 1) or config in configs:
        return None
    if config is None:
        return f"{dataset} has several configurations in the local cache: give one of {configs}"
    return f"{dataset} has no configuration {config!r} in the local cache ({directory}); cached: {configs}"


def split_problem(path: str | list[str], split: str) -> str | None:
    """Why `split` of the files or saved directory `path` names does not exist, or None."""
    files, directory, problems = _expand(path)
    if problems:
        return None  # `path` reports them
    if directory is None or (directory / "state.json").is_file():
        if split == "train":
            return None
        what = "files are" if directory is None else f"{directory} is one Dataset,"
        return f"{what} one split, `train` (got {split!r}): point path at the {split} data, or leave split out"
    splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits", [])
    return None if split in splits else f"{directory} has no split {split!r}; its splits: {splits}"


def source_field_problems(field: str, value: Any, earlier: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Problems with one field of a source section (`path`, `dataset`, `config`, `split`) given the
    fields validated before it, each at its location relative to the field ("" or "[i]")."""
    if field == "path":
        return path_problems(value) if value is not None else []
    if field == "dataset":
        problem = dataset_problem(value) if value is not None else None
    elif field == "config":
        problem = config_problem(earlier["dataset"], value) if earlier.get("dataset") is not None else None
    else:
        problem = split_problem(earlier["path"], value) if earlier.get("path") is not None else None
    return [("", problem)] if problem else []


# -- reading -------------------------------------------------------------------------------------------

@contextmanager
def _offline() -> Iterator[None]:
    """`datasets` in offline mode (HF_DATASETS_OFFLINE=1) for one read: a dataset id is looked up in
    the local cache only; nothing is downloaded."""
    import datasets.config

    was = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = was


def open_table(section: TableSection, *, where: str = "data") -> datasets.Dataset:
    """The rows `section` names (its path or dataset, and split) as one `datasets.Dataset`.

    `SourceError` (a ValueError) says what was looked for and where, and what to write instead: a
    missing file, directory or cached dataset, a split that does not exist (with those that do), a
    file that does not parse. `where` is the config section, for its keys in messages.
    """
    import datasets

    datasets.disable_progress_bars()
    if section.dataset is not None:
        problem = dataset_problem(section.dataset) or config_problem(section.dataset, section.config)
        if problem:
            raise SourceError(where, "dataset", problem)
        return _read_cached(section, where)
    if section.path is None:
        raise SourceError(where, "path", "give path (files, a glob, a saved directory) or dataset (a cached "
                                         "dataset id)")
    files, directory, problems = _expand(section.path)
    if problems:
        raise SourceError(where, "path", "; ".join(f"{at + ': ' if at else ''}{why}" for at, why in problems))
    problem = split_problem(section.path, section.split)
    if problem:
        raise SourceError(where, "split", problem)
    if directory is not None:
        saved = datasets.load_from_disk(str(directory))
        return saved[section.split] if isinstance(saved, datasets.DatasetDict) else saved
    kind = TASK_FILES[files[0].suffix.lower()]
    try:
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as exc:  # datasets wraps each format's parser error in its own types
        cause = exc.__cause__ or exc
        raise SourceError(where, "path", f"{describe_source(section)}: does not parse as {files[0].suffix.lower()[1:]} "
                                         f"({type(cause).__name__}: {cause}); fix the file or point {where}.path "
                                         "at another") from None


def _read_cached(section: TableSection, where: str) -> datasets.Dataset:
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # not "Using the latest cached version ..." on every read
    try:
        with _offline():
            table = datasets.load_dataset(section.dataset, section.config,
                                          download_mode=datasets.DownloadMode.REUSE_DATASET_IF_EXISTS)
    except Exception as exc:  # datasets raises ConnectionError, ValueError, FileNotFoundError here
        raise SourceError(where, "dataset", f"{describe_source(section)} does not read from the local cache "
                                            f"({type(exc).__name__}: {exc})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if section.split not in table:
        raise SourceError(where, "split", f"{section.dataset} has no split {section.split!r}; its splits: "
                                          f"{list(table)}")
    return table[section.split]


def load_rows(config: TableSection, *, section: str = "data") -> list[TaskRow]:
    """Every row of the source, in order; `SourceError`s name the source, row and column (and the
    config `section` whose keys name the columns)."""
    table = open_table(config, where=section)
    source, field = describe_source(config), "dataset" if config.dataset is not None else "path"
    missing = [k for k in (config.prompt_key, config.answer_key) if k not in table.column_names]
    if missing:
        raise SourceError(section, field, f"{source}: no column {', '.join(map(repr, missing))}; it has "
                                          f"{table.column_names} (set {section}.prompt_key / {section}.answer_key)")
    if len(table) == 0:
        raise SourceError(section, field, f"{source}: no rows")
    rows = []
    for i, columns in enumerate(table):
        prompt, answer = columns[config.prompt_key], columns[config.answer_key]
        if not isinstance(prompt, str) or not prompt:
            raise SourceError(section, field, f"{source} row {i}: {config.prompt_key!r} must be non-empty text, "
                                              f"got {prompt!r}")
        if answer is None:
            raise SourceError(section, field, f"{source} row {i}: {config.answer_key!r} is empty")
        rows.append(TaskRow(prompt=prompt, answer=str(answer), columns=dict(columns)))
    return rows


class TextTaskSet:
    """Explorer `shard` of `num_shards`'s endless, seeded, resumable stream of tokenized tasks."""

    def __init__(self, config: DataConfig, tokenizer: Any, *, shard: int, num_shards: int, batch_size: int,
                 num_batches: int | None = None, rows: Sequence[TaskRow] | None = None,
                 source: str | None = None) -> None:
        """`rows` instead of the source `config` names (an eval's), `source` naming them in messages."""
        rows = load_rows(config) if rows is None else rows
        source = source or describe_source(config)
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
            prompt = rows[row].prompt
            if use_template:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                    add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
            else:
                ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            if len(ids) > config.max_prompt_tokens:
                raise ValueError(f"{source} row {row}: prompt is {len(ids)} tokens, more than "
                                 f"data.max_prompt_tokens={config.max_prompt_tokens}")
            self.tasks[row] = Task(id=f"row{row}", prompt=tuple(int(t) for t in ids), answer=rows[row].answer,
                                   prompt_text=prompt, row=rows[row].columns)
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
