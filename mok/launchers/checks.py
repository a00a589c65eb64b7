"""Launcher argument checks: each rule once, each error naming argument, expectation and value."""

from __future__ import annotations

import torch

from ..errors import MoKInputError, MoKKernelUnavailableError
from ..validation import HIDDEN_ALIGNMENT
from .device_args import TILE_ROWS

# TMA coordinates are int32 and the kernels' coordinate tensors assume these extents.
MAX_ROWS = 1 << 30
MAX_COLS = 1 << 16
# Experts' weight rows start on the GEMMs' 128-row weight tiles.
EXPERT_ROW_ALIGNMENT = 128
# The kernels pack a routed row's (source rank, row) into one int32: rank * 2^24 + row
# (mok/dsl_kernels/common/peers.py).
MAX_EP_SIZE = 127
MAX_PACKED_ROWS = 1 << 24


def check_arg(
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    *,
    cuda: bool,
    align: int = 16,
    contiguous: bool = True,
) -> None:
    """Raise TypeError / ValueError naming `name`, the expectation and what was given.

    `cuda`: also on a CUDA device and 16-byte aligned (TMA descriptors are encoded from it); the
    CPU-tested epilogue and dispatch launchers pass False. `align`: the byte alignment a CUDA tensor
    needs (4 for scalar reads, e.g. router-weight views). `contiguous` False: any strides (the
    caller checks the layout, e.g. `expert_rows_view`).
    """
    if not isinstance(tensor, torch.Tensor):
        raise MoKInputError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    where = "CUDA " if cuda else ""
    layout = "contiguous " if contiguous else ""
    if (
        tensor.dtype != dtype
        or tuple(tensor.shape) != tuple(shape)
        or (contiguous and not tensor.is_contiguous())
        or (cuda and not tensor.is_cuda)
    ):
        raise ValueError(
            f"{name} must be a {layout}{where}{dtype} tensor of shape {list(shape)}, got "
            f"{tensor.dtype} {list(tensor.shape)} on {tensor.device} "
            f"(contiguous={tensor.is_contiguous()})"
        )
    if cuda and tensor.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned, got address {tensor.data_ptr():#x}")


def check_multiple(name: str, value: int, multiple: int) -> None:
    if value <= 0 or value % multiple:
        raise ValueError(f"{name} must be a positive multiple of {multiple}, got {value}")


def check_cuda(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """A contiguous, 16-byte aligned CUDA tensor (what a TMA descriptor is encoded from)."""
    check_arg(name, tensor, dtype, shape, cuda=True)


def check_macrobatch_edge(first_row, partial_in, partial_out, prefix: str = "") -> None:
    """One macrobatch's weight-gradient launch (a window kernel's, or the backward megakernel's
    window variant's): its first schedule row a multiple of TILE_ROWS >= 0 and its two fp32
    partials different buffers. `prefix`: the arguments' owner ("window." for a WeightWindow)."""
    if isinstance(first_row, bool) or not isinstance(first_row, int) or first_row < 0 \
            or first_row % TILE_ROWS:  # fmt: skip
        raise ValueError(
            f"{prefix}first_row must be a multiple of {TILE_ROWS} >= 0, got {first_row!r}"
        )
    if partial_in.data_ptr() == partial_out.data_ptr():
        raise ValueError(f"{prefix}partial_in and {prefix}partial_out must be different buffers")


def check_counts(name: str, tensor: torch.Tensor, size: int) -> None:
    """A contiguous CUDA int32 vector of `size` that the kernels read element by element
    (`Int32Pointer`, 4-byte aligned): a row of a larger table qualifies, as a macrobatch's
    `tokens_per_expert` row of one local expert does."""
    check_arg(name, tensor, torch.int32, (size,), cuda=True, align=4)


def check_expert_weights(
    name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> int:
    """A 16-byte aligned CUDA [E, N, K] tensor of contiguous rows whose experts may lie further
    apart than N rows (`expert_rows_view`: a half of a fused [E, 2 N, K]); returns its rows per
    expert."""
    check_arg(name, tensor, dtype, shape, cuda=True, contiguous=False)
    return expert_rows(name, tensor)


def check_gate_up_weights(gate_weights, up_weights, shape: tuple[int, int, int]) -> int:
    """Gate and up bf16 [E, I, H] as `check_expert_weights` takes them, with equal strides (the
    kernels take one rows-per-expert for both); returns that rows-per-expert."""
    gate_rows = check_expert_weights("gate_weights", gate_weights, torch.bfloat16, shape)
    up_rows = check_expert_weights("up_weights", up_weights, torch.bfloat16, shape)
    if gate_rows != up_rows:
        raise ValueError(
            f"gate_weights and up_weights must have the same strides, got "
            f"{tuple(gate_weights.stride())} and {tuple(up_weights.stride())}"
        )
    return gate_rows


def expert_rows(name: str, weights: torch.Tensor) -> int:
    """Rows from one expert's [N, K] block of `weights` [E, N, K] to the next's: N for a
    contiguous tensor, 2 N for either half of a fused [E, 2 N, K] (gate_up[:, :N], gate_up[:, N:],
    as Hugging Face and TorchTitan hold gate and up). Raises ValueError naming `name`, the
    strides expected and those given, unless stride(-1) == 1, stride(-2) == K and stride(0) is
    a multiple of K, at least N * K and, unless it is N * K, in rows a multiple of 128 (the
    GEMMs' weight tiles)."""
    num_experts, rows, cols = weights.shape
    strides = tuple(weights.stride())
    expert_stride = strides[0] if num_experts > 1 else max(strides[0], rows * cols)
    if (
        strides[2] != 1
        or strides[1] != cols
        or cols == 0
        or expert_stride < rows * cols
        or expert_stride % cols
        # Apart from a contiguous tensor's (N rows: N's own checks), on the weight tiles.
        or (expert_stride != rows * cols and expert_stride % (cols * EXPERT_ROW_ALIGNMENT))
    ):
        raise ValueError(
            f"{name} must have strides (R * {cols}, {cols}, 1) with R >= {rows} rows per expert, "
            f"a multiple of {EXPERT_ROW_ALIGNMENT} (contiguous, or a half of a fused "
            f"[E, 2 * {rows}, {cols}] tensor), got strides {strides}"
        )
    return expert_stride // cols


def expert_rows_view(name: str, weights: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rank-2 [rows, K] view of `weights` [E, N, K] from its first element, rows per expert):
    what the GEMMs' TMA descriptors are encoded from, expert e's rows at e * rows per expert
    (`expert_rows` checks the layout). A contiguous tensor gives its [E * N, K] view; a half of
    a fused [E, 2 N, K] one the (E - 1) * 2 N + N rows from its first, with no copy."""
    per_expert = expert_rows(name, weights)
    num_experts, rows, cols = weights.shape
    total = (num_experts - 1) * per_expert + rows if num_experts else 0
    return weights.as_strided((total, cols), (cols, 1)), per_expert


def check_extents(what: str, capacity: int, weight_rows: int, k_size: int, n_size: int) -> None:
    """The GEMMs' TMA coordinate tensors assume rows < 2^30 and K, N < 2^16."""
    if capacity >= MAX_ROWS or weight_rows >= MAX_ROWS:
        raise ValueError(
            f"routed rows ({capacity}) and {what} ({weight_rows}) must be below {MAX_ROWS}"
        )
    for name, value in (("K", k_size), ("N", n_size)):
        if value >= MAX_COLS:
            raise ValueError(f"{name} extent must be below {MAX_COLS}, got {value}")


def check_host(name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """A contiguous tensor a kernel reads with plain loads (its launch packing is tested on CPU)."""
    check_arg(name, tensor, dtype, shape, cuda=False)


def check_gpu_layer(ws, op: str) -> None:
    """The GPU layer's limits on a workspace: hidden_size aligned for the sm_90a GEMMs, and a
    (rank, row) that packs into one int32."""
    if ws.hidden_size % HIDDEN_ALIGNMENT:
        raise ValueError(
            f"hidden_size must be a multiple of {HIDDEN_ALIGNMENT} on the sm_90a kernel path "
            f"(mok.ops.{op}), got {ws.hidden_size}"
        )
    if ws.ep_size > MAX_EP_SIZE:
        raise MoKKernelUnavailableError(
            f"mok.ops.{op} on CUDA with an EP group of {ws.ep_size}: the GPU kernels take EP "
            f"groups of at most {MAX_EP_SIZE} ranks"
        )
    if ws.num_local_tokens * ws.topk >= MAX_PACKED_ROWS:
        raise ValueError(
            f"num_local_tokens * topk must be below {MAX_PACKED_ROWS} on the GPU path "
            f"(mok.ops.{op}), got {ws.num_local_tokens} * {ws.topk}"
        )
