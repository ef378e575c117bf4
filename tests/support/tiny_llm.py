"""Helpers of the hf / vllm engine tests: the quickstart's tiny random-init model, built once per session
from examples/data (nothing is downloaded), and the engine sections that point at it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "reverse_digits.jsonl"
BUILD = {"family": "qwen2", "hidden_size": 64, "num_layers": 2, "num_heads": 2, "head_dim": 32,
         "intermediate_size": 128, "seed": 0}


def model_section(path: Path, **overrides: Any) -> dict[str, Any]:
    return {"engine": "hf", "path": str(path), "build": BUILD, "group_size": 4, "max_new_tokens": 5,
            "lr": 3e-3, "minibatches": 2, "micro_batch_size": 16, **overrides}


def data_section(**overrides: Any) -> dict[str, Any]:
    return {"path": str(DATA), "rewards": [{"name": "positional_match"}, {"name": "exact_match", "weight": 0}],
            **overrides}


def built_model(directory: Path) -> Path:
    """The tiny Qwen2 and its word-level tokenizer under `directory/model` (built on first use)."""
    from rolectl.roles.engines.hf_model import HFModelConfig, ensure_model

    section = model_section(directory / "model")
    section.pop("engine")
    return ensure_model(HFModelConfig.model_validate(section), data_path=str(DATA))
