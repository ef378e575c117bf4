"""Evaluation on a held-out set: the `eval:` section, its file through the data loader, greedy scoring."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_eval_tasks, make_rollout_engine
from rolectl.roles.engines.evaluation import evaluate
from rolectl.sync_protocol import ConfigError
from tests.support.tiny_llm import built_model, data_section, model_section

ROOT = Path(__file__).resolve().parents[2]
EVAL_FILE = ROOT / "examples/data/reverse_digits_eval.jsonl"
LLM_DATA = ROOT / "examples/data/reverse_digits.jsonl"


def _tiny(**eval_section):
    return parse_config({"job": "eval-test", "model": {"engine": "tiny"},
                         "eval": {"path": str(EVAL_FILE), "eval_interval": 5, **eval_section}})


def _problems(data) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return dict(info.value.problems)


def test_an_eval_file_that_does_not_exist_is_a_config_error_naming_it(tmp_path):
    problems = _problems({"job": "j", "eval": {"path": str(tmp_path / "nope.jsonl"), "eval_interval": 2}})
    assert "no such file" in problems["eval.path"] and "nope.jsonl" in problems["eval.path"]


def test_an_eval_file_that_does_not_parse_is_a_config_error_saying_so(tmp_path):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"prompt": "reverse 1 2 3 4 =", "answer": "4 3 2 1"}\n{"prompt": oops\n')
    problems = _problems({"job": "j", "eval": {"path": str(bad), "eval_interval": 2}})
    assert "does not parse as jsonl" in problems["eval.path"] and str(bad) in problems["eval.path"]


def test_eval_problems_are_each_reported_by_path(tmp_path):
    wrong = tmp_path / "three.jsonl"
    wrong.write_text('{"prompt": "reverse 1 2 3 =", "answer": "3 2 1"}\n')
    problems = _problems({"job": "j", "eval": {"path": str(wrong), "eval_interval": 1, "rewards": ["no_such"],
                                               "temperature": -1}})
    assert "temperature" in " ".join(problems)  # the section's own constraint
    problems = _problems({"job": "j", "eval": {"path": str(wrong), "eval_interval": 1, "rewards": ["no_such"]}})
    assert "unknown reward 'no_such'" in problems["eval.rewards[0]"]
    assert "reverses 4 digits" in problems["eval.path"] and "row 0" in problems["eval.path"]
    assert "required" in _problems({"job": "j", "eval": {"eval_on_startup": True}})["eval.path"]
    missing = _problems({"job": "j", "eval": {"path": str(EVAL_FILE), "eval_interval": 1, "prompt_key": "q"}})
    assert "no column 'q'" in missing["eval.path"] and "eval.prompt_key" in missing["eval.path"]


def test_an_eval_set_is_read_like_data_from_a_saved_directory_and_its_split(tmp_path):
    import datasets

    rows = [r for r in datasets.load_dataset("json", data_files=str(EVAL_FILE), split="train")]
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:8]),
                          "test": datasets.Dataset.from_list(rows[8:12])}).save_to_disk(str(saved))
    tasks = make_eval_tasks(_tiny(path=str(saved), split="test"))
    assert [t.answer for t in tasks] == [r["answer"] for r in rows[8:12]]
    assert tasks[0].prompt_text == rows[8]["prompt"] and tasks[0].row == rows[8]
    problems = _problems({"job": "j", "eval": {"path": str(saved), "split": "dev", "eval_interval": 1}})
    assert problems == {"eval.split": f"{saved} has no split 'dev'; its splits: ['train', 'test']"}


def test_eval_rewards_see_the_row(tmp_path):
    (tmp_path / "row_reward.py").write_text(
        "def first_digit(response, answer, *, prompt, row):\n"
        "    return float(row['answer'] == answer and prompt == row['prompt']) + int(row['answer'][0]) / 10\n")
    cfg = _tiny(rewards=[f"{tmp_path}/row_reward.py:first_digit"], max_tasks=4)
    tasks = make_eval_tasks(cfg)
    result = evaluate(make_rollout_engine(cfg, "explorer-0"), tasks, cfg)
    expected = sum(1 + int(t.answer[0]) / 10 for t in tasks) / 4
    assert result.rewards == {f"{tmp_path}/row_reward.py:first_digit": pytest.approx(expected)}


def test_a_tiny_eval_is_greedy_deterministic_and_reports_each_reward():
    cfg = _tiny()
    tasks = make_eval_tasks(cfg)
    assert len(tasks) == 64 and tasks[0].answer == "1 4 1 9" and tasks[0].target == (1, 4, 1, 9)
    engine = make_rollout_engine(cfg, "explorer-0")
    first = evaluate(engine, tasks, cfg, seed=1)
    again = evaluate(engine, tasks, cfg, seed=2)  # greedy: the seed changes nothing
    assert first.rewards == again.rewards
    assert set(first.rewards) == {"positional_match", "exact_match"}
    assert first.tasks == first.responses == 64
    assert 0 <= first.rewards["exact_match"] <= first.rewards["positional_match"] <= 1


def test_sampled_evals_differ_by_seed_and_count_every_response():
    cfg = _tiny(temperature=1.0, samples=3, max_tasks=10, rewards=["positional_match"])
    engine = make_rollout_engine(cfg, "explorer-0")
    tasks = make_eval_tasks(cfg)
    one, two = evaluate(engine, tasks, cfg, seed=1), evaluate(engine, tasks, cfg, seed=2)
    assert one.tasks == 10 and one.responses == 30 and set(one.rewards) == {"positional_match"}
    assert one.rewards != two.rewards


def test_the_tiny_engines_eval_reward_matches_its_training_reward():
    # the text rewards on decoded digits score as the token-level task does
    from rolectl.roles.engines.rewards import positional_match
    from rolectl.roles.engines.task import score_response

    cfg = _tiny(rewards=["positional_match"])
    engine = make_rollout_engine(cfg, "explorer-0")
    tasks = make_eval_tasks(cfg)[:8]
    texts = engine.generate(tasks, temperature=0.0, samples=1, seed=0)
    for task, (text,) in zip(tasks, texts):
        tokens = [int(t) for t in text.split()]
        assert positional_match(text, task.answer) == pytest.approx(score_response(tokens, task.target))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return built_model(tmp_path_factory.mktemp("hf-eval"))


def test_an_hf_eval_uses_the_data_rewards_and_is_greedy(model_dir):
    cfg = parse_config({"job": "hf-eval", "model": model_section(model_dir, rollout_engine="hf"),
                        "data": data_section(), "eval": {"path": str(LLM_DATA), "max_tasks": 6, "eval_interval": 1}})
    tasks = make_eval_tasks(cfg)
    assert len(tasks) == 6 and all(t.prompt for t in tasks)
    engine = make_rollout_engine(cfg, "explorer-0")
    first, again = evaluate(engine, tasks, cfg, seed=1), evaluate(engine, tasks, cfg, seed=5)
    assert set(first.rewards) == {"positional_match", "exact_match"}  # data.rewards' names
    assert first.rewards == again.rewards and first.responses == 6


def test_bench_evaluates_the_base_model_and_each_kept_checkpoint(tmp_path):
    from rolectl.roles.engines import make_train_engine
    from rolectl.roles.observe.bench import run_bench

    cfg = _tiny(max_tasks=16).with_overrides(run_dir=str(tmp_path))
    trainer = make_train_engine(cfg)
    trainer.step = 3  # the base weights, saved as if after step 3: the same eval as version 0
    trainer.save_checkpoint(tmp_path / "eval-test" / "trainer" / "step-3")
    (tmp_path / "eval-test" / "trainer" / "step-7").mkdir()  # an empty (unfinished) save is not a version
    rows = run_bench(cfg)
    assert [(r.version, r.tasks) for r in rows] == [(0, 16), (3, 16)]
    assert rows[0].rewards == rows[1].rewards and rows[0].source == "base model"
    assert [r.version for r in run_bench(cfg, versions=[3])] == [3]


def test_bench_says_what_is_missing(tmp_path):
    from rolectl.roles.observe.bench import BenchError, run_bench

    no_eval = parse_config({"job": "j", "run_dir": str(tmp_path)})
    with pytest.raises(BenchError, match="no eval set: set eval.path"):
        run_bench(no_eval)
    with pytest.raises(BenchError, match="no saved versions of job 'eval-test'.*--run-dir"):
        run_bench(_tiny().with_overrides(run_dir=str(tmp_path)))
    (tmp_path / "eval-test" / "trainer").mkdir(parents=True)
    with pytest.raises(BenchError, match=r"version\(s\) \[4\] are not kept; kept: \[0\]"):
        run_bench(_tiny().with_overrides(run_dir=str(tmp_path)), versions=[4])


def test_replay_and_the_summary_show_the_eval_curve(capsys):
    from rolectl.roles.observe.render import print_timeline
    from rolectl.roles.observe.timeline import build_timeline, summarize
    from rolectl.sync_protocol import EvalFinished, MemberJoined, MemberRef, Recorded, Role

    e = MemberRef(role=Role.EXPLORER, id="explorer-0", incarnation=0)
    events = [MemberJoined(member=e, host="h", pid=1, step=0, version=-1),
              EvalFinished(member=e, version=0, step=0, rewards={"positional_match": 0.1}, tasks=64, responses=64),
              EvalFinished(member=e, version=9, step=10, rewards={"positional_match": 0.5}, tasks=64, responses=64)]
    records = [Recorded(seq=i + 1, time_ms=1000 * i, event=ev) for i, ev in enumerate(events)]
    assert summarize(records, job="j")["eval"] == [
        {"version": 0, "step": 0, "rewards": {"positional_match": 0.1}, "tasks": 64},
        {"version": 9, "step": 10, "rewards": {"positional_match": 0.5}, "tasks": 64}]
    timeline = build_timeline(records)
    timeline.update(source="test", until=None)
    print_timeline(timeline)
    out = capsys.readouterr().out
    assert "evals: 2 on the eval set (64 tasks)" in out
    assert any(line.split()[:3] == ["9", "10", "0.5000"] for line in out.splitlines()), out
