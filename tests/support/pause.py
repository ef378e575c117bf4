"""A `PausePoint` for engine tests: a new version pending after a chosen number of token boundaries."""

from __future__ import annotations

import torch


class PauseAfter:
    """A `PausePoint` whose new version is pending once the engine has asked `after` times (its
    `after`-th token boundary), and loads `tensors` as `version` into `engine`."""

    def __init__(self, engine, tensors, version: int, *, after: int):
        self.engine, self.tensors, self.version, self.after = engine, tensors, version, after
        self.asked = 0
        self.loads = 0

    def pending(self) -> bool:
        self.asked += 1
        return self.loads == 0 and self.asked > self.after

    def load(self) -> None:
        self.engine.load_weights(self.tensors, self.version)
        self.loads += 1


def changed_weights(engine, seed: int = 1) -> dict[str, torch.Tensor]:
    """The engine's weights moved far enough that sampling with them differs (a trained version)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: t.detach() + 0.5 * torch.randn(t.shape, generator=generator).to(t.dtype)
            for name, t in engine.weight_buffers().items()}
