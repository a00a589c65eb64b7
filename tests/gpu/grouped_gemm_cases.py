"""What the grouped-GEMM kernel tests share: the segment bounds of a case, NaN-poisoned
outputs, and the bound against PyTorch's own bf16 error."""

from __future__ import annotations

import torch

from mok.testing import within_bf16_bound


def segments(sizes):
    """([(first row, end row)] of each expert's segment, rows in all) of segment sizes."""
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds, start


def poisoned(rows, cols):
    """A bf16 CUDA output filled with NaN: a row the kernel should write and did not shows."""
    return torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device="cuda")


def check_bound(what, got, truth, bf16):
    """`got` within 2x PyTorch's bf16 error (`bf16`) of the fp64 `truth`."""
    ok, err, base = within_bf16_bound(got, truth, bf16)
    assert ok, f"{what}: error {err:.3e} > 2 x PyTorch bf16 error {base:.3e}"
