"""The forward megakernel's first phase for a group of one: the receive schedule of the caller's
int64 routing (the `schedule_ids64` kernel's tasks, common/schedule_tasks.py; the kernel:
kernels/schedule.py), so a layer step needs no schedule launch.

Every thread of every CTA takes schedule tickets (one int32 of the launch's counters, thread 0's
`atom.add` broadcast through shared memory) until none are left: tickets [0, num_chunks) count
chunk t, [num_chunks, 2 * num_chunks) place chunk t - num_chunks, as the schedule kernel's. The
task runs on threads 0 .. 255 (sm90: warpgroups 0-1; the schedule's 256-thread CTA) with named
barrier SCHEDULE_SYNC in place of the CTA barrier, its shared-memory tables carved from the
operand ring (unused until the mainloop). The count task that scans last releases `scanned`;
a placement waits for it (bounded) and, once placed, releases `placed`. Then thread 0 waits
(bounded) until `placed` reaches num_chunks, and the CTA meets: every CTA reads the schedule
(tokens_per_expert, num_tokens, peer_rank, peer_token_idx) after it is whole.

Forward progress: a placement waits only on count tasks, and a CTA past its last ticket only on
placements; every one was taken, by a smaller ticket, by a CTA that runs. So the phase
completes with any number of resident CTAs >= 1, as the kernel's later phases do.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import (
    OWN_MEMORY,
    bounded_wait_reached,
    ld_acquire_gpu_s32,
)
from ..common.schedule_count import COUNT_SMEM_SIZES, count_smem
from ..common.schedule_place import PLACE_SMEM_SIZES, place_smem
from ..common.schedule_tasks import PHASE_SCHEDULE, schedule_task, take_task
from ..common.schedule_warp import CHUNK, THREADS, smem_words

SCHEDULE_SYNC = 8  # named barrier of threads 0 .. 255 (sm90/epilogue_warps.py has 3-6, combine 7)
# The phase's int32 words in the launch's counters: the schedule kernel's ticket, count
# arrivals and scanned words (common/schedule_tasks.py), then placed.
WORD_PLACED, WORDS = 3, 4
# Shared memory it carves (int32 words, each table 16-byte aligned), then the ticket's slot.
SMEM_WORDS = smem_words(COUNT_SMEM_SIZES + PLACE_SMEM_SIZES) + 4


@cute.jit
def schedule_tasks(
    ids_ptr: cute.Pointer,
    counts_ptr: cute.Pointer,
    expert_counts_ptr: cute.Pointer,
    words: Int64,
    walk,
    record: Int64,
    status_ptr: cute.Pointer,
    num_entries: Int32,
    smem: cute.Pointer,
    tidx: Int32,
):
    """Every thread of the CTA: the schedule's tasks by ticket, then the wait for all of them
    (module docstring). `ids_ptr`: the caller's int64 [T, k] routing, 8-byte aligned (read as
    int32 words, as `schedule_ids64`); `counts_ptr` int32 [num_chunks, E], `expert_counts_ptr`
    int32 [E]: scratch; `words`: the address of the phase's WORDS int32 counters (zero at the
    start); `walk` (task_walk.WalkArgs): the outputs as the schedule kernel's, the sizes and the
    bounded waits' timeout; `record`: the error record's address; `status_ptr`: the value-status words; `smem`:
    SMEM_WORDS int32 of shared memory, 16-byte aligned."""
    num_chunks = cutlass.max((num_entries + CHUNK - 1) // CHUNK, 1)
    placed = words + Int64(4 * WORD_PLACED)
    count_tables = count_smem(smem)
    place_tables = place_smem(smem + smem_words(COUNT_SMEM_SIZES))
    sTicket = cute.make_tensor(smem + (SMEM_WORDS - 4), cute.make_layout(1))

    task = take_task(sTicket, words, tidx)
    while task < 2 * num_chunks:
        if tidx < THREADS:
            schedule_task(
                True, task, num_chunks, words, ids_ptr, counts_ptr, expert_counts_ptr,
                walk.peer_rank_ptr, walk.peer_token_idx_ptr, walk.num_tokens_ptr, walk.tokens_per_expert_ptr,
                status_ptr, record, walk.timeout_ns, num_entries, num_entries, Int32(0),
                walk.num_experts, walk.capacity, count_tables, place_tables, tidx, SCHEDULE_SYNC,
                placed,
            )  # fmt: skip
        task = take_task(sTicket, words, tidx)
    if tidx == 0:
        bounded_wait_reached(
            placed, num_chunks, walk.timeout_ns, record, Int32(0), Int32(PHASE_SCHEDULE),
            Int32(WORD_PLACED), Int32(OWN_MEMORY), task, ld_acquire_gpu_s32,
        )  # fmt: skip
    cute.arch.sync_threads()
