"""Host memory for weights: huge-page receive buffers, the pull transports' spare, pinned staging.

Where weights land or are packed on the host costs as much as the wire at model sizes, so the
three kinds of buffer live together:

- `host_buffer`: what a receiver allocates for a fetch. Fresh memory faults in one page per 4 KiB
  the first time it is written, a large part of a whole fetch; from `_HUGE_PAGE_MIN` on it is
  advised into 2 MiB huge pages (figures: docs/weights-at-size.md).
- `SpareBuffer`: a pull transport's one buffer kept from the last fetch, so the next fetch of that
  size writes memory that is already mapped instead of faulting in fresh pages.
- `PinnedStaging`: the torch.distributed transport packs buckets on CPU (gloo) into one buffer
  reused across versions. Keeping it from one version to the next avoids paying for the allocation
  (and, pinned, for `cudaHostAlloc`, slow and fragmenting host memory) on every round. Without CUDA
  it is ordinary pageable memory (CPU CI).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .format import Destination

__all__ = ["PinnedStaging", "SpareBuffer", "host_buffer"]

_HUGE = 2 * 1024 * 1024
_HUGE_PAGE_MIN = 32 * 1024 * 1024
_MADV_HUGEPAGE = 14


def _madvise_huge() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _madvise_huge()


def _empty_huge(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor whose pages fault in as 2 MiB huge pages where the kernel allows.

    A fresh buffer costs one page fault per 4 KiB the first time it is written, a large part of a
    whole fetch; MADV_HUGEPAGE (THP in "madvise" mode) cuts the faults 512-fold. Best effort:
    without THP this is a plain allocation plus 2 MiB of slack.
    """
    if _madvise is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % _HUGE
    flat = raw[offset : offset + nbytes]
    _madvise(flat.data_ptr(), nbytes - nbytes % _HUGE, _MADV_HUGEPAGE)  # advice only: errors ignored
    return flat


def host_buffer(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised flat uint8 host buffer as a receiver allocates one: pinned if asked, else
    huge-page backed from `_HUGE_PAGE_MIN` on (a copy into touched huge pages also runs about twice
    as fast as into 4 KiB ones: fewer TLB misses)."""
    if pin_memory or nbytes < _HUGE_PAGE_MIN:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory)
    return _empty_huge(nbytes)


class SpareBuffer:
    """A pull transport's one spare flat buffer: the next fetch of the same size lands in it instead
    of fresh memory. Writing fresh memory faults in every page, several times slower than a copy
    into mapped memory (docs/weights-at-size.md), and a CUDA fetch's pinned staging buffer costs a
    pinned allocation each time.

    A buffer becomes spare only when nobody else can see it: a fetch onto another device copied
    out of it (`hand_out` keeps it), or the receiver of a CPU fetch said it is done with the tensors
    (`give_back`, after copying them into its model)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        # The last CPU fetch's buffer: its storage (data_ptr, nbytes), and where the flat view starts
        # in it (a huge-page-aligned buffer is a view into a larger allocation) and how long it is.
        self._handed_out: tuple[int, int, int, int] | None = None

    def take(self, nbytes: int, *, pin_memory: bool) -> torch.Tensor | None:
        """The spare, if it fits `nbytes` (it is dropped either way: one fetch at a time uses it)."""
        flat, self._flat = self._flat, None
        if flat is not None and flat.numel() == nbytes and flat.is_pinned() == pin_memory:
            return flat
        return None

    def hand_out(self, dest: Destination, device: str | torch.device, *, reusable: bool) -> dict[str, torch.Tensor]:
        """`dest.tensors(device)`, noting what may become spare (nothing unless `reusable`)."""
        tensors = dest.tensors(device)
        self._handed_out = None
        if reusable and dest.layout.nbytes:
            if torch.device(device).type == "cpu":  # the caller holds views of it until give_back
                storage = dest.flat.untyped_storage()
                offset = dest.flat.data_ptr() - storage.data_ptr()
                self._handed_out = (storage.data_ptr(), storage.nbytes(), offset, dest.layout.nbytes)
            else:  # copied onto the device: the buffer is ours again
                self._flat = dest.flat
        return tensors

    def give_back(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Keep the buffer behind `tensors`, the last CPU fetch's, which its caller will not use
        again; False (nothing kept) for tensors of any other memory."""
        if self._handed_out is None or not tensors:
            return False
        ptr, storage_nbytes, offset, nbytes = self._handed_out
        storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
        storage = next(iter(tensors.values())).untyped_storage()
        if storages != {ptr} or storage.nbytes() != storage_nbytes:
            return False
        self._handed_out = None
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)  # the whole allocation, as bytes
        self._flat = whole[offset : offset + nbytes]
        return True


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
