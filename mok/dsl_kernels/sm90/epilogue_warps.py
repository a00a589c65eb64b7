"""Epilogue warps for the SM90 GEMM engine: the epilogue runs beside the next tile's mainloop.

Consumers round their fp32 accumulators to bf16 into two padded shared blocks and start the next
tile's wgmmas; the crew (CREW) does SwiGLU, 16-byte stores and slot look-ups from those blocks.

Named barriers (256 consumer threads + the crew; 0 is the CTA barrier): the crew arrives on
BUFFERS_FREE once the previous tile is stored; consumers wait on it, write, and arrive on
TILE_READY, which the crew waits on. Each side arrives only after passing the other's barrier: at
most one generation pending, none at exit. TARGETS (crew only) guards a slots tile's rows.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from ..common.bounded_wait import red_add_release_gpu_s32
from ..common.peers import RANK_UNIT, peer_table, rank_address
from ..phases.combine_phase import COMBINE_THREADS
from ..phases.expert_tiles import locate_first_tile, locate_tile
from .gemm_engine import (
    STAGED_BYTES,
    STAGED_CHUNKS,
    STAGED_ROW,
    THREADS_PER_WARPGROUP,
    TILE_M,
    TILE_N,
    allocate_operand_ring_storage,
    staged_block,
)

TILE_READY = 3  # named barrier ids
BUFFERS_FREE = 4
TARGETS = 5
COUNTER_SYNC = 6  # the crew's barrier before it releases a row tile's counter
CONSUMER_THREADS = 2 * THREADS_PER_WARPGROUP
# The megakernels run the in-kernel sums (phases/combine_phase.py) on the consumer warpgroups.
if CONSUMER_THREADS != COMBINE_THREADS:
    raise ImportError(
        f"phases.combine_phase.COMBINE_THREADS ({COMBINE_THREADS}) must equal the engine's "
        f"consumer threads ({CONSUMER_THREADS})"
    )
# Two staged blocks and the 128 destination rows of a slots tile.
TARGETS_OFFSET = 2 * STAGED_BYTES
BUFFER_BYTES = TARGETS_OFFSET + 4 * TILE_M
CHUNKS_PER_TILE = TILE_M * STAGED_CHUNKS


def allocate_crew_storage(a_layout, b_layout, stages: int, extra_bytes: int = 0):
    """The operand ring's shared memory with the crew's hand-off blocks (then `extra_bytes`):
    (storage, sA, sB0, sB1, hand-off buffers)."""
    storage, sA, sB0, sB1 = allocate_operand_ring_storage(
        a_layout, b_layout, stages, BUFFER_BYTES + extra_bytes
    )
    return storage, sA, sB0, sB1, handoff_buffers(storage)


def handoff_buffers(storage, offset_bytes: int = 0):
    """(block 0, block 1, targets) in `storage.staging` from `offset_bytes` (BUFFER_BYTES)."""
    targets = cute.make_tensor(
        cute.recast_ptr(storage.staging.data_ptr() + offset_bytes + TARGETS_OFFSET, dtype=Int32),
        cute.make_layout(TILE_M),
    )
    return (
        staged_block(storage, offset_bytes),
        staged_block(storage, offset_bytes + STAGED_BYTES),
        targets,
    )


@cute.jit
def store_pair(first, second, target, chunk, first_col, out_ptr, row_stride):
    """A `store_chunk` for tiles of two adjacent 128-column blocks (block 0 at first_col)."""
    at = cute.assume(target * row_stride + Int64(first_col + chunk * 8), divby=8)
    cute.make_tensor(out_ptr + at, cute.make_layout(8)).store(first)
    cute.make_tensor(out_ptr + at + TILE_N, cute.make_layout(8)).store(second)


@cute.jit
def store_split(first, second, target, chunk, first_col, first_ptr, second_ptr, row_stride):
    """A `store_chunk`: block 0 into `first_ptr`, block 1 into `second_ptr`, same columns."""
    at = cute.assume(target * row_stride + Int64(first_col + chunk * 8), divby=8)
    cute.make_tensor(first_ptr + at, cute.make_layout(8)).store(first)
    cute.make_tensor(second_ptr + at, cute.make_layout(8)).store(second)


@dataclass(frozen=True)
class EpilogueCrew:
    """The producer-warpgroup warps first_warp .. first_warp + num_warps - 1 that store tiles."""

    first_warp: int = 1
    num_warps: int = 3

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def handoff_threads(self) -> int:
        return CONSUMER_THREADS + self.threads

    # ------------------------------------------------------------------ consumer side

    @cute.jit
    def hand_off(self, thr_mma, accumulators: tuple, buffers: tuple):
        """Consumers: round both fp32 accumulators and hand them off (`hand_off_bf16`)."""
        values = []
        for j in cutlass.range_constexpr(2):
            rounded = cute.make_rmem_tensor(accumulators[j].shape, BFloat16)
            rounded.store(accumulators[j].load().to(BFloat16))
            values.append(rounded)
        self.hand_off_bf16(thr_mma, values, buffers)

    @cute.jit
    def hand_off_bf16(self, thr_mma, values, buffers: tuple):
        """Consumers: once the crew freed the blocks, write two bf16 fragments and arrive (no wait)."""
        cute.arch.barrier(barrier_id=BUFFERS_FREE, number_of_threads=self.handoff_threads)
        for j in cutlass.range_constexpr(2):
            cute.autovec_copy(values[j], thr_mma.partition_C(buffers[j]))
        cute.arch.barrier_arrive(barrier_id=TILE_READY, number_of_threads=self.handoff_threads)

    @cute.jit
    def hand_off_nothing(self):
        """Consumers, past their last ticket: wake the crew with empty blocks (it reads NO_TASK)."""
        cute.arch.barrier(barrier_id=BUFFERS_FREE, number_of_threads=self.handoff_threads)
        cute.arch.barrier_arrive(barrier_id=TILE_READY, number_of_threads=self.handoff_threads)

    # ------------------------------------------------------------------ crew side

    @cute.jit
    def look_up_targets(self, targets, lane, first_row, peer_rank_ptr, peer_token_idx_ptr):
        """targets[r] = (source rank, slot) of routed row first_row + r packed (RANK_UNIT), or -1
        for padding; barriers on both sides."""
        rank = cute.make_tensor(peer_rank_ptr, cute.make_layout(1 << 30))
        slot = cute.make_tensor(peer_token_idx_ptr, cute.make_layout(1 << 30))
        cute.arch.barrier(barrier_id=TARGETS, number_of_threads=self.threads)
        for row in cutlass.range(lane, TILE_M, self.threads, unroll=1):
            targets[row] = cutlass.select_(
                rank[first_row + row] >= 0,
                rank[first_row + row] * RANK_UNIT + slot[first_row + row],
                Int32(-1),
            )
        cute.arch.barrier(barrier_id=TARGETS, number_of_threads=self.threads)

    @cute.jit
    def copy_out(self, buffers, lane, first_row, first_col, targets, store_chunk, store_args):
        """Crew: store_chunk(block 0 chunk, block 1 chunk, destination row, chunk, first_col,
        *store_args) for every 16-byte chunk whose target is not -1 (`targets` None: in place)."""
        views = [
            cute.make_tensor(
                buffers[j].iterator,
                cute.make_layout((8, STAGED_CHUNKS, TILE_M), stride=(1, 8, STAGED_ROW)),
            )
            for j in range(2)
        ]
        for idx in cutlass.range(lane, CHUNKS_PER_TILE, self.threads, unroll=1):
            row = idx // STAGED_CHUNKS
            chunk = idx % STAGED_CHUNKS
            target = Int64(first_row + row)
            if cutlass.const_expr(targets is not None):
                target = Int64(targets[row])
            if target >= 0:
                store_chunk(
                    views[0][None, chunk, row].load(), views[1][None, chunk, row].load(),
                    target, chunk, first_col, *store_args,
                )  # fmt: skip

    @cute.jit
    def release_row_tile(self, lane, first_row, counters):
        """Crew `after_tile`: fence the stores for the async proxy (later tasks read them by TMA),
        meet, then one thread adds 1 (release, GPU scope) to row tile m's counter at `counters` + 4m."""
        cute.arch.fence_proxy("async.global")
        self.count_tile(lane, first_row, counters + Int64(4) * Int64(first_row // TILE_M))

    @cute.jit
    def count_tile(self, lane, first_row, counter):
        """Crew `after_tile`: meet, then one thread adds 1 (release, GPU scope) to the int32 at
        `counter` (plain readers: no async-proxy fence)."""
        cute.arch.barrier(barrier_id=COUNTER_SYNC, number_of_threads=self.threads)
        if lane == 0:
            red_add_release_gpu_s32(counter, Int32(1))

    @cute.jit
    def wait_for_handoff(self):
        """Crew: free the blocks, then wait for the next hand-off (or `hand_off_nothing`)."""
        cute.arch.barrier_arrive(barrier_id=BUFFERS_FREE, number_of_threads=self.handoff_threads)
        cute.arch.barrier(barrier_id=TILE_READY, number_of_threads=self.handoff_threads)

    @cute.jit
    def store_handoff(self, buffers, lane, first_row, first_col, targets, store_chunk, store_args):
        """Crew: wait for the next hand-off and store it (`copy_out`)."""
        self.wait_for_handoff()
        self.copy_out(buffers, lane, first_row, first_col, targets, store_chunk, store_args)

    @cute.jit
    def run(
        self, tiles, first_tile, grid_size, buffers, tidx, tile_cols: int, slots, store_chunk,
        store_args, after_tile=None, after_args=(), handoffs: int = 1, before_tile=None,
        before_args=(),
    ):  # fmt: skip
        """Crew: store this CTA's tiles (first_tile, + grid_size, ...; `tile_cols` columns each).
        `slots`: (peer_rank, peer_token_idx) pointers or None (in place). `handoffs` per tile, the h-th
        at first_col + h * TILE_N, between `before_tile` and `after_tile`. Returns the next tile."""
        lane = tidx - 32 * self.first_warp
        tile = first_tile
        expert, tile_base, row_base, row_tiles = locate_first_tile(tiles, tile)
        while expert < tiles.num_experts:
            local = tile - tile_base
            first_row = row_base + (local % row_tiles) * TILE_M
            first_col = (local // row_tiles) * tile_cols
            tile = tile + grid_size
            expert, tile_base, row_base, row_tiles = locate_tile(
                tiles, tile, (expert, tile_base, row_base, row_tiles)
            )
            if cutlass.const_expr(before_tile is not None):
                before_tile(lane, first_row, first_col, *before_args)
            targets = None
            if cutlass.const_expr(slots is not None):
                targets = buffers[2]
                self.look_up_targets(targets, lane, first_row, slots[0], slots[1])
            for h in cutlass.range_constexpr(handoffs):
                self.store_handoff(
                    buffers, lane, first_row, first_col + h * TILE_N, targets, store_chunk,
                    store_args,
                )  # fmt: skip
            if cutlass.const_expr(after_tile is not None):
                after_tile(lane, first_row, *after_args)
        return tile


# Warps 1-3 of the producer warpgroup, in every SM90 GEMM and megakernel. The release atomics
# live here, not in the consumers: there, one makes ptxas serialise every wgmma (C7520).
CREW = EpilogueCrew(first_warp=1, num_warps=3)


def slot_stores(args, walk, stored, slots_row: int) -> dict:
    """Crew store keywords (task_walk.store_phase) of 128 x 256 tiles whose rows are pushed to
    their (token, j) slots on the source rank: `args.slots_ptr` bf16 [T * k, H] on this rank,
    on the others the address in row `slots_row` of the peer table at `args.peer_table_ptr`
    (common/peers.py: the forward's combine_buffer, the backward's d_x_routed_buffer), by `walk`'s schedule
    (task_walk.WalkArgs); padding rows are not stored. Each stored tile counts on the int32 at
    `stored` (`count_tile`: the in-kernel sums wait on it)."""
    table = peer_table(args.peer_table_ptr, slots_row)
    row_bytes = cute.assume(Int64(walk.hidden_size) * Int64(2), divby=4 * TILE_N)
    return dict(
        tile_cols=2 * TILE_N, slots=(walk.peer_rank_ptr, walk.peer_token_idx_ptr),
        store_chunk=store_pair_to_slot, store_args=(args.slots_ptr, table, walk.ep_rank, row_bytes),
        after_tile=CREW.count_tile, after_args=(stored,),
    )  # fmt: skip


@cute.jit
def store_pair_to_slot(first, second, packed, chunk, first_col, slots_ptr, table, ep_rank,
                       row_bytes):  # fmt: skip
    """A `store_chunk` pushing two adjacent 128-column blocks of a row to its packed (rank, slot)
    target. The source rank reads them after the group's end barrier, whose system-scope release
    follows this kernel's end in stream order."""
    base = rank_address(slots_ptr, table, ep_rank, Int32(packed // RANK_UNIT))
    at = base + (packed % RANK_UNIT) * row_bytes + Int64(first_col + chunk * 8) * Int64(2)
    first_ptr = cute.make_ptr(BFloat16, at, cute.AddressSpace.gmem, assumed_align=16)
    second_ptr = cute.make_ptr(BFloat16, at + Int64(TILE_N * 2), cute.AddressSpace.gmem,
                               assumed_align=16)  # fmt: skip
    cute.make_tensor(first_ptr, cute.make_layout(8)).store(first)
    cute.make_tensor(second_ptr, cute.make_layout(8)).store(second)
