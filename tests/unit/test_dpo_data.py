"""DPO's pair files and its `stage: dpo` section: text pairs rendered as RL prompts are, TRL's
conversational pairs through a real chat template, any column names, JSONL / CSV / Parquet, held-out
rows scored on their pairs and by generation, bad rows named; and the job's rules for the stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_train_engine
from rolectl.roles.engines.dpo import DPOData, DPOLoss, load_pairs, pair_words
from rolectl.roles.engines.hf import AdapterDisabled
from rolectl.roles.engines.hf_model import load_tokenizer
from rolectl.roles.engines.stage_sections import DPOSection
from rolectl.sync_protocol import ConfigError
from tests.support.tiny_llm import built_model, chat_model, data_section, model_section

PAIRS = [{"prompt": "reverse 1 2 3 =", "chosen": "3 2 1", "rejected": "1 2 3", "answer": "3 2 1"},
         {"prompt": "reverse 4 5 =", "chosen": "5 4", "rejected": "4", "answer": "5 4"}]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return built_model(tmp_path_factory.mktemp("dpo-data"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return load_tokenizer(chat_model(tmp_path_factory.mktemp("dpo-chat")))


def _words(tokenizer, ids) -> list[str]:
    return tokenizer.convert_ids_to_tokens(list(ids))


def test_text_pairs_are_the_rl_prompt_and_each_response_then_the_end_of_sequence(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "pairs.jsonl", PAIRS)
    pairs, tasks = load_pairs(path, tokenizer, DPOSection(path=str(path)), name="dpo")
    assert tasks == []  # answers are read from held-out files only
    first = pairs[0]
    assert first.prompt == tuple(tokenizer("reverse 1 2 3 =", add_special_tokens=True)["input_ids"])
    assert _words(tokenizer, first.chosen) == ["3", "2", "1", "<eos>"]
    assert _words(tokenizer, first.rejected) == ["1", "2", "3", "<eos>"]
    assert first.chosen_mask == (True,) * 4 and [p.id for p in pairs] == ["row0", "row1"]
    assert pair_words(path, DPOSection(path=str(path)), name="dpo") == {"reverse", "=", *"12345"}


def test_conversational_pairs_score_the_assistant_turn_after_the_prompt(tmp_path, chat_tokenizer):
    rows = [{"prompt": [{"role": "system", "content": "you reverse"}, {"role": "user", "content": "reverse 1 2 ="}],
             "chosen": [{"role": "assistant", "content": "2 1"}],
             "rejected": [{"role": "assistant", "content": "1 2"}]}]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    (pair,), _ = load_pairs(path, chat_tokenizer, DPOSection(path=str(path)), name="dpo")
    assert _words(chat_tokenizer, pair.prompt)[:3] == ["<|im_start|>", "system", "you"]
    assert _words(chat_tokenizer, pair.prompt)[-4:] == ["=", "<|im_end|>", "<|im_start|>", "assistant"]
    scored = [w for w, m in zip(_words(chat_tokenizer, pair.chosen), pair.chosen_mask) if m]
    assert scored == ["2", "1", "<|im_end|>"]  # the assistant's turn and its end of turn, nothing after
    # a text pair through the same template: the prompt as a user turn, the response an assistant turn
    text = _jsonl(tmp_path / "text.jsonl", [{"prompt": "reverse 1 2 =", "chosen": "2 1", "rejected": "1 2"}])
    (templated,), _ = load_pairs(text, chat_tokenizer, DPOSection(path=str(text)), name="dpo")
    assert _words(chat_tokenizer, templated.prompt)[:2] == ["<|im_start|>", "user"]
    assert [w for w, m in zip(_words(chat_tokenizer, templated.rejected), templated.rejected_mask) if m] == [
        "1", "2", "<|im_end|>"]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_pairs_come_from_csv_or_parquet_under_any_column_names(tmp_path, tokenizer, suffix):
    import datasets

    path = tmp_path / f"pairs{suffix}"
    table = datasets.Dataset.from_list([{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PAIRS])
    table.to_csv(str(path), index=False) if suffix == ".csv" else table.to_parquet(str(path))
    section = DPOSection(path=str(path), prompt_key="q", chosen_key="good", rejected_key="bad")
    pairs, _ = load_pairs(path, tokenizer, section, name="dpo")
    assert [_words(tokenizer, p.chosen) for p in pairs] == [["3", "2", "1", "<eos>"], ["5", "4", "<eos>"]]


def test_held_out_rows_give_pairs_where_they_have_them_and_tasks_where_they_have_answers(tmp_path, tokenizer):
    rows = [*PAIRS, {"prompt": "reverse 7 8 =", "chosen": None, "rejected": None, "answer": "8 7"}]
    train = _jsonl(tmp_path / "train.jsonl", PAIRS)
    held_out = _jsonl(tmp_path / "eval.jsonl", rows)
    data = DPOData(DPOSection(path=str(train), eval_path=str(held_out), beta=0.2, loss="ipo"), tokenizer)
    assert len(data) == 2 and [p.id for p in data.eval] == ["row0", "row1"]
    assert [(t.answer, t.prompt_text) for t in data.eval_tasks()] == [
        ("3 2 1", "reverse 1 2 3 ="), ("5 4", "reverse 4 5 ="), ("8 7", "reverse 7 8 =")]
    assert data.eval_tasks()[2].prompt == tuple(tokenizer("reverse 7 8 =", add_special_tokens=True)["input_ids"])
    assert [len(b) for b in data.eval_batches(1)] == [2, 2]  # one pair, two rows
    batch = data.batch([1, 0])
    assert batch.groups == ("row1", "row1", "row0", "row0") and batch.chosen.tolist() == [True, False, True, False]
    assert isinstance(data.loss, DPOLoss) and (data.loss.beta, data.loss.loss) == (0.2, "ipo")
    limited = DPOData(DPOSection(path=str(train), eval_path=str(held_out), eval_max_rows=1), tokenizer)
    assert len(limited.eval) == len(limited.eval_tasks()) == 1


@pytest.mark.parametrize("row,words", [
    ({"prompt": "reverse 1 =", "chosen": "1", "rejected": "1"}, "row 0: 'chosen' and 'rejected' are the same"),
    ({"prompt": "", "chosen": "1", "rejected": "2"}, "row 0: 'prompt' must be non-empty text"),
    ({"prompt": "reverse 1 =", "chosen": 1, "rejected": "2"}, r"row 0 \(chosen\): a response must be text"),
    ({"prompt": "reverse 1 2 3 4 5 6 =", "chosen": "6 5 4 3 2 1", "rejected": "1"},
     "row 0: 15 tokens .*more than dpo.max_length = 12"),
])
def test_a_bad_pair_is_named_by_file_and_row(tmp_path, tokenizer, row, words):
    path = _jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match=words):
        load_pairs(path, tokenizer, DPOSection(path=str(path), max_length=12), name="dpo")


def test_a_file_without_the_columns_is_refused_naming_the_keys(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "reverse 1 =", "response": "1"}])
    with pytest.raises(ValueError, match=r"no column 'chosen', 'rejected'.*set dpo.prompt_key / chosen_key"):
        load_pairs(path, tokenizer, DPOSection(path=str(path)), name="dpo")
    with pytest.raises(ValueError, match="held-out rows need pairs"):
        load_pairs(path, tokenizer, DPOSection(path=str(path), answer_key="gold"), name="dpo", held_out=True)


def _job(model_dir: Path, pairs: Path, **top) -> dict:
    return {"job": "dpo-test", "model": model_section(model_dir), "data": data_section(),
            "dpo": {"path": str(pairs), "beta": 0.1}, "stage": "dpo", **top}


def test_a_dpo_job_trains_on_its_stage_with_the_frozen_reference(tmp_path, model_dir):
    pairs = _jsonl(tmp_path / "pairs.jsonl", PAIRS)
    job = parse_config(_job(model_dir, pairs))
    assert job.trainer_only and job.explorer_ids() == [] and job.dpo.loss == "sigmoid"
    engine = make_train_engine(job)
    assert engine.reference is not None and engine.reference is engine.update.reference
    lora = parse_config(_job(model_dir, pairs, model={**model_section(model_dir), "lora": {"rank": 2}}))
    assert isinstance(make_train_engine(lora).reference, AdapterDisabled)  # the base under the fresh adapter


def test_the_stage_and_its_section_go_together(tmp_path, model_dir):
    pairs = _jsonl(tmp_path / "pairs.jsonl", PAIRS)
    cases = [({"dpo": None}, "dpo", "required by `stage: dpo`"),
             ({"stage": "rl"}, "dpo", "read only by `stage: dpo` (this job is `stage: rl`)"),
             ({"dpo": {"path": str(pairs), "loss": "hinge"}}, "dpo.loss", "sigmoid"),
             ({"dpo": {"path": str(pairs), "beta": 0}}, "dpo.beta", "> 0"),
             ({"dpo": {"path": str(tmp_path / "nope.jsonl")}}, "dpo.path", "no such file")]
    for change, path, words in cases:
        job = {key: value for key, value in {**_job(model_dir, pairs), **change}.items() if value is not None}
        with pytest.raises(ConfigError) as info:
            parse_config(job)
        problems = dict(info.value.problems)
        assert words in problems.get(path, ""), (change, problems)
