"""The `fsdp` train engine: a Hugging Face causal LM sharded over N ranks with FSDP2, trained with verl's losses.

Every rank builds the same engine and calls the same methods in the same order (SPMD): `train_step`
gets the whole batch on every rank (the trainer's rank 0 receives it and broadcasts it) and runs the
one training step (`roles.engines.step`) on its slice of each minibatch's rows; gradients are summed
across ranks, so N ranks take the same optimizer step as the one-process `hf` engine on the same batch.

- Sharding: `fully_shard` (torch.distributed.fsdp, FSDP2) on each decoder layer (the model's
  `_no_split_modules`) and on the root, over a 1-D device mesh; gloo on CPU, NCCL on CUDA.
- Precision: parameters are kept in fp32 (the optimizer's master copy); on CUDA they are all-gathered
  as bf16 for compute and gradients reduced in fp32; on CPU everything is fp32.
- Weights leave as a stream: `iter_weight_buckets` gathers one parameter at a time
  (`DTensor.full_tensor()`, a collective every rank joins) into buckets, and only rank 0 keeps them.
- Checkpoints are `torch.distributed.checkpoint` (DCP) directories: each rank writes its shards of
  the model and the optimizer and its RNG state; rank 0 writes the scalars and the caller's
  bookkeeping as JSON. A checkpoint written by N ranks loads on M ranks.
- `save_hf_model` writes a `save_pretrained` directory from the stream: safetensors, config, tokenizer.
- LoRA (`model.lora`): every rank wraps the model with the same peft adapter before sharding (rank 0's
  seeded adapter is what every rank loads), the base stays frozen, the optimizer holds the adapter
  alone; only the adapter is streamed (peft's names, as the `hf` engine sends them), checkpointed
  (DCP without the frozen base: it is reloaded from `model.path`) and exported in peft's format. The
  KL anchor is the same sharded model with its adapter disabled: no second copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rolectl.bus.files import atomic_directory, atomic_path
from rolectl.sync_protocol.experience import Experience, ExperienceLimits

from .algorithms import AlgorithmConfig, VerlAlgorithm
from .hf import AdapterDisabled, checkpoint_step_dir, model_forward
from .hf_model import load_tokenizer
from .lora import ADAPTER_NAME, save_adapter, wrap_with_lora
from .losses import TrainBatch
from .sections import FSDPModelSection, LoRASection
from .sft import mixed_batches
from .step import StageTraining, TrainStep
from .streaming import DEFAULT_BUCKET_BYTES, NamedTensors, buckets_of

__all__ = ["FSDPTrainEngine"]

_STATE_JSON_FILE = "engine_state.json"
_DCP_DIR = "dcp"


def _join_process_group(device: str, timeout: timedelta) -> tuple[int, int, bool]:
    """(rank, world size, whether we created the group): an existing group, one from torchrun-style
    environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or a group of one."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    # CPU tensors (metrics, the weight stream's bookkeeping) travel over gloo even on GPUs.
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), True


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: those whose class the model names as not to be split."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (`_no_split_modules` is "
                         f"{sorted(names)}); the fsdp engine shards per decoder layer")
    return layers


def _experience_of(fields: dict[str, Any]) -> Experience:
    """An experience from its `dataclasses.asdict` as JSON gave it back (lists for tuples)."""
    mask, versions = fields["loss_mask"], fields["token_versions"]
    return Experience(**{**fields, "prompt": tuple(fields["prompt"]), "response": tuple(fields["response"]),
                         "logprobs": tuple(fields["logprobs"]),
                         "loss_mask": None if mask is None else tuple(mask),
                         "token_versions": None if versions is None else tuple(map(tuple, versions))})


