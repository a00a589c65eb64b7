"""MXFP8 round trip along rows: bf16 [rows, cols] -> bf16 [rows, cols], every value quantised to
MXFP8 (scale per 32 consecutive elements of a row) and dequantised again.

`Mxfp8RoundTripRowwise` is a pure memory-bound CUDA-core kernel (no TMA, no smem), the same
code for sm_90a and sm_100a. It is `Mxfp8QuantizeRowwise` with the E4M3 bytes turned straight
back into bf16 (common/mxfp8_values.py's `round_trip_chunk`) instead of being stored.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32

from .args import global_pointer
from .mxfp8_values import round_trip_chunk

TILE = 128  # rows and columns of one CTA tile
VECTOR = 8  # bf16 elements per thread per pass: one 16-byte load and one 16-byte store
THREADS = 256


@dataclass(frozen=True)
class Mxfp8RoundTripRowwise:
    """Replace each value of a bf16 matrix by its MXFP8 round trip along the row.

    The result is `mok.reference.mxfp8_round_trip(input)` bit for bit: the values
    `Mxfp8QuantizeRowwise` would quantise to, dequantised (E4M3 value times its power-of-two
    scale is exact in bf16).

    Kernel parameters (in this order): `input_ptr` (bf16 [num_rows, num_cols] row-major),
    `output_ptr` (bf16 [num_rows, num_cols] row-major), `num_rows`, `num_cols` (int32).

    Constraints (the caller checks them; the kernel does not):
    - num_rows % 128 == 0 and num_cols % 128 == 0, both > 0 (element offsets are 64-bit).
    - both pointers 16-byte aligned and contiguous; output_ptr == input_ptr (in place) is
      allowed, any other overlap is not.
    - launch: grid (num_cols/128, num_rows/128, 1), block (256, 1, 1), no dynamic smem,
      cluster (1, 1, 1). num_rows/128 <= 65535 (grid.y limit).

    Math, bit-exact (SEMANTICS.md §5): per 32 consecutive elements of a row, the scale byte and
    the E4M3 bytes exactly as `Mxfp8QuantizeRowwise` computes them; each output = the E4M3
    value (cvt.rn.f16x2.e4m3x2, exact) times 2^(byte - 127) (mul.rn.f32, exact), converted to
    bf16 (exact: at most 4 significant bits in bf16's exponent range). NaN or infinite inputs
    give unspecified results.

    Work split (as `Mxfp8QuantizeRowwise`): CTA = one 128x128 tile; thread = 8 consecutive
    columns of 8 rows (one row per pass, 16 rows per pass); the 4 adjacent lanes of a
    32-element block reduce amax with 2 shuffles. In place is safe: a thread reads exactly the
    elements it writes, all of them before its first store, and shares only registers.
    """

    @property
    def threads(self) -> int:
        return THREADS

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(BFloat16, 16),
            global_pointer(BFloat16, 16),
            Int32(0),
            Int32(0),
        )

    @cute.jit
    def __call__(
        self,
        input_ptr: cute.Pointer,
        output_ptr: cute.Pointer,
        num_rows: Int32,
        num_cols: Int32,
    ):
        self.kernel(input_ptr, output_ptr, num_rows, num_cols).launch(
            grid=[num_cols // TILE, num_rows // TILE, 1], block=[THREADS, 1, 1]
        )

    @cute.kernel
    def kernel(
        self,
        input_ptr: cute.Pointer,
        output_ptr: cute.Pointer,
        num_rows: Int32,
        num_cols: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile_col, tile_row, _ = cute.arch.block_idx()
        # The documented alignment lets CuTe prove every 8-element chunk is 16-byte aligned;
        # 64-bit row strides keep row * num_cols from overflowing int32.
        num_cols = cute.assume(num_cols, divby=TILE)
        num_rows = cute.assume(num_rows, divby=TILE)

        # ---- views: global tensors -> this CTA's tile -> 8-element chunks ----
        mX = cute.make_tensor(
            input_ptr,
            cute.make_layout(
                (num_rows, num_cols), stride=(cute.assume(Int64(num_cols), divby=TILE), 1)
            ),
        )
        # The bf16 output viewed as 32-bit words (bf16x2), the form the round trip returns.
        words_per_row = num_cols // 2
        mY = cute.make_tensor(
            cute.recast_ptr(output_ptr, dtype=Uint32),
            cute.make_layout(
                (num_rows, words_per_row),
                stride=(cute.assume(Int64(words_per_row), divby=TILE // 2), 1),
            ),
        )
        gX = cute.flat_divide(
            cute.local_tile(mX, (TILE, TILE), (tile_row, tile_col)), (1, VECTOR)
        )  # (1, 8, 128, 16)
        gY = cute.flat_divide(
            cute.local_tile(mY, (TILE, TILE // 2), (tile_row, tile_col)), (1, VECTOR // 2)
        )  # (1, 4, 128, 16)

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
