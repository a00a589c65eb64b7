"""Schedule pass 1 of 2: per-chunk counts of the entries routed to each local expert, then (the
grid's last CTA) each chunk's offset inside its expert's segment and every expert's total."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .args import global_pointer
from .bounded_wait import atom_add_acq_rel_gpu_s32, fence_acq_rel_sys, st_global_b32
from .schedule_warp import (
    CHUNK,
    ENTRIES_PER_LANE,
    MAX_LOCAL_EXPERTS,
    THREADS,
    WARP_CHUNK,
    WARP_SIZE,
    WARPS,
    local_expert_key,
    warp_group_of,
)

EXPERTS_PER_BLOCK = WARP_SIZE  # the scan: lane = expert of a block of 32 ...
CHUNK_GROUPS = WARPS  # ... and warp g sums a contiguous range of chunk rows
SUM_PITCH = EXPERTS_PER_BLOCK + 1  # padded row of the group-sum table (no bank conflicts)


@dataclass(frozen=True)
class ScheduleCount:
    """counts[c, e] <- sum_{c' < c} #{i in chunk c' : ids[i] - ep_rank * E == e} (chunk c's
    offset inside expert e's segment); expert_counts[e] = the entries routed to expert e.

    Kernel parameters (in this order): `ids_ptr` (int32 [num_entries], the all-gathered
    routing [P, T, k] flattened), `counts_ptr` (int32 [num_chunks, E], fully written),
    `expert_counts_ptr` (int32 [E]), `arrivals_ptr` (one int32, zero when the launch starts;
    the launch leaves it zero), `num_entries` (P * T * k), `ep_rank`, `num_local_experts` (E),
    all int32.

    Counting: CTA c owns entries [c * 4096, (c + 1) * 4096), warp w the 512 of them from
    c * 4096 + w * 512, lane order = entry order (schedule_warp.py). Each warp groups its 32
    entries per step by expert (`match.any.sync`), and the group's leader adds the group size
    to the CTA's shared-memory count with an integer atomic (integer sums do not depend on the
    order of the adds); the CTA writes its row of counts.

    Scan: each CTA then counts itself on `arrivals` (`atom.acq_rel.gpu` after a CTA barrier and
    a fence: it covers every thread's row); the CTA that counts last has every row and rewrites
    them in place. Per block of 32 experts (lane = expert), warp g sums the chunk rows
    [g * R, (g + 1) * R), R = ceil(num_chunks / 8); the 8 group sums are scanned through shared
    memory and each warp walks its rows again writing the running offset. Integer sums in a
    fixed order: exact and deterministic. It then sets `arrivals` back to zero.

    `ids64` (a group of one, schedule_warp.py): `ids_ptr` is the caller's int64 [T, k] routing
    (8-byte aligned), of which the count reads each id's low word.

    Constraints (the launcher checks them; the kernel does not):
    - 1 <= E <= 1024; 0 <= num_entries < 2^31; num_chunks * E < 2^31; pointers 4-byte
      aligned, contiguous.
    - launch: grid (max(1, ceil(num_entries / 4096)), 1, 1), block (256, 1, 1), no dynamic
      smem (about 5 KiB static), cluster (1, 1, 1).
    """

    ids64: bool = False

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(Int32, 8 if self.ids64 else 4),
            global_pointer(Int32, 4),
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
        expert_counts_ptr: cute.Pointer,
        arrivals_ptr: cute.Pointer,
        num_entries: Int32,
        ep_rank: Int32,
        num_local_experts: Int32,
    ):
        num_chunks = cutlass.max((num_entries + CHUNK - 1) // CHUNK, 1)
        self.kernel(
            ids_ptr, counts_ptr, expert_counts_ptr, arrivals_ptr, num_entries, ep_rank,
            num_local_experts,
        ).launch(grid=[num_chunks, 1, 1], block=[THREADS, 1, 1])  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        ids_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        expert_counts_ptr: cute.Pointer,
        arrivals_ptr: cute.Pointer,
        num_entries: Int32,
        ep_rank: Int32,
        num_local_experts: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, _, _ = cute.arch.block_idx()
        num_chunks, _, _ = cute.arch.grid_dim()
        warp = tidx // WARP_SIZE
        lane = tidx % WARP_SIZE
        expert_base = ep_rank * num_local_experts

        # ids64: the low word of each int64 id (little-endian), int32 stride 2.
        id_stride = 2 if cutlass.const_expr(self.ids64) else 1
        mIds = cute.make_tensor(ids_ptr, cute.make_layout(num_entries, stride=id_stride))
        mCounts = cute.make_tensor(counts_ptr, cute.make_layout(num_local_experts * num_chunks))
        sCount = cute.make_tensor(
            cute.arch.alloc_smem(Int32, MAX_LOCAL_EXPERTS, alignment=16),
            cute.make_layout(MAX_LOCAL_EXPERTS),
        )
        sSum = cute.make_tensor(
            cute.arch.alloc_smem(Int32, CHUNK_GROUPS * SUM_PITCH, alignment=16),
            cute.make_layout(CHUNK_GROUPS * SUM_PITCH),
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

        # ---- count this CTA; the last one scans (its verdict through sSum[0]) ----
        cute.arch.sync_threads()
        arrivals = arrivals_ptr.toint()
        if tidx == 0:
            fence_acq_rel_sys()
            sSum[0] = atom_add_acq_rel_gpu_s32(arrivals, Int32(1))
        cute.arch.sync_threads()
        if sSum[0] == num_chunks - 1:
            cute.arch.sync_threads()  # every thread has read the verdict before sSum is reused
            mExpertCounts = cute.make_tensor(expert_counts_ptr, cute.make_layout(num_local_experts))
            scan_counts(mCounts, mExpertCounts, sSum, num_chunks, num_local_experts, warp, lane)
            if tidx == 0:
                st_global_b32(arrivals, Int32(0))


@cute.jit
def scan_counts(mCounts, mExpertCounts, sSum, num_chunks, num_experts, group, lane):
    """In place over chunks, per expert: counts[c, e] <- sum_{c' < c} counts[c', e], and
    expert_counts[e] = sum_c counts[c, e] (every thread of the CTA; the scan of the docstring)."""
    rows_per_group = (num_chunks + CHUNK_GROUPS - 1) // CHUNK_GROUPS
    first_row = cutlass.min(group * rows_per_group, num_chunks)
    end_row = cutlass.min(first_row + rows_per_group, num_chunks)
    for block in cutlass.range((num_experts + EXPERTS_PER_BLOCK - 1) // EXPERTS_PER_BLOCK):
        expert = block * EXPERTS_PER_BLOCK + lane
        # ---- sum of this group's rows (unrolled: the loads are independent) ----
        group_sum = Int32(0)
        if expert < num_experts:
            for row in cutlass.range(first_row, end_row, 1, unroll=8):
                group_sum = group_sum + mCounts[row * num_experts + expert]
        sSum[group * SUM_PITCH + lane] = group_sum
        cute.arch.sync_threads()

        # ---- exclusive prefix over the groups before this one; the last group has the total --
        running = Int32(0)
        for earlier in cutlass.range(group):
            running = running + sSum[earlier * SUM_PITCH + lane]
        if expert < num_experts:
            if group == CHUNK_GROUPS - 1:
                mExpertCounts[expert] = running + group_sum
            # ---- rewrite this group's rows with the running offset ----
            for row in cutlass.range(first_row, end_row, 1, unroll=4):
                index = row * num_experts + expert
                count = mCounts[index]
                mCounts[index] = running
                running = running + count
        cute.arch.sync_threads()  # sSum is the next block's
