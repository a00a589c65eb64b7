"""MXFP8 quantisation of the transpose: bf16 [rows, cols] -> E4M3 [cols, rows] + UE8M0 scales.

`Mxfp8QuantizeTransposed` is a pure memory-bound CUDA-core kernel (no TMA, no smem), the same
code for sm_90a and sm_100a. The transpose happens in registers: each thread loads an 8x8
block (8 rows x 16 bytes) and writes it back as 8 output rows of 8 bytes.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint32

from ..common.mxfp8_values import quantize_chunk
from ..common.params import Bf16Pointer, Uint8Pointer
from ..common.tile_views import matrix, tile_chunks, tile_entry, word_matrix

TILE = 128  # input rows and columns of one CTA tile (= one 512-byte scale tile)
VECTOR = 8  # a thread owns VECTOR input rows x VECTOR input columns
BLOCK = 32  # elements that share one scale (32 input rows of one column)
THREADS = 256


class QuantizeTransposedArgs(NamedTuple):
    """`Mxfp8QuantizeTransposed`'s parameters, in order."""

    input_ptr: Bf16Pointer  # bf16 [num_rows, num_cols] row-major
    output_ptr: Uint8Pointer  # E4M3 bytes [num_cols, num_rows] row-major
    scale_ptr: Uint8Pointer  # uint8 [num_cols / 128, num_rows / 128, 32, 16]
    num_rows: Int32
    num_cols: Int32


@dataclass(frozen=True)
class Mxfp8QuantizeTransposed:
    """Quantise the transpose of a bf16 matrix to MXFP8 (scale per 32 consecutive input rows).

    The result equals `Mxfp8QuantizeRowwise` applied to `input.T.contiguous()`: output
    E4M3 [num_cols, num_rows] row-major and scales [num_cols/128, num_rows/128, 32, 16].

    Kernel parameters: `QuantizeTransposedArgs`.

    Constraints (the caller checks them; the kernel does not):
    - num_rows % 128 == 0 and num_cols % 128 == 0, both > 0; num_rows * num_cols < 2^36
      (element offsets are 64-bit; scale offsets are int32).
    - all three pointers 16-byte aligned, contiguous, not overlapping.
    - launch: grid (num_cols/128, num_rows/128, 1), block (256, 1, 1), no dynamic smem,
      cluster (1, 1, 1). num_rows/128 <= 65535 (grid.y limit).

    Math: identical to `Mxfp8QuantizeRowwise` (div.rn.f32 by 448, clamp at fp32(1e-12),
    round the scale up to a power of two, mul.rn.f32 by the exact inverse, then
    cvt.rn.satfinite.e4m3x2.f32), with the 32-element blocks running down input columns.

    Work split: CTA = one 128x128 input tile, 8 warps as 4 (32-row groups) x 2 (64-column
    groups); lane = 4 (8-row chunks) x 8 (8-column chunks), so each load instruction of a warp
    reads 4 rows x 128 contiguous bytes and each store writes 8 runs of 32 contiguous bytes.
    The 4 lanes of one 32-row block (lane bits 3 and 4) reduce amax with 2 shuffles.
    """

    @property
    def threads(self) -> int:
        return THREADS

    @cute.jit
    def __call__(self, args: QuantizeTransposedArgs):
        self.kernel(args).launch(
            grid=[args.num_cols // TILE, args.num_rows // TILE, 1], block=[THREADS, 1, 1]
        )

    @cute.kernel
    def kernel(self, args: QuantizeTransposedArgs):
        tidx, tile_col, tile_row, _, num_rows, num_cols = tile_entry(args.num_rows, args.num_cols)

        # ---- views: input [rows, cols] bf16; output [cols, rows] as 32-bit words ----
        mX = matrix(args.input_ptr, num_rows, num_cols)
        mQ = word_matrix(args.output_ptr, num_cols, num_rows, 4)
        mS = cute.make_tensor(args.scale_ptr, cute.make_layout(num_cols * (num_rows // TILE) * 4))
        gX = tile_chunks(
            mX, (tile_row, tile_col), TILE, VECTOR
        )  # (1, 8, 128 rows, 16 column chunks)
        gQ = tile_chunks(
            mQ, (tile_col, tile_row), TILE // 4, VECTOR // 4
        )  # (1, 2, 128 output rows, 16 output chunks)
        scale_tile_base = (tile_col * (num_rows // TILE) + tile_row) * (TILE * 4)

        warp = tidx // 32
        lane = tidx % 32
        row_group = warp % 4  # 32-row block of the tile = output column block
        col_chunk = (warp // 4) * 8 + lane % 8  # 0..15: which 8 input columns
        row_chunk = row_group * 4 + lane // 8  # 0..15: which 8 input rows
        row0 = row_chunk * VECTOR

        # ---- loads: 8 input rows x 16 bytes; values[j, i] = input[row0 + i, col0 + j] ----
        values = cute.make_rmem_tensor((VECTOR, VECTOR), Float32)
        for i in cutlass.range_constexpr(VECTOR):
            values[None, i].store(gX[0, None, row0 + i, col_chunk].load().to(Float32))

        # ---- per input column: amax over 32 rows, scale, convert, store 8 bytes ----
        for j in cutlass.range_constexpr(VECTOR):
            packed = cute.make_rmem_tensor((VECTOR // 4,), Uint32)
            # the block's 4 lanes are 8 apart (lane bits 3 and 4)
            scale_byte = quantize_chunk(values[j, None], packed, lane_stride=8)
            out_row = col_chunk * VECTOR + j  # tile-local output row = input column
            gQ[0, None, out_row, row_chunk].store(packed.load())

            if lane // 8 == 0:
                offset = scale_tile_base + (out_row % 32) * 16 + (out_row // 32) * 4 + row_group
                mS[offset] = Uint8(scale_byte)
