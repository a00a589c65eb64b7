"""The receive schedule in one launch: a stable counting sort of the routing entries by local
expert, its count tasks (common/schedule_count.py) and then its placement tasks
(common/schedule_place.py), taken by dynamic tickets (common/schedule_tasks.py)."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.args import global_pointer
from ..common.params import int32_pointer, placeholders
from ..common.retire import retire_cta
from ..common.schedule_count import count_smem
from ..common.schedule_place import place_smem
from ..common.schedule_tasks import COUNTER_WORDS, schedule_task, take_task
from ..common.schedule_warp import CHUNK, THREADS, WARP_SIZE

# `__call__`'s parameters, in order.
PARAMS = (
    ("ids_ptr", int32_pointer),  # int32 elements either way: see `compile_arguments`
    ("counts_ptr", int32_pointer),
    ("expert_counts_ptr", int32_pointer),
    ("counters_ptr", int32_pointer),
    ("peer_rank_ptr", int32_pointer),
    ("peer_token_idx_ptr", int32_pointer),
    ("num_tokens_ptr", int32_pointer),
    ("tokens_per_expert_ptr", int32_pointer),
    ("status_ptr", int32_pointer),
    ("error_record_ptr", int32_pointer),
    ("timeout_ns", Int64(0)),
    ("num_entries", Int32(0)),
    ("entries_per_rank", Int32(0)),
    ("ep_rank", Int32(0)),
    ("num_local_experts", Int32(0)),
    ("capacity", Int32(0)),
)


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

    Kernel parameters, in order: `ids_ptr` (int32 [P * T * k], the all-gathered routing; with
    `ids64` a group of one's int64 [T, k], 8-byte aligned), `counts_ptr` (int32 [num_chunks,
    E], scratch), `expert_counts_ptr` (int32 [E], scratch), `counters_ptr` (4 int32, zero),
    the outputs `peer_rank_ptr` [C], `peer_token_idx_ptr` [C], `num_tokens_ptr` [1],
    `tokens_per_expert_ptr` [E], `status_ptr` (4 int32: overflow words; with `ids64` the
    value-status words, where a bad id is recorded), `error_record_ptr`, int64 `timeout_ns`,
    int32 `num_entries`, `entries_per_rank` (T * k), `ep_rank`, `num_local_experts` (E),
    `capacity` (C). Constraints: `count_chunk`'s and `place_chunk`'s.

    Launch: grid (max(1, ceil(num_entries / 4096)), 1, 1), block (256, 1, 1), no dynamic smem
    (about 46 KiB static), cluster (1, 1, 1).
    """

    ids64: bool = False

    def compile_arguments(self) -> tuple:
        """A group of one's int64 ids are read as int32 words from an 8-byte aligned array."""
        ids = global_pointer(Int32, 8 if self.ids64 else 4)
        return (ids, *placeholders(PARAMS)[1:])

    @cute.jit
    def __call__(
        self,
        ids_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        expert_counts_ptr: cute.Pointer,
        counters_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_tokens_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        status_ptr: cute.Pointer,
        error_record_ptr: cute.Pointer,
        timeout_ns: Int64,
        num_entries: Int32,
        entries_per_rank: Int32,
        ep_rank: Int32,
        num_local_experts: Int32,
        capacity: Int32,
    ):
        num_chunks = cutlass.max((num_entries + CHUNK - 1) // CHUNK, 1)
        self.kernel(
            ids_ptr, counts_ptr, expert_counts_ptr, counters_ptr, peer_rank_ptr,
            peer_token_idx_ptr, num_tokens_ptr, tokens_per_expert_ptr, status_ptr,
            error_record_ptr, timeout_ns, num_entries, entries_per_rank, ep_rank,
            num_local_experts, capacity,
        ).launch(grid=[num_chunks, 1, 1], block=[THREADS, 1, 1])  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        ids_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        expert_counts_ptr: cute.Pointer,
        counters_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_tokens_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        status_ptr: cute.Pointer,
        error_record_ptr: cute.Pointer,
        timeout_ns: Int64,
        num_entries: Int32,
        entries_per_rank: Int32,
        ep_rank: Int32,
        num_local_experts: Int32,
        capacity: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        grid_size, _, _ = cute.arch.grid_dim()
        num_chunks = cutlass.max((num_entries + CHUNK - 1) // CHUNK, 1)
        counters = counters_ptr.toint()
        count_tables = count_smem()
        place_tables = place_smem()
        sTask = cute.make_tensor(cute.arch.alloc_smem(Int32, 4, alignment=16),
                                 cute.make_layout(4))  # fmt: skip

        task = take_task(sTask, counters, tidx)
        while task < 2 * num_chunks:
            schedule_task(
                self.ids64, task, num_chunks, counters, ids_ptr, counts_ptr, expert_counts_ptr,
                peer_rank_ptr, peer_token_idx_ptr, num_tokens_ptr, tokens_per_expert_ptr,
                status_ptr, error_record_ptr.toint(), timeout_ns, num_entries, entries_per_rank,
                ep_rank, num_local_experts, capacity, count_tables, place_tables, tidx,
            )  # fmt: skip
            task = take_task(sTask, counters, tidx)
        retire_cta(counters, Int32(COUNTER_WORDS), tidx // WARP_SIZE, grid_size)
