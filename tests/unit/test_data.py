"""Task sets from data files: formats, sharding, seeded shuffle, exact resume, and errors that say what to fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolectl.roles.config_base import CHECK_ENGINES, validate_section
from rolectl.roles.engines.data import DataConfig, TaskRow, TextTaskSet, load_rows

ROOT = Path(__file__).resolve().parents[2]


def data_config_problems(values):
    """The `data:` section's problems, as a job loaded with its engines reports them."""
    return validate_section(DataConfig, values, where="data", context=CHECK_ENGINES)[1]


ROWS = [{"prompt": f"reverse {i} {i % 7} =", "answer": f"{i % 7} {i}", "extra": i} for i in range(23)]


class WordTokenizer:
    """A stand-in tokenizer with the two calls the task set makes (tokenizers themselves are tested
    with the hf engine): one id per word, no chat template."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [sum(map(ord, word)) for word in text.split()]}


def write(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"tasks.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif kind == "csv":
        path.write_text("prompt,answer,extra\n" + "".join(f"{r['prompt']},{r['answer']},{r['extra']}\n" for r in ROWS))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_every_format_loads_the_same_rows(tmp_path, kind):
    rows = load_rows(DataConfig(path=str(write(tmp_path, kind))))
    assert rows == [TaskRow(prompt=r["prompt"], answer=r["answer"], columns=r) for r in ROWS]


def taskset(path: Path, *, shard=0, shards=1, batch=5, seed=0, batches=None) -> TextTaskSet:
    return TextTaskSet(DataConfig(path=str(path), shuffle_seed=seed), WordTokenizer(), shard=shard,
                       num_shards=shards, batch_size=batch, num_batches=batches)


def answers(batches) -> list[list[str]]:
    return [[t.answer for t in b] for b in batches]


def test_each_epoch_is_a_seeded_permutation_of_the_shard(tmp_path):
    path = write(tmp_path, "jsonl")
    shard = taskset(path, shard=1, shards=3, batch=4)
    mine = [r["answer"] for i, r in enumerate(ROWS) if i % 3 == 1]  # 8 rows
    first_two_epochs = [a for b in answers(shard.next_batch() for _ in range(4)) for a in b]
    assert sorted(first_two_epochs[:8]) == sorted(mine) and sorted(first_two_epochs[8:]) == sorted(mine)
    assert first_two_epochs[:8] != first_two_epochs[8:]  # a new order each epoch
    again = taskset(path, shard=1, shards=3, batch=4)
    assert [a for b in answers(again.next_batch() for _ in range(4)) for a in b] == first_two_epochs
    other_seed = taskset(path, shard=1, shards=3, batch=4, seed=1)
    assert [a for b in answers(other_seed.next_batch() for _ in range(2)) for a in b] != first_two_epochs[:8]


def test_shards_are_disjoint_and_cover_the_file(tmp_path):
    path = write(tmp_path, "jsonl")
    seen = [set(t.answer for t in taskset(path, shard=k, shards=3, batch=len(range(k, len(ROWS), 3))).next_batch())
            for k in range(3)]  # one epoch of each shard (8, 8 and 7 rows)
    assert set.union(*seen) == {r["answer"] for r in ROWS} and sum(map(len, seen)) == len(ROWS)


def test_resume_gives_exactly_the_batches_not_yet_seen(tmp_path):
    path = write(tmp_path, "jsonl")
    straight = taskset(path, batch=6, batches=9)
    expected = answers(iter(straight.next_batch, None))
    assert len(expected) == 9
    first = taskset(path, batch=6, batches=9)
    seen = answers(first.next_batch() for _ in range(5))
    state = json.loads(json.dumps(first.state_dict()))  # what the explorer writes to disk
    resumed = taskset(path, batch=6, batches=9)
    resumed.load_state_dict(state)
    assert seen + answers(iter(resumed.next_batch, None)) == expected
    with pytest.raises(ValueError, match="seed 0 shard 0"):
        taskset(path, batch=6, seed=5).load_state_dict(state)


def test_prompts_are_tokenized_and_tasks_carry_the_answer(tmp_path):
    task = taskset(write(tmp_path, "jsonl"), batch=1).next_batch()[0]
    row = next(r for r in ROWS if r["answer"] == task.answer)
    assert task.prompt == tuple(WordTokenizer()(row["prompt"])["input_ids"]) and task.target == ()


def test_config_problems_are_all_reported(tmp_path):
    problems = dict(data_config_problems({"path": str(tmp_path / "missing.jsonl"), "prompt_key": "",
                                          "shuffle_seed": -1, "chat_template": "maybe", "rewards": "nope",
                                          "colour": 1}))
    assert set(problems) == {"data.path", "data.prompt_key", "data.shuffle_seed", "data.chat_template",
                             "data.rewards[0]", "data.colour"}
    assert "no such file" in problems["data.path"]
    assert "unknown file type" in dict(data_config_problems({"path": "tasks.txt"}))["data.path"]
    assert data_config_problems({"path": str(write(tmp_path, "jsonl"))}) == []


def test_a_missing_column_names_the_columns_there(tmp_path):
    with pytest.raises(ValueError, match=r"no column 'question'.*\['prompt', 'answer', 'extra'\]"):
        load_rows(DataConfig(path=str(write(tmp_path, "jsonl")), prompt_key="question"))


def test_the_shipped_quickstart_data_is_what_its_script_writes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_data", ROOT / "examples/data/make_reverse_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "examples/data/reverse_digits.jsonl").read_text() == module.render()
    assert (ROOT / "examples/data/reverse_digits_eval.jsonl").read_text() == module.render_eval()


def test_the_shipped_tool_example_data_is_what_its_script_writes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_add", ROOT / "examples/data/make_add_numbers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "examples/data/add_numbers.jsonl").read_text() == module.render()


def test_the_shipped_sft_demonstrations_are_what_their_script_writes_and_never_the_rl_task():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_sft", ROOT / "examples/data/make_digits_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "examples/data/digits_sft.jsonl").read_text() == module.render()
    assert (ROOT / "examples/data/digits_sft_eval.jsonl").read_text() == module.render_eval()
    # the RL task reverses 3 digits: no demonstration does (the base must not know its answers)
    reversed_lengths = {len(r["prompt"].split()) - 2 for r in module.rows() if r["prompt"].startswith("reverse")}
    assert reversed_lengths and 3 not in reversed_lengths, reversed_lengths


# -- sources: save_to_disk directories, globs, lists of files, splits, cached Hub datasets ------------

def _save(tmp_path: Path, splits: dict[str, list[dict]] | None) -> Path:
    import datasets

    out = tmp_path / "saved"
    if splits is None:
        datasets.Dataset.from_list(ROWS).save_to_disk(str(out))
    else:
        datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(out))
    return out


def test_a_directory_saved_with_save_to_disk_is_read_with_its_split(tmp_path):
    plain = _save(tmp_path / "plain", None)
    assert [r.prompt for r in load_rows(DataConfig(path=str(plain)))] == [r["prompt"] for r in ROWS]
    split = _save(tmp_path / "dict", {"train": ROWS[:3], "test": ROWS[3:5]})
    assert [r.columns for r in load_rows(DataConfig(path=str(split), split="test"))] == ROWS[3:5]
    assert data_config_problems({"path": str(split), "split": "test"}) == []
    problems = dict(data_config_problems({"path": str(split), "split": "validation"}))
    assert problems == {"data.split": f"{split} has no split 'validation'; its splits: ['train', 'test']"}
    with pytest.raises(ValueError, match=r"data.split: .* has no split 'validation'; its splits: \['train', 'test'\]"):
        load_rows(DataConfig(path=str(split), split="validation"))
    assert "one Dataset, one split" in dict(data_config_problems({"path": str(plain), "split": "test"}))["data.split"]


def test_a_directory_not_saved_by_datasets_says_what_to_point_at(tmp_path):
    (tmp_path / "files").mkdir()
    said = dict(data_config_problems({"path": str(tmp_path / "files")}))["data.path"]
    assert "not one saved with `datasets`' save_to_disk" in said and f"{tmp_path / 'files'}/*.jsonl" in said


def _shards(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    for i, chunk in enumerate((ROWS[:10], ROWS[10:])):
        (tmp_path / "data" / f"train-{i:02d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))
    return tmp_path / "data"


def test_a_glob_reads_every_file_it_matches_in_name_order(tmp_path, monkeypatch):
    _shards(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert [r.columns for r in load_rows(DataConfig(path="data/train-*.jsonl"))] == ROWS
    assert data_config_problems({"path": "data/train-*.jsonl"}) == []
    said = dict(data_config_problems({"path": "data/test-*.jsonl"}))["data.path"]
    assert said == f"data/test-*.jsonl: no file matches (relative paths are from the working directory {tmp_path})"


def test_a_list_of_files_and_globs_reads_them_in_order(tmp_path):
    data = _shards(tmp_path)
    rows = load_rows(DataConfig(path=[str(data / "train-01.jsonl"), str(data / "train-00.jsonl")]))
    assert [r.columns for r in rows] == ROWS[10:] + ROWS[:10]
    problems = dict(data_config_problems({"path": [str(data / "train-00.jsonl"), str(data / "nope.jsonl"),
                                                   str(data / "x-*.jsonl")]}))
    assert set(problems) == {"data.path[1]", "data.path[2]"}
    assert "nope.jsonl: no such file or directory" in problems["data.path[1]"]
    assert "x-*.jsonl: no file matches" in problems["data.path[2]"]
    (data / "more.csv").write_text("prompt,answer\na,b\n")
    mixed = dict(data_config_problems({"path": [str(data / "train-*.jsonl"), str(data / "more.csv")]}))
    assert "files of several formats (.csv, .jsonl)" in mixed["data.path"]


def test_files_are_one_split_named_train(tmp_path):
    data = _shards(tmp_path)
    said = dict(data_config_problems({"path": str(data / "train-00.jsonl"), "split": "test"}))["data.split"]
    assert "files are one split, `train` (got 'test')" in said


def test_the_source_is_path_or_dataset_and_config_goes_with_a_dataset(tmp_path):
    def problems(values):  # the section alone, as a copy with changes is checked
        return dict(validate_section(DataConfig, values, where="data")[1])

    path = str(write(tmp_path, "jsonl"))
    assert "give path" in problems({"path": path, "dataset": "a/b"})["data.dataset"]
    assert "remove it" in problems({"path": path, "config": "main"})["data.config"]
    assert "required" in problems({})["data.path"]


class _Gsm8kLike:
    """Writes a dataset to a `datasets` cache the way loading `openai/gsm8k` (config `main`) from the
    Hub leaves it: the library's own builder, given the repo id, config and commit a Hub load gives it."""

    ROWS = {"train": [{"question": f"what is {i} + 0.5?", "answer": f"{i + 0.5}", "tolerance": 0.1 * i}
                      for i in range(4)],
            "test": [{"question": "what is 2 + 2?", "answer": "4", "tolerance": 0.0}]}

    @classmethod
    def write(cls, cache: Path) -> None:
        import datasets

        rows = cls.ROWS

        class Gsm8k(datasets.GeneratorBasedBuilder):
            BUILDER_CONFIGS = [datasets.BuilderConfig(name="main"), datasets.BuilderConfig(name="socratic")]

            def _info(self):
                return datasets.DatasetInfo(features=datasets.Features(
                    {"question": datasets.Value("string"), "answer": datasets.Value("string"),
                     "tolerance": datasets.Value("float64")}))

            def _split_generators(self, dl_manager):
                return [datasets.SplitGenerator(name=split, gen_kwargs={"split": split}) for split in rows]

            def _generate_examples(self, split):
                yield from enumerate(rows[split])

        for config in ("main", "socratic"):
            Gsm8k(cache_dir=str(cache), dataset_name="gsm8k", repo_id="openai/gsm8k", config_name=config,
                  hash="e53f048856ff4f594e959d75785d2c2d37b678ee").download_and_prepare()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A local datasets cache holding `openai/gsm8k`, and a Hub endpoint that counts the requests it
    gets (none may come: a cached dataset is read offline)."""
    import http.server
    import threading

    import datasets.config

    requests = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            requests.append(self.path)
            self.send_error(404)

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    cache = tmp_path / "hf-datasets"
    _Gsm8kLike.write(cache)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    yield cache, requests
    server.shutdown()
    thread.join(timeout=10)


def test_a_dataset_id_in_the_local_cache_is_read_offline(hub_cache):
    import datasets.config

    cache, requests = hub_cache
    section = {"dataset": "openai/gsm8k", "config": "main", "prompt_key": "question"}
    rows = load_rows(DataConfig(**section))
    assert [r.columns for r in rows] == _Gsm8kLike.ROWS["train"]
    assert [r.columns for r in load_rows(DataConfig(**section, split="test"))] == _Gsm8kLike.ROWS["test"]
    assert data_config_problems(section) == []
    assert requests == [] and datasets.config.HF_HUB_OFFLINE is False  # offline for the read only


def test_a_dataset_id_that_is_not_cached_says_where_it_looked(hub_cache):
    cache, requests = hub_cache
    said = dict(data_config_problems({"dataset": "openai/other"}))["data.dataset"]
    assert f"openai/other is not in the local datasets cache ({cache / 'openai___other'} is missing" in said
    assert "nothing is downloaded" in said and "cached datasets: ['openai/gsm8k']" in said
    with pytest.raises(ValueError, match="data.dataset: openai/other is not in the local datasets cache"):
        load_rows(DataConfig(dataset="openai/other"))
    assert requests == []


def test_a_cached_dataset_names_its_configurations_and_splits(hub_cache):
    assert dict(data_config_problems({"dataset": "openai/gsm8k"}))["data.config"] == (
        "openai/gsm8k has several configurations in the local cache: give one of ['main', 'socratic']")
    said = dict(data_config_problems({"dataset": "openai/gsm8k", "config": "nope"}))["data.config"]
    assert "no configuration 'nope'" in said and "cached: ['main', 'socratic']" in said
    with pytest.raises(ValueError, match=r"data.split: openai/gsm8k has no split 'dev'; its splits: "
                                         r"\['train', 'test'\]"):
        load_rows(DataConfig(dataset="openai/gsm8k", config="main", split="dev", prompt_key="question"))
    with pytest.raises(ValueError, match=r"no column 'prompt'; it has \['question', 'answer', 'tolerance'\]"):
        load_rows(DataConfig(dataset="openai/gsm8k", config="main"))


def test_tasks_carry_the_prompt_text_and_their_whole_row(tmp_path):
    task = taskset(write(tmp_path, "jsonl"), batch=1).next_batch()[0]
    row = next(r for r in ROWS if r["answer"] == task.answer)
    assert task.prompt_text == row["prompt"] and task.row == row
    json.dumps(task.row)  # a plain, JSON-able mapping
