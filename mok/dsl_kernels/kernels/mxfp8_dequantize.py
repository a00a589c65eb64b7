"""MXFP8 dequantisation: E4M3 [rows, cols] quantised along its rows + UE8M0 scales -> bf16,
in the data's layout [rows, cols], or (`transposed`: the data is a transposed copy,
`Mxfp8QuantizeTransposed`'s output) back in the original layout [cols, rows].

`Mxfp8Dequantize` is a pure memory-bound CUDA-core kernel (no TMA, no smem), the same code for
sm_90a and sm_100a: the inverse of the quantisers' layouts, exact; the transpose is done in
registers (one pass over memory instead of a dequantisation and a transposing copy).
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from ..common.mxfp8_values import dequantize_word, scale_bits_of, transpose_halves
from ..common.params import Bf16Pointer, Uint8Pointer
from ..common.tile_views import tile_chunks, tile_entry, word_matrix

TILE = 128  # rows and columns of one CTA tile (= one 512-byte scale tile)
VECTOR = 8  # elements per thread per pass: an 8-byte load, a 16-byte store
BLOCK = 32  # elements that share one scale
THREADS = 256


class DequantizeArgs(NamedTuple):
    """`Mxfp8Dequantize`'s parameters, in order."""

    input_ptr: Uint8Pointer  # E4M3 bytes [batch, num_rows, num_cols] row-major
    scale_ptr: Uint8Pointer  # uint8 [batch * num_rows / 128, num_cols / 128, 32, 16]
    # bf16 [batch, num_rows, num_cols], or transposed [batch, num_cols, num_rows], row-major
    output_ptr: Bf16Pointer
    num_rows: Int32  # one input matrix's
    num_cols: Int32


