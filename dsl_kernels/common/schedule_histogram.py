"""Schedule pass 1 of 3: per-chunk counts of the entries routed to each local expert."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .args import global_pointer
from .schedule_warp import (
    CHUNK,
    ENTRIES_PER_LANE,
    MAX_LOCAL_EXPERTS,
    THREADS,
    WARP_CHUNK,
    WARP_SIZE,
    local_expert_key,
    warp_group_of,
)


@dataclass(frozen=True)
class ScheduleHistogram:
    """counts[c, e] = #{i in chunk c : ids[i] - ep_rank * E == e}, for every e < E.

    Kernel parameters (in this order): `ids_ptr` (int32 [num_entries], the all-gathered
    routing [P, T, k] flattened), `counts_ptr` (int32 [num_chunks, E], fully written),
    `num_entries` (P * T * k), `ep_rank`, `num_local_experts` (E), all int32.

    Chunking (schedule_warp.py): CTA c owns entries [c * 4096, (c + 1) * 4096), warp w the
    512 of them from c * 4096 + w * 512, lane order = entry order.

    Constraints (the launcher checks them; the kernel does not):
    - 1 <= E <= 1024; 0 <= num_entries < 2^31; ids and counts 4-byte aligned, contiguous.
    - launch: grid (max(1, ceil(num_entries / 4096)), 1, 1), block (256, 1, 1), no dynamic
      smem (4 KiB static), cluster (1, 1, 1).

    Counting: each warp groups its 32 entries per step by expert (`match.any.sync`), and the
    group's leader adds the group size to the CTA's shared-memory count with an integer
    atomic (integer sums do not depend on the order of the adds).
    """

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(Int32, 4),
            global_pointer(Int32, 4),
            Int32(0),
            Int32(0),
            Int32(0),
        )

    @cute.jit
    def __call__(
        self,
        ids_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        num_entries: Int32,
        ep_rank: Int32,
        num_local_experts: Int32,
    ):
        num_chunks = cutlass.max((num_entries + CHUNK - 1) // CHUNK, 1)
        self.kernel(ids_ptr, counts_ptr, num_entries, ep_rank, num_local_experts).launch(
            grid=[num_chunks, 1, 1], block=[THREADS, 1, 1]
        )

    @cute.kernel
    def kernel(
        self,
        ids_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        num_entries: Int32,
        ep_rank: Int32,
        num_local_experts: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        warp = tidx // WARP_SIZE
        lane = tidx % WARP_SIZE
        expert_base = ep_rank * num_local_experts

        mIds = cute.make_tensor(ids_ptr, cute.make_layout(num_entries))
        mCounts = cute.make_tensor(counts_ptr, cute.make_layout(num_local_experts * (chunk + 1)))
        sCount = cute.make_tensor(
            cute.arch.alloc_smem(Int32, MAX_LOCAL_EXPERTS, alignment=16),
            cute.make_layout(MAX_LOCAL_EXPERTS),
        )

        # ---- zero this CTA's counts ----
        for e in cutlass.range(tidx, num_local_experts, THREADS):
            sCount[e] = Int32(0)
        cute.arch.sync_threads()

        # ---- load this lane's 16 entries first: independent loads, one round trip ----
        warp_start = chunk * CHUNK + warp * WARP_CHUNK
        keys = cute.make_rmem_tensor((ENTRIES_PER_LANE,), Int32)
        for step in cutlass.range_constexpr(ENTRIES_PER_LANE):
            keys[step] = local_expert_key(
                mIds, warp_start + step * WARP_SIZE + lane, num_entries, expert_base,
                num_local_experts,
            )  # fmt: skip

        # ---- count: one integer atomic per (step, expert group) of a warp ----
        for step in cutlass.range_constexpr(ENTRIES_PER_LANE):
            key = keys[step]
            _, below, group_size = warp_group_of(key)
            if key >= 0 and below == 0:
                cute.arch.atomic_add((sCount.iterator + key).llvm_ptr, group_size, scope="cta")
        cute.arch.sync_threads()

        # ---- write every count (zeros included: the scan reads all of them) ----
        row = chunk * num_local_experts
        for e in cutlass.range(tidx, num_local_experts, THREADS):
            mCounts[row + e] = sCount[e]
