"""Bit-exact comparison of named tensors, the way the weight tests check a transfer."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes as stored, whatever its dtype (bf16 included)."""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_bit_exact(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> None:
    """The same names, and under each the same dtype, shape and bytes."""
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for name, t in expected.items():
        assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape), name
        assert raw_bytes(got[name]) == raw_bytes(t), name
