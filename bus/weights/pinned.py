"""Pinned host staging reused across versions: GPU weights to bytes and back with one copy each way.

Pull transports (object store, checkpoint) need the weights as one run of host bytes. For GPU
tensors the one copy that cannot be avoided is device→host; doing it into *pinned* memory lets it
run at PCIe speed, and keeping that pinned buffer from one version to the next avoids paying for
`cudaHostAlloc` (slow, and it fragments host memory) on every publish. The same buffer serves the
way back: bytes land in pinned memory and go host→device into the engine's parameters.

`PinnedStaging` owns one growing host buffer; `stage()` fills it from tensors (any device),
`reserve()` lays a known layout out in it for bytes arriving from elsewhere. The returned
`StagedTensors` are *views* into the shared buffer: valid until the next `stage()`/`reserve()`.
Without CUDA the buffer is ordinary pageable memory and everything still works (CPU CI).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

__all__ = ["StagedEntry", "StagedTensors", "PinnedStaging", "layout_of"]

_ALIGN = 64  # every tensor starts on a cache line, so typed views and DMA stay aligned


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout_of(tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor, in mapping order."""
    return [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]


@dataclass(frozen=True, slots=True)
class StagedEntry:
    """Where one tensor's bytes sit in a staging buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class StagedTensors:
    """Tensors laid out in one host byte buffer (a view; valid until the staging is reused)."""

    flat: torch.Tensor  # uint8, 1-D, covers every entry
    entries: tuple[StagedEntry, ...]

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def memoryview(self) -> memoryview:
        """The staged bytes without a copy (for writers that take a buffer)."""
        return memoryview(self.flat.numpy()).cast("B")

    def tensor(self, entry: StagedEntry) -> torch.Tensor:
        """A typed view of one entry."""
        raw = self.flat[entry.offset : entry.offset + entry.nbytes]
        return raw.view(entry.dtype).view(entry.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Typed views of every entry, by name."""
        return {e.name: self.tensor(e) for e in self.entries}

    def copy_into(self, into: Mapping[str, torch.Tensor]) -> None:
        """Copy every entry into the same-named tensor of `into` (any device), in place.

        Host→device copies are issued non-blocking from pinned memory and waited for once at the
        end, so they overlap each other instead of syncing per tensor.
        """
        devices: set[torch.device] = set()
        with torch.no_grad():
            for entry in self.entries:
                dst = into[entry.name]
                dst.copy_(self.tensor(entry), non_blocking=dst.is_cuda)
                if dst.is_cuda:
                    devices.add(dst.device)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    def to_device(self, device: str | torch.device) -> dict[str, torch.Tensor]:
        """Fresh tensors on `device` holding the staged values (one copy each)."""
        device = torch.device(device)
        out = {e.name: torch.empty(e.shape, dtype=e.dtype, device=device) for e in self.entries}
        self.copy_into(out)
        return out


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

    def reserve(self, layout: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> StagedTensors:
        """Lay `layout` out in the buffer (contents undefined) to receive bytes from elsewhere."""
        entries: list[StagedEntry] = []
        offset = 0
        for name, dtype, shape in layout:
            shape = tuple(int(s) for s in shape)
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * dtype.itemsize
            entries.append(StagedEntry(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
            offset = _aligned(offset + nbytes)
        return StagedTensors(flat=self.buffer(offset), entries=tuple(entries))

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> StagedTensors:
        """Copy `tensors` (any device) into the buffer; return when every byte is on the host."""
        staged = self.reserve(layout_of(tensors))
        devices: set[torch.device] = set()
        with torch.no_grad():
            for entry in staged.entries:
                src = tensors[entry.name]
                # Non-blocking D2H into pinned memory; one sync per device at the end.
                staged.tensor(entry).copy_(src, non_blocking=src.is_cuda and self._pin)
                if src.is_cuda:
                    devices.add(src.device)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
        return staged

    def close(self) -> None:
        """Release the buffer (views handed out before become invalid to use)."""
        self._buf = None