@dataclass(frozen=True)
class Mxfp8Dequantize:
    """bf16 values of MXFP8 data quantised along its rows (a scale per 32 consecutive elements
    of a row), in the data's layout or with `transposed` in the transposed one.

    The result is `mok.reference.mxfp8_dequantize(data, scales, transpose=transposed)` in bf16
    bit for bit, for the (data, scales) `Mxfp8QuantizeRowwise` (`Mxfp8QuantizeTransposed`)
    writes.

    Kernel parameters: `DequantizeArgs`. Transposed: matrix b of the batch is grid.z = b; in
    the data's layout the batch folds into the rows (grid.z = 1).

    Constraints (the caller checks them; the kernel does not):
    - num_rows % 128 == 0 and num_cols % 128 == 0, both > 0; batch * num_rows * num_cols <
      2^36 (element offsets are 64-bit; scale offsets are int32).
    - all three pointers 16-byte aligned, contiguous, not overlapping.
    - launch: grid (num_cols/128, num_rows/128, batch), block (256, 1, 1), no dynamic smem,
      cluster (1, 1, 1). num_rows/128 and batch <= 65535 (grid.y, grid.z limits).

    Math, bit-exact (SEMANTICS.md §5): element = E4M3 value (cvt.rn.f16x2.e4m3x2, exact) times
    the fp32 whose bits are byte << 23 (2^(byte - 127); byte 0 gives +0.0, as the reference
    builds it) with mul.rn.f32, rounded to bf16 (cvt.rn.bf16x2.f32, the reference's fp32 -> bf16
    rounding; exact for every byte the quantisers write, in [88, 246]). E4M3 NaN bytes and scale
    byte 255 (infinity) give NaNs whose bits may differ from the reference's.

    Scale layout (as `Mxfp8QuantizeRowwise` writes it): byte ((r//128)*(cols/128) + c//128)*512
    + (r%32)*16 + ((r%128)//32)*4 + (c%128)//32 holds the scale of row r, columns c..c+31; the
    4 bytes of one row in one tile are one 32-bit word, which each thread loads whole.

    Work split, CTA = one 128x128 input tile. In the data's layout (as `Mxfp8QuantizeRowwise`):
    thread = 8 consecutive columns of 8 rows (one row per pass, 16 rows per pass). Transposed:
    8 warps as 4 (32-row groups) x 2 (64-column groups), lane = 4 (8-row chunks) x 8 (8-column
    chunks); a thread loads 8 input rows x 8 bytes (their 8 scale words first), dequantises
    them into bf16x2 words along the input rows, turns each 2x2 block of 16-bit halves around,
    and stores 8 output rows x 16 bytes.
    """

    transposed: bool = False

    @property
    def threads(self) -> int:
        return THREADS

    @cute.jit
    def __call__(self, args: DequantizeArgs):
        self.kernel(args).launch(
            grid=[args.num_cols // TILE, args.num_rows // TILE, 1], block=[THREADS, 1, 1]
        )  # the runtime launches the cubin with its own grid (z = batch)

    @cute.kernel
    def kernel(self, args: DequantizeArgs):
        tidx, tile_col, tile_row, matrix, num_rows, num_cols = tile_entry(
            args.num_rows, args.num_cols
        )
        scale_tile_base = (tile_row * (num_cols // TILE) + tile_col) * TILE  # in words
        if cutlass.const_expr(self.transposed):
            # Matrix `matrix` of the batch: its elements (64-bit), its scale words (int32).
            elements = cute.assume(
                Int64(matrix) * Int64(num_rows) * Int64(num_cols), divby=TILE * TILE
            )
            args = args._replace(
                input_ptr=args.input_ptr + elements, output_ptr=args.output_ptr + elements
            )
            scale_tile_base = (
                scale_tile_base + matrix * (num_rows // TILE) * (num_cols // TILE) * TILE
            )

        # ---- views: E4M3 input [rows, cols] as 32-bit words, scales as words ----
        mQ = word_matrix(args.input_ptr, num_rows, num_cols, 4)
        # One word per (input row, 128-column tile): its 4 blocks' scale bytes.
        mS = cute.make_tensor(
            cute.recast_ptr(args.scale_ptr, dtype=Uint32),
            cute.make_layout(num_rows * (num_cols // TILE)),
        )
        gQ = tile_chunks(
            mQ, (tile_row, tile_col), TILE // 4, VECTOR // 4
        )  # (1, 2, 128 input rows, 16 column chunks)
        # ---- the bf16 output as 32-bit words, [rows, cols] or transposed [cols, rows] ----
        out_rows, out_cols = num_rows, num_cols
        out_tile = (tile_row, tile_col)
        if cutlass.const_expr(self.transposed):
            out_rows, out_cols = num_cols, num_rows
            out_tile = (tile_col, tile_row)
        mY = word_matrix(args.output_ptr, out_rows, out_cols, 2)
        gY = tile_chunks(mY, out_tile, TILE // 2, VECTOR // 2)  # (1, 4, 128 output rows, 16 chunks)
        if cutlass.const_expr(self.transposed):
            self.back_transposed(gQ, mS, gY, scale_tile_base, tidx)
        else:
            self.in_place(gQ, mS, gY, scale_tile_base, tidx)

    @cute.jit
    def in_place(self, gQ: cute.Tensor, mS: cute.Tensor, gY: cute.Tensor, scale_tile_base: Int32,
                 tidx: Int32):  # fmt: skip
        """The data's layout: each thread 8 columns of 8 rows, one row per pass."""
        chunk = tidx % (TILE // VECTOR)  # 0..15: which 8 columns of the tile
        row_in_pass = tidx // (TILE // VECTOR)  # 0..15
        col_block = chunk // (BLOCK // VECTOR)  # 0..3: which 32-column block = scale byte

        # ---- loads: all 8 passes issued up front (8 x 8 B of data + 8 scale words) ----
        data = cute.make_rmem_tensor((VECTOR // 4, TILE // 16), Uint32)
        scale_words = cute.make_rmem_tensor((TILE // 16,), Uint32)
        for p in cutlass.range_constexpr(TILE // 16):
            row = p * 16 + row_in_pass
            data[None, p].store(gQ[0, None, row, chunk].load())
            scale_words[p] = mS[scale_tile_base + (row % 32) * 4 + row // 32]

        # ---- per pass: 8 E4M3 values times their scale, store 16 bytes ----
        for p in cutlass.range_constexpr(TILE // 16):
            row = p * 16 + row_in_pass
            scale_bits = scale_bits_of(scale_words[p] >> Uint32(8 * col_block))
            values = cute.make_rmem_tensor((VECTOR // 2,), Uint32)
            for w in cutlass.range_constexpr(VECTOR // 4):
                dequantize_word(data[w, p], scale_bits, values, 2 * w)
            gY[0, None, row, chunk].store(values.load())

    @cute.jit
    def back_transposed(self, gQ: cute.Tensor, mS: cute.Tensor, gY: cute.Tensor,
                        scale_tile_base: Int32, tidx: Int32):  # fmt: skip
        """The transposed layout: each thread 8 input rows x 8 columns, turned around."""
        warp = tidx // 32
        lane = tidx % 32
        col_chunk = (warp // 4) * 8 + lane % 8  # 0..15: which 8 input columns
        row_chunk = (warp % 4) * 4 + lane // 8  # 0..15: which 8 input rows
        row0 = row_chunk * VECTOR
        col_block = col_chunk // 4  # the 32-column block: which byte of a scale word

        # ---- loads: 8 scale words, then 8 input rows x 8 bytes ----
        scale_words = cute.make_rmem_tensor((VECTOR,), Uint32)
        data = cute.make_rmem_tensor((VECTOR // 4, VECTOR), Uint32)
        for i in cutlass.range_constexpr(VECTOR):
            row = row0 + i
            scale_words[i] = mS[scale_tile_base + (row % 32) * 4 + row // 32]
        for i in cutlass.range_constexpr(VECTOR):
            data[None, i].store(gQ[0, None, row0 + i, col_chunk].load())

        # ---- per input row: 8 values times its scale; by_row[k, i] = columns 2k, 2k + 1 ----
        by_row = cute.make_rmem_tensor((VECTOR // 2, VECTOR), Uint32)
        row_words = cute.make_rmem_tensor((VECTOR // 2,), Uint32)
        for i in cutlass.range_constexpr(VECTOR):
            scale_bits = scale_bits_of(scale_words[i] >> Uint32(8 * col_block))
            for w in cutlass.range_constexpr(VECTOR // 4):
                dequantize_word(data[w, i], scale_bits, row_words, 2 * w)
            for k in cutlass.range_constexpr(VECTOR // 2):
                by_row[k, i] = row_words[k]

        # ---- per output row (input column): rows 2w, 2w + 1 from two words' halves, 16 B ----
        for k in cutlass.range_constexpr(VECTOR // 2):
            even_col = cute.make_rmem_tensor((VECTOR // 2,), Uint32)
            odd_col = cute.make_rmem_tensor((VECTOR // 2,), Uint32)
            for w in cutlass.range_constexpr(VECTOR // 2):
                even_col[w], odd_col[w] = transpose_halves(by_row[k, 2 * w], by_row[k, 2 * w + 1])
            col = col_chunk * VECTOR + 2 * k
            gY[0, None, col, row_chunk].store(even_col.load())
            gY[0, None, col + 1, row_chunk].store(odd_col.load())
