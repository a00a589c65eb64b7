"""MXFP8 quantisation along rows: bf16 [rows, cols] -> E4M3 [rows, cols] + UE8M0 scales.

`Mxfp8QuantizeRowwise` is a pure memory-bound CUDA-core kernel (no TMA, no smem), the same
code for sm_90a and sm_100a.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint32

from ..common.mxfp8_values import quantize_chunk
from ..common.params import Bf16Pointer, Uint8Pointer
from ..common.tile_views import matrix, tile_chunks, tile_entry, word_matrix

TILE = 128  # rows and columns of one CTA tile (= one 512-byte scale tile)
VECTOR = 8  # bf16 elements per thread per pass: one 16-byte load
BLOCK = 32  # elements that share one scale
THREADS = 256


class QuantizeRowwiseArgs(NamedTuple):
    """`Mxfp8QuantizeRowwise`'s parameters, in order."""

    input_ptr: Bf16Pointer  # bf16 [num_rows, num_cols] row-major
    output_ptr: Uint8Pointer  # E4M3 bytes [num_rows, num_cols] row-major
    scale_ptr: Uint8Pointer  # uint8 [num_rows / 128, num_cols / 128, 32, 16]
    num_rows: Int32
    num_cols: Int32


@dataclass(frozen=True)
class Mxfp8QuantizeRowwise:
    """Quantise each row of a bf16 matrix to MXFP8 (scale per 32 consecutive elements of a row).

    Kernel parameters: `QuantizeRowwiseArgs`.

    Constraints (the caller checks them; the kernel does not):
    - num_rows % 128 == 0 and num_cols % 128 == 0, both > 0; num_rows * num_cols < 2^36
      (element offsets are 64-bit; scale offsets are int32).
    - all three pointers 16-byte aligned, contiguous, not overlapping.
    - launch: grid (num_cols/128, num_rows/128, 1), block (256, 1, 1), no dynamic smem,
      cluster (1, 1, 1). num_rows/128 <= 65535 (grid.y limit).

    Math, bit-exact (SEMANTICS.md §5): per 32 consecutive elements of a row, amax = max |v|
    (fp32 of the bf16 values); q = amax / 448 (div.rn.f32); q = max(q, fp32(1e-12)); scale = q
    rounded up to a power of two; scale byte = biased fp32 exponent of scale (UE8M0);
    element = cvt.rn.satfinite.e4m3 of (v * (1/scale)) with mul.rn.f32 (1/scale is exact).
    NaN inputs give unspecified results.

    Scale layout: byte ((r//128)*(cols/128) + c//128)*512 + (r%32)*16 + ((r%128)//32)*4
    + (c%128)//32 holds the scale of row r, columns c..c+31 (torch's SWIZZLE_32_4_4).

    Work split: CTA = one 128x128 tile; thread = 8 consecutive columns of 8 rows (one row per
    pass, 16 rows per pass); the 4 threads of a 32-element block reduce amax with 2 shuffles.
    """

    @property
    def threads(self) -> int:
        return THREADS

    @cute.jit
    def __call__(self, args: QuantizeRowwiseArgs):
        self.kernel(args).launch(
            grid=[args.num_cols // TILE, args.num_rows // TILE, 1], block=[THREADS, 1, 1]
        )

    @cute.kernel
    def kernel(self, args: QuantizeRowwiseArgs):
        tidx, tile_col, tile_row, _, num_rows, num_cols = tile_entry(args.num_rows, args.num_cols)

        # ---- views: global tensors -> this CTA's tile -> 8-element chunks ----
        mX = matrix(args.input_ptr, num_rows, num_cols)
        # E4M3 output viewed as 32-bit words: 8 bytes = 2 words per thread and pass.
        mQ = word_matrix(args.output_ptr, num_rows, num_cols, 4)
        mS = cute.make_tensor(args.scale_ptr, cute.make_layout(num_rows * (num_cols // TILE) * 4))
        gX = tile_chunks(mX, (tile_row, tile_col), TILE, VECTOR)  # (1, 8, 128, 16)
        gQ = tile_chunks(mQ, (tile_row, tile_col), TILE // 4, VECTOR // 4)  # (1, 2, 128, 16)
        scale_tile_base = (tile_row * (num_cols // TILE) + tile_col) * (TILE * 4)

        chunk = tidx % (TILE // VECTOR)  # 0..15: which 8 columns of the tile
        row_in_pass = tidx // (TILE // VECTOR)  # 0..15
        col_block = chunk // (BLOCK // VECTOR)  # 0..3: which 32-column block

        # ---- loads: all 8 passes issued up front (8 x 16 B in flight per thread) ----
        values = cute.make_rmem_tensor((VECTOR, TILE // 16), Float32)
        for p in cutlass.range_constexpr(TILE // 16):
            row = p * 16 + row_in_pass
            values[None, p].store(gX[0, None, row, chunk].load().to(Float32))

        # ---- per pass: amax over 32 elements, scale, convert, store ----
        for p in cutlass.range_constexpr(TILE // 16):
            row = p * 16 + row_in_pass
            packed = cute.make_rmem_tensor((VECTOR // 4,), Uint32)
            # the 4 lanes holding one 32-element block are adjacent (lane bits 0 and 1)
            scale_byte = quantize_chunk(values[None, p], packed)
            gQ[0, None, row, chunk].store(packed.load())

            if tidx % (BLOCK // VECTOR) == 0:
                offset = scale_tile_base + (row % 32) * 16 + (row // 32) * 4 + col_block
                mS[offset] = Uint8(scale_byte)
