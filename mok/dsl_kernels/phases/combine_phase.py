"""The megakernels' last phase for a group of one without a shared expert: the forward's
fixed-order weighted top-k sum of the slots into `out` (moe_combine_forward's, in-kernel,
`combine_slots`), the backward's d_x sum and router-weight gradients (backward_finish's,
`finish_backward`).

The crew counts every stored down tile on one int32 (`down_done`, `EpilogueCrew.count_tile`
of sm90/epilogue_warps.py: a crew barrier, then `red.release.gpu`). Once a CTA's consumer
warpgroups are past their last ticket (`hand_off_nothing`), one of their threads waits
(bounded, `ld.acquire.gpu`) for that counter to reach every down tile of the launch, the 256
consumer threads meet on COMBINE_SYNC, and they sum the combine items b, b + grid, ... of CTA
b. An item is COMBINE_TOKENS tokens by 256 16-byte column chunks; each thread runs
`combine_rows` over its chunk, as the epilogue kernel's threads do, so `out` has that kernel's
bits and the router weights are checked into the same value-status word.

The backward's crew counts every stored d_x tile the same way (`dx_done`); its router-weight
partials are covered by the d_hidden tile count (`dgu_total`: sm90/d_hidden_phase's
swiglu_backward stores them before its hand-off, which the crew's release follows). Once past
its weight tasks a CTA waits for both, then its 256 consumer threads take items of the d_x sum
(as above, unweighted) and of the push (256 routed rows each,
`common/router_grad_rows.push_row`).

Forward progress: a CTA waits here only once the task ticket is spent, so every tile it waits
for is held by a running CTA, whose tasks wait on nothing this phase does.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import bounded_wait_reached, ld_acquire_gpu_s32
from ..common.combine_rows import combine_rows
from ..common.router_grad_rows import push_row
from ..common.row_chunks import chunked_row_views
from ..common.value_checks import STATUS_BAD_WEIGHT_FORWARD

# WaitPhase ids (mok.runtime.WaitPhase, a wire format): down tiles before the combine; d_x and
# d_hidden tiles before the backward's finish.
PHASE_DOWN_GEMM = 7
PHASE_BACKWARD_DHIDDEN_GEMM = 10
PHASE_BACKWARD_DX_GEMM = 11
# The threads that sum: the megakernel's consumer threads (sm90: its two consumer warpgroups,
# sm90/epilogue_warps.CONSUMER_THREADS), which meet on COMBINE_SYNC.
COMBINE_THREADS = 256
COMBINE_SYNC = 7  # named barrier of the COMBINE_THREADS (sm90/epilogue_warps.py has 3-6)
COMBINE_TOKENS = 4  # tokens per item, as moe_combine_forward's tokens_per_cta
# Slots of each token loaded per step: 4 x 4 16-byte loads in flight per thread, twice the
# epilogue kernels' (which can run up to 8x the threads per SM).
SLOTS_PER_STEP = 4


@cute.jit
def wait_and_meet(thread: Int32, waits: tuple, wait: tuple):
    """Consumer thread 0 waits (bounded, GPU-scope acquire) for each (counter, target, phase)
    of `waits`; then the 256 consumer threads meet. `wait` = (error record, timeout_ns,
    ep_rank)."""
    record, timeout_ns, ep_rank = wait
    if thread == 0:
        for i in cutlass.range_constexpr(len(waits)):
            counter, target, phase = waits[i]
            bounded_wait_reached(counter, target, timeout_ns, record, ep_rank, Int32(phase),
                                 Int32(0), Int32(-1), Int32(-1),
                                 acquire=ld_acquire_gpu_s32)  # fmt: skip
    cute.arch.barrier(barrier_id=COMBINE_SYNC, number_of_threads=COMBINE_THREADS)


@cute.jit
def sum_slots(thread: Int32, item: Int32, col_blocks: Int32, chunks: Int32, num_tokens: Int32,
              topk: Int32, views: tuple, weights=None):  # fmt: skip
    """Combine item `item` (COMBINE_TOKENS tokens x 256 chunks) of thread `thread`: views =
    (out, shared stand-in, slots) as `chunked_row_views` gives them; `weights` as combine_rows'."""
    chunk = (item % col_blocks) * COMBINE_THREADS + thread
    first_token = (item // col_blocks) * COMBINE_TOKENS
    combine_rows(COMBINE_TOKENS, chunks, chunk, first_token, num_tokens, topk, Int32(0),
                 views[0], views[1], views[2], weights, SLOTS_PER_STEP)  # fmt: skip


@cute.jit
def combine_items(hidden_size: Int32, num_tokens: Int32, out_ptr: cute.Pointer,
                  slots_ptr: cute.Pointer, topk: Int32):  # fmt: skip
    """(chunks, column blocks, items, views) of a sum over `slots` into `out` (no shared rows:
    out stands in for them and is never read)."""
    chunks, views = chunked_row_views(
        hidden_size, (out_ptr, num_tokens), (out_ptr, num_tokens), (slots_ptr, num_tokens * topk)
    )
    col_blocks = (chunks + COMBINE_THREADS - 1) // COMBINE_THREADS
    items = (num_tokens + COMBINE_TOKENS - 1) // COMBINE_TOKENS * col_blocks
    return chunks, col_blocks, items, views


@cute.jit
def combine_slots(
    thread: Int32,
    bidx: Int32,
    grid_size: Int32,
    down_done: Int64,
    down_tiles: Int32,
    wait: tuple,
    args,
    walk,
):
    """Consumer thread `thread` (0 .. 255) of CTA `bidx`: out (bf16 [T, H]) = sum_j
    router_weights[t, j] * slots[t * k + j] once `down_done` reaches `down_tiles`. `wait` =
    (error record, timeout_ns, ep_rank) of the bounded wait; `args`
    (sm90/moe_forward.ForwardTensors): out, router_weights, slots, the value-status words and T
    (combine_tokens); `walk` (task_walk.WalkArgs): H and k."""
    out_ptr, weight_ptr, slots_ptr = args.out_ptr, args.router_weights_ptr, args.slots_ptr
    status_ptr, num_tokens = args.status_ptr, args.combine_tokens
    hidden_size, topk = walk.hidden_size, walk.topk
    wait_and_meet(thread, ((down_done, down_tiles, PHASE_DOWN_GEMM),), wait)
    chunks, col_blocks, items, views = combine_items(hidden_size, num_tokens, out_ptr,
                                                     slots_ptr, topk)  # fmt: skip
    mWeight = cute.make_tensor(weight_ptr, cute.make_layout(num_tokens * topk))
    bad_weight = status_ptr.toint() + Int64(STATUS_BAD_WEIGHT_FORWARD * 4)
    for item in cutlass.range(bidx, items, grid_size, unroll=1):
        sum_slots(thread, item, col_blocks, chunks, num_tokens, topk, views,
                  (mWeight, bad_weight))  # fmt: skip


@cute.jit
def finish_backward(thread: Int32, bidx: Int32, grid_size: Int32, waits: tuple, wait: tuple,
                    d_x_ptr: cute.Pointer, slots_ptr: cute.Pointer, num_tokens: Int32,
                    hidden_size: Int32, topk: Int32, push: tuple):  # fmt: skip
    """Consumer thread `thread` (0 .. 255) of CTA `bidx`, once `waits` ((dx_done, d_x tiles),
    (dgu_total, d_hidden tiles)) are reached: d_x (bf16 [num_tokens, H]) = sum_j slots[t * k
    + j], and the router-weight gradient of every routed row, as backward_finish computes them.
    `push` = (partials, peer_rank, peer_token_idx, num_tokens (the routed rows), router
    weights, d_router, capacity, blocks, status) as `push_row` takes them for a group of one."""
    (dx_done, dx_tiles), (dgu_total, dgu_tiles) = waits
    wait_and_meet(thread, ((dx_done, dx_tiles, PHASE_BACKWARD_DX_GEMM),
                           (dgu_total, dgu_tiles, PHASE_BACKWARD_DHIDDEN_GEMM)), wait)  # fmt: skip
    chunks, col_blocks, items, views = combine_items(hidden_size, num_tokens, d_x_ptr,
                                                     slots_ptr, topk)  # fmt: skip
    push_items = (push[6] + COMBINE_THREADS - 1) // COMBINE_THREADS
    no_table = cute.make_ptr(Int64, Int64(0), cute.AddressSpace.gmem, assumed_align=8)
    for item in cutlass.range(bidx, items + push_items, grid_size, unroll=1):
        if item < items:
            sum_slots(thread, item, col_blocks, chunks, num_tokens, topk, views)
        else:
            push_row((item - items) * COMBINE_THREADS + thread, *push[:6], no_table, Int32(0),
                     *push[6:])  # fmt: skip
