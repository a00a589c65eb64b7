"""The receive schedule in one launch: a stable counting sort of the routing entries by local
expert, its count tasks (common/schedule_count.py) and then its placement tasks
(common/schedule_place.py), taken by dynamic tickets (common/schedule_tasks.py)."""

from dataclasses import dataclass
from typing import Annotated, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.args import global_pointer
from ..common.params import Int32Pointer
from ..common.retire import retire_cta
from ..common.schedule_count import count_smem
from ..common.schedule_place import place_smem
from ..common.schedule_tasks import COUNTER_WORDS, schedule_task, take_task
from ..common.schedule_warp import CHUNK, THREADS, WARP_SIZE


def ids_pointer(kernel):
    """int32 elements either way: a group of one's int64 ids are read as int32 words from an
    8-byte aligned array."""
    return global_pointer(Int32, 8 if kernel.ids64 else 4)


class ScheduleArgs(NamedTuple):
    """`Schedule`'s parameters, in order (C = capacity, E = num_local_experts)."""

    # int32 [P * T * k], the all-gathered routing; with `ids64` a group of one's int64 [T, k]
    ids_ptr: Annotated[cute.Pointer, ids_pointer]
    counts_ptr: Int32Pointer  # int32 [num_chunks, E], scratch
    expert_counts_ptr: Int32Pointer  # int32 [E], scratch
    counters_ptr: Int32Pointer  # 4 int32, zero
    peer_rank_ptr: Int32Pointer  # outputs: [C]
    peer_token_idx_ptr: Int32Pointer  # [C]
    num_tokens_ptr: Int32Pointer  # [1]
    tokens_per_expert_ptr: Int32Pointer  # [E]
    # 4 int32: overflow words; with `ids64` the value-status words, where a bad id is recorded
    status_ptr: Int32Pointer
    error_record_ptr: Int32Pointer
    timeout_ns: Int64
    num_entries: Int32
    entries_per_rank: Int32  # T * k
    ep_rank: Int32
    num_local_experts: Int32  # E
    capacity: Int32  # C


@dataclass(frozen=True)
class Schedule:
    """This rank's receive schedule (docs/SEMANTICS.md §3) of `num_entries` routing entries in
    chunks of 4096: 2 * num_chunks tasks, taken by a ticket (`atom.add` on counters[0]) in any
    order the CTAs run; tickets [0, num_chunks) count chunk t (`count_chunk`: the task that
    counts last scans every chunk's counts, then publishes counters[2] with a release),
    tickets [num_chunks, 2 * num_chunks) place chunk t - num_chunks (`place_chunk`, after a
    bounded wait for counters[2]). A placement waits only on count tasks, whose tickets are
    all smaller: they were taken by CTAs that run and never wait, so the launch completes
    whatever part of its grid is resident. A wait past `timeout_ns` writes the error record
    (phase SCHEDULE, task = the ticket) and traps. The grid's last CTA to exit zeroes the four
    counters (common/retire.py).

    Kernel parameters: `ScheduleArgs`. Constraints: `count_chunk`'s and `place_chunk`'s.

    Launch: grid (max(1, ceil(num_entries / 4096)), 1, 1), block (256, 1, 1), no dynamic smem
    (about 46 KiB static), cluster (1, 1, 1).
    """

    ids64: bool = False

    @cute.jit
    def __call__(self, args: ScheduleArgs):
        num_chunks = cutlass.max((args.num_entries + CHUNK - 1) // CHUNK, 1)
        self.kernel(args).launch(grid=[num_chunks, 1, 1], block=[THREADS, 1, 1])

    @cute.kernel
    def kernel(self, args: ScheduleArgs):
        tidx, _, _ = cute.arch.thread_idx()
        grid_size, _, _ = cute.arch.grid_dim()
        num_chunks = cutlass.max((args.num_entries + CHUNK - 1) // CHUNK, 1)
        counters = args.counters_ptr.toint()
        count_tables = count_smem()
        place_tables = place_smem()
        sTask = cute.make_tensor(cute.arch.alloc_smem(Int32, 4, alignment=16),
                                 cute.make_layout(4))  # fmt: skip

        task = take_task(sTask, counters, tidx)
        while task < 2 * num_chunks:
            schedule_task(
                self.ids64,
                task,
                num_chunks,
                counters,
                args.ids_ptr,
                args.counts_ptr,
                args.expert_counts_ptr,
                args.peer_rank_ptr,
                args.peer_token_idx_ptr,
                args.num_tokens_ptr,
                args.tokens_per_expert_ptr,
                args.status_ptr,
                args.error_record_ptr.toint(),
                args.timeout_ns,
                args.num_entries,
                args.entries_per_rank,
                args.ep_rank,
                args.num_local_experts,
                args.capacity,
                count_tables,
                place_tables,
                tidx,
            )
            task = take_task(sTask, counters, tidx)
        retire_cta(counters, Int32(COUNTER_WORDS), tidx // WARP_SIZE, grid_size)
