"""MXFP8 dequantisation of a transposed copy back into the original layout: E4M3 [cols, rows]
(quantised along its rows, `Mxfp8QuantizeTransposed`'s output) + UE8M0 scales -> bf16
[rows, cols].

`Mxfp8DequantizeTransposed` is a pure memory-bound CUDA-core kernel (no TMA, no smem), the same
code for sm_90a and sm_100a: the inverse of `Mxfp8QuantizeTransposed`, exact, the transpose
done in registers (one pass over memory instead of a dequantisation and a transposing copy).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64, Uint8, Uint32

from .args import global_pointer
from .mxfp8_values import dequantize_word, scale_bits_of

TILE = 128  # input rows and columns of one CTA tile (= one 512-byte scale tile)
VECTOR = 8  # a thread owns VECTOR input rows x VECTOR input columns
THREADS = 256
LOW_HALF = 0x0000FFFF
HIGH_HALF = 0xFFFF0000


@dataclass(frozen=True)
class Mxfp8DequantizeTransposed:
    """bf16 values, in the original [num_cols, num_rows] layout, of MXFP8 data that quantised
    the transpose: input E4M3 [num_rows, num_cols] with a scale per 32 consecutive elements of
    each input row (what `Mxfp8QuantizeTransposed` writes for a bf16 [num_cols, num_rows]).

    The result is `mok.reference.mxfp8_dequantize(data, scales, transpose=True)` in bf16 bit
    for bit (that is, `Mxfp8DequantizeRowwise`'s output transposed).

    Kernel parameters (in this order): `input_ptr` (E4M3 bytes [batch, num_rows, num_cols]
    row-major), `scale_ptr` (uint8 [batch * num_rows/128, num_cols/128, 32, 16]), `output_ptr`
    (bf16 [batch, num_cols, num_rows] row-major), `num_rows`, `num_cols` (int32; one input
    matrix's). Matrix b of the batch is grid.z = b.

    Constraints (the caller checks them; the kernel does not):
    - num_rows % 128 == 0 and num_cols % 128 == 0, both > 0; batch * num_rows * num_cols <
      2^36 (element offsets are 64-bit; scale offsets are int32).
    - all three pointers 16-byte aligned, contiguous, not overlapping.
    - launch: grid (num_cols/128, num_rows/128, batch), block (256, 1, 1), no dynamic smem,
      cluster (1, 1, 1). num_rows/128 and batch <= 65535 (grid.y, grid.z limits).

    Math, bit-exact: `Mxfp8DequantizeRowwise`'s (E4M3 -> f16 exact, times 2^(byte - 127) with
    mul.rn.f32, to bf16), with the same scale layout.

    Work split: CTA = one 128x128 input tile, 8 warps as 4 (32-row groups) x 2 (64-column
    groups); lane = 4 (8-row chunks) x 8 (8-column chunks). A thread loads 8 input rows x 8
    bytes (their 8 scale words first), dequantises them into bf16x2 words along the input
    rows, turns each 2x2 block of 16-bit halves around, and stores 8 output rows x 16 bytes.
    """

    @property
    def threads(self) -> int:
        return THREADS

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(Uint8, 16),
            global_pointer(Uint8, 16),
            global_pointer(BFloat16, 16),
            Int32(0),
            Int32(0),
        )

    @cute.jit
    def __call__(
        self,
        input_ptr: cute.Pointer,
        scale_ptr: cute.Pointer,
        output_ptr: cute.Pointer,
        num_rows: Int32,
        num_cols: Int32,
    ):
        self.kernel(input_ptr, scale_ptr, output_ptr, num_rows, num_cols).launch(
            grid=[num_cols // TILE, num_rows // TILE, 1], block=[THREADS, 1, 1]
        )  # the runtime launches the cubin with its own grid (z = batch)

    @cute.kernel
    def kernel(
        self,
        input_ptr: cute.Pointer,
        scale_ptr: cute.Pointer,
        output_ptr: cute.Pointer,
        num_rows: Int32,
        num_cols: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile_col, tile_row, matrix = cute.arch.block_idx()
        num_cols = cute.assume(num_cols, divby=TILE)
        num_rows = cute.assume(num_rows, divby=TILE)
        # Matrix `matrix` of the batch: its elements (64-bit), its scale words (int32).
        elements = cute.assume(Int64(matrix) * Int64(num_rows) * Int64(num_cols), divby=TILE * TILE)
        input_ptr = input_ptr + elements
        output_ptr = output_ptr + elements
        matrix_scale_words = matrix * (num_rows // TILE) * (num_cols // TILE) * TILE

        # ---- views: E4M3 input [rows, cols] and bf16 output [cols, rows] as 32-bit words ----
        in_words_per_row = num_cols // 4
        mQ = cute.make_tensor(
            cute.recast_ptr(input_ptr, dtype=Uint32),
            cute.make_layout(
                (num_rows, in_words_per_row),
                stride=(cute.assume(Int64(in_words_per_row), divby=TILE // 4), 1),
            ),
        )
        out_words_per_row = num_rows // 2
        mY = cute.make_tensor(
            cute.recast_ptr(output_ptr, dtype=Uint32),
            cute.make_layout(
                (num_cols, out_words_per_row),
                stride=(cute.assume(Int64(out_words_per_row), divby=TILE // 2), 1),
            ),
        )
        # One word per (input row, 128-column tile): its 4 blocks' scale bytes.
        mS = cute.make_tensor(
            cute.recast_ptr(scale_ptr, dtype=Uint32),
            cute.make_layout(num_rows * (num_cols // TILE)),
        )
        gQ = cute.flat_divide(
            cute.local_tile(mQ, (TILE, TILE // 4), (tile_row, tile_col)), (1, VECTOR // 4)
        )  # (1, 2, 128 input rows, 16 column chunks)
        gY = cute.flat_divide(
            cute.local_tile(mY, (TILE, TILE // 2), (tile_col, tile_row)), (1, VECTOR // 2)
        )  # (1, 4, 128 output rows = input columns, 16 chunks of input rows)
        scale_tile_base = (
            matrix_scale_words + (tile_row * (num_cols // TILE) + tile_col) * TILE
        )  # in words

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
                upper, lower = by_row[k, 2 * w], by_row[k, 2 * w + 1]
                even_col[w] = (upper & Uint32(LOW_HALF)) | (lower << Uint32(16))
                odd_col[w] = (upper >> Uint32(16)) | (lower & Uint32(HIGH_HALF))
            col = col_chunk * VECTOR + 2 * k
            gY[0, None, col, row_chunk].store(even_col.load())
            gY[0, None, col + 1, row_chunk].store(odd_col.load())
