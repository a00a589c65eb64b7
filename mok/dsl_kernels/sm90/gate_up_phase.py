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
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.mxfp8_values import store_round_trip
from . import gemm_engine as engine
from .gemm_engine import TILE_K, TILE_M, TILE_N

# WaitPhase id (mok.runtime.WaitPhase, a wire format) of a down task waiting for hidden rows.
PHASE_GATE_UP_GEMM = 6


# Named barriers of the producer warp and the loader warpgroup (ids past the crew's 3-6, the
# combine's 7 and the schedule's 8): the loaders arrive on TASK_FREE once they have read the
# published task; the producer waits on it, publishes, and arrives on TASK_READY.
TASK_FREE = 9
TASK_READY = 10
LOADER_HANDSHAKE_THREADS = 32 + engine.THREADS_PER_WARPGROUP
# The published task: its row tile (NO_ROWS: the producer is done), its first stage's ring
# index and phase.
HANDSHAKE_WORDS = 3
NO_ROWS = -1


def producer_loads(ring, smem, tma, hidden_size, gate_up_expert_rows, gather=None):
    """Producer: `load(state, expert, col_tile, row_tile)` of a gate/up task over `tma` = (tma_x,
    mX, tma_wg, mWg, tma_wu, mWu) into `smem` = (sA, sB0, sB1). The weights' [rows, H] views
    hold expert e's rows from e * gate_up_expert_rows (I, or 2 I in a fused [E, 2 I, H]).
    `gather` = (an Int32, nonzero: on; the shared Int32 [HANDSHAKE_WORDS] handshake): the ring
    has a loader warpgroup (gemm_engine.make_operand_ring `loader_threads`). When on, the
    producer publishes the task to it (`publish_task`) and loads B alone, the loaders gather
    A's rows from x (`gather_rows`); when off, A comes from x_routed by tma_x and each stage
    makes up the loaders' arrivals."""
    sA, sB0, sB1 = smem
    tma_x, mX, tma_wg, mWg, tma_wu, mWu = tma
    tXsX, tXgX = engine.partition_tma_load(tma_x, sA, mX, (TILE_M, TILE_K))
    tGsG, tGgG = engine.partition_tma_load(tma_wg, sB0, mWg, (TILE_N, TILE_K))
    tUsU, tUgU = engine.partition_tma_load(tma_wu, sB1, mWu, (TILE_N, TILE_K))
    expert_tiles = gate_up_expert_rows // TILE_N
    k_tiles = hidden_size // TILE_K
    loaders = 0 if gather is None else engine.THREADS_PER_WARPGROUP

    def load(state, expert, col_tile, row_tile):
        weight_tile = expert * expert_tiles + col_tile
        weights = (
            (tma_wg, tGgG, weight_tile, None, tGsG),
            (tma_wu, tUgU, weight_tile, None, tUsU),
        )
        if cutlass.const_expr(gather is None):
            return engine.load_k_tiles(ring, state, k_tiles, ((tma_x, tXgX, row_tile, None, tXsX),
                                                              *weights))  # fmt: skip
        return load_task(state, row_tile, weights)

    @cute.jit
    def load_task(state, row_tile, weights):
        gathers, handshake = gather
        if gathers != 0:
            publish_task(handshake, row_tile, state.index, state.phase)
            state = engine.load_b_tiles(ring, state, k_tiles, weights)
        else:
            state = engine.load_k_tiles(
                ring, state, k_tiles, ((tma_x, tXgX, row_tile, None, tXsX), *weights), loaders
            )
        return state

    return load


def handshake_words(at) -> cute.Tensor:
    """The producer-to-loaders handshake: HANDSHAKE_WORDS shared int32 at `at` (a pointer)."""
    return cute.make_tensor(cute.recast_ptr(at, dtype=Int32), cute.make_layout(HANDSHAKE_WORDS))


@cute.jit
def publish_task(handshake, row_tile: Int32, index: Int32, phase: Int32):
    """Producer warp: once the loaders have read the last task, publish this one (row tile, its
    first stage's ring index and phase; NO_ROWS: none left)."""
    cute.arch.barrier(barrier_id=TASK_FREE, number_of_threads=LOADER_HANDSHAKE_THREADS)
    if cute.arch.lane_idx() == 0:
        handshake[0] = row_tile
        handshake[1] = index
        handshake[2] = phase
    cute.arch.barrier_arrive(barrier_id=TASK_READY, number_of_threads=LOADER_HANDSHAKE_THREADS)


@cute.jit
def gather_rows(ring, stages: int, handshake, table, sA, x_at: Int64, hidden_size: Int32,
                rank_of, token_of, topk: Int32, loader: Int32):  # fmt: skip
    """The loader warpgroup (`loader` = its thread 0 .. 127): for each task the producer
    publishes, row `loader` of its row tile in the shared Int32 [TILE_M] `table` (x's row
    peer_token_idx // k, or -1 for padding: zeros), then its warp's rows of A in every stage
    (gemm_engine.gather_stages), until NO_ROWS."""
    warp_rows = (loader // 32) * engine.LOADER_ROWS
    row_bytes = Int64(hidden_size) * Int64(2)
    k_tiles = hidden_size // TILE_K
    stages_at = sA.iterator.toint()
    cute.arch.barrier_arrive(barrier_id=TASK_FREE, number_of_threads=LOADER_HANDSHAKE_THREADS)
    cute.arch.barrier(barrier_id=TASK_READY, number_of_threads=LOADER_HANDSHAKE_THREADS)
    row_tile = handshake[0]
    while row_tile != NO_ROWS:
        state = pipeline.PipelineState(stages, Int32(0), handshake[1], handshake[2])
        cute.arch.barrier_arrive(barrier_id=TASK_FREE, number_of_threads=LOADER_HANDSHAKE_THREADS)
        row = row_tile * TILE_M + loader
        table[loader] = cutlass.select_(rank_of[row] >= 0, token_of[row] // topk, Int32(-1))
        cute.arch.sync_warp()
        engine.gather_stages(ring, state, k_tiles, stages_at, table, x_at, row_bytes, warp_rows)
        # The warp's lanes read one another's table entries: all done before the next task's.
        cute.arch.sync_warp()
        cute.arch.barrier(barrier_id=TASK_READY, number_of_threads=LOADER_HANDSHAKE_THREADS)
        row_tile = handshake[0]


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
