"""CPU checks of the GPU schedule (dsl_kernels/common/schedule_*.py, mok/launchers/schedule.py).

1. A pure-PyTorch emulation of the kernels' exact multi-pass algorithm (same 4096-entry chunks,
   same 8 warps x 16 steps x 32 lanes, same match.any groups and leaders, same scans, padding
   fill and overflow rule) equals `mok.reference.build_schedule` bit for bit, writes every
   output element and never writes outside [0, C). No GPU needed; this is the algorithm proof.
2. The three variants compile for sm_90a and sm_100a, rely on `match.any.sync`, use only
   integer (shared-memory) atomics, no floating-point atomics, and no dynamic shared memory.
"""


import torch

from mok.config import ROUTED_ROW_ALIGNMENT
from mok.launchers import schedule as launcher

# The kernels' constants (dsl_kernels/common/schedule_warp.py), restated: the emulation must
# not import the DSL. `test_constants_agree` checks them against the kernel sources.
WARP_SIZE = 32
WARPS = 8
STEPS = 16  # ENTRIES_PER_LANE
CHUNK = WARPS * STEPS * WARP_SIZE
EXPERTS_PER_THREAD = 4
SCAN_GROUPS = 32
POISON = 12345


# ---------------------------------------------------------------------------------------------
# Emulation of the kernels
# ---------------------------------------------------------------------------------------------
def _round_up(counts: torch.Tensor) -> torch.Tensor:
    return (counts + ROUTED_ROW_ALIGNMENT - 1) // ROUTED_ROW_ALIGNMENT * ROUTED_ROW_ALIGNMENT


def _warp_keys(ids: torch.Tensor, ep_rank: int, num_experts: int, num_chunks: int):
    """keys [chunk, warp, step, lane] as `local_expert_key` computes them (-1: not mine)."""
    flat = torch.full((num_chunks * CHUNK,), -1, dtype=torch.int64)
    local = ids.reshape(-1).long() - ep_rank * num_experts
    flat[: local.numel()] = torch.where((local >= 0) & (local < num_experts), local, -1)
    return flat.view(num_chunks, WARPS, STEPS, WARP_SIZE)


def _match_any(keys: torch.Tensor):
    """(below, group_size) per lane: `warp_group_of` on the last dim (32 lanes)."""
    same = keys[..., :, None] == keys[..., None, :]  # [..., lane, other lane]
    lower = torch.ones(WARP_SIZE, WARP_SIZE, dtype=torch.bool).tril(-1)  # other < lane
    return (same & lower).sum(-1), same.sum(-1)


