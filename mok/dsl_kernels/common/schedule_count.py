"""The schedule's count pass over one chunk: the entries routed to each local expert, then (the
last chunk counted) each chunk's offset inside its expert's segment and every expert's total."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

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
    schedule_barrier,
    smem_vectors,
    warp_group_of,
)

EXPERTS_PER_BLOCK = WARP_SIZE  # the scan: lane = expert of a block of 32 ...
CHUNK_GROUPS = WARPS  # ... and warp g sums a contiguous range of chunk rows
SUM_PITCH = EXPERTS_PER_BLOCK + 1  # padded row of the group-sum table (no bank conflicts)


@cute.jit
def count_chunk(
    ids64: cutlass.Constexpr,
    ids_ptr: cute.Pointer,
    counts_ptr: cute.Pointer,
    expert_counts_ptr: cute.Pointer,
    arrivals: Int64,
    num_entries: Int32,
    ep_rank: Int32,
    num_local_experts: Int32,
    chunk: Int32,
    num_chunks: Int32,
    sCount: cute.Tensor,
    sSum: cute.Tensor,
    named_barrier: cutlass.Constexpr = None,
) -> Int32:
    """Every thread of the CTA: count chunk `chunk` of `num_chunks` and, if it is the last to
    arrive, scan them all. Returns the old arrivals value (num_chunks - 1: this CTA scanned).

    counts[c, e] <- sum_{c' < c} #{i in chunk c' : ids[i] - ep_rank * E == e} (chunk c's
    offset inside expert e's segment); expert_counts[e] = the entries routed to expert e.
    `ids_ptr`: int32 [num_entries] (the all-gathered routing [P, T, k] flattened), or with
    `ids64` the caller's int64 [T, k] (8-byte aligned), of which each id's low word is read;
    `counts_ptr` int32 [num_chunks, E] (fully written); `expert_counts_ptr` int32 [E];
    `arrivals` the address of an int32 that is zero before the first chunk is counted and is
    left zero by the scan. `sCount` (MAX_LOCAL_EXPERTS int32) and `sSum` (CHUNK_GROUPS *
    SUM_PITCH int32): shared memory. `named_barrier`: `schedule_barrier`'s (None: the CTA is
    the task's THREADS threads).

    Counting: entries [chunk * 4096, (chunk + 1) * 4096), warp w the 512 of them from
    chunk * 4096 + w * 512, lane order = entry order (schedule_warp.py). Each warp groups its 32
    entries per step by expert (`match.any.sync`), and the group's leader adds the group size
    to the CTA's shared-memory count with an integer atomic (integer sums do not depend on the
    order of the adds); the CTA writes its row of counts.

    Scan: the CTA then counts itself on `arrivals` (`atom.acq_rel.gpu` after a CTA barrier and
    a fence: it covers every thread's row); the CTA that counts last has every row and rewrites
    them in place. Per block of 32 experts (lane = expert), warp g sums the chunk rows
    [g * R, (g + 1) * R), R = ceil(num_chunks / 8); the 8 group sums are scanned through shared
    memory and each warp walks its rows again writing the running offset. Integer sums in a
    fixed order: exact and deterministic. It then sets `arrivals` back to zero.

    Constraints (the launcher checks them): 1 <= E <= 1024; 0 <= num_entries < 2^31;
    num_chunks * E < 2^31; pointers 4-byte aligned, contiguous.
    """
    tidx, _, _ = cute.arch.thread_idx()
    warp = tidx // WARP_SIZE
    lane = tidx % WARP_SIZE
    expert_base = ep_rank * num_local_experts

    # ids64: the low word of each int64 id (little-endian), int32 stride 2.
    id_stride = 2 if cutlass.const_expr(ids64) else 1
    mIds = cute.make_tensor(ids_ptr, cute.make_layout(num_entries, stride=id_stride))
    mCounts = cute.make_tensor(counts_ptr, cute.make_layout(num_local_experts * num_chunks))

    # ---- zero this CTA's counts ----
    for e in cutlass.range(tidx, num_local_experts, THREADS):
        sCount[e] = Int32(0)
    schedule_barrier(named_barrier)

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
    schedule_barrier(named_barrier)

    # ---- write every count (zeros included: the scan reads all of them) ----
    row = chunk * num_local_experts
    for e in cutlass.range(tidx, num_local_experts, THREADS):
        mCounts[row + e] = sCount[e]

    # ---- count this CTA; the last one scans (its verdict through sSum[0]) ----
    schedule_barrier(named_barrier)
    if tidx == 0:
        fence_acq_rel_sys()
        sSum[0] = atom_add_acq_rel_gpu_s32(arrivals, Int32(1))
    schedule_barrier(named_barrier)
    verdict = sSum[0]
    if verdict == num_chunks - 1:
        schedule_barrier(named_barrier)  # every thread has read the verdict before sSum is reused
        mExpertCounts = cute.make_tensor(expert_counts_ptr, cute.make_layout(num_local_experts))
        scan_counts(mCounts, mExpertCounts, sSum, num_chunks, num_local_experts, warp, lane,
                    named_barrier)  # fmt: skip
        if tidx == 0:
            st_global_b32(arrivals, Int32(0))
    return verdict


COUNT_SMEM_SIZES = (MAX_LOCAL_EXPERTS, CHUNK_GROUPS * SUM_PITCH)


def count_smem(base=None) -> tuple:
    """`count_chunk`'s shared memory (about 5 KiB): the CTA's count of each expert, and the
    scan's group-sum table (its word 0 carries the arrival verdict); static, or carved from
    `base` (`smem_vectors`)."""
    return smem_vectors(COUNT_SMEM_SIZES, base)


@cute.jit
def scan_counts(mCounts, mExpertCounts, sSum, num_chunks, num_experts, group, lane,
                named_barrier: cutlass.Constexpr):  # fmt: skip
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
        schedule_barrier(named_barrier)

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
        schedule_barrier(named_barrier)  # sSum is the next block's