class FSDPTrainEngine(StageTraining):
    """Trainer side of the `fsdp` engine; one instance per rank."""

    def __init__(self, config: FSDPModelSection, algorithm: AlgorithmConfig, *, model_path: Path,
                 expert: Any = None, keep_reference: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.config = config
        self.algorithm_config = algorithm
        self.rank, self.world_size, self._owns_group = _join_process_group(
            config.device, timedelta(seconds=config.fsdp.timeout_s))
        if config.device.startswith("cuda"):
            index = int(os.environ.get("LOCAL_RANK", "0")) if config.device == "cuda" else None
            self.device = torch.device("cuda", index) if index is not None else torch.device(config.device)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        torch.manual_seed(config.seed)
        self.model_path = Path(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.lora = config.lora
        self.model = self._sharded_model(trainable=True)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable_parameters = sum(p.numel() for p in trained)  # DTensors count their global size
        self.optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)
        self.algorithm = VerlAlgorithm(algorithm, group_size=config.group_size)
        # Each rank trains on its rows of each minibatch; gradients are summed across ranks (see
        # `_sharded_model`), so the step is the one-process step.
        self.update = TrainStep(model=self.model, optimizer=self.optimizer,
                                forward=model_forward(self.pad_id, str(self.device), config.temperature),
                                max_grad_norm=config.max_grad_norm, minibatches=config.minibatches,
                                micro_batch_size=config.micro_batch_size, rank=self.rank,
                                world_size=self.world_size, correction=self.algorithm.correction(),
                                micro_batch_tokens=config.micro_batch_tokens)
        self.loss_fn = self.algorithm.loss_function()
        self.expert = mixed_batches(expert, self.tokenizer, rl_loss=self.loss_fn) if expert is not None else None
        self.group_size = config.group_size
        self.vocab_size = int(self.model.config.vocab_size)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())  # DTensors count their global size
        state = self.model.state_dict(keep_vars=True)
        # What is streamed, by state-dict name: every tensor, or under LoRA the adapter's (peft's names)
        marker = f".{ADAPTER_NAME}."
        self._sent_names = {n: n.replace(marker, ".") for n in state
                            if self.lora is None or ("lora_" in n and marker in n)}
        itemsize = torch.empty(0, dtype=config.torch_dtype).element_size()
        # Full sizes as streamed, so every rank cuts the same buckets without gathering to measure.
        self._streamed_nbytes = {self._sent_names[n]: t.numel() * (itemsize if t.is_floating_point()
                                                                   else t.element_size())
                                 for n, t in state.items() if n in self._sent_names}
        # Names that alias an earlier name's tensor (a tied `lm_head.weight`): saved once in HF form.
        seen: set[int] = set()
        self._tied_names: set[str] = set()
        for name, tensor in state.items():
            if id(tensor) in seen:
                self._tied_names.add(name)
            seen.add(id(tensor))
        self.experience_limits = ExperienceLimits(
            vocab_size=self.vocab_size, prompt_length=None, max_response_length=config.max_new_tokens,
            group_size=config.group_size)
        self.updates_skipped_nonfinite = 0
        self.step = 0
        # what a sync of every weight moves at the streamed dtype (the tied head under both names)
        self.full_model_bytes = sum(t.numel() * (itemsize if t.is_floating_point() else t.element_size())
                                    for n, t in state.items() if "lora_" not in n)
        if config.init_from:
            self.load_weights_from(Path(config.init_from))
        # the KL anchor (`algorithm.kl_coef`) or a stage's reference (DPO: `keep_reference`)
        self.reference: Any = None
        if algorithm.kl_coef > 0 or keep_reference:
            self.reference = self.update.reference = self._frozen_reference()

    def _frozen_reference(self) -> Any:
        """The frozen model a loss that `needs_reference` compares with: the weights the engine starts
        from (after `model.init_from`). Under `model.lora` with a fresh adapter, the same sharded
        model with its adapter disabled (no copy); else a second sharded model, frozen: 1/N of the
        weights per rank, with no gradients or optimizer state."""
        from torch.distributed.tensor import DTensor

        if self.lora is not None and not self.config.init_from:
            return AdapterDisabled(self.model)
        reference = self._sharded_model(trainable=False, adapter=self.lora is not None)
        if self.config.init_from:  # the start is the checkpoint's weights: each rank copies its shards
            live = self.model.state_dict()
            with torch.no_grad():
                for name, tensor in reference.state_dict().items():
                    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                    local.copy_(live[name].to_local() if isinstance(live[name], DTensor) else live[name])
        return reference

    def _sharded_model(self, *, trainable: bool, adapter: bool | None = None):
        """The model at `model_path` sharded over the mesh: to train (gradients summed across ranks)
        or frozen; wrapped with `model.lora`'s adapter when `adapter` (default: when `trainable`)."""
        import transformers
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        # Every rank builds the model without memory (meta), shards it, then allocates its shard;
        # rank 0 alone reads the weights and sends each rank its part, so no other rank ever holds
        # the whole model.
        path = self.model_path
        model_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        if (path / "generation_config.json").is_file():
            model.generation_config = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
        if trainable and self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lora = self.config.lora if (trainable if adapter is None else adapter) else None
        if lora is not None:
            if trainable and self.config.gradient_checkpointing:
                model.enable_input_require_grads()  # the frozen embeddings' output must carry grad
            model = wrap_with_lora(model, lora, seed=self.config.seed)  # on meta: values from rank 0
        policy = MixedPrecisionPolicy(param_dtype=self.config.compute_dtype, reduce_dtype=torch.float32)
        reshard = self.config.fsdp.reshard_after_forward
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=self.mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=self.mesh, mp_policy=policy, reshard_after_forward=reshard)
        model.to_empty(device=self.device)
        full = None
        if self.rank == 0:
            full = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
            if lora is not None:  # the same seeded adapter the explorers build: version 0 everywhere
                full = wrap_with_lora(full, lora, seed=self.config.seed)
        set_model_state_dict(model, full.state_dict() if full is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        # Buffers outside the state dict (rotary frequencies) were computed at load on rank 0 only.
        own_buffers = dict(full.named_buffers()) if full is not None else {}
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if full is not None:
                    buffer.copy_(own_buffers[name])
                if self.world_size > 1:
                    dist.broadcast(buffer, src=0)
        del full, own_buffers
        if trainable:
            # The loss is normalised by the whole minibatch's tokens on every rank: sum the ranks'
            # gradients rather than average them, as one process would (a plain SUM: gloo has no
            # pre-multiplied sum).
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
            return model.train()
        return model.eval().requires_grad_(False)

    # -- training ----------------------------------------------------------------------------------

    def share_batch(self, experiences: Sequence[Experience] | None) -> list[Experience]:
        """Rank 0's `experiences` on every rank (a collective; the other ranks pass None): the rank
        that reads the bus hands each batch to its followers before they all call `train_step`.
        Sent as JSON bytes over the process group (no pickle)."""
        if self.rank == 0 and experiences is None:
            raise ValueError("share_batch: rank 0 must pass the batch")
        if self.world_size == 1:
            return list(experiences or ())
        payload = b""
        if self.rank == 0:
            payload = json.dumps([dataclasses.asdict(e) for e in experiences or ()]).encode()
        payload = self._broadcast_bytes(payload)
        if self.rank == 0:
            return list(experiences or ())
        return [_experience_of(e) for e in json.loads(payload)]

    def model_figures(self) -> dict[str, float]:
        return {"model_parameters": float(self.num_parameters),
                "trainable_parameters": float(self.trainable_parameters),
                "world_size": float(self.world_size), "full_model_bytes": float(self.full_model_bytes)}

    def share_train_batch(self, batch: TrainBatch | None) -> TrainBatch:
        """Rank 0's `batch` on every rank (a collective; the other ranks pass None): a stage's batch,
        as `share_batch` shares experiences. Its token lists as JSON, its tensors as safetensors
        bytes (no pickle)."""
        from safetensors.torch import load as load_tensors
        from safetensors.torch import save as save_tensors

        if self.rank == 0 and batch is None:
            raise ValueError("share_train_batch: rank 0 must pass the batch")
        if self.world_size == 1:
            assert batch is not None
            return batch
        header, tensors = b"", b""
        if self.rank == 0:
            fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(TrainBatch)}
            header = json.dumps({k: v for k, v in fields.items() if isinstance(v, tuple)}).encode()
            tensors = save_tensors({k: v.contiguous() for k, v in fields.items() if isinstance(v, Tensor)})
        header, tensors = self._broadcast_bytes(header), self._broadcast_bytes(tensors)
        if self.rank == 0:
            return batch
        lists = json.loads(header)
        return TrainBatch(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v) for k, v in lists.items()},
                          **load_tensors(tensors))

    def _broadcast_bytes(self, payload: bytes) -> bytes:
        """Rank 0's `payload` on every rank (the others pass anything)."""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0)
        buffer = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 and payload
                  else torch.empty(int(size), dtype=torch.uint8))
        if int(size):
            dist.broadcast(buffer, src=0)
        return payload if self.rank == 0 else buffer.numpy().tobytes()

    # -- weights out -------------------------------------------------------------------------------

    def _gathered(self, *, all_ranks: bool) -> Iterator[tuple[str, Tensor]]:
        """Each tensor of the state dict (tied weights under each name), gathered on demand, cast to
        the model's dtype, on CPU; ranks that do not keep it drop it at once."""
        from torch.distributed.tensor import DTensor

        dtype = self.config.torch_dtype
        keep = all_ranks or self.rank == 0
        for state_name, tensor in self.model.state_dict().items():
            name = self._sent_names.get(state_name)
            if name is None:
                continue  # the frozen base under an adapter: every explorer loads it from model.path
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if keep:
                # A gathered tensor is fresh memory, unless it is the live shard itself (one rank):
                # copy only what the next train step could change under the consumer.
                live = full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
                yield name, full.detach().to("cpu", dtype=dtype if full.is_floating_point() else full.dtype,
                                             copy=live).contiguous()
            else:
                yield name, full.new_empty(0)  # keeps every rank's bucket boundaries the same
            del full, local

    def iter_weight_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                            all_ranks: bool = False) -> Iterator[NamedTensors]:
        """The weights (the names and dtypes `HFTrainEngine.weights()` gives: under LoRA the
        adapter's) in buckets of about `bucket_bytes`, gathered from the shards one at a time.

        A collective: every rank must drive the iterator to its end. Rank 0 (every rank with
        `all_ranks`) gets the tensors; the others get the same number of buckets, empty.
        """
        keep = all_ranks or self.rank == 0
        # Sized by the full tensors on every rank, so all ranks cut the same buckets.
        for bucket in buckets_of(self._gathered(all_ranks=all_ranks), bucket_bytes,
                                 nbytes=lambda name, _: self._streamed_nbytes[name]):
            yield bucket if keep else []

    def weights(self) -> dict[str, Tensor]:
        """The whole model on every rank: for small models and tests; transports use the stream."""
        return {name: tensor for bucket in self.iter_weight_buckets(all_ranks=True) for name, tensor in bucket}

    def save_hf_model(self, path: Path, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """A `save_pretrained` directory at `path` (rank 0 writes; every rank must call): one
        safetensors file per bucket and their index, the config and the tokenizer. Under
        `model.lora` the adapter in peft's format instead (see `_save_adapter`)."""
        path = Path(path)
        if self.lora is not None:
            self._save_adapter(path, bucket_bytes, self.lora)
            return
        with contextlib.ExitStack() as stack:
            # rank 0 writes beside `path` and renames into place: never a half export, nor old files
            written = stack.enter_context(atomic_directory(path)) if self.rank == 0 else None
            self._save_full(written, bucket_bytes)
        self._barrier()

    def _save_full(self, path: Path | None, bucket_bytes: int) -> None:
        """Every weight as `save_pretrained` writes it, into `path` (rank 0; the others gather, None)."""
        from safetensors.torch import save_file

        index: dict[str, str] = {}
        total = 0
        for number, bucket in enumerate(self.iter_weight_buckets(bucket_bytes)):
            if path is None:
                continue
            file = f"model-{number + 1:05d}.safetensors"
            # Tied weights are saved once, as save_pretrained does; loading ties them again.
            tensors = {n: t for n, t in bucket if n not in self._tied_names}
            if not tensors:
                continue
            save_file(tensors, str(path / file), metadata={"format": "pt"})
            index.update({n: file for n in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        if path is not None:
            self.model.config.save_pretrained(path)
            generation = getattr(self.model, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
            index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}
            (path / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))

    def _save_adapter(self, path: Path, bucket_bytes: int, lora: LoRASection) -> None:
        """The adapter as a peft directory at `path` (adapter_model.safetensors, adapter_config.json)
        with the tokenizer, and with `merge_on_save` the merged model in `path/merged`. Rank 0
        writes, built beside and renamed into place; every rank gathers."""
        adapter = {name: tensor for bucket in self.iter_weight_buckets(bucket_bytes) for name, tensor in bucket}
        if self.rank == 0:
            with atomic_directory(path) as tmp:
                save_adapter(self.model, tmp, tensors=adapter)
                self.tokenizer.save_pretrained(tmp)
                if lora.merge_on_save:
                    self._save_merged(tmp / "merged", adapter, lora)
        self._barrier()

    def _save_merged(self, path: Path, adapter: dict[str, Tensor], lora: LoRASection) -> None:
        """Rank 0: the base model from `model.path` with `adapter` merged in, as `save_pretrained`
        writes it (the whole model in rank 0's memory once, as when the engine started)."""
        import transformers
        from peft import set_peft_model_state_dict

        base = transformers.AutoModelForCausalLM.from_pretrained(self.model_path, local_files_only=True,
                                                                 dtype=self.config.torch_dtype)
        model = wrap_with_lora(base, lora, seed=self.config.seed)
        set_peft_model_state_dict(model, adapter, adapter_name=ADAPTER_NAME)
        model.merge_and_unload().save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    # -- checkpoints -------------------------------------------------------------------------------

    def _state_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # Under an adapter the frozen base is not checkpointed (it is reloaded from model.path)
        adapter = self.lora is not None
        return StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=adapter, strict=not adapter)

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        if self.lora is not None:  # a tied head escapes ignore_frozen_params under its second name
            model_state = {k: v for k, v in model_state.items() if k in self._sent_names}
        return model_state, optimizer_state

    def save_checkpoint(self, path: Path, *, extra: Mapping[str, Any] | None = None) -> None:
        """A DCP directory under `path` (every rank writes its shards) and, last, rank 0's JSON of
        the step, the optimizer's scalars and `extra` (the caller's bookkeeping: data position,
        trained experiences; JSON-able). The JSON marks a complete checkpoint."""
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        model_state, optimizer_state = self._state_dicts()
        tensors = {f"model.{k}": v for k, v in model_state.items()}
        tensors.update({f"optimizer.{k}": v for k, v in optimizer_state.items() if isinstance(v, Tensor)})
        # Each rank's RNG under its own name: DCP keeps one copy of a replicated (plain) tensor.
        tensors[f"rng.{self.rank}.cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            tensors[f"rng.{self.rank}.cuda"] = torch.cuda.get_rng_state(self.device)
        scalars = {k: list(v) if isinstance(v, tuple) else v for k, v in optimizer_state.items()
                   if not isinstance(v, Tensor)}
        dcp.save(tensors, checkpoint_id=str(path / _DCP_DIR))
        if self.rank == 0:
            state = {"step": self.step, "world_size": self.world_size, "updates_skipped_nonfinite":
                     self.updates_skipped_nonfinite, "model": self.config.model_dump(),
                     "optimizer_scalars": scalars, "scheduler": self.scheduler_state(), "extra": dict(extra or {})}
            with atomic_path(path / _STATE_JSON_FILE) as tmp:
                Path(tmp).write_text(json.dumps(state, indent=1))
        self._barrier()

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore what `save_checkpoint(path)` wrote, on any number of ranks; returns its `extra`.

        Rank r takes the RNG state rank r saved (rank 0's when the checkpoint had fewer ranks).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = Path(path)
        state = json.loads((path / _STATE_JSON_FILE).read_text())
        model_state, optimizer_state = self._state_dicts()
        missing = [k for k in optimizer_state if not isinstance(optimizer_state[k], Tensor)
                   and k not in state["optimizer_scalars"]]
        if missing:
            raise ValueError(f"{path}: the checkpoint's optimizer settings lack {missing[:5]}: not a checkpoint "
                             "of this model and optimizer")
        source = self.rank if self.rank < int(state["world_size"]) else 0
        tensors = {f"model.{k}": v for k, v in model_state.items()}
        tensors.update({f"optimizer.{k}": v for k, v in optimizer_state.items() if isinstance(v, Tensor)})
        tensors[f"rng.{source}.cpu"] = torch.get_rng_state()
        cuda_rng = self.device.type == "cuda"
        if cuda_rng:
            tensors[f"rng.{source}.cuda"] = torch.cuda.get_rng_state(self.device)
        dcp.load(tensors, checkpoint_id=str(path / _DCP_DIR))
        model_state = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        optimizer_loaded: dict[str, Any] = {k[len("optimizer."):]: v for k, v in tensors.items()
                                            if k.startswith("optimizer.")}
        for key, value in state["optimizer_scalars"].items():
            current = optimizer_state.get(key)
            optimizer_loaded[key] = tuple(value) if isinstance(current, tuple) else value
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state,
                       optim_state_dict=optimizer_loaded, options=self._state_options())
        torch.set_rng_state(tensors[f"rng.{source}.cpu"])
        if cuda_rng:
            torch.cuda.set_rng_state(tensors[f"rng.{source}.cuda"], self.device)
        self.load_scheduler_state(state.get("scheduler"))
        self.step = int(state["step"])
        self.updates_skipped_nonfinite = int(state["updates_skipped_nonfinite"])
        return dict(state["extra"])

    def load_weights_from(self, path: Path) -> None:
        """The trained weights of another job's `fsdp` checkpoint (`model.init_from`), every rank its
        shards: weights only (the optimizer, schedule and step stay fresh)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        step_dir = checkpoint_step_dir(path)
        if not (step_dir / _DCP_DIR).is_dir():
            raise ValueError(f"model.init_from {path}: {step_dir} is not an fsdp engine checkpoint (no {_DCP_DIR}/); "
                             "start from the hf engine's checkpoints with engine: hf, or from a Hugging Face export "
                             "as model.path")
        model_state, _ = self._state_dicts()
        tensors = {f"model.{k}": v for k, v in model_state.items()}
        dcp.load(tensors, checkpoint_id=str(step_dir / _DCP_DIR))
        set_model_state_dict(self.model, {k[len("model."):]: v for k, v in tensors.items()},
                             options=self._state_options())

    # -- lifecycle ---------------------------------------------------------------------------------

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group if this engine created it (safe twice)."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

