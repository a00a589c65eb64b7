"""CPU checks of the GPU schedule (mok/dsl_kernels/kernels/schedule.py over
mok/dsl_kernels/common/schedule_*.py, mok/launchers/schedule_kernels.py).

1. A pure-PyTorch emulation of the kernels' exact multi-pass algorithm (same 4096-entry chunks,
   same 8 warps x 16 steps x 32 lanes, same match.any groups and leaders, same scans, padding
   fill and overflow rule) equals `mok.reference.build_schedule` bit for bit, writes every
   output element and never writes outside [0, C). No GPU needed; this is the algorithm proof.
2. The kernel's two variants compile for sm_90a and sm_100a, rely on `match.any.sync`, use
   only integer atomics (shared-memory counts; global tickets, arrivals and the scan's
   release), no floating-point atomics, a bounded wait, and no dynamic shared memory.
"""

import re

import pytest
import torch

from mok import reference
from mok.config import ROUTED_ROW_ALIGNMENT
from mok.launchers import schedule_kernels as launcher

# The kernels' constants (mok/dsl_kernels/common/schedule_warp.py), restated: the emulation must
# not import the DSL. `test_constants_agree` checks them against the kernel sources.
WARP_SIZE = 32
WARPS = 8
STEPS = 16  # ENTRIES_PER_LANE
CHUNK = WARPS * STEPS * WARP_SIZE
EXPERTS_PER_THREAD = 4
SCAN_GROUPS = 8  # the count pass's scan: one group of chunk rows per warp
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
    """The GPU schedule computed the way the two kernels compute it (CPU, int64 math).

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

    # ---- pass 1, schedule_count: leaders add group sizes per chunk ----
    counts = torch.zeros(num_chunks, num_experts + 1, dtype=torch.int64)  # column E: not mine
    chunk_of = torch.arange(num_chunks)[:, None, None, None].expand_as(keys)
    counts.index_put_(
        (chunk_of[leader], keys[leader]), group_size[leader], accumulate=True
    )  # integer adds: order does not matter, like the shared-memory atomics
    counts = counts[:, :num_experts]

    # ---- pass 1, schedule_count's last CTA: 8 groups of chunk rows per expert ----
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
    expert_counts = running_groups  # what the last group writes

    # ---- pass 2, schedule_place, phase 1: segment table (block scan of 256 x 4 experts) ----
    padded_all = torch.zeros(launcher.MAX_LOCAL_EXPERTS, dtype=torch.int64)
    padded_all[:num_experts] = _round_up(expert_counts)
    thread_rows = padded_all.view(-1, EXPERTS_PER_THREAD).sum(1)  # 256 threads
    warp_inclusive = thread_rows.view(WARPS, WARP_SIZE).cumsum(1)
    warp_totals = warp_inclusive[:, -1]
    thread_start = (warp_inclusive - thread_rows.view(WARPS, WARP_SIZE)) + (
        warp_totals.cumsum(0) - warp_totals
    )[:, None]
    within_thread = padded_all.view(-1, EXPERTS_PER_THREAD).cumsum(1) - padded_all.view(
        -1, EXPERTS_PER_THREAD
    )  # row = thread start, then + padded per expert
    start = (thread_start.reshape(-1, 1) + within_thread).reshape(-1)[:num_experts]
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
        tokens_per_expert.zero_()
        num_tokens.zero_()
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
            chunk_idx = torch.arange(num_chunks)[:, None, None].expand_as(key)[lead]
            warp_idx = torch.arange(WARPS)[None, :, None].expand_as(key)[lead]
            warp_offset[chunk_idx, warp_idx, key[lead]] = (base + group_size[:, :, step])[lead]
    as32 = [t.to(torch.int32) for t in (peer_rank, peer_token, num_tokens, tokens_per_expert)]
    return (*as32, status.to(torch.int32))


# ---------------------------------------------------------------------------------------------
# Routings: random and adversarial, [P, T, k] int32 global expert ids in [0, E * P)
# ---------------------------------------------------------------------------------------------
def make_routing(kind: str, ranks: int, tokens: int, topk: int, experts: int, seed: int = 0):
    """Routing [P, T, k] int32 with distinct experts per token (k <= E * P)."""
    generator = torch.Generator().manual_seed(seed)
    total_experts = experts * ranks
    scores = torch.rand(ranks, tokens, total_experts, generator=generator)
    if kind == "one_expert":  # every token's first choice is expert 0 of rank 0
        scores[..., 0] = 2.0
    elif kind == "empty_experts":  # only every 3rd expert is ever chosen (when k allows)
        keep = torch.arange(total_experts) % 3 == 0
        if int(keep.sum()) >= topk:
            scores[..., ~keep] -= 2.0
    elif kind == "rank_starved":  # no token routes to rank 0's experts (when k allows)
        if total_experts - experts >= topk:
            scores[..., :experts] -= 2.0
    elif kind == "skewed":  # a power law over experts
        scores = scores * torch.arange(1, total_experts + 1).float().pow(-1.5)
    elif kind != "random":
        raise ValueError(kind)
    return scores.topk(topk, dim=-1).indices.to(torch.int32).contiguous()


def _reference_or_error(ids, ep_rank, experts, capacity):
    try:
        s = reference.build_schedule(
            ids, ep_rank=ep_rank, num_local_experts=experts, capacity=capacity
        )
    except ValueError as error:
        return error
    return s.peer_rank, s.peer_token_idx, s.num_tokens, s.tokens_per_expert


def _capacity(ids, experts, factor=1.0):
    ranks, tokens, topk = ids.shape
    rows = int(ranks * tokens * topk * factor) + experts * (ROUTED_ROW_ALIGNMENT - 1)
    return -(-rows // ROUTED_ROW_ALIGNMENT) * ROUTED_ROW_ALIGNMENT


CASES = [
    # (kind, P, T, k, E)
    ("random", 1, 100, 2, 8),
    ("random", 2, 777, 4, 16),
    ("random", 4, 300, 8, 32),
    ("one_expert", 2, 4500, 2, 8),
    ("empty_experts", 2, 513, 3, 16),
    ("rank_starved", 4, 200, 4, 8),
    ("skewed", 4, 1000, 6, 64),
    ("random", 2, 64, 1, 4),  # k = 1
    ("random", 2, 50, 8, 4),  # k = E * P: every expert of every rank, every token
    ("random", 1, 3, 5, 5),  # k = E, tiny T
    ("random", 1, 0, 4, 8),  # no tokens at all
    ("random", 1, 2000, 8, 1000),  # E close to the 1024 limit
    ("random", 8, 2048, 8, 128),  # ~ the big case scaled down 8x (CPU time)
    ("random", 2, 4096, 8, 512),
]


@pytest.mark.parametrize("kind, ranks, tokens, topk, experts", CASES)
def test_emulation_equals_reference(kind, ranks, tokens, topk, experts):
    ids = make_routing(kind, ranks, tokens, topk, experts, seed=tokens + topk)
    for ep_rank in sorted({0, ranks - 1}):
        capacity = _capacity(ids, experts)
        expected = _reference_or_error(ids, ep_rank, experts, capacity)
        got = emulate_schedule(ids, ep_rank=ep_rank, num_local_experts=experts, capacity=capacity)
        assert not isinstance(expected, ValueError)
        for want, have in zip(expected, got[:4], strict=True):
            assert torch.equal(want, have)
        assert got[4].tolist() == [0, int(expected[2]), ep_rank, capacity]


def test_emulation_big_case_equals_reference():
    """The documented performance case: 8 ranks x 16384 tokens x 8, E = 128 (~1M entries)."""
    ids = make_routing("random", 8, 16384, 8, 128, seed=1)
    capacity = _capacity(ids, 128, factor=0.25)
    expected = _reference_or_error(ids, 3, 128, capacity)
    got = emulate_schedule(ids, ep_rank=3, num_local_experts=128, capacity=capacity)
    for want, have in zip(expected, got[:4], strict=True):
        assert torch.equal(want, have)


@pytest.mark.parametrize("capacity_rows", [0, 128, 4096])
def test_emulation_overflow(capacity_rows):
    ids = make_routing("one_expert", 2, 4500, 2, 8)
    error = _reference_or_error(ids, 0, 8, capacity_rows)
    assert isinstance(error, ValueError)
    peer_rank, peer_token, num_tokens, tokens_per_expert, status = emulate_schedule(
        ids, ep_rank=0, num_local_experts=8, capacity=capacity_rows
    )
    total = int(status[1])
    assert status.tolist() == [1, total, 0, capacity_rows] and total > capacity_rows
    assert bool((peer_rank == -1).all()) and bool((peer_token == -1).all())
    # No row to run: the layer's kernels walk nothing past the capacity.
    assert int(num_tokens) == 0 and int(tokens_per_expert.sum()) == 0
    with pytest.raises(ValueError) as raised:
        raise ValueError(launcher.overflow_message(0, total, capacity_rows))
    assert str(raised.value) == str(error)


def test_emulation_exact_fit_and_other_ids():
    """Capacity exactly the padded total; ids of other ranks' experts are ignored."""
    ids = make_routing("random", 4, 333, 4, 8, seed=5)
    for ep_rank in range(4):
        total = int(reference.build_schedule(ids, ep_rank=ep_rank, num_local_experts=8,
                                             capacity=1 << 24).num_tokens)  # fmt: skip
        expected = _reference_or_error(ids, ep_rank, 8, total)
        got = emulate_schedule(ids, ep_rank=ep_rank, num_local_experts=8, capacity=total)
        for want, have in zip(expected, got[:4], strict=True):
            assert torch.equal(want, have)


