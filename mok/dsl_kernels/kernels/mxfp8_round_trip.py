"""MXFP8 round trips: bf16 [rows, cols] -> bf16 [rows, cols], every value quantised to MXFP8
and dequantised again, along the rows (scale per 32 consecutive elements of a row) or down the
columns (scale per 32 consecutive rows of a column).

`Mxfp8RoundTrip` is a pure memory-bound CUDA-core kernel (no TMA, no smem), the same code for
sm_90a and sm_100a: `Mxfp8QuantizeRowwise` / `Mxfp8QuantizeTransposed` with the E4M3 bytes
turned straight back into bf16 in the input's own layout instead of being stored.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32

from ..common.mxfp8_values import round_trip_chunk, transpose_halves
from ..common.params import Bf16Pointer
from ..common.tile_views import matrix, tile_chunks, tile_entry, word_matrix

TILE = 128  # rows and columns of one CTA tile
VECTOR = 8  # bf16 elements per 16-byte load or store
THREADS = 256


class RoundTripArgs(NamedTuple):
    """`Mxfp8RoundTrip`'s parameters, in order."""

    input_ptr: Bf16Pointer  # bf16 [num_rows, num_cols] row-major
    output_ptr: Bf16Pointer  # bf16 [num_rows, num_cols] row-major
    num_rows: Int32
    num_cols: Int32


