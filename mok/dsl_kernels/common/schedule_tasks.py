"""The schedule's tasks, taken by ticket: count chunk `task`, or place a chunk once the counts
are scanned (the schedule kernel, and the forward megakernel's schedule phase,
phases/schedule_phase.py), and the CTA's next ticket.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .bounded_wait import (
    OWN_MEMORY,
    atom_add_relaxed_gpu_s32,
    bounded_wait_reached,
    fence_acq_rel_sys,
    ld_acquire_gpu_s32,
    red_add_release_gpu_s32,
)
from .schedule_count import count_chunk
from .schedule_place import place_chunk
from .schedule_warp import schedule_barrier

PHASE_SCHEDULE = 15  # mok.runtime.WaitPhase.SCHEDULE (dsl_kernels may not import mok)
# The launch's int32 counters (zero when it starts; its last CTA leaves them zero).
WORD_TICKETS, WORD_ARRIVALS, WORD_SCANNED, WORD_EXITS = range(4)
COUNTER_WORDS = 4


@cute.jit
def schedule_task(
    ids64: cutlass.Constexpr,
    task: Int32,
    num_chunks: Int32,
    counters: Int64,
    ids_ptr: cute.Pointer,
    counts_ptr: cute.Pointer,
    expert_counts_ptr: cute.Pointer,
    peer_rank_ptr: cute.Pointer,
    peer_token_idx_ptr: cute.Pointer,
    num_tokens_ptr: cute.Pointer,
    tokens_per_expert_ptr: cute.Pointer,
    status_ptr: cute.Pointer,
    record: Int64,
    timeout_ns: Int64,
    num_entries: Int32,
    entries_per_rank: Int32,
    ep_rank: Int32,
    num_local_experts: Int32,
    capacity: Int32,
    count_tables: tuple,
    place_tables: tuple,
    tidx: Int32,
    named_barrier: cutlass.Constexpr = None,
    placed: Int64 = None,
):
    """The task's THREADS threads: ticket `task` of the schedule, count chunk `task` (task <
    num_chunks; the task that scans releases the WORD_SCANNED word of `counters`) or place
    chunk `task - num_chunks` (after a bounded wait for that word; a timeout is written to the
    error record at `record`), then, given the address `placed`, release it by one.
    `named_barrier`: `schedule_barrier`'s."""
    scanned = counters + Int64(4 * WORD_SCANNED)
    if task < num_chunks:
        verdict = count_chunk(
            ids64, ids_ptr, counts_ptr, expert_counts_ptr, counters + Int64(4 * WORD_ARRIVALS),
            num_entries, ep_rank, num_local_experts, task, num_chunks, *count_tables,
            named_barrier,
        )  # fmt: skip
        if verdict == num_chunks - 1:  # this task scanned: publish the offsets
            schedule_barrier(named_barrier)
            if tidx == 0:
                fence_acq_rel_sys()
                red_add_release_gpu_s32(scanned, Int32(1))
    else:
        if tidx == 0:
            bounded_wait_reached(
                scanned, Int32(1), timeout_ns, record, ep_rank, Int32(PHASE_SCHEDULE),
                Int32(WORD_SCANNED), Int32(OWN_MEMORY), task, ld_acquire_gpu_s32,
            )  # fmt: skip
        schedule_barrier(named_barrier)
        place_chunk(
            ids64, ids_ptr, counts_ptr, expert_counts_ptr, peer_rank_ptr, peer_token_idx_ptr,
            num_tokens_ptr, tokens_per_expert_ptr, status_ptr, num_entries, entries_per_rank,
            ep_rank, num_local_experts, capacity, task - num_chunks, num_chunks, place_tables,
            named_barrier,
        )  # fmt: skip
        if cutlass.const_expr(placed is not None):
            schedule_barrier(named_barrier)
            if tidx == 0:
                fence_acq_rel_sys()
                red_add_release_gpu_s32(placed, Int32(1))


@cute.jit
def take_task(sTask: cute.Tensor, counters: Int64, tidx: Int32) -> Int32:
    """Every thread: the CTA's next ticket, from the WORD_TICKETS word of `counters` (thread 0
    takes it, shared memory broadcasts it), after every thread is done with the previous task."""
    cute.arch.sync_threads()
    if tidx == 0:
        sTask[0] = atom_add_relaxed_gpu_s32(counters + Int64(4 * WORD_TICKETS), Int32(1))
    cute.arch.sync_threads()
    return sTask[0]
