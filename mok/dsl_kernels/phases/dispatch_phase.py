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

from typing import NamedTuple

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
            src_row = source_row(src, packed, source, row_bytes, chunks)
            scale = None
            if cutlass.const_expr(scaled):
                scale = (w, scaled_values)
            rounded = None
            if cutlass.const_expr(rounded_ptr is not None):
                rounded = (rounded_words, widened, packed_words)
            copy_row_chunks(src_row, packed, mOut, first_row + r, lane, chunks, values,
                            DISPATCH_BATCH, scale, rounded)  # fmt: skip
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


@cute.jit
def source_row(src, packed, source, row_bytes, chunks):
    """Row `source` of rank `packed // RANK_UNIT`'s tensor in `src` = (local pointer, peer
    table, ep_rank) as (VECTOR, chunks) bf16; this rank's row 0 for padding (`packed` < 0),
    which `copy_row_chunks` never reads."""
    src_ptr, src_table, ep_rank = src
    src_base = src_ptr.toint()
    if packed >= 0:
        src_base = rank_address(src_ptr, src_table, ep_rank, packed // RANK_UNIT)
    return cute.make_tensor(
        cute.make_ptr(BFloat16, src_base + Int64(source) * row_bytes,
                      cute.AddressSpace.gmem, assumed_align=16),
        cute.make_layout((VECTOR, chunks), stride=(1, VECTOR)),
    )  # fmt: skip


@cute.jit
def copy_row_chunks(src_row, packed, mOut, row, lane, chunks, values, batch: int, scale=None,
                    rounded=None):  # fmt: skip
    """One warp: mOut[:, :, row] = src_row (zeros if `packed` < 0), lane `lane`'s 16-byte chunks,
    `batch` loads (into `values`, bf16 (VECTOR, batch)) issued before their stores. `scale` =
    (w, fp32 (VECTOR,) scratch): each value times w (`mul_rn`); `rounded` = (round-trip words
    view, fp32 and uint32 scratch): each written chunk's MXFP8 round trip too."""
    for base in cutlass.range(lane, chunks, 32 * batch, unroll=1):
        for j in cutlass.range_constexpr(batch):
            chunk = base + 32 * j
            values[None, j].fill(0.0)
            if chunk < chunks:
                if packed >= 0:
                    values[None, j].store(src_row[None, chunk].load())
        for j in cutlass.range_constexpr(batch):
            chunk = base + 32 * j
            if chunk < chunks:
                row_values = values[None, j].load()
                if cutlass.const_expr(scale is not None):
                    w, scaled_values = scale
                    # Padding rows: w = 0 times +0.0 is +0.0.
                    scaled_values.store(row_values.to(Float32))
                    for i in cutlass.range_constexpr(VECTOR):
                        scaled_values[i] = mul_rn(w, scaled_values[i])
                    row_values = scaled_values.load().to(BFloat16)
                mOut[None, chunk, row].store(row_values)
                if cutlass.const_expr(rounded is not None):
                    rounded_words, widened, packed_words = rounded
                    widened.store(row_values.to(Float32))
                    round_trip_chunk(widened, packed_words)
                    rounded_words[None, chunk, row].store(packed_words.load())


# ---- the forward megakernel's crew, dispatching in the background ----
# Its shared words (background_words): whether it still dispatches, the row tile it holds (-1:
# none), that tile's next row, the step's decision (lane 0's, read by the crew), and the
# consumers' hand-off word (set by every consumer thread once its fragments are written,
# cleared by the crew once it has passed TILE_READY).
ACTIVE, TILE, ROW, DECISION, PENDING = range(5)
BACKGROUND_WORDS = 8
DISPATCH_SYNC = 9  # named barrier of the crew's threads (3-6 the crew's hand-off, 7 the sums, 8 the schedule)
# 16-byte loads in flight per crew lane (the crew runs at the producer warpgroup's registers).
BACKGROUND_BATCH = 4
COPY, HANDOFF = 1, 2


class Background(NamedTuple):
    """The crew's background dispatch: `words` (shared Int32 [BACKGROUND_WORDS]), `src` and
    `out_ptr` as in dispatch_rows, the schedule (`walk`), the row tiles' counters
    (`dispatched`), the dispatch ticket's address and the routed row tiles."""

    words: cute.Tensor
    src: tuple
    out_ptr: object
    walk: object
    dispatched: Int64
    counter: Int64
    total: Int32


@cute.jit
def start_background(words, tidx, held: Int32, total: Int32, active) -> None:
    """Thread 0, before the roles split (the CTA meets after it): the crew holds row tile
    `held` (the ticket dispatch_rows stopped at) if `active` and held < total."""
    if tidx == 0:
        on = active & (held < total)
        words[ACTIVE] = cutlass.select_(on, Int32(1), Int32(0))
        words[TILE] = cutlass.select_(on, held, Int32(-1))
        words[ROW] = Int32(0)
        words[DECISION] = Int32(0)
        words[PENDING] = Int32(0)


@cute.jit
def background_steps(crew, bg: Background, lane, until_handoff: bool) -> None:
    """Crew (`lane` 0 .. crew.threads - 1): copy rows of held row tiles, one row a warp a step,
    taking tickets while they last; with `until_handoff` stop before a step once the consumers
    have handed off (words[PENDING]). A held tile is copied to its end in later steps whatever
    comes between: nothing the crew does between steps waits on another CTA. Lane 0 decides
    each step and the crew meets twice around the reading of its decision."""
    words = bg.words
    walk = bg.walk
    warps = crew.threads // 32
    chunks, (mOut,) = chunked_row_views(walk.hidden_size, (bg.out_ptr, walk.capacity))
    row_bytes = cute.assume(Int64(walk.hidden_size) * Int64(2), divby=128)
    rank_of = cute.make_tensor(walk.peer_rank_ptr, cute.make_layout(walk.capacity))
    slot_of = cute.make_tensor(walk.peer_token_idx_ptr, cute.make_layout(walk.capacity))
    values = cute.make_rmem_tensor((VECTOR, BACKGROUND_BATCH), BFloat16)
    go = Int32(1)
    while go > 0:
        if lane == 0:
            decision = Int32(0)
            if words[ACTIVE] > 0:
                decision = COPY
                if cutlass.const_expr(until_handoff):
                    if words[PENDING] > 0:
                        decision = HANDOFF
                if decision == COPY:
                    if words[TILE] < 0:
                        ticket = atom_add_relaxed_gpu_s32(bg.counter, Int32(1))
                        if ticket < bg.total:
                            words[TILE] = ticket
                            words[ROW] = Int32(0)
                        else:
                            words[ACTIVE] = Int32(0)
                            decision = Int32(0)
            words[DECISION] = decision
        cute.arch.barrier(barrier_id=DISPATCH_SYNC, number_of_threads=crew.threads)
        decision = words[DECISION]
        tile = words[TILE]
        first = words[ROW]
        cute.arch.barrier(barrier_id=DISPATCH_SYNC, number_of_threads=crew.threads)
        go = Int32(0)
        if decision == COPY:
            go = Int32(1)
            r = first + lane // 32
            if r < TILE_M:
                row = tile * TILE_M + r
                packed = cutlass.select_(
                    rank_of[row] >= 0, rank_of[row] * RANK_UNIT + slot_of[row] // walk.topk,
                    Int32(-1),
                )  # fmt: skip
                src_row = source_row(bg.src, packed, packed % RANK_UNIT, row_bytes, chunks)
                copy_row_chunks(src_row, packed, mOut, row, lane % 32, chunks, values,
                                BACKGROUND_BATCH)  # fmt: skip
            if first + warps >= TILE_M:
                # The tile's last step: publish it as dispatch_rows does.
                cute.arch.fence_proxy("async.global")
                cute.arch.barrier(barrier_id=DISPATCH_SYNC, number_of_threads=crew.threads)
                if lane == 0:
                    red_add_release_gpu_s32(bg.dispatched + Int64(4) * Int64(tile), Int32(1))
                    words[TILE] = Int32(-1)
            elif lane == 0:
                words[ROW] = first + warps


@cute.jit
def crew_wait_dispatching(crew, bg: Background, lane) -> None:
    """Crew, a tickets.crew_task `wait`: free the blocks, dispatch until the consumers hand off
    (or nothing is left to dispatch), then pass TILE_READY and clear their word."""
    crew.free_blocks()
    background_steps(crew, bg, lane, True)
    crew.wait_ready()
    if lane == 0:
        bg.words[PENDING] = Int32(0)