@dataclass(frozen=True)
class Mxfp8RoundTrip:
    """Replace each value of a bf16 matrix by its MXFP8 round trip along its row, or with
    `along_rows` down its column.

    The result is `mok.reference.mxfp8_round_trip(input, along_rows=along_rows)` bit for bit:
    the values `Mxfp8QuantizeRowwise` (`Mxfp8QuantizeTransposed`) would quantise to,
    dequantised (an E4M3 value times its power-of-two scale is exact in bf16).

    Kernel parameters: `RoundTripArgs`.

    Constraints (the caller checks them; the kernel does not):
    - num_rows % 128 == 0 and num_cols % 128 == 0, both > 0 (element offsets are 64-bit).
    - both pointers 16-byte aligned and contiguous; output_ptr == input_ptr (in place) is
      allowed, any other overlap is not.
    - launch: grid (num_cols/128, num_rows/128, 1), block (256, 1, 1), no dynamic smem,
      cluster (1, 1, 1). num_rows/128 <= 65535 (grid.y limit).

    Math, bit-exact (SEMANTICS.md §5): per 32-element block, the scale byte and the E4M3 bytes
    exactly as the quantisers compute them; each output = the E4M3 value (cvt.rn.f16x2.e4m3x2,
    exact) times 2^(byte - 127) (mul.rn.f32, exact), converted to bf16 (exact: at most 4
    significant bits in bf16's exponent range). NaN or infinite inputs give unspecified results.

    Work split, CTA = one 128x128 tile. Along the row (as `Mxfp8QuantizeRowwise`): thread = 8
    consecutive columns of 8 rows (one row per pass, 16 rows per pass); the 4 adjacent lanes of
    a 32-element block reduce amax with 2 shuffles. Down the column (as
    `Mxfp8QuantizeTransposed`): 8 warps as 4 (32-row groups) x 2 (64-column groups); lane = 4
    (8-row chunks) x 8 (8-column chunks), so each load and store instruction of a warp covers
    4 rows x 128 contiguous bytes; the 4 lanes of one 32-row block (lane bits 3 and 4) reduce
    amax with 2 shuffles; a column's pairs of rows come out as bf16x2 words, and a 2x2
    transpose of 16-bit halves turns them into pairs of columns of one row. In place is safe:
    a thread reads exactly the elements it writes, all of them before its first store, and
    shares only registers.
    """

    along_rows: bool = False

    @property
    def threads(self) -> int:
        return THREADS

    @cute.jit
    def __call__(self, args: RoundTripArgs):
        self.kernel(args).launch(
            grid=[args.num_cols // TILE, args.num_rows // TILE, 1], block=[THREADS, 1, 1]
        )

    @cute.kernel
    def kernel(self, args: RoundTripArgs):
        tidx, tile_col, tile_row, _, num_rows, num_cols = tile_entry(args.num_rows, args.num_cols)

        # ---- views: input bf16 [rows, cols]; output the same matrix as 32-bit words ----
        mX = matrix(args.input_ptr, num_rows, num_cols)
        # The bf16 output viewed as 32-bit words (bf16x2), the form the round trips return.
        mY = word_matrix(args.output_ptr, num_rows, num_cols, 2)
        gX = tile_chunks(
            mX, (tile_row, tile_col), TILE, VECTOR
        )  # (1, 8, 128 rows, 16 column chunks)
        gY = tile_chunks(
            mY, (tile_row, tile_col), TILE // 2, VECTOR // 2
        )  # (1, 4, 128 rows, 16 column chunks)
        if cutlass.const_expr(self.along_rows):
            self.down_columns(gX, gY, tidx)
        else:
            self.along_row(gX, gY, tidx)

    @cute.jit
    def along_row(self, gX: cute.Tensor, gY: cute.Tensor, tidx: Int32):
        """Blocks of 32 elements of a row: each thread 8 columns of 8 rows."""
        chunk = tidx % (TILE // VECTOR)  # 0..15: which 8 columns of the tile
        row_in_pass = tidx // (TILE // VECTOR)  # 0..15

        # ---- loads: all 8 passes issued up front (8 x 16 B in flight per thread) ----
        # Held as bf16 and widened per pass: fp32 would double the registers the loads hold.
        values = cute.make_rmem_tensor((VECTOR, TILE // 16), BFloat16)
        for p in cutlass.range_constexpr(TILE // 16):
            row = p * 16 + row_in_pass
            values[None, p].store(gX[0, None, row, chunk].load())

        # ---- per pass: round trip of the 32-element block (4 lanes), store 16 bytes ----
        for p in cutlass.range_constexpr(TILE // 16):
            row = p * 16 + row_in_pass
            widened = cute.make_rmem_tensor((VECTOR,), Float32)
            widened.store(values[None, p].load().to(Float32))
            rounded = cute.make_rmem_tensor((VECTOR // 2,), Uint32)
            round_trip_chunk(widened, rounded)
            gY[0, None, row, chunk].store(rounded.load())

    @cute.jit
    def down_columns(self, gX: cute.Tensor, gY: cute.Tensor, tidx: Int32):
        """Blocks of 32 rows of a column: each thread 8 rows x 8 columns."""
        warp = tidx // 32
        lane = tidx % 32
        row_group = warp % 4  # which 32-row block of the tile
        col_chunk = (warp // 4) * 8 + lane % 8  # 0..15: which 8 columns
        row_chunk = row_group * 4 + lane // 8  # 0..15: which 8 rows
        row0 = row_chunk * VECTOR

        # ---- loads: 8 rows x 16 bytes; values[j, i] = input[row0 + i, col0 + j] ----
        # Held as bf16 and widened per column: fp32 would double the registers they take.
        values = cute.make_rmem_tensor((VECTOR, VECTOR), BFloat16)
        for i in cutlass.range_constexpr(VECTOR):
            values[None, i].store(gX[0, None, row0 + i, col_chunk].load())

        # ---- per column: amax over 32 rows, scale, round trip of 8 values ----
        # by_column[k, j] = bf16x2 of rows 2k, 2k + 1 of column j (low half: row 2k)
        by_column = cute.make_rmem_tensor((VECTOR // 2, VECTOR), Uint32)
        column = cute.make_rmem_tensor((VECTOR,), Float32)
        words = cute.make_rmem_tensor((VECTOR // 2,), Uint32)
        for j in cutlass.range_constexpr(VECTOR):
            column.store(values[j, None].load().to(Float32))
            round_trip_chunk(column, words, lane_stride=8)  # the block's 4 lanes: bits 3, 4
            for k in cutlass.range_constexpr(VECTOR // 2):
                by_column[k, j] = words[k]

        # ---- per row: columns 2w, 2w + 1 from the halves of two column words, store 16 B ----
        for k in cutlass.range_constexpr(VECTOR // 2):
            even_row = cute.make_rmem_tensor((VECTOR // 2,), Uint32)
            odd_row = cute.make_rmem_tensor((VECTOR // 2,), Uint32)
            for w in cutlass.range_constexpr(VECTOR // 2):
                even_row[w], odd_row[w] = transpose_halves(by_column[k, 2 * w],
                                                           by_column[k, 2 * w + 1])  # fmt: skip
            gY[0, None, row0 + 2 * k, col_chunk].store(even_row.load())
            gY[0, None, row0 + 2 * k + 1, col_chunk].store(odd_row.load())
