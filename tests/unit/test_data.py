"""Task sets from data files: formats, sharding, seeded shuffle, exact resume, and errors that say what to fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolectl.roles.config_base import CHECK_ENGINES, validate_section
from rolectl.roles.engines.data import DataConfig, TextTaskSet, load_rows

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
    assert rows == [(r["prompt"], r["answer"]) for r in ROWS]


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