# ---------------------------------------------------------------------------------------------
# Compile checks (need nvidia-cutlass-dsl; no GPU)
# ---------------------------------------------------------------------------------------------
SCHEDULE_VARIANTS = ("schedule", "schedule_ids64")
ARCHS = ("sm_90a", "sm_100a")


@pytest.fixture(scope="module")
def compiled_schedule():
    """{(variant, arch): (manifest entry, PTX)} for the schedule kernel's variants (~1 s)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from mok.dsl_kernels import build
    from mok.dsl_kernels.registry import variants

    registry = {v.name: v for v in variants()}
    out = {}
    for name in SCHEDULE_VARIANTS:
        for arch in ARCHS:
            entry, cubin, ptx = build.compile_variant(registry[name], arch)
            assert cubin.startswith(b"\x7fELF")
            out[name, arch] = (entry, ptx)
    return out


def test_constants_agree():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from mok.dsl_kernels.common import schedule_count, schedule_place, schedule_tasks, schedule_warp
    from mok.runtime import WaitPhase

    assert schedule_warp.CHUNK == CHUNK == launcher.ENTRIES_PER_CHUNK
    assert (schedule_warp.WARPS, schedule_warp.ENTRIES_PER_LANE) == (WARPS, STEPS)
    assert schedule_warp.MAX_LOCAL_EXPERTS == launcher.MAX_LOCAL_EXPERTS
    assert schedule_warp.ROUTED_ROW_ALIGNMENT == ROUTED_ROW_ALIGNMENT
    assert schedule_place.EXPERTS_PER_THREAD == EXPERTS_PER_THREAD
    assert schedule_place.STATUS_WORDS == launcher.STATUS_WORDS
    assert schedule_count.CHUNK_GROUPS == SCAN_GROUPS == schedule_warp.WARPS
    assert schedule_count.EXPERTS_PER_BLOCK == WARP_SIZE
    assert schedule_tasks.COUNTER_WORDS == launcher.COUNTER_WORDS
    assert schedule_tasks.PHASE_SCHEDULE == WaitPhase.SCHEDULE


def _opcodes(ptx: str) -> list[str]:
    return re.findall(r"^\s*(?:@!?%?\w+\s+)?([a-z][\w.]*)", ptx, re.M)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", SCHEDULE_VARIANTS)
def test_schedule_ptx(compiled_schedule, name, arch):
    entry, ptx = compiled_schedule[name, arch]
    ops = _opcodes(ptx)
    atomics = [op for op in ops if op.startswith(("atom", "red"))]
    # Determinism: integer atomics on shared memory only (the count tasks' counts), never
    # float. Global ones: the tickets (relaxed, taken at two sites), the count tasks' arrivals
    # and the exit count (acq_rel), the scan's release of the placement tasks, and the error
    # record's claim (CAS, on a timed-out wait only, which then traps).
    shared = [op for op in atomics if op.startswith("atom.shared")]
    assert shared == ["atom.shared.cta.add.u32"] * STEPS
    assert not [op for op in ops if re.match(r"(atom|red)\..*\.(f16|bf16|f32|f64)", op)]
    assert sorted(op for op in atomics if op not in shared) == sorted(
        ["atom.relaxed.gpu.global.add.s32"] * 2 + ["atom.acq_rel.gpu.global.add.s32"] * 2
        + ["red.release.gpu.global.add.s32", "atom.relaxed.sys.global.cas.b32"]
    )  # fmt: skip
    assert "trap" in ops  # the bounded wait gives up by trapping, never hangs
    # Count tasks group one step at a time, placement tasks twice (count, then place).
    assert ops.count("match.any.sync.b32") == STEPS * 3
    # ids64 (a group of one): the placement loads and checks each int64 id, the count reads
    # its low word; the int32 variant loads no int64.
    assert ops.count("ld.global.nc.s64") == (STEPS if name == "schedule_ids64" else 0)
    # Static shared memory only, under the 48 KiB that needs no opt-in.
    assert entry["dynamic_smem_bytes"] == 0
    static = sum(int(n) for n in re.findall(r"\.shared\s+\.align\s+\d+\s+\.b8\s+\S+\[(\d+)\]", ptx))
    assert static <= 48 * 1024
    assert entry["block"] == [256, 1, 1]
