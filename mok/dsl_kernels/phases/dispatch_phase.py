"""The megakernels' dispatch, a pull: every thread of a dispatching CTA (the comm CTAs, or with
none every CTA) copies routed row tiles from the source ranks before the roles split,
releasing each tile's counter once written. With p = peer_rank[r], t = peer_token_idx[r] // k:

    out[r] = src_p[t]                                           (forward: x -> x_routed)
    out[r] = bf16(w_p[peer_token_idx[r]] * float(src_p[t]))    (scaled, backward: dY -> dY_e)
    out[r] = 0                                                  padding rows (p < 0)

src_p is this rank's own tensor for p == ep_rank and the peer's symmetric buffer (an address
from the peer table) otherwise; the peers wrote them before the group's start barrier, whose
system-scope acquire orders these plain loads after their writes.

Row tiles are taken by ticket (one `atom.add` on a zeroed int32 per tile), not by CTA index: a
CTA leaves dispatch only once every row tile has been taken by a running CTA, and copying waits
on nothing, so every tile gets copied whichever CTAs are resident. Which CTA copies a tile
changes from run to run; the bytes written do not.

Scaled: one fp32 `mul.rn` (no fma contraction), one rounding: bit for bit kernels/gather_rows.py.
With `rounded_ptr` (the MXFP8 megakernels) each written row is also written there as its MXFP8
round trip along H (common/mxfp8_values.py), the first GEMM's operand (x, or dY_e); the lanes of a 32-element block
are adjacent and every lane of a warp takes the same chunk branch, as the shuffles need.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32

from ..common.bounded_wait import atom_add_relaxed_gpu_s32, red_add_release_gpu_s32
from ..common.mxfp8_values import round_trip_chunk
from ..common.peers import RANK_UNIT, rank_address
from ..common.ptx import mul_rn
from ..common.row_chunks import VECTOR, chunked_row_views
from .tickets import Tickets
from .tiles import TILE_M

# WaitPhase ids (mok.runtime.WaitPhase, a wire format) of tasks waiting for dispatched rows.
PHASE_DISPATCH = 5
PHASE_BACKWARD_DISPATCH = 9
# Each thread keeps DISPATCH_BATCH 16-byte loads in flight (sm90's 384 threads: 48 KiB per SM),
# every load of a batch issued before its stores.
DISPATCH_BATCH = 8


@cute.jit
def dispatch_rows(
    src,
    out_ptr,
    walk,
    dispatched,
    table,
    tidx,
    threads: int,
    tickets: Tickets,
    weights=None,
    rounded_ptr=None,
) -> Int32:
    """All `threads` threads of the CTA (the megakernel's block size, a multiple of 32 and >=
    TILE_M; sm90: 384): row tiles of `out` (bf16 [capacity, H]) by ticket, until the ticket
    reaches `tickets.total` (the routed row tiles); returns how many this CTA copied.
    `walk` (task_walk.WalkArgs): the schedule and the sizes. `src` = (local bf16 [T, H] pointer, peer table tensor of int64 addresses, ep_rank);
    `weights` = (local fp32 [T * k] pointer, its peer table) or None: unscaled. `rounded_ptr`:
    bf16 [capacity, H] for each written row's MXFP8 round trip (after the scaling), or None. Thread 0 takes
    each ticket from `tickets.counter` and broadcasts it through `tickets.slots[0]` (free until
    the producer's first ticket: the CTA meets before returning). A tile's 128 packed (rank,
    source) entries go to `table` (shared Int32 [128]); each warp copies whole rows. Then fence
    for the async proxy (TMA readers), meet, and thread 0 releases counter m at
    `dispatched` + 4 m."""
    scaled = weights is not None
    src_ptr, src_table, ep_rank = src
    chunks, (mOut,) = chunked_row_views(walk.hidden_size, (out_ptr, walk.capacity))
    row_bytes = cute.assume(Int64(walk.hidden_size) * Int64(2), divby=128)
    rank_of = cute.make_tensor(walk.peer_rank_ptr, cute.make_layout(walk.capacity))
    slot_of = cute.make_tensor(walk.peer_token_idx_ptr, cute.make_layout(walk.capacity))
    scaled_values = None
    if cutlass.const_expr(scaled):
        scaled_values = cute.make_rmem_tensor((VECTOR,), Float32)
    warp = tidx // 32
    lane = tidx % 32
    values = cute.make_rmem_tensor((VECTOR, DISPATCH_BATCH), BFloat16)
    rounded_words = None
    if cutlass.const_expr(rounded_ptr is not None):
        # The round trip's rows as 16-byte chunks of 4 bf16x2 words.
        row_words = cute.assume(Int64(walk.hidden_size) // Int64(2), divby=32)
        rounded_words = cute.make_tensor(
            cute.recast_ptr(rounded_ptr, dtype=Uint32),
            cute.make_layout(
                (VECTOR // 2, chunks, walk.capacity), stride=(1, VECTOR // 2, row_words)
            ),
        )
        widened = cute.make_rmem_tensor((VECTOR,), Float32)
        packed_words = cute.make_rmem_tensor((VECTOR // 2,), Uint32)
    slot = tickets.slots
    if tidx == 0:
        slot[0] = atom_add_relaxed_gpu_s32(tickets.counter, Int32(1))
    cute.arch.sync_threads()
    row_tile = slot[0]
    copied = Int32(0)
    while row_tile < tickets.total:
        first_row = row_tile * TILE_M
        if tidx < TILE_M:
            row = first_row + tidx
            # (rank, source row) packed; scaled: the slot, whose weight is needed too.
            source = slot_of[row]
            if cutlass.const_expr(not scaled):
                source = source // walk.topk
            table[tidx] = cutlass.select_(
                rank_of[row] >= 0, rank_of[row] * RANK_UNIT + source, Int32(-1)
            )
        cute.arch.sync_threads()
        # The next ticket, taken now: its round trip overlaps this tile's copy. The CTA holds
        # it meanwhile, which is safe: it copies that tile next, waiting on nothing.
        next_tile = Int32(0)
        if tidx == 0:
            next_tile = atom_add_relaxed_gpu_s32(tickets.counter, Int32(1))
        for r in cutlass.range(warp, TILE_M, threads // 32, unroll=1):
            packed = table[r]
            rank = packed // RANK_UNIT
            source = packed % RANK_UNIT
            w = None
            if cutlass.const_expr(scaled):
                w = Float32(0.0)
                if packed >= 0:
                    w_base = rank_address(weights[0], weights[1], ep_rank, rank)
                    w_ptr = cute.make_ptr(Float32, w_base + Int64(source) * Int64(4),
                                          cute.AddressSpace.gmem, assumed_align=4)  # fmt: skip
                    w = cute.make_tensor(w_ptr, cute.make_layout(1))[0]
                    source = source // walk.topk
            src_base = src_ptr.toint()
            if packed >= 0:
                src_base = rank_address(src_ptr, src_table, ep_rank, rank)
            src_row = cute.make_tensor(
                cute.make_ptr(BFloat16, src_base + Int64(source) * row_bytes,
                              cute.AddressSpace.gmem, assumed_align=16),
                cute.make_layout((VECTOR, chunks), stride=(1, VECTOR)),
            )  # fmt: skip
            row = first_row + r
            for base in cutlass.range(lane, chunks, 32 * DISPATCH_BATCH, unroll=1):
                for j in cutlass.range_constexpr(DISPATCH_BATCH):
                    chunk = base + 32 * j
                    values[None, j].fill(0.0)
                    if chunk < chunks:
                        if packed >= 0:
                            values[None, j].store(src_row[None, chunk].load())
                for j in cutlass.range_constexpr(DISPATCH_BATCH):
                    chunk = base + 32 * j
                    if chunk < chunks:
                        row_values = values[None, j].load()
                        if cutlass.const_expr(scaled):
                            # Padding rows: w = 0 times +0.0 is +0.0.
                            scaled_values.store(row_values.to(Float32))
                            for i in cutlass.range_constexpr(VECTOR):
                                scaled_values[i] = mul_rn(w, scaled_values[i])
                            row_values = scaled_values.load().to(BFloat16)
                        mOut[None, chunk, row].store(row_values)
                        if cutlass.const_expr(rounded_ptr is not None):
                            widened.store(row_values.to(Float32))
                            round_trip_chunk(widened, packed_words)
                            rounded_words[None, chunk, row].store(packed_words.load())
        cute.arch.fence_proxy("async.global")
        cute.arch.sync_threads()
        if tidx == 0:
            red_add_release_gpu_s32(dispatched + Int64(4) * Int64(row_tile), Int32(1))
            slot[0] = next_tile
        # The next ticket is in the slot, and every thread is done with `table`.
        cute.arch.sync_threads()
        row_tile = slot[0]
        copied = copied + 1
    # Every thread has read the last ticket: the producer may reuse the slot.
    cute.arch.sync_threads()
    return copied
