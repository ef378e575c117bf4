"""The engines' side of agent episodes: `generate_turns` (tiny, hf), and a job's `agent:` section
turning an explorer's rollouts into trajectories its trainer takes."""

from __future__ import annotations

import shutil

import pytest
import torch

from rolectl.bus.experiences import validate_batch
from rolectl.roles.config import parse_config
from rolectl.roles.engines import make_rollout_engine, make_taskset, make_train_engine
from rolectl.roles.engines.agent.render import RenderError
from rolectl.roles.engines.agent.rollout import AgentRollout
from rolectl.roles.engines.grpo import token_group_advantages
from rolectl.roles.engines.hf import response_logprobs
from rolectl.roles.engines.hf_model import load_tokenizer
from rolectl.roles.engines.losses import experience_batch
from rolectl.roles.engines.model import response_logprobs as tiny_logprobs
from rolectl.roles.engines.task import AGENT_RESPONSE_TOKENS, AGENT_VOCAB_SIZE, EOS, QUERY
from rolectl.sync_protocol.experience import ExperienceBatch
from tests.support.tiny_llm import built_model, data_section, model_section

TINY_AGENT = {"environment": "hidden_reverse", "max_turns": 3, "max_tokens": 16, "max_tokens_per_turn": 5}


def _tiny_job(**agent):
    return parse_config({"job": "agent-test", "model": {"engine": "tiny", "group_size": 4, "tasks_per_step": 3},
                         "agent": {**TINY_AGENT, **agent}})


def test_a_tiny_turn_is_sampled_from_its_own_seed_whatever_else_is_in_the_batch():
    engine = make_rollout_engine(_tiny_job(), "explorer-0").engine
    sequences = [[10, 13, 13, 13, 13, 11], [10, 13, 13, 13, 13, 11, QUERY, 1, 2, 3, 4, 11]]
    both = engine.generate_turns(sequences, max_tokens=[5, 3], seeds=[1, 2])
    alone = engine.generate_turns(sequences[1:], max_tokens=[3], seeds=[2])
    # the same tokens; the logprobs to float rounding (a decode over two rows or one sums differently)
    assert (both[1].tokens, both[1].finished) == (alone[0].tokens, alone[0].finished)
    assert list(both[1].logprobs) == pytest.approx(list(alone[0].logprobs), abs=1e-6)
    assert both[0] != engine.generate_turns(sequences[:1], max_tokens=[5], seeds=[3])[0]
    for turn, limit in zip(both, [5, 3]):
        assert 1 <= len(turn.tokens) <= limit and set(turn.tokens) <= set(AGENT_RESPONSE_TOKENS)
        # a turn ends at EOS or at the query (the model asks; its environment answers)
        assert turn.finished == (turn.tokens[-1] in (EOS, QUERY))
        assert not {EOS, QUERY} & set(turn.tokens[:-1])
        assert turn.version == 0
    # the logprobs are the policy's own (as the trainer computes them), under the agent vocabulary
    for sequence, turn in zip(sequences, both):
        expected = tiny_logprobs(engine.policy, torch.tensor([sequence]), torch.tensor([turn.tokens]),
                                 allowed_tokens=engine.allowed_tokens, temperature=1.0)
        assert expected[0].tolist() == pytest.approx(list(turn.logprobs), abs=1e-5)


def test_an_agent_job_explores_trajectories_its_trainer_takes():
    cfg = _tiny_job()
    explorer, trainer = make_rollout_engine(cfg, "explorer-0"), make_train_engine(cfg)
    assert isinstance(explorer, AgentRollout) and explorer.policy.head.out_features == AGENT_VOCAB_SIZE
    assert trainer.experience_limits.max_response_length == 16
    explorer.version = 2  # the explorer sets its engines' versions
    assert explorer.engine.version == 2
    experiences = explorer.rollout(make_taskset(cfg, seed=0, batch_size=3).next_batch(), explore_step=1)
    assert len(experiences) == 12 and {e.model_version for e in experiences} == {2}
    assert explorer.rollout_metrics["agent/episodes"] == 12.0 and explorer.rollout_metrics["agent/turns_mean"] >= 1
    batch = ExperienceBatch(member="explorer-0", explore_step=1, model_version=2, experiences=tuple(experiences))
    validate_batch(batch, trainer.experience_limits)
    metrics = trainer.train_step(experiences, current_version=2)
    assert metrics["updates_skipped_nonfinite"] == 0.0
    # a replayed explore step plays the same episodes
    again = explorer.rollout(make_taskset(cfg, seed=0, batch_size=3).next_batch(), explore_step=1)
    assert [(e.response, e.loss_mask, e.reward) for e in again] == [
        (e.response, e.loss_mask, e.reward) for e in experiences]



