"""Schedule pass 2 of 3: per expert, the exclusive prefix of the chunk counts over chunks."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .args import global_pointer
from .schedule_warp import WARP_SIZE

EXPERTS_PER_CTA = 32  # one per lane: a warp reads 32 consecutive counts of one chunk row
CHUNK_GROUPS = 32  # one per warp: warp g sums a contiguous range of chunk rows
THREADS = EXPERTS_PER_CTA * CHUNK_GROUPS
SUM_PITCH = EXPERTS_PER_CTA + 1  # padded row of the group-sum table (no bank conflicts)


@dataclass(frozen=True)
class ScheduleScan:
    """In place: counts[c, e] <- sum_{c' < c} counts[c', e]; expert_counts[e] = sum_c counts[c, e].

    Kernel parameters (in this order): `counts_ptr` (int32 [num_chunks, E], the histogram
    pass's output, overwritten with each chunk's offset inside its expert's segment),
    `expert_counts_ptr` (int32 [E], entries routed to each local expert), `num_chunks`,
    `num_local_experts` (E), all int32.

    Work split: CTA b owns experts [32 b, 32 b + 32), lane = expert. Warp g owns the chunk
    rows [g * R, (g + 1) * R), R = ceil(num_chunks / 32): it sums them, the 32 group sums of
    each expert are scanned through shared memory, then the warp walks its rows again writing
    the running offset. Integer sums in a fixed order: the result is exact and deterministic.

    Constraints (the launcher checks them; the kernel does not):
    - 1 <= E; num_chunks >= 1; num_chunks * E < 2^31; pointers 4-byte aligned, contiguous.
    - launch: grid (ceil(E / 32), 1, 1), block (1024, 1, 1), no dynamic smem (4.1 KiB
      static), cluster (1, 1, 1).
    """

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (global_pointer(Int32, 4), global_pointer(Int32, 4), Int32(0), Int32(0))

    @cute.jit
    def __call__(
        self,
        counts_ptr: cute.Pointer,
        expert_counts_ptr: cute.Pointer,
        num_chunks: Int32,
        num_local_experts: Int32,
    ):
        grid_x = (num_local_experts + EXPERTS_PER_CTA - 1) // EXPERTS_PER_CTA
        self.kernel(counts_ptr, expert_counts_ptr, num_chunks, num_local_experts).launch(
            grid=[grid_x, 1, 1], block=[THREADS, 1, 1]
        )

    @cute.kernel
    def kernel(
        self,
        counts_ptr: cute.Pointer,
        expert_counts_ptr: cute.Pointer,
        num_chunks: Int32,
        num_local_experts: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % WARP_SIZE
        group = tidx // WARP_SIZE
        expert = bidx * EXPERTS_PER_CTA + lane

        mCounts = cute.make_tensor(counts_ptr, cute.make_layout(num_chunks * num_local_experts))
        mExpertCounts = cute.make_tensor(expert_counts_ptr, cute.make_layout(num_local_experts))
        sSum = cute.make_tensor(
            cute.arch.alloc_smem(Int32, CHUNK_GROUPS * SUM_PITCH, alignment=16),
            cute.make_layout(CHUNK_GROUPS * SUM_PITCH),
        )

        rows_per_group = (num_chunks + CHUNK_GROUPS - 1) // CHUNK_GROUPS
        first_row = cutlass.min(group * rows_per_group, num_chunks)
        end_row = cutlass.min(first_row + rows_per_group, num_chunks)

        # ---- sum of this group's rows (unrolled: the loads are independent) ----
        group_sum = Int32(0)
        if expert < num_local_experts:
            for row in cutlass.range(first_row, end_row, 1, unroll=8):
                group_sum = group_sum + mCounts[row * num_local_experts + expert]
        sSum[group * SUM_PITCH + lane] = group_sum
        cute.arch.sync_threads()

        # ---- exclusive prefix over the groups before this one; the last group has the total ----
        running = Int32(0)
        for earlier in cutlass.range(group):
            running = running + sSum[earlier * SUM_PITCH + lane]
        if expert < num_local_experts:
            if group == CHUNK_GROUPS - 1:
                mExpertCounts[expert] = running + group_sum
            # ---- rewrite this group's rows with the running offset ----
            for row in cutlass.range(first_row, end_row, 1, unroll=4):
                index = row * num_local_experts + expert
                count = mCounts[index]
                mCounts[index] = running
                running = running + count
