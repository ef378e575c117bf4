"""The pure-PyTorch reference engines: a tiny transformer that learns to reverse digits with GRPO on CPU.

`TinyTrainEngine` and `TinyRolloutEngine` build the same version-0 policy from `TinyConfig.seed`, so a
trainer and its explorers agree on the base weights without transferring them. A job with an `agent:`
section plays multi-turn episodes (`TinyRolloutEngine.generate_turns`) over the agent vocabulary, and
both sides size the policy for its trajectories (`tiny_layout`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from rolectl.bus.files import atomic_path
from rolectl.sync_protocol.experience import Experience, ExperienceLimits, version_runs

from .agent.environment import TurnOutput
from .algorithms import RolloutCorrection
from .base import PausePoint, Task, WeightsMismatch
from .grpo import ClippedPolicyLoss, token_group_advantages
from .losses import LossFunction, TokenScores, TrainBatch, experience_batch
from .model import TinyPolicy, build_base_policy, scored_tokens
from .sections import RolloutCorrectionSection, TinyModelSection
from .step import TrainStep, step_metrics
from .streaming import DEFAULT_BUCKET_BYTES, NamedTensors, buckets_of
from .task import (
    AGENT_RESPONSE_TOKENS,
    AGENT_VOCAB_SIZE,
    EOS,
    QUERY,
    RESPONSE_TOKENS,
    VOCAB_SIZE,
    ReverseDigitsTaskSet,
    score_response,
)
from .tiny_generation import FinishedGroup, GenerationPool, GroupedGenerations, row_seed

if TYPE_CHECKING:
    from .agent.config import AgentSection
    from .agent.render import TinyRenderer

__all__ = [
    "TinyConfig",
    "TinyLayout",
    "TinyTrainEngine",
    "TinyRolloutEngine",
    "build_policy",
    "build_task_set",
    "length_buckets",
    "tiny_layout",
]


TinyConfig = TinyModelSection  # the `model:` section of `engine: tiny`, as the engines use it


@dataclass(frozen=True, slots=True)
class TinyLayout:
    """What the policy is sized for: its vocabulary, the tokens it may sample, the longest response
    (for an agent: the trajectory's token budget) and the longest turn. An agent's prompts are what
    its environment says first, rendered (any length up to the task's `prompt_length`)."""

    vocab_size: int
    response_tokens: tuple[int, ...]
    max_response_length: int
    turn_tokens: int
    stop_tokens: tuple[int, ...] = (EOS,)
    """Tokens that end a model turn (kept in it): EOS, and in an agent's episodes the query (the
    model asks, and its environment answers)."""


def tiny_layout(config: TinyConfig, agent: AgentSection | None = None) -> TinyLayout:
    """The single-turn task's layout, or with `agent` the agent vocabulary (its query token) and the
    section's token budgets (by default one response's)."""
    if agent is None:
        return TinyLayout(VOCAB_SIZE, RESPONSE_TOKENS, config.max_response_length, config.max_response_length)
    budget, turn = agent.budget(config.max_response_length)
    return TinyLayout(AGENT_VOCAB_SIZE, AGENT_RESPONSE_TOKENS, budget, turn, stop_tokens=(EOS, QUERY))


def build_policy(config: TinyConfig, layout: TinyLayout | None = None) -> TinyPolicy:
    """The version-0 policy `config` describes (its seed makes trainer and explorers agree on it)."""
    layout = layout or tiny_layout(config)
    return build_base_policy(
        seed=config.seed,
        vocab_size=layout.vocab_size,
        max_seq_len=config.prompt_length + layout.max_response_length,
        d_model=config.d_model,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        d_ff=config.d_ff,
    )


def build_task_set(config: TinyConfig, *, seed: int, num_batches: int | None = None) -> ReverseDigitsTaskSet:
    """The task stream of one explorer; give each explorer its own `seed` so they explore different tasks."""
    return ReverseDigitsTaskSet(
        seed=seed, tasks_per_batch=config.tasks_per_step, length=config.task_length, num_batches=num_batches,
        long_length=config.long_task_length, long_fraction=config.long_task_fraction,
    )


BUCKET_GROWTH = 1.5
"""A length bucket takes rows while its padded width stays within this factor of its shortest row:
at most a third of its positions are padding, and a long-tailed batch is a few buckets."""


def length_buckets(starts: Sequence[int], lengths: Sequence[int], *, growth: float = BUCKET_GROWTH
                   ) -> list[list[int]]:
    """The rows (a prompt of `starts[i]` tokens, a response of `lengths[i]`) in buckets to score
    together: taken by real length (prompt + response), shortest first, a row joins the bucket
    while the bucket's padded width (its longest prompt + its longest response) stays within
    `growth` x its shortest row's length, else opens the next. Each bucket lists its rows in their
    order; `growth` inf: one bucket."""
    buckets: list[list[int]] = []
    prompt = response = shortest = 0
    for row in sorted(range(len(starts)), key=lambda i: starts[i] + lengths[i]):
        start, length = starts[row], max(1, lengths[row])
        if buckets and max(prompt, start) + max(response, length) <= growth * shortest:
            buckets[-1].append(row)
            prompt, response = max(prompt, start), max(response, length)
        else:
            buckets.append([row])
            prompt, response, shortest = start, length, start + length
    return [sorted(bucket) for bucket in buckets]


def _in_rows_order(parts: Sequence[Tensor], order: Sequence[int], width: int) -> Tensor:
    """The buckets' scores `(bucket rows, own width)`, each padded with 0 to `width`, as one
    `(rows, width)` tensor in the rows' order (`order`: the row of each of the buckets' rows)."""
    stacked = torch.cat([F.pad(part, (0, width - part.shape[1])) for part in parts])
    return stacked[torch.tensor(order).argsort()]


_MODEL_FILE = "model.safetensors"
_STATE_TENSORS_FILE = "engine_state.safetensors"
_STATE_JSON_FILE = "engine_state.json"


class TinyTrainEngine:
    """Trainer side: a `train_step` takes `minibatches` Adam steps of the clipped GRPO loss, one per
    slice of the batch's groups (the one training step, `roles.engines.step`); the weights after it
    are version `step`. With `rollout_correction` (`algorithm.rollout_correction`), decoupled PPO
    and verl's rollout correction, as the hf trainer's (`RolloutCorrectionSection`)."""

    def __init__(self, config: TinyConfig, agent: AgentSection | None = None, *,
                 rollout_correction: RolloutCorrectionSection | None = None) -> None:
        self.config = config
        self.layout = tiny_layout(config, agent)
        self.allowed_tokens = torch.tensor(self.layout.response_tokens)
        self.policy = build_policy(config, self.layout)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=config.lr)
        # Each minibatch in one pass: its whole-minibatch token mean is the clipped loss's own.
        correction = None if rollout_correction is None else RolloutCorrection(rollout_correction)
        self.bucket_growth = BUCKET_GROWTH  # inf: each micro-batch one bucket, padded to its longest row
        self.update = TrainStep(model=self.policy, optimizer=self.optimizer, forward=self._logprobs,
                                max_grad_norm=config.max_grad_norm, minibatches=config.minibatches,
                                micro_batch_size=None, correction=correction)
        self.loss_fn: LossFunction = ClippedPolicyLoss(clip_eps=config.clip_eps, loss_agg_mode=config.loss_agg_mode)
        self.group_size = config.group_size
        self.experience_limits = ExperienceLimits(
            vocab_size=self.layout.vocab_size,
            prompt_length=config.prompt_length if agent is None else None,
            max_response_length=self.layout.max_response_length,
            group_size=config.group_size,
            response_tokens=frozenset(self.layout.response_tokens),
        )
        self.step = 0

    def train_step(self, experiences: Sequence[Experience], *, current_version: int) -> dict[str, float]:
        batch = experience_batch(experiences, token_group_advantages, current_version=current_version)
        self.policy.train()
        result = self.update.train_batch(batch, self.loss_fn)
        self.step += 1
        # this step's skipped updates (the hf and fsdp engines count since the start)
        return {**step_metrics(result, batch, experiences, current_version=current_version,
                               updates_skipped=result.updates_skipped),
                "model_parameters": float(sum(p.numel() for p in self.policy.parameters()))}

    def _logprobs(self, policy: TinyPolicy, batch: TrainBatch, rows: Sequence[int], *, entropy: bool) -> TokenScores:
        """The `Forward` of the one training step, without the padding waste (verl's
        `use_remove_padding`, in length buckets): rows of like real length (prompt + response) are
        scored together, each bucket right-padded with EOS only to its own longest prompt and
        response (`length_buckets`), and put back in the rows' order at the batch's width; past a
        bucket's longest response a row's scores are 0 (the step trains only under `loss_mask`)."""
        rows = list(rows)
        width = batch.loss_mask.shape[1]
        starts = [len(batch.prompts[row]) for row in rows]
        lengths = [len(batch.responses[row]) for row in rows]
        buckets = length_buckets(starts, lengths, growth=self.bucket_growth)
        scored = [self._bucket_scores(policy, batch, [rows[i] for i in bucket], entropy=entropy) for bucket in buckets]
        order = [index for bucket in buckets for index in bucket]
        return TokenScores(logprobs=_in_rows_order([s.logprobs for s in scored], order, width),
                           entropy=_in_rows_order([s.entropy for s in scored], order, width) if entropy else None)

    def _bucket_scores(self, policy: TinyPolicy, batch: TrainBatch, rows: list[int], *, entropy: bool) -> TokenScores:
        """One bucket's rows scored at its own width: each row its prompt then its response,
        right-padded with EOS (at least one response position, so a pass always has a gradient)."""
        starts = [len(batch.prompts[row]) for row in rows]
        width = max(1, max(len(batch.responses[row]) for row in rows))
        tokens = torch.full((len(rows), max(starts) + width), EOS)
        for index, row in enumerate(rows):
            sequence = (*batch.prompts[row], *batch.responses[row])
            tokens[index, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        logprobs, entropies = scored_tokens(policy, tokens, torch.tensor(starts), width=width,
                                            allowed_tokens=self.allowed_tokens,
                                            temperature=self.config.temperature, entropy=entropy)
        return TokenScores(logprobs=logprobs, entropy=entropies)

    def weights(self) -> dict[str, Tensor]:
        # A copy, not a view: a transport may still be serialising while the next step runs.
        return {name: p.detach().clone().contiguous() for name, p in self.policy.named_parameters()}

    def iter_weight_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[NamedTensors]:
        """`weights()` in buckets, each tensor copied only when its bucket is cut."""
        named = ((name, p.detach().clone().contiguous()) for name, p in self.policy.named_parameters())
        return buckets_of(named, bucket_bytes)

    def save_checkpoint(self, path: Path) -> None:
        """Three files under `path`; the JSON is written last so its presence marks a complete checkpoint."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        optimizer_state = self.optimizer.state_dict()
        state_tensors: dict[str, Tensor] = {"rng.torch_cpu": torch.get_rng_state()}
        per_param_scalars: dict[str, dict[str, Any]] = {}
        for index, param_state in optimizer_state["state"].items():
            for key, value in param_state.items():
                if isinstance(value, Tensor):
                    state_tensors[f"optimizer.{index}.{key}"] = value.detach().clone().contiguous()
                else:
                    per_param_scalars.setdefault(str(index), {})[key] = value
        state_json = {
            "step": self.step,
            "config": self.config.model_dump(),
            "optimizer_param_groups": optimizer_state["param_groups"],
            "optimizer_scalars": per_param_scalars,
        }
        model_tensors = {name: t.detach().clone().contiguous() for name, t in self.policy.state_dict().items()}
        _atomic_write(path / _MODEL_FILE, lambda tmp: save_file(model_tensors, tmp))
        _atomic_write(path / _STATE_TENSORS_FILE, lambda tmp: save_file(state_tensors, tmp))
        _atomic_write(path / _STATE_JSON_FILE, lambda tmp: Path(tmp).write_text(json.dumps(state_json, indent=1)))

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        state_json = json.loads((path / _STATE_JSON_FILE).read_text())
        saved_config = TinyConfig(**state_json["config"])
        model_fields = ("task_length", "longest_task", "d_model", "n_layers", "n_heads", "d_ff")
        differing = [f for f in model_fields if getattr(saved_config, f) != getattr(self.config, f)]
        if differing:
            raise ValueError(f"checkpoint {path} was written with different {', '.join(differing)}")
        self.policy.load_state_dict(load_file(path / _MODEL_FILE))
        state_tensors = load_file(path / _STATE_TENSORS_FILE)
        optimizer_state: dict[int, dict[str, Any]] = {}
        for name, tensor in state_tensors.items():
            if name.startswith("optimizer."):
                _, index, key = name.split(".", 2)
                optimizer_state.setdefault(int(index), {})[key] = tensor
        for index, scalars in state_json["optimizer_scalars"].items():
            optimizer_state.setdefault(int(index), {}).update(scalars)
        # JSON turned tuples (Adam's betas) into lists; give them back their type.
        param_groups = [
            {key: tuple(value) if isinstance(current.get(key), tuple) else value for key, value in saved.items()}
            for saved, current in zip(state_json["optimizer_param_groups"], self.optimizer.param_groups)
        ]
        self.optimizer.load_state_dict({"state": optimizer_state, "param_groups": param_groups})
        torch.set_rng_state(state_tensors["rng.torch_cpu"])
        self.step = int(state_json["step"])


class TinyRolloutEngine:
    """Explorer side: samples `group_size` responses per task with the weights it was last sent.

    Sampling draws from a generator seeded by `(sampling_seed, explore_step)`, so a replayed explore
    step with the same weights yields the same experiences. Give explorers distinct `sampling_seed`s.
    """

    def __init__(self, config: TinyConfig, *, member: str, sampling_seed: int | None = None,
                 agent: AgentSection | None = None) -> None:
        self.config = config
        self.member = member
        self.sampling_seed = config.seed if sampling_seed is None else sampling_seed
        self.layout = tiny_layout(config, agent)
        self.allowed_tokens = torch.tensor(self.layout.response_tokens)
        self.response_bound = config.max_response_length  # one response's tokens (an agent's default budget)
        self.policy = build_policy(config, self.layout).eval().requires_grad_(False)
        self.group_size = config.group_size
        self.rollout_metrics: dict[str, float] = {}  # the task's one reward is the experiences' reward
        self.version = 0
        self._weights_epoch = 0  # counts weight loads: a pool recomputes its caches when it changes
        self._stream = GroupedGenerations(self._pool(config.temperature))  # `admit`/`collect`'s rows

    def weight_buffers(self) -> dict[str, Tensor]:
        return dict(self.policy.named_parameters())

    def load_weights(self, tensors: Mapping[str, Tensor], version: int) -> None:
        buffers = self.weight_buffers()
        problems = [f"missing {name}" for name in buffers if name not in tensors]
        problems += [f"unexpected {name}" for name in tensors if name not in buffers]
        for name, received in tensors.items():
            own = buffers.get(name)
            if own is not None and (received.shape != own.shape or received.dtype != own.dtype):
                problems.append(
                    f"{name}: got {received.dtype} {tuple(received.shape)}, expected {own.dtype} {tuple(own.shape)}"
                )
        if problems:
            raise WeightsMismatch(
                f"{self.member}: weights for version {version} do not match the policy "
                f"(kept version {self.version}): " + "; ".join(problems)
            )
        with torch.no_grad():
            for name, own in buffers.items():
                received = tensors[name]
                if received.data_ptr() != own.data_ptr():  # else it was received in place already
                    own.copy_(received)
        self.version = version
        self._weights_epoch += 1  # every cached key/value was computed by the old weights

    def _pool(self, temperature: float, stop_tokens: Sequence[int] = (EOS,)) -> GenerationPool:
        return GenerationPool(self.policy, allowed_tokens=self.allowed_tokens, stop_tokens=stop_tokens,
                              temperature=temperature)

    def _admit(self, generations: GroupedGenerations, tasks: Sequence[Task], explore_step: int) -> None:
        """Each task's `group_size` rows, seeded by (sampling seed, step, task index, k), as group
        `{member}-{explore_step}-{task_idx}`."""
        for task_idx, task in enumerate(tasks):
            seeds = [row_seed(self.sampling_seed, explore_step, task_idx, k) for k in range(self.group_size)]
            generations.admit(f"{self.member}-{explore_step}-{task_idx}", task_index=task_idx, payload=task,
                              prompt=task.prompt, seeds=seeds, max_new_tokens=self.config.max_response_length)

    def _generate_until(self, generations: GroupedGenerations, groups: int, pause_point: PausePoint | None) -> None:
        """Tokens until `groups` groups are finished or nothing is in flight; a pending pause loads its
        weights between two tokens (the pool then recomputes the live rows' caches)."""
        while generations.finished() < groups and generations.pool.live:
            if pause_point is not None and pause_point.pending():
                pause_point.load()  # the pause: the next token is sampled with the new weights
            generations.step(version=self.version, weights_epoch=self._weights_epoch)

    def _experiences(self, finished: Sequence[FinishedGroup]) -> list[Experience]:
        experiences = []
        for group in finished:
            task = group.payload
            assert isinstance(task, Task)
            for k, row in enumerate(group.rows):
                experiences.append(Experience(
                    id=f"{group.name}-{k}", group=group.name, prompt=task.prompt, response=tuple(row.tokens),
                    logprobs=tuple(row.logprobs), reward=score_response(row.tokens, task.target),
                    model_version=min(row.versions, default=self.version),
                    token_versions=version_runs(row.versions)))
        return experiences

    def rollout(self, tasks: Sequence[Task], *, explore_step: int,
                pause_point: PausePoint | None = None) -> list[Experience]:
        """`group_size` responses per task (in task order), generated together on a pool of their own."""
        generations = GroupedGenerations(self._pool(self.config.temperature))
        self._admit(generations, tasks, explore_step)
        self._generate_until(generations, len(tasks), pause_point)
        finished = sorted(generations.take(len(tasks)), key=lambda group: group.task_index)
        return self._experiences(finished)

    def admit(self, tasks: Sequence[Task], *, explore_step: int) -> None:
        """Streaming: the tasks' rows join the generations in flight (named as `rollout` names them)."""
        self._admit(self._stream, tasks, explore_step)

    def collect(self, groups: int, *, pause_point: PausePoint | None = None) -> list[Experience]:
        """Streaming: generate until `groups` whole groups are finished (or nothing is in flight);
        returns `min(groups, finished)` groups' experiences, the earliest finished first. The rest
        stay in flight, finished or not, for the next call."""
        self._generate_until(self._stream, groups, pause_point)
        return self._experiences(self._stream.take(groups))

    def in_flight_groups(self) -> int:
        return self._stream.in_flight

    def abandon(self) -> int:
        """Drop every generation in flight; returns how many groups were dropped."""
        return self._stream.abandon()

    def generate_turns(self, sequences: Sequence[Sequence[int]], *, max_tokens: Sequence[int],
                       seeds: Sequence[int]) -> list[TurnOutput]:
        """One model turn per sequence (the agent loop's `TurnGenerator`), on the generation pool as
        rollouts are: a turn ends at a stop token or at its `max_tokens`, and each is sampled from its
        own seed, so its tokens do not depend on what else is in the batch."""
        pool = self._pool(self.config.temperature, stop_tokens=self.layout.stop_tokens)
        for index, (sequence, limit, seed) in enumerate(zip(sequences, max_tokens, seeds, strict=True)):
            pool.admit(index, sequence, max_new_tokens=limit, seed=seed % 2**63)
        turns: list[TurnOutput] = [None] * len(sequences)  # type: ignore[list-item]  # each filled once
        for row in pool.run_to_end(version=self.version, weights_epoch=self._weights_epoch):
            turns[row.key] = TurnOutput(tokens=tuple(row.tokens), logprobs=tuple(row.logprobs),  # type: ignore[index]
                                        version=self.version, finished=row.stopped)
        return turns

    def agent_renderer(self) -> TinyRenderer:
        """How an agent's episodes are rendered in the tiny vocabulary."""
        from .agent.render import TinyRenderer

        return TinyRenderer()

    def generate(self, tasks: Sequence[Task], *, temperature: float, samples: int, seed: int) -> list[list[str]]:
        """`samples` responses per task as text (digits separated by spaces, up to EOS), for
        evaluation: greedy at temperature 0; nothing is recorded."""
        pool = self._pool(temperature)
        for index, task in enumerate(tasks):
            for sample in range(samples):
                pool.admit((index, sample), task.prompt, max_new_tokens=self.config.max_response_length,
                           seed=row_seed(seed, index, sample))
        texts = [[""] * samples for _ in tasks]
        for row in pool.run_to_end(version=self.version, weights_epoch=self._weights_epoch):
            index, sample = row.key  # type: ignore[misc]
            texts[index][sample] = " ".join(str(t) for t in row.tokens if t != EOS)
        return texts


def _atomic_write(final: Path, write) -> None:
    with atomic_path(final) as tmp:
        write(str(tmp))
