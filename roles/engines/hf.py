"""The `hf` engines: a Hugging Face transformers causal LM as trainer (verl's losses) and as rollout engine.

`HFTrainEngine.train_step` computes advantages and the policy loss with verl's `core_algos`
(`roles.engines.algorithms`) and runs the one training step (`roles.engines.step`): `minibatches`
optimizer steps over slices of the batch's groups, each accumulated over micro-batches of
`micro_batch_size` sequences (and at most `micro_batch_tokens` tokens, when set). Checkpoints are safetensors (model,
optimizer tensors, RNG) plus JSON: no pickle. `HFRolloutEngine` samples with `generate` under a seed
derived from (member, explore step, task), scores decoded text with the job's reward functions, and
tags each experience with the version it sampled with.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from rolectl.bus.files import atomic_directory, atomic_path
from rolectl.sync_protocol.experience import Experience, ExperienceLimits, version_runs

from .agent.environment import TurnOutput
from .agent.render import ChatTemplateRenderer
from .algorithms import AlgorithmConfig, VerlAlgorithm
from .base import PausePoint, Task, WeightsMismatch
from .hf_model import HFModelConfig, flat_weights, load_model, load_tokenizer, parameter_count
from .lora import adapter_tensors, save_adapter, save_merged, wrap_with_lora
from .losses import TokenScores, TrainBatch, token_entropy
from .rewards import WeightedReward, score_all
from .sft import mixed_batches
from .step import Forward, StageTraining, TrainStep
from .streaming import DEFAULT_BUCKET_BYTES, NamedTensors, buckets_of

__all__ = ["HFTrainEngine", "HFRolloutEngine", "AdapterDisabled", "response_logprobs", "response_scores",
           "model_forward", "task_seed", "score_texts", "check_weights", "checkpoint_step_dir"]

_MODEL_FILE = "model.safetensors"
_STATE_TENSORS_FILE = "engine_state.safetensors"
_STATE_JSON_FILE = "engine_state.json"


def task_seed(seed: int, member: str, explore_step: int, task_idx: int) -> int:
    """The sampling seed of one task's group: a replayed explore step samples the same responses."""
    return zlib.crc32(f"{seed}/{member}/{explore_step}/{task_idx}".encode())


