"""Argument checks shared by the launchers: one place for the rules a kernel argument obeys (a
torch.Tensor of the expected dtype and shape, contiguous; for the GEMMs also on CUDA and 16-byte
aligned, as TMA needs), so each launcher raises the same clear error."""

from __future__ import annotations

import torch


def check_arg(
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    *,
    cuda: bool,
    align: int = 16,
) -> None:
    """Raise TypeError / ValueError naming `name`, the expectation and what was given.

    `cuda`: the tensor must also live on a CUDA device and be 16-byte aligned (the GEMM
    launchers encode TMA descriptors from it); the epilogue and dispatch launchers, whose
    argument packing is tested on CPU, pass False (their router-weight arguments may be views
    that are only 4-byte aligned, which their scalar loads accept). `align`: the byte
    alignment a CUDA tensor needs (4 for one a kernel reads as scalars).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    where = "CUDA " if cuda else ""
    if (
        tensor.dtype != dtype
        or tuple(tensor.shape) != tuple(shape)
        or not tensor.is_contiguous()
        or (cuda and not tensor.is_cuda)
    ):
        raise ValueError(
            f"{name} must be a contiguous {where}{dtype} tensor of shape {list(shape)}, got "
            f"{tensor.dtype} {list(tensor.shape)} on {tensor.device} "
            f"(contiguous={tensor.is_contiguous()})"
        )
    if cuda and tensor.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned, got address {tensor.data_ptr():#x}")


def check_multiple(name: str, value: int, multiple: int) -> None:
    if value <= 0 or value % multiple:
        raise ValueError(f"{name} must be a positive multiple of {multiple}, got {value}")
