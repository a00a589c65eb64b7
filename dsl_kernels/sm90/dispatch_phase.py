"""The megakernels' dispatch (EP group of one): every thread of a dispatching CTA (the comm CTAs,
or with none every CTA) copies its row tiles' routed rows before the roles split, releasing each
tile's counter once written.

    out[r] = src[peer_token_idx[r] // k]                        (forward: x -> x_routed)
    out[r] = bf16(w[peer_token_idx[r]] * float(src[...]))      (scaled, backward: dY -> dY_e)
    out[r] = 0                                                  padding rows (peer_rank < 0)

Scaled: one fp32 `mul.rn` (no fma contraction), one rounding: bit for bit common/gather_rows.py.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.bounded_wait import red_add_release_gpu_s32
from ..common.ptx import mul_rn
from ..common.row_chunks import VECTOR, chunked_row_views
from .gemm_phases import THREADS, TILE_M

# WaitPhase ids (mok.runtime.WaitPhase, a wire format) of tasks waiting for dispatched rows.
PHASE_DISPATCH = 5
PHASE_BACKWARD_DISPATCH = 9
# Each thread keeps DISPATCH_BATCH 16-byte loads in flight (384 threads: 48 KiB per SM), every
# load of a batch issued before its stores.
DISPATCH_BATCH = 8


@cute.jit
def dispatch_rows(
    src_ptr, out_ptr, peer_rank_ptr, peer_token_idx_ptr, row_tiles_total, hidden_size, topk,
    num_src_rows, capacity, dispatched, table, tidx, first_tile, tile_stride, weight_ptr=None,
):  # fmt: skip
    """All 384 threads: row tiles first_tile, + tile_stride, ... of `out` (bf16 [capacity, H]) from
    `src` [num_src_rows, H] (`weight_ptr` fp32 [T * k], or None: unscaled). A tile's 128 sources go
    to `table` (shared Int32 [128]); each warp copies whole rows. Then fence for the async proxy
    (TMA readers), meet, and thread 0 releases counter m at `dispatched` + 4 m."""
    scaled = weight_ptr is not None
    chunks, (mOut, mSrc) = chunked_row_views(
        hidden_size, (out_ptr, capacity), (src_ptr, num_src_rows)
    )
    rank = cute.make_tensor(peer_rank_ptr, cute.make_layout(capacity))
    slot_of = cute.make_tensor(peer_token_idx_ptr, cute.make_layout(capacity))
    weight = None
    scaled_values = None
    if cutlass.const_expr(scaled):
        weight = cute.make_tensor(weight_ptr, cute.make_layout(1 << 30))
        scaled_values = cute.make_rmem_tensor((VECTOR,), Float32)
    warp = tidx // 32
    lane = tidx % 32
    values = cute.make_rmem_tensor((VECTOR, DISPATCH_BATCH), BFloat16)
    for row_tile in cutlass.range(first_tile, row_tiles_total, tile_stride, unroll=1):
        first_row = row_tile * TILE_M
        cute.arch.sync_threads()  # the previous tile's copy is done with `table`
        if tidx < TILE_M:
            row = first_row + tidx
            # The source row (unscaled) or the slot, whose weight is needed too (scaled).
            if cutlass.const_expr(scaled):
                table[tidx] = cutlass.select_(rank[row] >= 0, slot_of[row], Int32(-1))
            else:
                table[tidx] = cutlass.select_(rank[row] >= 0, slot_of[row] // topk, Int32(-1))
        cute.arch.sync_threads()
        for r in cutlass.range(warp, TILE_M, THREADS // 32, unroll=1):
            source = table[r]
            w = None
            if cutlass.const_expr(scaled):
                w = Float32(0.0)
                if source >= 0:
                    w = weight[source]
                    source = source // topk
            row = first_row + r
            for base in cutlass.range(lane, chunks, 32 * DISPATCH_BATCH, unroll=1):
                for j in cutlass.range_constexpr(DISPATCH_BATCH):
                    chunk = base + 32 * j
                    values[None, j].fill(0.0)
                    if chunk < chunks:
                        if source >= 0:
                            values[None, j].store(mSrc[None, chunk, source].load())
                for j in cutlass.range_constexpr(DISPATCH_BATCH):
                    chunk = base + 32 * j
                    if chunk < chunks:
                        if cutlass.const_expr(scaled):
                            # Padding rows: w = 0 times +0.0 is +0.0.
                            scaled_values.store(values[None, j].load().to(Float32))
                            for i in cutlass.range_constexpr(VECTOR):
                                scaled_values[i] = mul_rn(w, scaled_values[i])
                            mOut[None, chunk, row].store(scaled_values.load().to(BFloat16))
                        else:
                            mOut[None, chunk, row].store(values[None, j].load())
        cute.arch.fence_proxy("async.global")
        cute.arch.sync_threads()
        if tidx == 0:
            red_add_release_gpu_s32(dispatched + Int64(4) * Int64(row_tile), Int32(1))
