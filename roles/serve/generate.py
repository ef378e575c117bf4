"""One served completion from an `hf` rollout engine: sample at the policy's temperature, hand each
new token to a callback (streaming), return the tokens and their sampling logprobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Generated", "generate", "prompt_limit"]


@dataclass(frozen=True, slots=True)
class Generated:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (end of sequence) or "length" (max_tokens reached)
    version: int


class _TokenStreamer:
    """transformers' streamer protocol: `put` gets the prompt once, then each step's new token."""

    def __init__(self, on_token: Callable[[int], None]) -> None:
        self.on_token = on_token
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.on_token(int(token))

    def end(self) -> None:
        pass


def prompt_limit(engine: Any) -> int:
    """The longest prompt the model takes with room left for a full response."""
    positions = getattr(engine.model.config, "max_position_embeddings", None) or 1 << 30
    return int(positions) - int(engine.config.max_new_tokens)


@torch.no_grad()
def generate(engine: Any, prompt: Sequence[int], *, max_tokens: int, seed: int,
             on_token: Callable[[int], None] | None = None) -> Generated:
    """Sample one response to `prompt` with the engine's current weights (caller holds its lock)."""
    device = engine.config.device
    input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    devices = [torch.device(device)] if device.startswith("cuda") else []
    streamer = _TokenStreamer(on_token) if on_token is not None else None
    version = engine.version
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = engine.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
            temperature=engine.config.temperature, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
            pad_token_id=engine.pad_id, eos_token_id=engine.eos_id, output_scores=True,
            return_dict_in_generate=True, streamer=streamer)
    new = out.sequences[0, input_ids.shape[1]:]
    # the processed scores are what was sampled from (temperature applied), as in the explore loop
    logprobs = torch.stack([torch.log_softmax(s[0].float(), dim=-1) for s in out.scores])
    picked = logprobs.gather(-1, new[:len(out.scores)].unsqueeze(-1)).squeeze(-1).tolist()
    ids = new.tolist()
    stopped = engine.eos_id in ids
    n = ids.index(engine.eos_id) + 1 if stopped else len(ids)
    return Generated(tokens=tuple(ids[:n]), logprobs=tuple(picked[:n]),
                     finish_reason="stop" if stopped else "length", version=version)
