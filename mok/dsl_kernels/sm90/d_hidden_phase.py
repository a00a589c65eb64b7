"""d_hidden GEMM with the SwiGLU backward fused (SEMANTICS §2), for every routed row r of expert e:

    d_hidden[r]  = dY_e[r] @ W_down[e]            (fp32, never stored)
    d_gate, d_up = mok.reference.swiglu_backward(d_hidden, gate[r], up[r], limit)
    partials[r, b] = sum over block b's 128 columns of bf16(hidden)[r, c] * d_hidden[r, c]

W_down is read as stored ([H, I]: B MN-major). The MXFP8 backward reads dY_e's round trip along H
and the context's gate and up round-tripped along I, and its crew also writes d_gate's and
d_up's round trips along I (`crew_stores(rounded=)`). Partials sum in a fixed order (columns increasing,
then lane butterfly ^1, ^2): sum_b partials[r, b] = w * <dY, y>. ex2.approx and rcp.approx cost
a few fp32 ulp, so a bf16 output may differ from the reference by 1 ulp on a rounding boundary.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.bounded_wait import red_add_release_gpu_s32
from ..common.mxfp8_values import store_round_trip
from ..common.ptx import prefetch_l2
from . import gemm_engine as engine
from .epilogue_warps import CREW, store_split
from .gemm_engine import TILE_K, TILE_M, TILE_N

# WaitPhase id (mok.runtime.WaitPhase, a wire format) of a d_x task waiting for d_gate/d_up rows.
PHASE_BACKWARD_DHIDDEN_GEMM = 10


def producer_loads(ring, smem, tma, hidden_size, intermediate_size, gate_ptr, up_ptr):
    """Producer: `load(...)` of a d_hidden task (gate/up prefetched to L2, then A = dY_e, B = W_down)."""
    sA, sB0, sB1 = smem
    tma_dy, mDy, tma_wd, mWd = tma
    tDYsA, tDYgA = engine.partition_tma_load(tma_dy, sA, mDy, (TILE_M, TILE_K))
    tWDsB0, tWDsB1, tWDgB = engine.partition_tma_load_pair(tma_wd, sB0, sB1, mWd)
    lane = cute.arch.lane_idx()
    i_stride = cute.assume(Int64(intermediate_size), divby=2 * TILE_N)

    def load(state, expert, col_tile, row_tile):
        prefetch_gate_up(lane, row_tile * TILE_M, col_tile * (2 * TILE_N), gate_ptr, up_ptr,
                         i_stride, threads=32)  # fmt: skip
        b_k_base = expert * (hidden_size // TILE_K)
        loads = (
            (tma_dy, tDYgA, row_tile, None, tDYsA),
            (tma_wd, tWDgB, 2 * col_tile, b_k_base, tWDsB0),
            (tma_wd, tWDgB, 2 * col_tile + 1, b_k_base, tWDsB1),
        )
        return engine.load_k_tiles(ring, state, hidden_size // TILE_K, loads)

    return load


def crew_stores(d_gate_ptr, d_up_ptr, intermediate_size, dgu_done, dgu_total,
                rounded=None) -> dict:  # fmt: skip
    """Crew store keywords of d_hidden tiles: d_gate, d_up in place (and with `rounded` = (bf16
    pointer, bf16 pointer) their MXFP8 round trips along I there, the d_x GEMM's operands), two
    hand-offs, then release."""
    row_stride = cute.assume(Int64(intermediate_size), divby=2 * TILE_N)
    store_chunk, store_args = store_split, (d_gate_ptr, d_up_ptr, row_stride)
    if rounded is not None:
        store_chunk, store_args = store_split_rounded, (*store_args, *rounded)
    return dict(
        tile_cols=2 * TILE_N, slots=None, store_chunk=store_chunk, store_args=store_args,
        after_tile=release_d_hidden_tile, after_args=(dgu_done, dgu_total), handoffs=2,
    )  # fmt: skip


@cute.jit
def store_split_rounded(d_gate, d_up, target, chunk, first_col, d_gate_ptr, d_up_ptr, row_stride,
                        d_gate_rounded_ptr, d_up_rounded_ptr):  # fmt: skip
    """`store_split`, then each chunk's MXFP8 round trip (the crew's lanes 4q .. 4q + 3 hold one
    32-column block: copy_out's chunk order)."""
    store_split(d_gate, d_up, target, chunk, first_col, d_gate_ptr, d_up_ptr, row_stride)
    at = cute.assume(target * row_stride + Int64(first_col + chunk * 8), divby=8)
    store_round_trip(d_gate, d_gate_rounded_ptr, at)
    store_round_trip(d_up, d_up_rounded_ptr, at)


@cute.jit
def release_d_hidden_tile(lane, first_row, dgu_done, dgu_total):
    """After a d_hidden tile: release its row tile's counter (d_x waits) and the tile count (weights)."""
    CREW.release_row_tile(lane, first_row, dgu_done)
    if lane == 0:
        red_add_release_gpu_s32(dgu_total, Int32(1))


@cute.jit
def prefetch_gate_up(
    lane, first_row, first_col, gate_ptr, up_ptr, row_stride, threads: int = CREW.threads
):
    """Crew (or the producer warp, `threads` 32) during a d_hidden tile's mainloop: prefetch its
    gate and up (128 rows x 256 columns, 4 x 128-byte lines a row) into L2 for the epilogue."""
    lines_per_row = 2 * TILE_N * 2 // 128
    per_tensor = TILE_M * lines_per_row
    for idx in cutlass.range(lane, 2 * per_tensor, threads, unroll=1):
        base = gate_ptr.toint()
        if idx >= per_tensor:
            base = up_ptr.toint()
        line = idx % per_tensor
        row = Int64(first_row + line // lines_per_row)
        col = Int64(first_col + (line % lines_per_row) * 64)
        prefetch_l2(base + (row * row_stride + col) * 2)


@cute.jit
def output_tile(ptr: cute.Pointer, first_row: Int32, first_col: Int32, n_size: Int32):
    """The 128 x 128 block at (first_row, first_col) of a row-major [*, n_size] tensor."""
    return engine.output_tile(ptr, None, first_row, first_col, n_size, 2 * TILE_N)


@cute.jit
def swiglu_backward(
    thr_mma,
    acc: cute.Tensor,
    gate_ptr: cute.Pointer,
    up_ptr: cute.Pointer,
    partials_ptr: cute.Pointer,
    first_row: Int32,
    first_col: Int32,
    n_size: Int32,
    has_limit: Int32,
    swiglu_limit: Float32,
    buffers,
):
    """d_gate, d_up of a 128 x 128 block (mok.reference order) into `buffers`; per-row partials."""
    gate = cute.make_rmem_tensor(acc.shape, BFloat16)
    up = cute.make_rmem_tensor(acc.shape, BFloat16)
    cute.autovec_copy(
        thr_mma.partition_C(output_tile(gate_ptr, first_row, first_col, n_size)), gate
    )
    cute.autovec_copy(thr_mma.partition_C(output_tile(up_ptr, first_row, first_col, n_size)), up)
    # Results overwrite their bf16 inputs once both are read: no fp32 fragment beyond the two
    # accumulators (a third spills at 232 registers).
    # Branch-free: with no limit the clamps run against +inf, the identity (NaN still propagates).
    limit = swiglu_limit
    if has_limit == 0:
        limit = Float32(float("inf"))
    # Rows r0 and r0 + 8: element i lies on row r0 + 8 * ((i // 2) % 2), a static choice.
    row0, row1 = engine.accumulator_rows(thr_mma)
    partial0 = Float32(0.0)
    partial1 = Float32(0.0)
    for i in cutlass.range_constexpr(cute.size(acc)):
        gate_raw = Float32(gate[i])
        up_raw = Float32(up[i])
        # g's min as one NaN-propagating FMNMX.NaN (min(a, b) = -max(-a, -b)); the same
        # for u's clamp made ptxas spill (28 bytes), so it stays a compare and selects.
        g = -cute.arch.fmax(-gate_raw, -limit, nan=True)
        u = cutlass.max(cutlass.min(up_raw, limit), -limit)
        # ex2.approx and rcp.approx (a few fp32 ulp, below the bf16 rounding): the epilogue is bound
        # by its instruction count, and IEEE expf and division cost far more instructions.
        sig = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-g, fastmath=True))
        dh = acc[i]
        silu = g * sig
        d_up_i = dh * silu
        hidden_i = Float32((silu * u).to(BFloat16))
        if cutlass.const_expr((i // 2) % 2 == 0):
            partial0 = partial0 + hidden_i * dh
        else:
            partial1 = partial1 + hidden_i * dh
        d_gate_i = (dh * u) * (sig * (Float32(1.0) + g * (Float32(1.0) - sig)))
        # Zero where the clamp was active (torch.where(gate > limit, 0, d_gate) etc.).
        d_gate_i = Float32(cutlass.select_(gate_raw > limit, Float32(0.0), d_gate_i))
        d_up_i = Float32(
            cutlass.select_(cutlass.max(up_raw, -up_raw) > limit, Float32(0.0), d_up_i)
        )
        gate[i] = d_gate_i.to(BFloat16)
        up[i] = d_up_i.to(BFloat16)
    # The partials before the hand-off: the crew's tile-count release, after the hand-off's
    # barrier, then covers them (the backward megakernel's finish reads them).
    store_partials(partials_ptr, (row0, row1), (partial0, partial1), first_row,
                         first_col, n_size)  # fmt: skip
    CREW.hand_off_bf16(thr_mma, (gate, up), buffers)


@cute.jit
def store_partials(
    partials_ptr: cute.Pointer,
    rows: tuple,
    row_partials: tuple,
    first_row: Int32,
    first_col: Int32,
    n_size: Int32,
):
    """Sum each row's partial over the 4 lanes that hold it (fixed butterfly order) and
    store it from lane 0 of the quad into partials[row, first_col / 128]."""
    row0, row1 = rows
    partial0, partial1 = row_partials
    for offset in cutlass.range_constexpr(2):
        partial0 = partial0 + cute.arch.shuffle_sync_bfly(partial0, offset=1 << offset)
        partial1 = partial1 + cute.arch.shuffle_sync_bfly(partial1, offset=1 << offset)
    lane = cute.arch.lane_idx()
    if lane % 4 == 0:
        blocks = n_size // TILE_N
        partials = cute.make_tensor(partials_ptr, cute.make_layout((1 << 30, blocks),
                                                                    stride=(blocks, 1)))  # fmt: skip
        block = first_col // TILE_N
        partials[first_row + row0, block] = partial0
        partials[first_row + row1, block] = partial1
