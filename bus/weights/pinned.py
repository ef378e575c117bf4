"""A host staging buffer reused across versions, pinned when CUDA is present.

The torch.distributed transport packs buckets on CPU (gloo) into it. Keeping one buffer from one
version to the next avoids paying for the allocation (and, pinned, for `cudaHostAlloc`, slow and
fragmenting host memory) on every round. Without CUDA it is ordinary pageable memory (CPU CI).
"""

from __future__ import annotations

import torch

__all__ = ["PinnedStaging"]


class PinnedStaging:
    """One host buffer, pinned when CUDA is present, grown on demand and reused across versions."""

    def __init__(self, *, pin: bool | None = None) -> None:
        # Pinning needs a CUDA context; without one it only costs memory, so the default follows CUDA.
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._buf: torch.Tensor | None = None

    @property
    def pinned(self) -> bool:
        return self._pin

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of `nbytes` at the start of the buffer, growing it (by ≥ 1/8) if needed."""
        if self._buf is None or self._buf.numel() < nbytes:
            # Grow with headroom so a slowly growing model does not re-pin on every version.
            size = max(nbytes, self.capacity + self.capacity // 8)
            self._buf = None  # free the old one first: pinned memory is a scarce resource
            self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        return self._buf[:nbytes]

    def close(self) -> None:
        """Release the buffer (views handed out before become invalid to use)."""
        self._buf = None
