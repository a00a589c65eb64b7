"""MXFP8 quantiser launches (SEMANTICS §5), bit-exact with `mok.reference.mxfp8_quantize`.

Kernels `mxfp8_quantize_rowwise` / `mxfp8_quantize_transposed` (dsl_kernels/common): one CTA
of 256 threads per 128x128 tile, grid (cols/128, rows/128).
"""

from __future__ import annotations

import torch

TILE = 128
# grid.y carries the 128-row tile index.
MAX_ROW_TILES_PER_LAUNCH = 65535


def mxfp8_quantize(x: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from mok.runtime import get_kernel  # noqa: PLC0415

    if x.dtype != torch.bfloat16 or x.dim() < 2 or not x.is_contiguous():
        raise ValueError(
            f"x must be a contiguous bf16 tensor with >= 2 dims, got {x.dtype} {list(x.shape)} "
            f"(contiguous={x.is_contiguous()})"
        )
    rows, cols = x.shape[-2], x.shape[-1]
    if rows % TILE or cols % TILE:
        raise ValueError(
            f"the last two dims of x must be multiples of {TILE}, got {list(x.shape[-2:])}"
        )
    batch = x.numel() // (rows * cols)
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
