"""Outputs compared bit for bit (the CPU and GPU tests that promise identical bits)."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor | None):
    """The tensor's bytes, None staying None (torch.equal would call -0.0 and 0.0 equal, and
    NaN unequal to itself)."""
    return None if t is None else t.contiguous().view(torch.uint8)


def assert_bitwise(got, want, what):
    """Outputs (tensors or Nones) of two runs: the same count, shapes, dtypes and bits."""
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, (what, i)
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape)
        assert torch.equal(bits(a), bits(b)), (what, i)
