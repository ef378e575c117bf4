"""Supervised fine-tuning's pieces: chats and pairs rendered with their masks (a real chat template),
the SFT loss on assistant tokens only, the stage's walk over its rows, the learning-rate schedule,
and demonstrations mixed into RL batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rolectl.roles.config import parse_config
from rolectl.roles.engines.algorithms import AlgorithmConfig
from rolectl.roles.engines.hf import HFTrainEngine, response_logprobs
from rolectl.roles.engines.hf_model import HFModelConfig, load_tokenizer
from rolectl.roles.engines.losses import LossSum, MicroBatch
from rolectl.roles.engines.sft import (
    Demonstration,
    MixedBatches,
    OnRows,
    SFTLoss,
    concat_batches,
    demonstration_batch,
    load_demonstrations,
    render_chat,
    render_pair,
)
from rolectl.roles.engines.stage_sections import ExpertDataSection, SFTSection
from rolectl.roles.engines.step import lr_schedule
from rolectl.roles.stage import StagePlan
from rolectl.sync_protocol import ConfigError
from tests.support.tiny_llm import chat_model

CHAT = [{"role": "system", "content": "you reverse"},
        {"role": "user", "content": "reverse 1 2 3 ="},
        {"role": "assistant", "content": "3 2 1"},
        {"role": "user", "content": "copy 4 5 ="},
        {"role": "assistant", "content": "4 5"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _words(tokenizer, ids) -> list[str]:
    return tokenizer.convert_ids_to_tokens(list(ids))


def test_a_chat_trains_on_the_assistant_turns_and_their_end_of_turn_only(tokenizer):
    prompt, response, mask = render_chat(tokenizer, CHAT, where="test")
    # the prompt is everything before the first assistant turn's content: system, user, the header
    assert _words(tokenizer, prompt) == ["<|im_start|>", "system", "you", "reverse", "<|im_end|>", "<|im_start|>",
                                         "user", "reverse", "1", "2", "3", "=", "<|im_end|>", "<|im_start|>",
                                         "assistant"]
    trained = [w for w, m in zip(_words(tokenizer, response), mask) if m]
    context = [w for w, m in zip(_words(tokenizer, response), mask) if not m]
    assert trained == ["3", "2", "1", "<|im_end|>", "4", "5", "<|im_end|>"]
    assert context == ["<|im_start|>", "user", "copy", "4", "5", "=", "<|im_end|>", "<|im_start|>", "assistant"]
    # nothing is lost or added: the trajectory is the whole rendered chat
    whole = tokenizer.apply_chat_template(CHAT, tokenize=True)
    assert [*prompt, *response] == list(whole["input_ids"] if isinstance(whole, dict) or hasattr(whole, "keys")
                                        else whole)


def test_a_chat_without_an_assistant_turn_or_a_template_is_refused(tokenizer, model_dir):
    with pytest.raises(ValueError, match="no assistant message"):
        render_chat(tokenizer, CHAT[:2], where="file row 3")
    with pytest.raises(ValueError, match=r"file row 3: message 1 must be \{role: text, content: text\}"):
        render_chat(tokenizer, [CHAT[0], {"role": "user"}], where="file row 3")
    plain = load_tokenizer(model_dir)
    plain.chat_template = None
    with pytest.raises(ValueError, match="needs the tokenizer's chat template"):
        render_chat(plain, CHAT, where="file row 0")


def test_a_pair_is_its_prompt_then_the_response_and_the_end_of_sequence(tokenizer):
    prompt, response, mask = render_pair(tokenizer, "reverse 1 2 =", "2 1", chat_template=False)
    assert _words(tokenizer, prompt) == ["reverse", "1", "2", "="]
    assert _words(tokenizer, response) == ["2", "1", "<|im_end|>"] and all(mask)
    templated = render_pair(tokenizer, "reverse 1 2 =", "2 1", chat_template="auto")
    assert _words(tokenizer, templated[0])[-2:] == ["<|im_start|>", "assistant"]  # as an RL prompt is rendered
    assert [w for w, m in zip(_words(tokenizer, templated[1]), templated[2]) if m] == ["2", "1", "<|im_end|>"]


def test_the_sft_loss_is_the_nll_of_the_assistant_tokens_alone(model_dir, tokenizer):
    section = HFModelConfig.model_validate({"path": str(model_dir), "micro_batch_size": 1})
    engine = HFTrainEngine(section, AlgorithmConfig(), model_path=model_dir)
    other = [{"role": "user", "content": "copy 7 ="}, {"role": "assistant", "content": "7"}]
    demos = [Demonstration(id=f"d{i}", **dict(zip(("prompt", "response", "mask"),
                                                    map(tuple, render_chat(tokenizer, chat, where="t")))))
             for i, chat in enumerate((CHAT, other))]
    batch = demonstration_batch(demos)
    loss = engine.evaluate_batch(batch, SFTLoss())["loss"]  # micro-batches of one row: accumulated
    with torch.no_grad():
        logprobs, _ = response_logprobs(engine.model, batch.prompts, batch.responses, pad_id=0, device="cpu")
    mask = batch.loss_mask
    assert loss == pytest.approx(float(-(logprobs * mask).sum() / mask.sum()), rel=1e-5)
    # a token out of the mask (a user turn's) changes nothing; an assistant token changes the loss
    changed = list(demos[0].response)
    user_token = changed.index(tokenizer.convert_tokens_to_ids("copy"))
    changed[user_token] = tokenizer.convert_tokens_to_ids("no")
    same_mask = demonstration_batch([Demonstration(id="d0", prompt=demos[0].prompt, response=tuple(changed),
                                                   mask=demos[0].mask), demos[1]])
    # the user token is context for what follows, so compare the loss on the tokens before it only
    head = Demonstration(id="h", prompt=demos[0].prompt, response=demos[0].response[:user_token],
                         mask=demos[0].mask[:user_token])
    head_changed = Demonstration(id="h", prompt=demos[0].prompt, response=tuple(changed[:user_token + 1]),
                                 mask=(*demos[0].mask[:user_token], False))
    a = engine.evaluate_batch(demonstration_batch([head]), SFTLoss())["loss"]
    b = engine.evaluate_batch(demonstration_batch([head_changed]), SFTLoss())["loss"]
    assert a == pytest.approx(b, rel=1e-6)
    assert engine.evaluate_batch(same_mask, SFTLoss())["loss"] != pytest.approx(loss, rel=1e-6)


def test_the_sequence_mean_modes_weigh_each_demonstration_once(model_dir, tokenizer):
    section = HFModelConfig.model_validate({"path": str(model_dir), "micro_batch_size": 1})
    engine = HFTrainEngine(section, AlgorithmConfig(), model_path=model_dir)
    demos = [Demonstration(id=f"d{i}", prompt=p, response=r, mask=(True,) * len(r))
             for i, (p, r) in enumerate((((5, 6), (7, 8, 9, 1)), ((5,), (10, 1))))]
    batch = demonstration_batch(demos)
    with torch.no_grad():
        logprobs, mask = response_logprobs(engine.model, batch.prompts, batch.responses, pad_id=0, device="cpu")
    per_sequence = (-(logprobs * mask).sum(-1) / mask.sum(-1)).mean()
    assert engine.evaluate_batch(batch, SFTLoss("seq-mean-token-mean"))["loss"] == pytest.approx(float(per_sequence),
                                                                                                 rel=1e-5)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_demonstrations_are_read_from_messages_or_pairs_with_clear_errors(tmp_path, tokenizer):
    chats = _write(tmp_path / "chats.jsonl", [{"messages": CHAT}, {"messages": CHAT[:3]}])
    section = SFTSection(path=str(chats))
    demos = load_demonstrations(chats, tokenizer, section, name="sft")
    assert [d.id for d in demos] == ["row0", "row1"] and all(d.answer is None for d in demos)
    pairs = _write(tmp_path / "pairs.jsonl", [{"q": "reverse 1 2 =", "a": "2 1"}])
    demos = load_demonstrations(pairs, tokenizer, SFTSection(path=str(pairs), prompt_key="q", response_key="a",
                                                             chat_template=False),
                                name="sft", answer_key="a")
    assert demos[0].answer == "2 1" and _words(tokenizer, demos[0].response) == ["2", "1", "<|im_end|>"]
    with pytest.raises(ValueError, match=r"no column 'response' for prompt_response rows; it has \['q', 'a'\] "
                                         r"\(set sft.prompt_key / response_key"):
        load_demonstrations(pairs, tokenizer, SFTSection(path=str(pairs), prompt_key="q"), name="sft")
    with pytest.raises(ValueError, match=r"row 0: 31 tokens, more than sft.max_length = 10"):
        load_demonstrations(chats, tokenizer, SFTSection(path=str(chats), max_length=10), name="sft")


def test_the_stage_walks_every_row_once_per_epoch_in_a_seeded_order():
    plan = StagePlan(10, batch_size=4, epochs=2, shuffle_seed=3)
    assert plan.steps_per_epoch == 3 and plan.total_steps == 6
    epochs = [[row for step in range(e * 3, e * 3 + 3) for row in plan.rows_of(step)] for e in range(2)]
    assert all(sorted(rows) == list(range(10)) for rows in epochs) and epochs[0] != epochs[1]
    assert [len(plan.rows_of(s)) for s in range(3)] == [4, 4, 2]
    again = StagePlan(10, batch_size=4, epochs=2, shuffle_seed=3)
    assert [again.rows_of(s) for s in (4, 1)] == [plan.rows_of(4), plan.rows_of(1)]  # a function of the step
    assert plan.epochs_done(4) == pytest.approx(1.4) and plan.position(4)["epoch"] == 1
    assert StagePlan(10, batch_size=4, epochs=2, shuffle_seed=3, cap=5).total_steps == 5
    with pytest.raises(ValueError, match="the data file or the stage's batch_size / shuffle_seed changed"):
        StagePlan(11, batch_size=4, epochs=2, shuffle_seed=3).check(plan.position(2), where="ckpt")


def test_the_lr_warms_up_then_decays_and_its_state_is_json():
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    schedule = lr_schedule(optimizer, "cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    rates = []
    for _ in range(10):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[:3] == pytest.approx([0.0, 0.05, 0.1]) and rates[3] < 0.1
    assert all(a >= b for a, b in zip(rates[2:], rates[3:])) and optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    resumed = lr_schedule(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=0.1), "cosine", warmup_steps=2,
                          total_steps=10, min_lr_ratio=0.1)
    resumed.load_state_dict(json.loads(json.dumps(schedule.state_dict())))
    assert resumed.get_last_lr() == schedule.get_last_lr()


def _rl_batch():
    from rolectl.roles.engines.losses import TrainBatch

    mask = torch.tensor([[True, True, False], [True, True, True]])
    return TrainBatch(prompts=((4, 5), (4, 5)), responses=((6, 7), (8, 9, 10)), groups=("g", "g"), loss_mask=mask,
                      old_logprobs=torch.full((2, 3), -1.0), advantages=torch.tensor([[1.0] * 3, [-1.0] * 3]),
                      rewards=torch.tensor([1.0, 0.0]))


class _Sum:
    """A stand-in loss: the sum of masked logprobs over `num_tokens` (what `OnRows` must hand it)."""

    needs_reference = False
    keeps_groups = False

    def __call__(self, micro: MicroBatch):
        return (micro.logprobs * micro.loss_mask).sum() / micro.num_tokens, {"seen": float(micro.num_tokens)}


def test_mixed_batches_train_each_part_with_its_loss_over_its_own_tokens():
    demos = [Demonstration(id=f"row{i}", prompt=(4,), response=(5,) * (i + 1), mask=(True,) * (i + 1))
             for i in range(5)]
    mixed = MixedBatches(demos, ratio=0.5, weight=2.0, shuffle_seed=0, rl_loss=_Sum())
    assert mixed.count(2) == 2
    assert MixedBatches(demos, ratio=0.2, weight=1, shuffle_seed=0, rl_loss=_Sum()).count(2) == 1
    assert [d.id for d in mixed.rows(1, 2)] == [d.id for d in mixed.rows(1, 2)]  # a function of the step
    walked = [d.id for s in range(5) for d in mixed.rows(s, 2)]
    assert sorted(walked[:5]) == [f"row{i}" for i in range(5)]  # each pass is a permutation of the file
    batch = mixed.batch(_rl_batch(), step=0)
    assert len(batch) == 4 and batch.demonstration.tolist() == [False, False, True, True]
    assert batch.loss_mask.shape[1] == max(3, *(len(r) for r in batch.responses[2:]))
    assert len(set(batch.groups)) == 3  # the experiences' group, one per demonstration
    logprobs = -torch.arange(1, 1 + batch.loss_mask.numel(), dtype=torch.float32).reshape(batch.loss_mask.shape)
    rows = list(range(4))
    micro = MicroBatch(batch=batch, rows=rows, logprobs=logprobs, ref_logprobs=None,
                       num_tokens=int(batch.loss_mask.sum()), num_sequences=4, minibatch=rows)
    rl_tokens, demo_tokens = batch.loss_mask[:2], batch.loss_mask[2:]
    loss, metrics = mixed.loss(micro)
    # the stand-in over the experiences' tokens alone, plus 2 x the NLL over the demonstrations' alone
    assert float(loss) == pytest.approx(float((logprobs[:2] * rl_tokens).sum() / rl_tokens.sum()
                                              + 2.0 * (-(logprobs[2:]) * demo_tokens).sum() / demo_tokens.sum()))
    assert metrics["seen"] == float(rl_tokens.sum())
    # a micro-batch holding none of a part's rows adds zero for it, and keeps the graph
    only_rl = MicroBatch(batch=batch, rows=[0, 1], logprobs=logprobs[:2].requires_grad_(), ref_logprobs=None,
                         num_tokens=0, num_sequences=0, minibatch=rows)
    part, _ = OnRows(SFTLoss(), demonstrations=True)(only_rl)
    assert float(part.detach()) == 0.0 and part.requires_grad


def test_concatenated_batches_pad_and_mark_the_rows_one_lacks():
    first = _rl_batch()
    second = demonstration_batch([Demonstration(id="d", prompt=(1,), response=(2, 3, 4, 5), mask=(1, 0, 1, 1))])
    both = concat_batches(first, second)
    assert both.loss_mask.shape == (3, 4) and both.loss_mask[2].tolist() == [True, False, True, True]
    assert both.advantages[0].tolist() == [1.0, 1.0, 1.0, 0.0] and both.demonstration.tolist() == [False, False, True]
    assert both.groups == ("g", "g", "d") and isinstance(LossSum(SFTLoss()).terms[0], SFTLoss)


def test_stage_config_rules_are_each_reported(tmp_path):
    data = _write(tmp_path / "d.jsonl", [{"prompt": "reverse 1 =", "response": "1"}])
    model = {"engine": "hf", "path": str(tmp_path / "m"), "build": {}}
    with pytest.raises(ConfigError) as refused:
        parse_config({"job": "j", "stage": "sft", "model": model,
                      "trainer": {"expert_data": {"path": str(data)}}})
    problems = dict(refused.value.problems)
    assert "required by `stage: sft`" in problems["sft"] and "mixes demonstrations" in problems["trainer.expert_data"]
    with pytest.raises(ConfigError) as refused:
        parse_config({"job": "j", "sft": {"path": str(data)}, "model": {**model, "init_from": "x"},
                      "data": {"path": str(data), "answer_key": "response"}})
    problems = dict(refused.value.problems)
    assert "read only by `stage: sft`" in problems["sft"] and "name it as model.path" in problems["model.init_from"]
    with pytest.raises(ConfigError) as refused:
        parse_config({"job": "j", "stage": "sft", "sft": {"path": str(tmp_path / "none.jsonl")}})
    problems = dict(refused.value.problems)
    assert "not tiny" in problems["stage"] or "runs on the hf or fsdp engine" in problems["stage"]
    cfg = parse_config({"job": "j", "stage": "sft", "model": model, "sft": {"path": str(data)}})
    assert cfg.trainer_only and cfg.explorer_ids() == [] and cfg.data is None
    assert ExpertDataSection(path=str(data)).ratio == 0.25


def test_an_rl_step_with_expert_data_trains_its_demonstrations_and_counts_them(tmp_path):
    from rolectl.roles.engines import make_train_engine
    from rolectl.roles.observe.replay import summarize
    from rolectl.roles.observe.timeline import observe
    from rolectl.sync_protocol import MemberJoined, MemberRef, Recorded, Role, StepFinished
    from rolectl.sync_protocol.experience import Experience
    from tests.support.tiny_llm import DATA, built_model, data_section, model_section

    model = built_model(tmp_path)
    cfg = parse_config({"job": "mixed", "model": model_section(model, minibatches=1),
                        "data": data_section(),
                        "trainer": {"expert_data": {"path": str(DATA), "prompt_key": "prompt",
                                                    "response_key": "answer", "ratio": 0.2, "weight": 1.0}}})
    engine = make_train_engine(cfg)
    experiences = [Experience(id=f"e{k}", group="g", prompt=(15, 5, 6, 14), response=(7, 1), logprobs=(-2.0, -2.0),
                              reward=float(k % 2), model_version=0) for k in range(8)]
    demo = engine.expert.rows(0, 2)[0]
    before = engine.evaluate_batch(demonstration_batch([demo]), SFTLoss())["loss"]
    trainer = MemberRef(role=Role.TRAINER, id="trainer", incarnation=1)
    records = [Recorded(seq=1, time_ms=0, subject=None, event=MemberJoined(member=trainer, host="h", pid=1, step=0,
                                                                          version=0))]
    for step in range(3):
        metrics = engine.train_step(experiences, current_version=step)
        assert metrics["expert_rows"] == 2.0 and metrics["num_experiences"] == 8.0  # 0.2 of the mixed batch
        assert metrics["reward_mean"] == 0.5  # the experiences' figures, not the demonstrations'
        records.append(Recorded(seq=step + 2, time_ms=step, subject=None, event=StepFinished(
            member=trainer, step=step + 1, version=step + 1, metrics=metrics)))
    assert engine.evaluate_batch(demonstration_batch([demo]), SFTLoss())["loss"] < before  # learnt by SFT
    # a restart's repeat of a step counts once
    records.append(Recorded(seq=9, time_ms=9, subject=None, event=records[-1].event))
    assert not observe(records).illegal
    assert summarize(records, job="mixed")["expert_rows_trained"] == 6