def response_logprobs(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                      pad_id: int, device: str, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Logprobs `(batch, max_response_len)` of each response token given its prompt, and the mask.

    Sequences are right-padded (positions stay those of an unpadded sequence); response token `j`
    of row `b` is predicted by the logits at `len(prompt_b) - 1 + j`.
    """
    scores, mask = response_scores(model, prompts, responses, pad_id=pad_id, device=device,
                                   temperature=temperature)
    return scores.logprobs, mask


def response_scores(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                    pad_id: int, device: str, temperature: float = 1.0, entropy: bool = False
                    ) -> tuple[TokenScores, Tensor]:
    """`response_logprobs`, with the entropy of each response token's distribution when asked."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width, max_response = max(lengths), max(1, max(len(r) for r in responses))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    index = torch.zeros((len(prompts), max_response), dtype=torch.long)
    mask = torch.zeros((len(prompts), max_response), dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[b, :len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.long)
        attention[b, :len(p) + len(r)] = 1
        index[b, :len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        mask[b, :len(r)] = True
    input_ids, attention, index, mask = (t.to(device) for t in (input_ids, attention, index, mask))
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float()
    picked = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # (b, r, vocab)
    targets = input_ids.gather(1, (index + 1).clamp(max=width - 1))
    distributions = torch.log_softmax(picked / temperature, dim=-1)
    logprobs = distributions.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropies = token_entropy(distributions) * mask if entropy else None
    return TokenScores(logprobs=logprobs * mask, entropy=entropies), mask


def model_forward(pad_id: int, device: str, temperature: float) -> Forward:
    """The one training step's `Forward` for a causal LM: `response_scores` of the batch's rows."""
    def forward(model, batch: TrainBatch, rows: Sequence[int], *, entropy: bool) -> TokenScores:
        scores, _ = response_scores(model, [batch.prompts[row] for row in rows],
                                    [batch.responses[row] for row in rows], pad_id=pad_id, device=device,
                                    temperature=temperature, entropy=entropy)
        return scores
    return forward


def score_texts(rewards: Sequence[WeightedReward], texts: Sequence[str], tasks: Sequence[Task | str]
                ) -> tuple[list[float], dict[str, float]]:
    """Totals per response (each to its task: `tasks[i]` is the task `texts[i]` answers), and each
    reward's mean as a metric `reward/<name>`."""
    totals, sums = [], {r.name: 0.0 for r in rewards}
    for text, task in zip(texts, tasks):
        total, scores = score_all(rewards, text, task)
        totals.append(total)
        for name, value in scores.items():
            sums[name] += value
    n = max(len(totals), 1)
    return totals, {f"reward/{name}": value / n for name, value in sums.items()}


def check_weights(member: str, own: Mapping[str, Tensor], received: Mapping[str, Tensor], version: int,
                  held: int) -> None:
    """Raise `WeightsMismatch` naming every missing, unexpected or mis-shaped tensor."""
    problems = [f"missing {name}" for name in own if name not in received]
    problems += [f"unexpected {name}" for name in received if name not in own]
    for name, tensor in received.items():
        mine = own.get(name)
        if mine is not None and (tensor.shape != mine.shape or tensor.dtype != mine.dtype):
            problems.append(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, "
                            f"expected {mine.dtype} {tuple(mine.shape)}")
    if problems:
        raise WeightsMismatch(f"{member}: weights for version {version} do not match the model "
                              f"(kept version {held}): " + "; ".join(problems))


def load_trained_model(config: HFModelConfig, path: Path):
    """The model as the job trains it: the base model, wrapped with a fresh adapter under `model.lora`."""
    model = load_model(config, path)
    if config.lora is None:
        return model
    if config.gradient_checkpointing:
        model.enable_input_require_grads()  # the frozen embeddings' output must carry grad for checkpointing
    return wrap_with_lora(model, config.lora, seed=config.seed)


def sent_tensors(model: torch.nn.Module, config: HFModelConfig, *, keep_vars: bool = False) -> dict[str, Tensor]:
    """What the trainer trains, checkpoints and sends: every weight, or under `model.lora` only the
    adapter's tensors (the base model is frozen and every explorer loads it from `model.path`)."""
    if config.lora is None:
        return flat_weights(model, keep_vars=keep_vars)
    return adapter_tensors(model, keep_vars=keep_vars)


class AdapterDisabled:
    """The base model under a LoRA model, callable like a model: the KL anchor costs no copy."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, **inputs):
        with self.model.disable_adapter():
            return self.model(**inputs)


class HFTrainEngine(StageTraining):
    """Trainer side of the `hf` engine."""

    def __init__(self, config: HFModelConfig, algorithm: AlgorithmConfig, *, model_path: Path,
                 expert: Any = None, keep_reference: bool = False) -> None:
        self.config = config
        self.algorithm_config = algorithm
        torch.manual_seed(config.seed)
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_trained_model(config, model_path)
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)
        self.algorithm = VerlAlgorithm(algorithm, group_size=config.group_size)
        self.update = TrainStep(model=self.model, optimizer=self.optimizer,
                                forward=model_forward(self.pad_id, config.device, config.temperature),
                                max_grad_norm=config.max_grad_norm, minibatches=config.minibatches,
                                micro_batch_size=config.micro_batch_size, correction=self.algorithm.correction(),
                                micro_batch_tokens=config.micro_batch_tokens)
        self.loss_fn = self.algorithm.loss_function()
        self.expert = mixed_batches(expert, self.tokenizer, rl_loss=self.loss_fn) if expert is not None else None
        self.group_size = config.group_size
        self.vocab_size = int(self.model.config.vocab_size)
        self.num_parameters = parameter_count(self.model)
        self.trainable_parameters = sum(p.numel() for p in trained)
        # what a sync of every weight moves (the tied head under both names), beside what is sent
        self.full_model_bytes = sum(t.numel() * t.element_size() for n, t in flat_weights(self.model).items()
                                    if "lora_" not in n)
        # What a batch must fit before it reaches the model (bus.experiences.validate_batch): ids in
        # the vocabulary, responses no longer than the rollouts generate, whole groups.
        self.experience_limits = ExperienceLimits(
            vocab_size=self.vocab_size, prompt_length=None, max_response_length=config.max_new_tokens,
            group_size=config.group_size)
        self.updates_skipped_nonfinite = 0
        self.step = 0
        if config.init_from:
            self.load_weights_from(Path(config.init_from))
        # the KL anchor (`algorithm.kl_coef`) or a stage's reference (DPO: `keep_reference`)
        self.reference = self.update.reference = (self._frozen_reference() if algorithm.kl_coef > 0 or keep_reference
                                                  else None)

    def _frozen_reference(self) -> Any:
        """The frozen model a loss that `needs_reference` compares with: the weights the engine starts
        from (after `model.init_from`). Under `model.lora` with a fresh adapter, the base with the
        adapter disabled (the adapter adds nothing yet, so that is the start, and costs no copy);
        else a frozen copy (the model's weights in memory once more)."""
        if self.config.lora is not None and not self.config.init_from:
            return AdapterDisabled(self.model)
        return copy.deepcopy(self.model).eval().requires_grad_(False)

    def model_figures(self) -> dict[str, float]:
        return {"model_parameters": float(self.num_parameters),
                "trainable_parameters": float(self.trainable_parameters),
                "full_model_bytes": float(self.full_model_bytes)}

    def load_weights_from(self, path: Path) -> None:
        """The trained weights of another job's `hf` checkpoint (`model.init_from`): weights only."""
        step_dir = checkpoint_step_dir(path)
        if not (step_dir / _MODEL_FILE).is_file():
            raise ValueError(f"model.init_from {path}: {step_dir} is not an hf engine checkpoint (no {_MODEL_FILE}); "
                             "start from the fsdp engine's checkpoints with engine: fsdp, or from a Hugging Face "
                             "export as model.path")
        saved = load_file(step_dir / _MODEL_FILE)
        live = self._sent(keep_vars=True)
        check_weights("trainer", live, saved, 0, self.step)
        with torch.no_grad():
            for name, tensor in saved.items():
                live[name].copy_(tensor)

    def weights(self) -> dict[str, Tensor]:
        # Copies on CPU: a transport may still be serialising while the next step runs; tied weights
        # are copied under each of their names (the receiver needs lm_head.weight).
        return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in self._sent().items()}

    def iter_weight_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[NamedTensors]:
        """`weights()` in buckets, each tensor copied only when its bucket is cut."""
        named = ((name, t.detach().to("cpu", copy=True).contiguous()) for name, t in self._sent().items())
        return buckets_of(named, bucket_bytes)

    def _sent(self, *, keep_vars: bool = False) -> dict[str, Tensor]:
        return sent_tensors(self.model, self.config, keep_vars=keep_vars)

    def save_hf_model(self, path: Path) -> None:
        """A Hugging Face export at `path`: the `save_pretrained` model and its tokenizer; under
        `model.lora` the adapter in peft's format instead (with the tokenizer), and with
        `merge_on_save` the merged model in `path/merged`. Written beside and renamed into place."""
        with atomic_directory(path) as tmp:
            if self.config.lora is None:
                self.model.save_pretrained(tmp)
            else:
                save_adapter(self.model, tmp)
                if self.config.lora.merge_on_save:
                    save_merged(self.model, tmp / "merged")
                    self.tokenizer.save_pretrained(tmp / "merged")
            self.tokenizer.save_pretrained(tmp)

    def save_checkpoint(self, path: Path) -> None:
        """Three files under `path`; the JSON, written last, marks a complete checkpoint."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        optimizer_state = self.optimizer.state_dict()
        state_tensors: dict[str, Tensor] = {"rng.torch_cpu": torch.get_rng_state()}
        if self.config.device.startswith("cuda"):
            state_tensors["rng.torch_cuda"] = torch.cuda.get_rng_state(torch.device(self.config.device))
        scalars: dict[str, dict[str, Any]] = {}
        for index, param_state in optimizer_state["state"].items():
            for key, value in param_state.items():
                if isinstance(value, Tensor):
                    state_tensors[f"optimizer.{index}.{key}"] = value.detach().to("cpu", copy=True).contiguous()
                else:
                    scalars.setdefault(str(index), {})[key] = value
        state_json = {"step": self.step, "model": self.config.model_dump(mode="json"),
                      "optimizer_param_groups": optimizer_state["param_groups"], "optimizer_scalars": scalars,
                      "scheduler": self.scheduler_state()}
        _atomic_write(path / _MODEL_FILE, lambda tmp: save_file(self.weights(), tmp))
        _atomic_write(path / _STATE_TENSORS_FILE, lambda tmp: save_file(state_tensors, tmp))
        _atomic_write(path / _STATE_JSON_FILE, lambda tmp: Path(tmp).write_text(json.dumps(state_json, indent=1)))

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        state_json = json.loads((path / _STATE_JSON_FILE).read_text())
        saved = load_file(path / _MODEL_FILE)
        live = self._sent(keep_vars=True)
        check_weights("trainer", live, saved, int(state_json["step"]), self.step)
        with torch.no_grad():
            for name, tensor in saved.items():
                live[name].copy_(tensor)
        state_tensors = load_file(path / _STATE_TENSORS_FILE)
        optimizer_state: dict[int, dict[str, Any]] = {}
        for name, tensor in state_tensors.items():
            if name.startswith("optimizer."):
                _, index, key = name.split(".", 2)
                optimizer_state.setdefault(int(index), {})[key] = tensor.to(self.config.device)
        for index, values in state_json["optimizer_scalars"].items():
            optimizer_state.setdefault(int(index), {}).update(values)
        param_groups = [
            {key: tuple(value) if isinstance(current.get(key), tuple) else value for key, value in group.items()}
            for group, current in zip(state_json["optimizer_param_groups"], self.optimizer.param_groups)
        ]
        self.optimizer.load_state_dict({"state": optimizer_state, "param_groups": param_groups})
        torch.set_rng_state(state_tensors["rng.torch_cpu"])
        if "rng.torch_cuda" in state_tensors and self.config.device.startswith("cuda"):
            torch.cuda.set_rng_state(state_tensors["rng.torch_cuda"], torch.device(self.config.device))
        self.load_scheduler_state(state_json.get("scheduler"))
        self.step = int(state_json["step"])


def checkpoint_step_dir(path: Path) -> Path:
    """One checkpoint of a trainer: `path` itself (a `step-N` directory), or the last one a trainer's
    checkpoint directory names (its `trainer_state.json`)."""
    path = Path(path)
    state = path / "trainer_state.json"
    if state.is_file():
        return path / json.loads(state.read_text())["checkpoint"]
    if (path / _STATE_JSON_FILE).is_file():
        return path
    raise ValueError(f"model.init_from {path}: not a trainer checkpoint (neither trainer_state.json nor "
                     f"{_STATE_JSON_FILE} there); name a job's `<run_dir>/<job>/trainer` or one `step-N` in it")


class HFRolloutEngine:
    """Explorer side of the `hf` engine: `generate` with the weights it was last sent."""

    def __init__(self, config: HFModelConfig, rewards: Sequence[WeightedReward], *, member: str,
                 model_path: Path) -> None:
        self.config = config
        self.member = member
        self.rewards = tuple(rewards)
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_trained_model(config, model_path).eval().requires_grad_(False)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_id = self.tokenizer.eos_token_id
        self.group_size = config.group_size
        self.num_parameters = parameter_count(self.model)
        self.rollout_metrics: dict[str, float] = {}
        self.response_bound = config.max_new_tokens  # an agent's default token budget
        self.sampling_seed = config.seed
        self.version = 0

    def weight_buffers(self) -> dict[str, Tensor]:
        return sent_tensors(self.model, self.config, keep_vars=True)

    def load_weights(self, tensors: Mapping[str, Tensor], version: int) -> None:
        buffers = self.weight_buffers()
        check_weights(self.member, buffers, tensors, version, self.version)
        with torch.no_grad():
            for name, own in buffers.items():
                if tensors[name].data_ptr() != own.data_ptr():  # else it was received in place
                    own.copy_(tensors[name])
        self.version = version

    @torch.no_grad()
    def _sample(self, prompt: Sequence[int], seed: int,
                pause_point: PausePoint | None = None) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """The group's responses, their logprobs and the version that sampled each token.

        Without a pause it is one `generate`. With `pause_point`, generation stops at the first token
        boundary where a newer version waits; the version is loaded and the unfinished rows go on
        from prompt + the tokens they have (re-encoded by the new weights), with what is left of
        `max_new_tokens` and a seed of their own (`seed + segment`)."""
        rows: list[list[int]] = [[] for _ in range(self.group_size)]
        logprobs: list[list[float]] = [[] for _ in range(self.group_size)]
        versions: list[list[int]] = [[] for _ in range(self.group_size)]
        active, segment = list(range(self.group_size)), 0
        while active:
            left = self.config.max_new_tokens - len(rows[active[0]])  # unfinished rows are as long
            if left <= 0:
                break
            new_tokens, picked = self._generate(
                [[*prompt, *rows[r]] for r in active], left, (seed + segment) % 2**32,
                stop_when=pause_point.pending if pause_point is not None else None)
            still = []
            for i, r in enumerate(active):
                ids = new_tokens[i]
                n = ids.index(self.eos_id) + 1 if self.eos_id in ids else len(ids)
                rows[r] += ids[:n]
                logprobs[r] += picked[i][:n]
                versions[r] += [self.version] * n
                if self.eos_id not in ids:
                    still.append(r)
            active, segment = still, segment + 1
            if active and pause_point is not None and pause_point.pending():
                pause_point.load()  # the pause: the unfinished rows go on with the new weights
        return rows, logprobs, versions

    def _generate(self, inputs: list[list[int]], max_new_tokens: int, seed: int,
                  stop_when) -> tuple[list[list[int]], list[list[float]]]:
        """One `generate` over equal-length rows: the new tokens and their (processed) logprobs;
        `stop_when()` true at a token boundary stops every row there."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        class _Pause(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), bool(stop_when()), dtype=torch.bool,
                                  device=input_ids.device)

        device = self.config.device
        input_ids = torch.tensor(inputs, dtype=torch.long, device=device)
        devices = [torch.device(device)] if device.startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                temperature=self.config.temperature, top_k=0, top_p=1.0,
                max_new_tokens=max_new_tokens, pad_token_id=self.pad_id, eos_token_id=self.eos_id,
                output_scores=True, return_dict_in_generate=True,
                stopping_criteria=StoppingCriteriaList([_Pause()] if stop_when is not None else []))
        new_tokens = out.sequences[:, input_ids.shape[1]:]
        # The processed scores are what was sampled from (temperature applied).
        scores = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)
        picked = scores.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        return new_tokens.tolist(), picked.tolist()

    @torch.no_grad()
    def generate_turns(self, sequences: Sequence[Sequence[int]], *, max_tokens: Sequence[int],
                       seeds: Sequence[int]) -> list[TurnOutput]:
        """One model turn per sequence (the agent loop's `TurnGenerator`): one `generate` over the batch,
        left-padded, sampling from a seed drawn from all of `seeds` (a replayed batch samples the
        same turns); each row cut at its own limit or its end-of-turn token."""
        if not sequences:
            return []
        device = self.config.device
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, width - len(sequence):] = torch.tensor(list(sequence), dtype=torch.long)
            attention[row, width - len(sequence):] = 1
        devices = [torch.device(device)] if device.startswith("cuda") else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(zlib.crc32(",".join(map(str, seeds)).encode()))
            out = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), do_sample=True,
                temperature=self.config.temperature, top_k=0, top_p=1.0, max_new_tokens=max(max_tokens),
                pad_token_id=self.pad_id, eos_token_id=self.eos_id, output_scores=True, return_dict_in_generate=True)
        new_tokens = out.sequences[:, width:]
        # the processed scores are what was sampled from (temperature applied), as in `_sample`
        logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)
        picked = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        turns = []
        for row, limit in enumerate(max_tokens):
            ids = new_tokens[row, :limit].tolist()
            finished = self.eos_id in ids
            n = ids.index(self.eos_id) + 1 if finished else len(ids)
            turns.append(TurnOutput(tokens=tuple(ids[:n]), logprobs=tuple(picked[row, :n].tolist()),
                                    version=self.version, finished=finished))
        return turns

    def agent_renderer(self) -> ChatTemplateRenderer:
        """An agent's episodes rendered with the model's chat template."""
        return ChatTemplateRenderer(self.tokenizer)

    def rollout(self, tasks: Sequence[Task], *, explore_step: int,
                pause_point: PausePoint | None = None) -> list[Experience]:
        experiences, texts, scored = [], [], []
        for task_idx, task in enumerate(tasks):
            seed = task_seed(self.config.seed, self.member, explore_step, task_idx)
            responses, logprobs, versions = self._sample(task.prompt, seed, pause_point)
            group = f"{self.member}-{explore_step}-{task_idx}"
            for k, (response, lp, vs) in enumerate(zip(responses, logprobs, versions)):
                texts.append(self.tokenizer.decode(response, skip_special_tokens=True))
                scored.append(task)
                experiences.append((group, k, task.prompt, response, lp, vs))
            if pause_point is not None and pause_point.pending():
                pause_point.load()  # between two tasks' groups: the next group starts with it
        totals, self.rollout_metrics = score_texts(self.rewards, texts, scored)
        return [Experience(id=f"{group}-{k}", group=group, prompt=tuple(prompt), response=tuple(response),
                           logprobs=tuple(lp), reward=reward, model_version=min(vs, default=self.version),
                           token_versions=version_runs(vs))
                for (group, k, prompt, response, lp, vs), reward in zip(experiences, totals)]


    @torch.no_grad()
    def generate(self, tasks: Sequence[Task], *, temperature: float, samples: int, seed: int) -> list[list[str]]:
        """`samples` decoded responses per task, for evaluation: greedy at temperature 0."""
        device = self.config.device
        devices = [torch.device(device)] if device.startswith("cuda") else []
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
            else dict(do_sample=False)
        out = []
        for task_idx, task in enumerate(tasks):
            input_ids = torch.tensor([list(task.prompt)] * samples, dtype=torch.long, device=device)
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed((seed * 1_000_003 + task_idx) % 2**63)
                sequences = self.model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **sampling,
                    max_new_tokens=self.config.max_new_tokens, pad_token_id=self.pad_id, eos_token_id=self.eos_id)
            out.append([self.tokenizer.decode(row[input_ids.shape[1]:].tolist(), skip_special_tokens=True)
                        for row in sequences])
        return out


def _atomic_write(final: Path, write) -> None:
    with atomic_path(final) as tmp:
        write(str(tmp))
