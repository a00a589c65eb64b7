"""The forward megakernel's last phase for a group of one without a shared expert: the
fixed-order weighted top-k sum of the slots into `out` (moe_combine_forward's, in-kernel).

The crew counts every stored down tile on one int32 (`down_done`, `EpilogueCrew.count_tile`:
a crew barrier, then `red.release.gpu`). Once a CTA's consumer warpgroups are past their last
ticket (`hand_off_nothing`), one of their threads waits (bounded, `ld.acquire.gpu`) for that
counter to reach every down tile of the launch, the 256 consumer threads meet on COMBINE_SYNC,
and they sum the combine items b, b + grid, ... of CTA b. An item is COMBINE_TOKENS tokens by
256 16-byte column chunks; each thread runs `combine_rows` over its chunk, as the epilogue
kernel's threads do, so `out` has that kernel's bits and the router weights are checked into
the same value-status word.

Forward progress: a CTA waits here only once the task ticket is spent, so every down tile it
waits for is held by a running CTA, whose down tasks wait on nothing this phase does.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import bounded_wait_reached, ld_acquire_gpu_s32
from ..common.combine_rows import combine_rows
from ..common.row_chunks import chunked_row_views
from ..common.value_checks import STATUS_BAD_WEIGHT_FORWARD
from .epilogue_warps import CONSUMER_THREADS

# WaitPhase.DOWN_GEMM (mok.runtime.WaitPhase, a wire format): down tiles before the combine.
PHASE_DOWN_GEMM = 7
COMBINE_SYNC = 7  # named barrier of the 256 consumer threads (epilogue_warps.py has 3-6)
COMBINE_TOKENS = 4  # tokens per item, as moe_combine_forward's tokens_per_cta


@cute.jit
def combine_slots(thread: Int32, bidx: Int32, grid_size: Int32, down_done: Int64,
                  down_tiles: Int32, wait: tuple, out_ptr: cute.Pointer,
                  weight_ptr: cute.Pointer, slots_ptr: cute.Pointer, status_ptr: cute.Pointer,
                  num_tokens: Int32, hidden_size: Int32, topk: Int32):  # fmt: skip
    """Consumer thread `thread` (0 .. 255) of CTA `bidx`: out (bf16 [num_tokens, H]) = sum_j
    weight[t, j] * slots[t * k + j] once `down_done` reaches `down_tiles`. `wait` = (error
    record, timeout_ns, ep_rank) of the bounded wait."""
    record, timeout_ns, ep_rank = wait
    if thread == 0:
        bounded_wait_reached(down_done, down_tiles, timeout_ns, record, ep_rank,
                             Int32(PHASE_DOWN_GEMM), Int32(0), Int32(-1), Int32(-1),
                             acquire=ld_acquire_gpu_s32)  # fmt: skip
    cute.arch.barrier(barrier_id=COMBINE_SYNC, number_of_threads=CONSUMER_THREADS)
    # No shared rows (has_shared 0): out stands in for them and is never read.
    chunks, (mOut, mShared, mSlots) = chunked_row_views(
        hidden_size, (out_ptr, num_tokens), (out_ptr, num_tokens), (slots_ptr, num_tokens * topk)
    )
    mWeight = cute.make_tensor(weight_ptr, cute.make_layout(num_tokens * topk))
    bad_weight = status_ptr.toint() + Int64(STATUS_BAD_WEIGHT_FORWARD * 4)
    col_blocks = (chunks + CONSUMER_THREADS - 1) // CONSUMER_THREADS
    items = (num_tokens + COMBINE_TOKENS - 1) // COMBINE_TOKENS * col_blocks
    for item in cutlass.range(bidx, items, grid_size, unroll=1):
        chunk = (item % col_blocks) * CONSUMER_THREADS + thread
        first_token = (item // col_blocks) * COMBINE_TOKENS
        combine_rows(COMBINE_TOKENS, chunks, chunk, first_token, num_tokens, topk, Int32(0),
                     mOut, mShared, mSlots, (mWeight, bad_weight))  # fmt: skip