def test_a_tiny_episodes_sampled_tokens_score_alike_in_the_explorer_and_the_trainer():
    # the whole trajectory, the environment's tokens between the turns included, reaches the trainer's
    # policy at the positions the explorer's saw: a shift there would cap what an agent can learn
    cfg = _tiny_job()
    explorer, trainer = make_rollout_engine(cfg, "explorer-0"), make_train_engine(cfg)
    experiences = explorer.rollout(make_taskset(cfg, seed=0, batch_size=3).next_batch(), explore_step=0)
    batch = experience_batch(experiences, token_group_advantages)
    after_observation = [row for row, e in enumerate(experiences) if 0 in e.loss_mask[:-1]
                         and 1 in e.loss_mask[e.loss_mask.index(0):]]
    assert after_observation, "no episode sampled a turn after its environment answered"
    with torch.no_grad():
        scores = trainer.update.forward(trainer.policy, batch, list(range(len(batch))), entropy=False)
    sampled = batch.loss_mask
    assert scores.logprobs[sampled].tolist() == pytest.approx(batch.old_logprobs[sampled].tolist(), abs=1e-5)


def test_a_single_turn_tiny_job_keeps_its_vocabulary():
    engine = make_rollout_engine(parse_config({"job": "a"}), "explorer-0")
    assert engine.policy.head.out_features == 14 and not isinstance(engine, AgentRollout)


# -- hf ----------------------------------------------------------------------------------------------

# Only words of the built tokenizer's vocabulary (and its <eos>): a model turn ends with <eos>.
WORD_TEMPLATE = ("{% for m in messages %}{% if m.role == 'assistant' %}= {{ m.content }} <eos> "
                 "{% else %}{{ m.content }} {% endif %}{% endfor %}{% if add_generation_prompt %}= {% endif %}")


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """The tests' tiny Qwen2, its tokenizer given a chat template."""
    built = built_model(tmp_path_factory.mktemp("hf"))
    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(built, path)
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = WORD_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def _hf_job(path, **agent):
    model = model_section(path, max_new_tokens=4)
    return parse_config({"job": "agent-hf", "model": model, "data": data_section(),
                         "agent": {"environment": "hidden_reverse", "max_tokens": 14, **agent}})


def test_hf_turns_of_left_padded_sequences_carry_the_trainers_logprobs(chat_model_dir):
    cfg = _hf_job(chat_model_dir)
    engine, trainer = make_rollout_engine(cfg, "explorer-0").engine, make_train_engine(cfg)
    tokenizer = engine.tokenizer
    sequences = [tokenizer("reverse 3 1 4 =")["input_ids"], tokenizer("reverse 6 =")["input_ids"]]
    turns = engine.generate_turns(sequences, max_tokens=[4, 2], seeds=[5, 6])
    assert turns == engine.generate_turns(sequences, max_tokens=[4, 2], seeds=[5, 6])
    for turn, limit in zip(turns, [4, 2]):
        assert 1 <= len(turn.tokens) <= limit
        assert turn.finished == (turn.tokens[-1] == tokenizer.eos_token_id)
    with torch.no_grad():
        expected, _ = response_logprobs(trainer.model, sequences, [t.tokens for t in turns], pad_id=trainer.pad_id,
                                        device="cpu")
    for row, turn in enumerate(turns):
        assert expected[row, :len(turn.tokens)].tolist() == pytest.approx(list(turn.logprobs), abs=1e-4)


def test_an_hf_agent_job_plays_episodes_with_the_chat_template(chat_model_dir):
    cfg = _hf_job(chat_model_dir, max_turns=2)
    explorer, trainer = make_rollout_engine(cfg, "explorer-0"), make_train_engine(cfg)
    assert trainer.experience_limits.max_response_length == 14
    experiences = explorer.rollout(make_taskset(cfg, seed=0, batch_size=2).next_batch(), explore_step=3)
    assert len(experiences) == 8
    assert all(1 <= e.turns <= 2 and len(e.response) <= 14 for e in experiences)
    assert set(explorer.rollout_metrics) >= {"agent/episodes", "agent/turns_mean", "reward/positional_match"}
    batch = ExperienceBatch(member="explorer-0", explore_step=3, model_version=0, experiences=tuple(experiences))
    validate_batch(batch, trainer.experience_limits)


def test_an_hf_agent_job_needs_a_chat_template(tmp_path):
    built = built_model(tmp_path)
    with pytest.raises(RenderError, match="this tokenizer has none"):
        make_rollout_engine(_hf_job(built), "explorer-0")
