"""MXFP8 launches (SEMANTICS §5), bit-exact with `mok.reference`: the quantisers
(`mxfp8_quantize`), the bf16 round trips (`mxfp8_round_trip`) and the rowwise dequantiser
(`mxfp8_dequantize`).

Kernels `mxfp8_quantize_rowwise` / `mxfp8_quantize_transposed` / `mxfp8_round_trip_rowwise` /
`mxfp8_round_trip_columns` / `mxfp8_dequantize_rowwise` (mok/dsl_kernels/kernels): one CTA of 256
threads per 128x128 tile, grid (cols/128, rows/128).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from .checks import check_arg

TILE = 128
# grid.y carries the 128-row tile index.
MAX_ROW_TILES_PER_LAUNCH = 65535
# The dequantiser's scale offsets are int32 (kernels/mxfp8_dequantize.py): it takes
# fewer than 2^36 elements a launch.
MAX_DEQUANTIZE_ELEMENTS_PER_LAUNCH = 1 << 36
# The kernels' 16-byte loads and stores (and the dequantiser's 16-byte scale loads).
ALIGNMENT = 16


def mxfp8_quantize(x: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from mok.runtime import get_kernel  # noqa: PLC0415

    batch, rows, cols = _matrices("x", x, torch.bfloat16)
    out_rows, out_cols = (cols, rows) if transpose else (rows, cols)
    data = torch.empty((*x.shape[:-2], out_rows, out_cols), dtype=torch.float8_e4m3fn,
                       device=x.device)  # fmt: skip
    scales = torch.empty((batch * out_rows // TILE, out_cols // TILE, 32, 16), dtype=torch.uint8,
                         device=x.device)  # fmt: skip
    flat_x = x.view(batch, rows, cols)
    flat_data = data.view(torch.uint8).view(batch, out_rows, out_cols)
    if transpose:
        # One launch per matrix (the transpose is per leading index), its tiles all in one grid.
        if rows // TILE > MAX_ROW_TILES_PER_LAUNCH:
            raise ValueError(
                f"transposed MXFP8 quantisation supports at most {MAX_ROW_TILES_PER_LAUNCH * TILE} "
                f"rows, got {rows}"
            )
        kernel = get_kernel("mxfp8_quantize_transposed", device=x.device)
        flat_scales = scales.view(batch, -1)
        for b in range(batch):
            kernel.launch(
                (cols // TILE, rows // TILE, 1),
                {"input_ptr": flat_x[b], "output_ptr": flat_data[b], "scale_ptr": flat_scales[b],
                 "num_rows": rows, "num_cols": cols},
            )  # fmt: skip
        return data, scales
    # Leading dims fold into rows: launches over chunks of at most 65535 row tiles.
    kernel = get_kernel("mxfp8_quantize_rowwise", device=x.device)
    src, dst = flat_x.view(-1, cols), flat_data.view(-1, cols)
    scale_bytes_per_row_tile = (cols // TILE) * 512
    total_tiles = batch * rows // TILE
    for tile0 in range(0, total_tiles, MAX_ROW_TILES_PER_LAUNCH):
        tiles = min(MAX_ROW_TILES_PER_LAUNCH, total_tiles - tile0)
        kernel.launch(
            (cols // TILE, tiles, 1),
            {"input_ptr": src[tile0 * TILE :], "output_ptr": dst[tile0 * TILE :],
             "scale_ptr": scales.view(-1)[tile0 * scale_bytes_per_row_tile :],
             "num_rows": tiles * TILE, "num_cols": cols},
        )  # fmt: skip
    return data, scales


def mxfp8_round_trip(
    x: torch.Tensor, *, along_rows: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """bf16 x [..., R, K] with every value replaced by its MXFP8 round trip, bitwise
    `mok.reference.mxfp8_round_trip(x, along_rows=along_rows)`: blocks of 32 consecutive
    elements along K, or (`along_rows`) down R within each matrix.

    `out` (bf16, x's shape, contiguous; default a new tensor) may be `x` itself (in place); any
    other overlap with x is refused. R and K must be multiples of 128.
    """
    from mok.runtime import get_kernel  # noqa: PLC0415

    batch, rows, cols = _matrices("x", x, torch.bfloat16)
    if out is None:
        out = torch.empty_like(x)
    else:
        check_arg("out", out, torch.bfloat16, tuple(x.shape), cuda=False)
        _check_same_device("out", out, x)
        _check_aligned("out", out)
        if out.data_ptr() != x.data_ptr() and _overlap(out, x):
            raise ValueError(
                f"out must be x itself (in place) or not overlap it, got out at "
                f"{out.data_ptr():#x} and x at {x.data_ptr():#x} ({x.nbytes} bytes)"
            )
    # Leading dims fold into rows. Along rows too: R % 128 == 0, so no 32-row block (nor any
    # 128-row tile) spans two matrices.
    name = "mxfp8_round_trip_columns" if along_rows else "mxfp8_round_trip_rowwise"
    kernel = get_kernel(name, device=x.device)
    src, dst = x.view(-1, cols), out.view(-1, cols)
    for tile0, tiles in _row_tile_chunks(batch * rows // TILE, MAX_ROW_TILES_PER_LAUNCH):
        kernel.launch(
            (cols // TILE, tiles, 1),
            {"input_ptr": src[tile0 * TILE :], "output_ptr": dst[tile0 * TILE :],
             "num_rows": tiles * TILE, "num_cols": cols},
        )  # fmt: skip
    return out


def mxfp8_dequantize(
    data: torch.Tensor, scales: torch.Tensor, *, transposed: bool = False
) -> torch.Tensor:
    """bf16 values [..., R, K] of rowwise MXFP8 `data` (float8_e4m3fn [..., R, K]) and its
    `scales` (uint8 [rows/128, K/128, 32, 16], rows folding every leading dim: what
    `mxfp8_quantize(x, transpose=False)` returns), bitwise
    `mok.reference.mxfp8_dequantize(data, scales).to(torch.bfloat16)`. R and K must be
    multiples of 128. `transposed`: `data` is a transposed copy (`mxfp8_quantize(x,
    transpose=True)` of an x [..., K, R]) and the result is in x's layout, [..., K, R]:
    `mok.reference.mxfp8_dequantize(data, scales, transpose=True)` in bf16, one pass.
    """
    from mok.runtime import get_kernel  # noqa: PLC0415

    batch, rows, cols = _matrices("data", data, torch.float8_e4m3fn)
    total_rows = batch * rows
    check_arg("scales", scales, torch.uint8, (total_rows // TILE, cols // TILE, 32, 16),
              cuda=False)  # fmt: skip
    _check_same_device("scales", scales, data)
    _check_aligned("scales", scales)
    if transposed:
        return _dequantize_transposed(data, scales, batch, rows, cols)
    out = torch.empty(data.shape, dtype=torch.bfloat16, device=data.device)
    if out.numel() == 0:
        return out
    # At most 65535 row tiles (grid.y) and fewer than 2^36 elements (int32 scale offsets).
    tiles_per_launch = min(
        MAX_ROW_TILES_PER_LAUNCH, (MAX_DEQUANTIZE_ELEMENTS_PER_LAUNCH - 1) // (TILE * cols)
    )
    if tiles_per_launch == 0:
        raise ValueError(f"the last dim of data must be below 2^29, got {cols}")
    kernel = get_kernel("mxfp8_dequantize_rowwise", device=data.device)
    src, dst = data.view(torch.uint8).view(-1, cols), out.view(-1, cols)
    scale_bytes_per_row_tile = (cols // TILE) * 512
    for tile0, tiles in _row_tile_chunks(total_rows // TILE, tiles_per_launch):
        kernel.launch(
            (cols // TILE, tiles, 1),
            {"input_ptr": src[tile0 * TILE :],
             "scale_ptr": scales.view(-1)[tile0 * scale_bytes_per_row_tile :],
             "output_ptr": dst[tile0 * TILE :], "num_rows": tiles * TILE, "num_cols": cols},
        )  # fmt: skip
    return out


def dequantized_weights(pairs, *, transposed: bool = False) -> tuple[torch.Tensor, ...]:
    """bf16 values of MXFP8 weight pairs (data, scales), each in its weight's own layout (exact:
    an E4M3 value times a power of two is a bf16). `transposed`: the pairs are transposed
    copies (the backward's), dequantised back into the weights' layouts in one pass."""
    return tuple(mxfp8_dequantize(data, scales, transposed=transposed) for data, scales in pairs)


def backward_weights(routed) -> tuple[torch.Tensor, ...]:
    """bf16 (gate [E, I, H], up [E, I, H], down [E, H, I]) from the backward's MXFP8 copies
    (gate, up: (fp8, scale, fp8_t, scale_t); down: (fp8_t, scale_t)): gate's and up's
    transposed copies (along I), down's (along H), each exact in bf16."""
    gate, up, down = routed
    return dequantized_weights((gate[2:], up[2:], down), transposed=True)


def gate_up_operands(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The context's gate and up as the MXFP8 backward reads them: round trips along I (new
    tensors)."""
    return (mxfp8_round_trip(gate, along_rows=False),
            mxfp8_round_trip(up, along_rows=False))  # fmt: skip


def weight_gradient_operands(dy_e, d_gate, d_up, x_rows, hidden, context_exact: bool = False):
    """The MXFP8 weight gradients' operands: every one's round trip along the tokens (32-row
    blocks). dy_e, d_gate, d_up (a launch's own scratch) in place; the context's x and hidden
    into new tensors, unless `context_exact` (MXFP8 values along the tokens already: the round
    trip is the identity). Returns (dy_e, x_rows, d_gate, d_up, hidden)."""
    for t in (dy_e, d_gate, d_up):
        mxfp8_round_trip(t, along_rows=True, out=t)
    if not context_exact:
        x_rows = mxfp8_round_trip(x_rows, along_rows=True)
        hidden = mxfp8_round_trip(hidden, along_rows=True)
    return dy_e, x_rows, d_gate, d_up, hidden


def _dequantize_transposed(data, scales, batch: int, rows: int, cols: int) -> torch.Tensor:
    """`mxfp8_dequantize(transposed=True)`'s launch: every matrix in one grid (z = matrix)."""
    from mok.runtime import get_kernel  # noqa: PLC0415

    out = torch.empty((*data.shape[:-2], cols, rows), dtype=torch.bfloat16, device=data.device)
    if out.numel() == 0:
        return out
    if rows // TILE > MAX_ROW_TILES_PER_LAUNCH or batch > MAX_ROW_TILES_PER_LAUNCH:
        raise ValueError(
            f"transposed MXFP8 dequantisation supports at most {MAX_ROW_TILES_PER_LAUNCH * TILE} "
            f"rows and {MAX_ROW_TILES_PER_LAUNCH} matrices, got {rows} rows, {batch} matrices"
        )
    if out.numel() >= MAX_DEQUANTIZE_ELEMENTS_PER_LAUNCH:
        raise ValueError(
            f"transposed MXFP8 dequantisation supports fewer than 2^36 elements, got {out.numel()}"
        )
    kernel = get_kernel("mxfp8_dequantize_transposed", device=data.device)
    kernel.launch(
        (cols // TILE, rows // TILE, batch),
        {"input_ptr": data.view(torch.uint8), "scale_ptr": scales, "output_ptr": out,
         "num_rows": rows, "num_cols": cols},
    )  # fmt: skip
    return out


def _matrices(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> tuple[int, int, int]:
    """(matrices, rows, cols) of a contiguous, 16-byte aligned `dtype` tensor [..., rows, cols]
    whose last two dims are multiples of 128; ValueError naming `name` otherwise."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype or tensor.dim() < 2 or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor with >= 2 dims, got {tensor.dtype} "
            f"{list(tensor.shape)} (contiguous={tensor.is_contiguous()})"
        )
    rows, cols = tensor.shape[-2], tensor.shape[-1]
    if rows % TILE or cols % TILE:
        raise ValueError(
            f"the last two dims of {name} must be multiples of {TILE}, got "
            f"{list(tensor.shape[-2:])}"
        )
    _check_aligned(name, tensor)
    return math.prod(tensor.shape[:-2]), rows, cols


def _check_aligned(name: str, tensor: torch.Tensor) -> None:
    if tensor.data_ptr() % ALIGNMENT:
        raise ValueError(
            f"{name} must be {ALIGNMENT}-byte aligned, got address {tensor.data_ptr():#x}"
        )


def _check_same_device(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    if tensor.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {tensor.device}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte."""
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes


def _row_tile_chunks(total_tiles: int, tiles_per_launch: int) -> Iterator[tuple[int, int]]:
    """(first row tile, row tiles) of each launch over `total_tiles` 128-row tiles."""
    for tile0 in range(0, total_tiles, tiles_per_launch):
        yield tile0, min(tiles_per_launch, total_tiles - tile0)
