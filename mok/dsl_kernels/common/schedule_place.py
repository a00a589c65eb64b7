"""The schedule's placement of one chunk: expert segments, padding rows and the stable
placement of every entry."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .schedule_warp import (
    CHUNK,
    ENTRIES_PER_LANE,
    MAX_LOCAL_EXPERTS,
    ROUTED_ROW_ALIGNMENT,
    THREADS,
    WARP_CHUNK,
    WARP_SIZE,
    WARPS,
    checked_local_expert_key,
    local_expert_key,
    schedule_barrier,
    smem_vectors,
    warp_group_of,
)
from .value_checks import STATUS_BAD_EXPERT_ID

EXPERTS_PER_THREAD = MAX_LOCAL_EXPERTS // THREADS  # experts of one thread in the segment scan
PADDING = -1  # peer_rank and peer_token_idx of a padding row (and of every row past the total)
STATUS_WORDS = 4  # status on overflow: [1, padded total, ep_rank, capacity]


@cute.jit
def place_chunk(
    ids64: cutlass.Constexpr,
    ids_ptr: cute.Pointer,
    offsets_ptr: cute.Pointer,
    expert_counts_ptr: cute.Pointer,
    peer_rank_ptr: cute.Pointer,
    peer_token_idx_ptr: cute.Pointer,
    num_tokens_ptr: cute.Pointer,
    tokens_per_expert_ptr: cute.Pointer,
    status_ptr: cute.Pointer,
    num_entries: Int32,
    entries_per_rank: Int32,
    ep_rank: Int32,
    num_local_experts: Int32,
    capacity: Int32,
    chunk: Int32,
    num_ctas: Int32,
    smem: tuple,
    named_barrier: cutlass.Constexpr = None,
):
    """Every thread of the CTA: place chunk `chunk` of the `num_ctas` placement tasks (one per
    chunk), from the count pass's offsets (schedule_count.py), into this rank's receive
    schedule (docs/SEMANTICS.md §3). `smem`: `place_smem()`. `named_barrier`:
    `schedule_barrier`'s (None: the CTA is the task's THREADS threads).

    Pointers to contiguous int32 buffers: `ids_ptr` [num_entries] (all-gathered routing),
    `offsets_ptr` [num_chunks, E] (count pass: each chunk's offset inside its expert's
    segment), `expert_counts_ptr` [E] (count pass), `peer_rank_ptr` [capacity],
    `peer_token_idx_ptr` [capacity], `num_tokens_ptr` [1], `tokens_per_expert_ptr` [E],
    `status_ptr` [4] (written only on overflow); then int32 `num_entries` (P * T * k),
    `entries_per_rank` (T * k), `ep_rank`, `num_local_experts` (E), `capacity` (C).

    Every CTA first rebuilds the segment table: padded[e] = round_up(count[e], 128),
    start[e] = sum_{e' < e} padded[e'], total = sum_e padded[e] (a block scan of <= 1024
    values). Task 0 writes tokens_per_expert = padded, num_tokens = total and, only if
    total > C, the status words [1, total, ep_rank, C]. Then, if total <= C:
    - rows start[e] + count[e] .. start[e] + padded[e] - 1 and rows total .. C - 1 get -1
      (strided over all placement tasks);
    - task c places its chunk [c * 4096, (c + 1) * 4096): warp w's sub-chunk of 512 entries is
      counted per expert into a private shared-memory row (match.any.sync groups, the group
      leader adds; no atomics), the 8 rows are turned into per-warp offsets starting at
      start[e] + offsets[c, e], and each warp walks its entries again in order: an entry's row
      is its warp's running offset for its expert plus the number of earlier lanes of the same
      step with the same expert. So rows follow the flat entry index (rank, then t * k + j),
      whatever order tasks and warps run in.
    If total > C (capacity overflow) nothing is placed: every row 0 .. C - 1 of peer_rank and
    peer_token_idx is -1, num_tokens and tokens_per_expert are 0 (the layer's kernels run no
    row), status = [1, the true total, ...]; the host reads the status at its next sync
    (mok.launchers.schedule_kernels.check_schedule).

    `ids64` (a group of one, schedule_warp.py): `ids_ptr` is the caller's int64 [T, k] routing
    (8-byte aligned; P = 1, ep_rank = 0) and `status_ptr` the device's value-status words
    (mok/launchers/status.py): phase 3 checks every id against [0, E) as the all-gather does
    (words 4-5; not when the schedule overflows, whose report comes first anyway).

    Constraints (the launcher checks them): 1 <= E <= 1024; 0 <= num_entries = P *
    entries_per_rank < 2^31; C + E * 128 < 2^31.
    """
    tidx, _, _ = cute.arch.thread_idx()
    warp = tidx // WARP_SIZE
    lane = tidx % WARP_SIZE
    num_experts = num_local_experts

    def vector(ptr, size):
        return cute.make_tensor(ptr, cute.make_layout(size))

    mIds = vector(ids_ptr, num_entries)
    mOffsets = vector(offsets_ptr, num_experts * (chunk + 1))
    mExpertCounts = vector(expert_counts_ptr, num_experts)
    mPeerRank = vector(peer_rank_ptr, capacity)
    mPeerToken = vector(peer_token_idx_ptr, capacity)
    mNumTokens = vector(num_tokens_ptr, 1)
    mTokensPerExpert = vector(tokens_per_expert_ptr, num_experts)
    mStatus = vector(status_ptr, STATUS_WORDS)

    sStart, sCount, sWarpTotal, sWarpOffset = smem

    # ==== phase 1: segment table (every CTA; CTA 0 publishes it) ====
    # Thread t owns experts [4 t, 4 t + 4): a thread sum, a warp scan, a scan of 8 warps.
    first_expert = tidx * EXPERTS_PER_THREAD
    thread_rows = Int32(0)
    for i in cutlass.range_constexpr(EXPERTS_PER_THREAD):
        e = first_expert + i
        count = Int32(0)
        if e < num_experts:
            count = mExpertCounts[e]
        sCount[e] = count
        thread_rows = thread_rows + round_up_rows(count)
    inclusive = thread_rows
    for shift in cutlass.range_constexpr(5):  # 1, 2, 4, 8, 16: Hillis-Steele over lanes
        other = cute.arch.shuffle_sync_up(inclusive, 1 << shift)
        if lane >= (1 << shift):
            inclusive = inclusive + other
    if lane == WARP_SIZE - 1:
        sWarpTotal[warp] = inclusive
    schedule_barrier(named_barrier)
    total = Int32(0)
    row = inclusive - thread_rows  # exclusive prefix inside the warp ...
    for w in cutlass.range_constexpr(WARPS):
        warp_rows = sWarpTotal[w]
        total = total + warp_rows
        if w < warp:
            row = row + warp_rows  # ... plus the rows of the warps before
    overflow = total > capacity
    for i in cutlass.range_constexpr(EXPERTS_PER_THREAD):
        e = first_expert + i
        padded = round_up_rows(sCount[e])
        sStart[e] = row
        if chunk == 0 and e < num_experts:
            # An overflowed schedule holds no rows: no kernel walks past the capacity.
            mTokensPerExpert[e] = cutlass.select_(overflow, Int32(0), padded)
        row = row + padded
    if chunk == 0 and tidx == 0:
        mNumTokens[0] = cutlass.select_(overflow, Int32(0), total)
        # Written only on overflow: the words are sticky until the host reports them, so a
        # later schedule that fits cannot erase an overflow nobody has seen yet.
        if overflow:
            mStatus[0] = Int32(1)
            mStatus[1] = total
            mStatus[2] = ep_rank
            mStatus[3] = capacity
    schedule_barrier(named_barrier)

    stride = num_ctas * THREADS
    if overflow:
        # ==== capacity overflow: place nothing, every row is padding ====
        for r in cutlass.range(chunk * THREADS + tidx, capacity, stride):
            mPeerRank[r] = Int32(PADDING)
            mPeerToken[r] = Int32(PADDING)
    else:
        # ==== phase 2: padding rows of every segment, then rows total .. C - 1 ====
        for q in cutlass.range(chunk * THREADS + tidx, num_experts * ROUTED_ROW_ALIGNMENT, stride):
            e = q // ROUTED_ROW_ALIGNMENT
            filled = sCount[e] + q % ROUTED_ROW_ALIGNMENT
            if filled < round_up_rows(sCount[e]):
                mPeerRank[sStart[e] + filled] = Int32(PADDING)
                mPeerToken[sStart[e] + filled] = Int32(PADDING)
        for r in cutlass.range(total + chunk * THREADS + tidx, capacity, stride):
            mPeerRank[r] = Int32(PADDING)
            mPeerToken[r] = Int32(PADDING)

        # ==== phase 3: each warp counts its sub-chunk per expert (private smem row) ====
        warp_row = warp * MAX_LOCAL_EXPERTS
        for e in cutlass.range(lane, num_experts, WARP_SIZE):
            sWarpOffset[warp_row + e] = Int32(0)
        warp_start = chunk * CHUNK + warp * WARP_CHUNK
        keys = cute.make_rmem_tensor((ENTRIES_PER_LANE,), Int32)
        for step in cutlass.range_constexpr(ENTRIES_PER_LANE):
            entry = warp_start + step * WARP_SIZE + lane
            if cutlass.const_expr(ids64):
                keys[step] = checked_local_expert_key(
                    ids_ptr.toint(), entry, num_entries, num_experts,
                    status_ptr.toint() + Int64(STATUS_BAD_EXPERT_ID * 4),
                )  # fmt: skip
            else:
                keys[step] = local_expert_key(
                    mIds, entry, num_entries, ep_rank * num_experts, num_experts
                )
        # The warp-level barriers order one step's leader writes before the next step's
        # reads (the next leader of an expert may be another lane).
        cute.arch.sync_warp()
        for step in cutlass.range_constexpr(ENTRIES_PER_LANE):
            key = keys[step]
            _, below, group_size = warp_group_of(key)
            if key >= 0 and below == 0:
                sWarpOffset[warp_row + key] = sWarpOffset[warp_row + key] + group_size
            cute.arch.sync_warp()
        schedule_barrier(named_barrier)

        # ==== phase 4: per-warp counts -> first row of each (warp, expert) run ====
        for e in cutlass.range(tidx, num_experts, THREADS):
            next_row = sStart[e] + mOffsets[chunk * num_experts + e]
            for w in cutlass.range_constexpr(WARPS):
                warp_count = sWarpOffset[w * MAX_LOCAL_EXPERTS + e]
                sWarpOffset[w * MAX_LOCAL_EXPERTS + e] = next_row
                next_row = next_row + warp_count
        schedule_barrier(named_barrier)

        # ==== phase 5: place the entries in flat-index order ====
        for step in cutlass.range_constexpr(ENTRIES_PER_LANE):
            key = keys[step]
            _, below, group_size = warp_group_of(key)
            base = Int32(0)
            if key >= 0:
                index = warp_start + step * WARP_SIZE + lane
                source_rank = index // entries_per_rank
                base = sWarpOffset[warp_row + key]
                mPeerRank[base + below] = source_rank
                mPeerToken[base + below] = index - source_rank * entries_per_rank
            # Every lane of the group has read `base` before its leader moves it on.
            cute.arch.sync_warp()
            if key >= 0 and below == 0:
                sWarpOffset[warp_row + key] = base + group_size
            cute.arch.sync_warp()


PLACE_SMEM_SIZES = (MAX_LOCAL_EXPERTS, MAX_LOCAL_EXPERTS, WARPS, WARPS * MAX_LOCAL_EXPERTS)


def place_smem(base=None) -> tuple:
    """`place_chunk`'s shared-memory tables (32 KiB + 8 KiB + 32 B): the first row of each
    expert's segment, each expert's unpadded entries, the block scan's per-warp totals, and the
    per-(warp, expert) counts / rows; static, or carved from `base` (`smem_vectors`)."""
    return smem_vectors(PLACE_SMEM_SIZES, base)


@cute.jit
def round_up_rows(count: Int32) -> Int32:
    """`count` rounded up to a multiple of ROUTED_ROW_ALIGNMENT (the GEMM tile height)."""
    return (count + ROUTED_ROW_ALIGNMENT - 1) // ROUTED_ROW_ALIGNMENT * ROUTED_ROW_ALIGNMENT
