"""LoRA adapters through peft for the `hf` / `vllm` engines (`model.lora`): wrap a model, name its
adapter tensors, save them in peft's format.

Only the adapter moves: `adapter_tensors(model)` are the trainable tensors under the names peft
saves them with (`get_peft_model_state_dict`: `base_model.model.<module>.lora_A.weight`), so what a
transport ships, an explorer loads and `adapter_model.safetensors` holds are one mapping. Both sides
wrap the same base model with the same seed, so version 0 is the same adapter everywhere (B = 0: the
base model's outputs).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .sections import LoRASection

__all__ = ["ADAPTER_NAME", "lora_config", "wrap_with_lora", "adapter_tensors", "save_adapter", "save_merged"]

ADAPTER_NAME = "default"


def lora_config(section: LoRASection):
    """peft's `LoraConfig` for a `model.lora` section."""
    from peft import LoraConfig, TaskType

    targets: Any = section.target_modules if isinstance(section.target_modules, str) else list(section.target_modules)
    return LoraConfig(r=section.rank, lora_alpha=section.alpha, lora_dropout=section.dropout,
                      target_modules=targets, bias="none", task_type=TaskType.CAUSAL_LM)


def wrap_with_lora(model: torch.nn.Module, section: LoRASection, *, seed: int):
    """`model` with a fresh adapter (A seeded by `seed`, B zero), its base frozen.

    Seeded apart from the caller's RNG stream: trainer and explorers build bit-identical adapters.
    """
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, lora_config(section), adapter_name=ADAPTER_NAME)
        except ValueError as exc:  # peft names the modules it did not find
            raise ValueError(f"model.lora.target_modules {section.target_modules!r}: {exc}") from exc


def adapter_tensors(model: torch.nn.Module, *, keep_vars: bool = False) -> dict[str, Tensor]:
    """The adapter's tensors by the names peft saves them under; `keep_vars=True` gives the live
    parameters (for in-place receives and checkpoint loads), otherwise detached views."""
    marker = f".{ADAPTER_NAME}."
    out = {}
    for name, param in model.named_parameters():
        if "lora_" in name and marker in name:
            out[name.replace(marker, ".")] = param if keep_vars else param.detach()
    return out


def save_adapter(model: torch.nn.Module, path: Path, *, tensors: dict[str, Tensor] | None = None) -> None:
    """A peft adapter directory at `path` (`adapter_config.json`, `adapter_model.safetensors`),
    loadable with `PeftModel.from_pretrained(base, path)` or as a vLLM `LoRARequest`. `tensors`
    (default: the model's own) are written under the adapter's names."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    own = adapter_tensors(model)
    tensors = own if tensors is None else tensors
    save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
              str(path / "adapter_model.safetensors"))
    model.peft_config[ADAPTER_NAME].save_pretrained(str(path))  # target modules resolved to names


def save_merged(model: torch.nn.Module, path: Path) -> None:
    """The base model with the adapter merged in, as a `save_pretrained` directory at `path`.
    Merged in a copy: the live model keeps training its unmerged adapter."""
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(path)