def emulate_schedule(ids: torch.Tensor, *, ep_rank: int, num_local_experts: int, capacity: int):
    """The GPU schedule computed the way the three kernels compute it (CPU, int64 math).

    Returns (peer_rank, peer_token_idx, num_tokens, tokens_per_expert, status) as int32,
    with outputs starting poisoned (12345) so that an unwritten element shows.
    """
    num_ranks, tokens, topk = ids.shape
    num_entries, entries_per_rank = num_ranks * tokens * topk, tokens * topk
    num_experts = num_local_experts
    num_chunks = max(1, -(-num_entries // CHUNK))
    keys = _warp_keys(ids, ep_rank, num_experts, num_chunks)
    below, group_size = _match_any(keys)
    leader = (keys >= 0) & (below == 0)

    # ---- pass 1, schedule_histogram: leaders add group sizes per chunk ----
    counts = torch.zeros(num_chunks, num_experts + 1, dtype=torch.int64)  # column E: not mine
    chunk_of = torch.arange(num_chunks)[:, None, None, None].expand_as(keys)
    counts.index_put_(
        (chunk_of[leader], keys[leader]), group_size[leader], accumulate=True
    )  # integer adds: order does not matter, like the shared-memory atomics
    counts = counts[:, :num_experts]

    # ---- pass 2, schedule_scan: 32 groups of chunk rows per expert ----
    rows_per_group = -(-num_chunks // SCAN_GROUPS)
    offsets = torch.empty_like(counts)
    group_sums = []
    for g in range(SCAN_GROUPS):
        first, end = min(g * rows_per_group, num_chunks), min((g + 1) * rows_per_group, num_chunks)
        group_sums.append(counts[first:end].sum(0))
    running_groups = torch.zeros(num_experts, dtype=torch.int64)
    for g in range(SCAN_GROUPS):
        first, end = min(g * rows_per_group, num_chunks), min((g + 1) * rows_per_group, num_chunks)
        running = running_groups.clone()
        for row in range(first, end):
            offsets[row] = running
            running = running + counts[row]
        running_groups = running_groups + group_sums[g]
    expert_counts = running_groups  # what group 31 writes

    # ---- pass 3, schedule_place, phase 1: segment table (block scan of 256 x 4 experts) ----
    padded_all = torch.zeros(launcher.MAX_LOCAL_EXPERTS, dtype=torch.int64)
    padded_all[:num_experts] = _round_up(expert_counts)
    thread_rows = padded_all.view(-1, EXPERTS_PER_THREAD).sum(1)  # 256 threads
    warp_inclusive = thread_rows.view(WARPS, WARP_SIZE).cumsum(1)
    warp_totals = warp_inclusive[:, -1]
    thread_start = (warp_inclusive - thread_rows.view(WARPS, WARP_SIZE)) + (
        warp_totals.cumsum(0) - warp_totals
    )[:, None]
    start = (
        thread_start.reshape(-1, 1)
        + torch.cat(
            [torch.zeros(256, 1, dtype=torch.int64), padded_all.view(-1, 4).cumsum(1)[:, :-1]], 1
        )
    ).reshape(-1)[:num_experts]
    total = int(warp_totals.sum())
    overflow = total > capacity

    peer_rank = torch.full((capacity,), POISON, dtype=torch.int64)
    peer_token = torch.full((capacity,), POISON, dtype=torch.int64)
    status = torch.tensor([int(overflow), total, ep_rank, capacity])
    tokens_per_expert = padded_all[:num_experts].clone()
    num_tokens = torch.tensor([total])
    if overflow:
        peer_rank[:] = -1
        peer_token[:] = -1
    else:
        # ---- phase 2: padding rows of each segment (q = e * 128 + i), then the tail ----
        q = torch.arange(num_experts * ROUTED_ROW_ALIGNMENT)
        e, filled = q // ROUTED_ROW_ALIGNMENT, expert_counts[q // ROUTED_ROW_ALIGNMENT]
        filled = filled + q % ROUTED_ROW_ALIGNMENT
        pad_rows = (start[e] + filled)[filled < _round_up(expert_counts)[e]]
        assert bool(((pad_rows >= 0) & (pad_rows < capacity)).all()), "padding row out of bounds"
        peer_rank[pad_rows] = -1
        peer_token[pad_rows] = -1
        peer_rank[total:] = -1
        peer_token[total:] = -1

        # ---- phase 3: per-warp counts; phase 4: per-warp first rows ----
        warp_counts = torch.zeros(num_chunks, WARPS, num_experts + 1, dtype=torch.int64)
        warp_of = torch.arange(WARPS)[None, :, None, None].expand_as(keys)
        warp_counts.index_put_(
            (chunk_of[leader], warp_of[leader], keys[leader]), group_size[leader], accumulate=True
        )
        warp_counts = warp_counts[..., :num_experts]
        warp_offset = (start[None, :] + offsets)[:, None, :] + (
            warp_counts.cumsum(1) - warp_counts
        )  # [chunk, warp, expert]

        # ---- phase 5: 16 steps; base + lanes below; the leader moves the offset on ----
        index = torch.arange(num_chunks * CHUNK).view(num_chunks, WARPS, STEPS, WARP_SIZE)
        for step in range(STEPS):
            key = keys[:, :, step]
            mine = key >= 0
            base = torch.gather(warp_offset, 2, key.clamp(min=0))
            rows = (base + below[:, :, step])[mine]
            entry = index[:, :, step][mine]
            assert bool(((rows >= 0) & (rows < capacity)).all()), "placement out of bounds"
            peer_rank[rows] = entry // entries_per_rank
            peer_token[rows] = entry % entries_per_rank
            lead = leader[:, :, step]
            chunk_idx = torch.arange(num_chunks)[:, None].expand_as(key)[lead]
            warp_idx = torch.arange(WARPS)[None, :].expand_as(key)[lead]
            warp_offset[chunk_idx, warp_idx, key[lead]] = (base + group_size[:, :, step])[lead]
    as32 = [t.to(torch.int32) for t in (peer_rank, peer_token, num_tokens, tokens_per_expert)]
    return (*as32, status.to(torch.int32))
