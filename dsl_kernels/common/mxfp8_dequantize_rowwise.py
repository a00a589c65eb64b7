"""MXFP8 dequantisation along rows: E4M3 [rows, cols] + UE8M0 scales -> bf16 [rows, cols].

`Mxfp8DequantizeRowwise` is a pure memory-bound CUDA-core kernel (no TMA, no smem), the same
code for sm_90a and sm_100a: the inverse of `Mxfp8QuantizeRowwise`'s layout, exact.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64, Uint8, Uint32

from .args import global_pointer
from .mxfp8_values import dequantize_word, scale_bits_of

TILE = 128  # rows and columns of one CTA tile (= one 512-byte scale tile)
VECTOR = 8  # elements per thread per pass: an 8-byte load, a 16-byte store
BLOCK = 32  # elements that share one scale
THREADS = 256


@dataclass(frozen=True)
class Mxfp8DequantizeRowwise:
    """bf16 values of MXFP8 data quantised along rows (scale per 32 consecutive elements of a row).

    The result is `mok.reference.mxfp8_dequantize(data, scales).to(torch.bfloat16)` bit for
    bit, for the (data, scales) `Mxfp8QuantizeRowwise` writes.

    Kernel parameters (in this order): `input_ptr` (E4M3 bytes [num_rows, num_cols]
    row-major), `scale_ptr` (uint8 [num_rows/128, num_cols/128, 32, 16]), `output_ptr` (bf16
    [num_rows, num_cols] row-major), `num_rows`, `num_cols` (int32).

    Constraints (the caller checks them; the kernel does not):
    - num_rows % 128 == 0 and num_cols % 128 == 0, both > 0; num_rows * num_cols < 2^36
      (element offsets are 64-bit; scale offsets are int32).
    - all three pointers 16-byte aligned, contiguous, not overlapping.
    - launch: grid (num_cols/128, num_rows/128, 1), block (256, 1, 1), no dynamic smem,
      cluster (1, 1, 1). num_rows/128 <= 65535 (grid.y limit).

    Math, bit-exact (SEMANTICS.md §5): element = E4M3 value (cvt.rn.f16x2.e4m3x2, exact) times
    the fp32 whose bits are byte << 23 (2^(byte - 127); byte 0 gives +0.0, as the reference
    builds it) with mul.rn.f32, rounded to bf16 (cvt.rn.bf16x2.f32, the reference's fp32 -> bf16
    rounding; exact for every byte `Mxfp8QuantizeRowwise` writes, in [88, 246]). E4M3 NaN bytes
    and scale byte 255 (infinity) give NaNs whose bits may differ from the reference's.

    Scale layout (as `Mxfp8QuantizeRowwise` writes it): byte ((r//128)*(cols/128) + c//128)*512
    + (r%32)*16 + ((r%128)//32)*4 + (c%128)//32 holds the scale of row r, columns c..c+31; the
    4 bytes of one row in one tile are one 32-bit word, which each thread loads whole.

    Work split (as `Mxfp8QuantizeRowwise`): CTA = one 128x128 tile; thread = 8 consecutive
    columns of 8 rows (one row per pass, 16 rows per pass).
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
        )

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
        tile_col, tile_row, _ = cute.arch.block_idx()
        # The documented alignment lets CuTe prove every chunk is 8- (input) or 16-byte
        # (output) aligned; 64-bit row strides keep row * num_cols from overflowing int32.
        num_cols = cute.assume(num_cols, divby=TILE)
        num_rows = cute.assume(num_rows, divby=TILE)

        # ---- views: E4M3 input and bf16 output as 32-bit words, scales as words ----
        in_words_per_row = num_cols // 4
        mQ = cute.make_tensor(
            cute.recast_ptr(input_ptr, dtype=Uint32),
            cute.make_layout(
                (num_rows, in_words_per_row),
                stride=(cute.assume(Int64(in_words_per_row), divby=TILE // 4), 1),
            ),
        )
        out_words_per_row = num_cols // 2
        mY = cute.make_tensor(
            cute.recast_ptr(output_ptr, dtype=Uint32),
            cute.make_layout(
                (num_rows, out_words_per_row),
                stride=(cute.assume(Int64(out_words_per_row), divby=TILE // 2), 1),
            ),
        )
        # One word per (row, 128-column tile): 4 blocks x 1 byte.
        mS = cute.make_tensor(
            cute.recast_ptr(scale_ptr, dtype=Uint32),
            cute.make_layout(num_rows * (num_cols // TILE)),
        )
        gQ = cute.flat_divide(
            cute.local_tile(mQ, (TILE, TILE // 4), (tile_row, tile_col)), (1, VECTOR // 4)
        )  # (1, 2, 128, 16)
        gY = cute.flat_divide(
            cute.local_tile(mY, (TILE, TILE // 2), (tile_row, tile_col)), (1, VECTOR // 2)
        )  # (1, 4, 128, 16)
        scale_tile_base = (tile_row * (num_cols // TILE) + tile_col) * TILE  # in words

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
