"""Gate/up GEMM with SwiGLU fused (SEMANTICS §2), for every routed row r of expert e:

    gate[r], up[r] = bf16(x[r] @ W_gate[e].T), bf16(x[r] @ W_up[e].T)
    hidden[r]      = bf16(SiLU(g) * u),  g, u = fp32(gate), fp32(up), clamped first if has_limit

One 128 x 256 tile is the gate and up blocks of the same 128 columns (B0 = W_gate rows, B1 =
W_up rows), so gate[i, j] and up[i, j] land in the same thread. The crew computes SwiGLU from
the handed-off bf16 values while the consumers run the next mainloop. The MXFP8 forward also
writes each hidden row's MXFP8 round trip along I (`rounded_ptr`), the down GEMM's operand.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64

from ..common.mxfp8_values import store_round_trip
from . import gemm_engine as engine
from .gemm_engine import TILE_K, TILE_M, TILE_N

# WaitPhase id (mok.runtime.WaitPhase, a wire format) of a down task waiting for hidden rows.
PHASE_GATE_UP_GEMM = 6


def producer_loads(ring, smem, tma, hidden_size, gate_up_expert_rows):
    """Producer: `load(state, expert, col_tile, row_tile)` of a gate/up task over `tma` = (tma_x,
    mX, tma_wg, mWg, tma_wu, mWu) into `smem` = (sA, sB0, sB1). The weights' [rows, H] views
    hold expert e's rows from e * gate_up_expert_rows (I, or 2 I in a fused [E, 2 I, H])."""
    sA, sB0, sB1 = smem
    tma_x, mX, tma_wg, mWg, tma_wu, mWu = tma
    tXsX, tXgX = engine.partition_tma_load(tma_x, sA, mX, (TILE_M, TILE_K))
    tGsG, tGgG = engine.partition_tma_load(tma_wg, sB0, mWg, (TILE_N, TILE_K))
    tUsU, tUgU = engine.partition_tma_load(tma_wu, sB1, mWu, (TILE_N, TILE_K))
    expert_tiles = gate_up_expert_rows // TILE_N

    def load(state, expert, col_tile, row_tile):
        weight_tile = expert * expert_tiles + col_tile
        loads = (
            (tma_x, tXgX, row_tile, None, tXsX),
            (tma_wg, tGgG, weight_tile, None, tGsG),
            (tma_wu, tUgU, weight_tile, None, tUsU),
        )
        return engine.load_k_tiles(ring, state, hidden_size // TILE_K, loads)

    return load


def crew_stores(hidden_ptr, gate_ptr, up_ptr, intermediate_size, has_limit, swiglu_limit,
                after_tile=None, after_args=(), rounded_ptr=None) -> dict:  # fmt: skip
    """Crew store keywords (task_walk.store_phase) of gate/up tiles: gate, up, hidden [C, I] in
    place (and hidden's MXFP8 round trip at `rounded_ptr`, if given), `after_tile(lane,
    first_row, *after_args)` after each."""
    row_stride = cute.assume(Int64(intermediate_size), divby=TILE_N)
    stores = dict(
        tile_cols=TILE_N, slots=None, store_chunk=store_swiglu_chunk,
        store_args=(hidden_ptr, gate_ptr, up_ptr, row_stride, has_limit, swiglu_limit,
                    rounded_ptr),
    )  # fmt: skip
    if after_tile is not None:
        stores.update(after_tile=after_tile, after_args=after_args)
    return stores


@cute.jit
def store_swiglu_chunk(
    gate_chunk, up_chunk, target, chunk, first_col, hidden_ptr, gate_ptr, up_ptr, row_stride,
    has_limit, swiglu_limit, rounded_ptr,
):  # fmt: skip
    """One 16-byte chunk of row `target`: gate, up, and hidden = SwiGLU of the bf16-rounded
    values in fp32 (mok.reference.swiglu); with `rounded_ptr`, hidden's MXFP8 round trip there
    (the crew's lanes 4q .. 4q + 3 hold one 32-column block: copy_out's chunk order)."""
    at = cute.assume(target * row_stride + Int64(first_col + chunk * 8), divby=8)
    cute.make_tensor(gate_ptr + at, cute.make_layout(8)).store(gate_chunk)
    cute.make_tensor(up_ptr + at, cute.make_layout(8)).store(up_chunk)
    gate = cute.make_rmem_tensor((8,), BFloat16)
    up = cute.make_rmem_tensor((8,), BFloat16)
    hidden = cute.make_rmem_tensor((8,), Float32)
    gate.store(gate_chunk)
    up.store(up_chunk)
    for i in cutlass.range_constexpr(8):
        g = Float32(gate[i])
        u = Float32(up[i])
        if has_limit != 0:
            g = cutlass.min(g, swiglu_limit)
            u = cutlass.max(cutlass.min(u, swiglu_limit), -swiglu_limit)
        hidden[i] = g / (Float32(1.0) + cute.math.exp(-g)) * u
    hidden_bf16 = hidden.load().to(BFloat16)
    cute.make_tensor(hidden_ptr + at, cute.make_layout(8)).store(hidden_bf16)
    if cutlass.const_expr(rounded_ptr is not None):
        # The round trip of the bf16 hidden values, as mok.reference rounds hidden first.
        store_round_trip(hidden_bf16, rounded_ptr, at)
