"""The mok layer written plainly in PyTorch: the oracle every kernel is tested against.

Everything here follows SEMANTICS.md and the roundings the kernels make: operands of tensor-core
GEMMs are bf16, GEMMs and SwiGLU run in fp32, results are rounded to bf16 where the kernels store
them. Functions take and return ordinary tensors and run on any device; EP data movement goes
through `torch.distributed` (gloo on CPU, NCCL on GPU) with the same pull/push pattern as the
kernels: rows are pulled from the source rank by (rank, row) and pushed back into per-(token, j)
slots.

Public functions: `all_gather_top_experts`, `build_schedule`, `forward`, `backward`,
`recompute_forward_context`, `fwd_epilogue`, `bwd_epilogue`, `swiglu`, `swiglu_backward`,
`mxfp8_quantize`, `mxfp8_dequantize`, the MXFP8 layer (`mxfp8_forward`, ...), and each pass up
to its epilogue (`forward_to_slots`, `backward_to_slots` and their MXFP8 twins: what the
original's raw ops `dispatch_mlp_swiglu_combine_*` compute).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import ROUTED_ROW_ALIGNMENT
from .groups import group_rank_size
from .types import MoKForwardContext, MoKSchedule

E4M3_MAX = 448.0
MXFP8_BLOCK = 32
MXFP8_TILE = 128
# Smallest scale before rounding up to a power of two (SEMANTICS §5): keeps all-zero blocks finite.
MXFP8_MIN_SCALE = 1e-12


# ----------------------------------------------------------------------------------------------
# EP group helpers
# ----------------------------------------------------------------------------------------------


def _all_to_all_bytes(chunks: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Exchange one uint8 tensor with every rank (chunks[p] goes to rank p)."""
    device = chunks[0].device
    send_counts = torch.tensor([c.numel() for c in chunks], dtype=torch.int64, device=device)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_list = recv_counts.tolist()
    send = torch.cat([c.reshape(-1) for c in chunks])
    recv = torch.empty(sum(recv_list), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send, recv_list, send_counts.tolist(), group=group)
    return list(torch.split(recv, recv_list))


def _as_bytes(rows: torch.Tensor) -> torch.Tensor:
    """The raw bytes of rows [N, ...] as uint8 (gloo and NCCL move any dtype's bits this way)."""
    return rows.contiguous().view(torch.uint8).reshape(-1)


def pull_rows(
    table: torch.Tensor,
    src_rank: torch.Tensor,
    src_row: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Dispatch: out[i] = table_on_rank[src_rank[i]][src_row[i]], zero where src_rank[i] < 0.

    `table` is this rank's source table [N, W]; every rank calls this collectively.
    """
    out = torch.zeros((src_rank.shape[0], *table.shape[1:]), dtype=table.dtype, device=table.device)
    rank, size = group_rank_size(group)
    src_rank = src_rank.long()
    src_row = src_row.long()
    if size == 1:
        valid = src_rank >= 0
        out[valid] = table[src_row[valid]]
        return out
    # Ask each source for the rows wanted from it, in schedule order; it answers in that order.
    wanted = [src_row[src_rank == p] for p in range(size)]
    requests = _all_to_all_bytes([_as_bytes(w.view(-1, 1)) for w in wanted], group)
    answers = [_as_bytes(table[r.view(torch.int64)]) for r in requests]
    replies = _all_to_all_bytes(answers, group)
    for p in range(size):
        mask = src_rank == p
        if mask.any():
            out[mask] = replies[p].view(table.dtype).view(-1, *table.shape[1:])
    return out


def push_rows(
    rows: torch.Tensor,
    dst_rank: torch.Tensor,
    dst_row: torch.Tensor,
    num_dst_rows: int,
    group: dist.ProcessGroup | None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine: table_on_rank[dst_rank[i]][dst_row[i]] = rows[i] for dst_rank[i] >= 0.

    Returns this rank's table [num_dst_rows, W] (zero where no row landed), or `out` with the
    landed rows written and the others left as they were (one push per macrobatch).
    """
    if out is None:
        out = torch.zeros((num_dst_rows, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    rank, size = group_rank_size(group)
    dst_rank = dst_rank.long()
    dst_row = dst_row.long()
    if size == 1:
        valid = dst_rank >= 0
        out[dst_row[valid]] = rows[valid]
        return out
    index_msgs = [_as_bytes(dst_row[dst_rank == p].view(-1, 1)) for p in range(size)]
    row_msgs = [_as_bytes(rows[dst_rank == p]) for p in range(size)]
    got_index = _all_to_all_bytes(index_msgs, group)
    got_rows = _all_to_all_bytes(row_msgs, group)
    for p in range(size):
        if got_index[p].numel():
            idx = got_index[p].view(torch.int64)
            out[idx] = got_rows[p].view(rows.dtype).view(-1, *rows.shape[1:])
    return out


# ----------------------------------------------------------------------------------------------
# Schedule
# ----------------------------------------------------------------------------------------------


def all_gather_top_experts(
    top_experts: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Routing ids of every rank of the group, int32 [P, T, k]."""
    ids = top_experts.to(torch.int32).contiguous()
    _, size = group_rank_size(group)
    if size == 1:
        return ids.unsqueeze(0)
    gathered = [torch.empty_like(ids) for _ in range(size)]
    dist.all_gather(gathered, ids, group=group)
    return torch.stack(gathered)


def build_schedule(
    top_experts_all: torch.Tensor,
    *,
    ep_rank: int,
    num_local_experts: int,
    capacity: int,
) -> MoKSchedule:
    """This rank's receive schedule from the all-gathered routing [P, T, k].

    Order (deterministic): local expert, then source rank, then slot `t * k + j` ascending.
    Each expert's segment is padded to ROUTED_ROW_ALIGNMENT rows marked -1.
    Raises ValueError when the padded rows exceed `capacity`.
    """
    num_ranks, num_tokens, topk = top_experts_all.shape
    ids = top_experts_all.reshape(num_ranks, num_tokens * topk).long()
    device = ids.device
    local = ids - ep_rank * num_local_experts
    mine = (local >= 0) & (local < num_local_experts)
    src_rank, slot = torch.nonzero(mine, as_tuple=True)  # row-major: rank, then slot ascending
    expert = local[src_rank, slot]
    order = torch.sort(expert, stable=True).indices  # expert-major, (rank, slot) order kept
    src_rank, slot, expert = src_rank[order], slot[order], expert[order]

    counts = torch.bincount(expert, minlength=num_local_experts)
    padded = (counts + ROUTED_ROW_ALIGNMENT - 1) // ROUTED_ROW_ALIGNMENT * ROUTED_ROW_ALIGNMENT
    total = int(padded.sum())
    if total > capacity:
        raise ValueError(
            f"schedule capacity overflow on EP rank {ep_rank}: {total} routed rows (padded to "
            f"{ROUTED_ROW_ALIGNMENT} per expert) > capacity {capacity}; raise "
            f"MoKConfig.schedule_capacity_multiplier or pass num_local_experts to get_workspace"
        )
    seg_start = torch.cumsum(padded, 0) - padded
    first_of_expert = torch.cumsum(counts, 0) - counts
    position = (
        seg_start[expert] + torch.arange(expert.numel(), device=device) - first_of_expert[expert]
    )
    peer_rank = torch.full((capacity,), -1, dtype=torch.int32, device=device)
    peer_token_idx = torch.full((capacity,), -1, dtype=torch.int32, device=device)
    peer_rank[position] = src_rank.to(torch.int32)
    peer_token_idx[position] = slot.to(torch.int32)
    return MoKSchedule(
        peer_rank=peer_rank,
        peer_token_idx=peer_token_idx,
        num_tokens=torch.tensor([total], dtype=torch.int32, device=device),
        tokens_per_expert=padded.to(torch.int32),
    )


def expert_segments(schedule: MoKSchedule) -> list[tuple[int, int]]:
    """[(start, end)) row range of each local expert in the routed buffer (host values)."""
    sizes = schedule.tokens_per_expert.tolist()
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


def _row_tiles(start: int, end: int):
    """The ROUTED_ROW_ALIGNMENT-row tiles of rows [start, end) (a padded segment), in order.

    Every routed GEMM here runs one tile at a time, as the kernels' tiles do: a macrobatch
    edge is a tile edge, so the same tiles meet the same operations whatever the macrobatch
    size, and the results are bitwise the same."""
    return [
        slice(r, min(r + ROUTED_ROW_ALIGNMENT, end))
        for r in range(start, end, ROUTED_ROW_ALIGNMENT)
    ]


# ----------------------------------------------------------------------------------------------
# Macrobatches (MoKConfig.macrobatch_size below the routed rows: ring reuse with replay)
# ----------------------------------------------------------------------------------------------


def macrobatch_schedules(
    num_tokens: torch.Tensor, tokens_per_expert: torch.Tensor, *, window_rows: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each macrobatch's schedule sizes: the `macrobatch_schedule` kernel's oracle.

    Macrobatch m holds rows [m * window_rows, min((m + 1) * window_rows, capacity)) of a
    schedule (`num_tokens` int32 [1], `tokens_per_expert` int32 [E], padded); there are
    max(1, ceil(capacity / window_rows)) of them. Returns (num_tokens int32 [M]: its routed rows,
    tokens_per_expert int32 [M, E]: each expert's segment clipped to it). `window_rows` is a
    multiple of 128, so every clipped segment is too and is a schedule of its own.
    """
    num_windows = max(1, -(-capacity // window_rows))
    first = torch.arange(num_windows, dtype=torch.int64, device=tokens_per_expert.device)
    first = first * window_rows
    end = torch.clamp(first + window_rows, max=capacity)
    sizes = tokens_per_expert.long()
    seg_end = torch.cumsum(sizes, 0)
    seg_start = seg_end - sizes
    clipped = torch.minimum(seg_end[None], end[:, None]) - torch.maximum(
        seg_start[None], first[:, None]
    )
    rows = torch.minimum(num_tokens.long().reshape(1), end) - first
    return rows.clamp_min(0).to(torch.int32), clipped.clamp_min(0).to(torch.int32)


def weight_gradient_window(
    a_rows: torch.Tensor,
    b_rows: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    first_row: int,
    out: torch.Tensor,
    partial_in: torch.Tensor,
    partial_out: torch.Tensor,
    *,
    output: str,
) -> torch.Tensor:
    """One macrobatch's part of the weight gradients out[e] = A[rows of e]^T @ B[rows of e]:
    the `expert_gemm_bwd_weights_window_*` kernels' oracle (mok/launchers/macrobatch.py).

    a_rows [R, M], b_rows [R, N] (bf16) are the routed rows first_row .. first_row + R - 1 of
    a schedule whose padded segments are `tokens_per_expert` [E]. Expert e's segment [S, S + n)
    meets them in [max(S, first_row), min(S + n, first_row + R)); there its fp32 sum starts
    from `partial_in` [M, N] if S < first_row (else zero), adds the rows tile by tile
    (ROUTED_ROW_ALIGNMENT rows, in order), and goes into `partial_out` if the segment goes on
    past the macrobatch; else it is finished: out[e] = bf16(sum) (output "bf16") or
    out[e] += sum (output "accumulate", fp32). An expert without rows is finished with a zero
    sum by the macrobatch at row 0 only; other experts are not touched. Returns `out`."""
    if output not in ("bf16", "accumulate"):
        raise ValueError(f"output must be 'bf16' or 'accumulate', got {output!r}")
    end_row = first_row + a_rows.shape[0]
    segment_start = 0
    for e, rows in enumerate(tokens_per_expert.tolist()):
        start, segment_start = segment_start, segment_start + rows
        low, high = max(start, first_row), min(start + rows, end_row)
        meets = high > low
        if not (meets or (rows == 0 and first_row == 0)):
            continue
        acc = torch.zeros(partial_in.shape, dtype=torch.float32, device=partial_in.device)
        if meets and start < first_row:
            acc = partial_in.clone()
        for tile in _row_tiles(low - first_row, high - first_row) if meets else ():
            acc += a_rows[tile].float().t() @ b_rows[tile].float()
        if meets and start + rows > end_row:
            partial_out.copy_(acc)
        elif output == "bf16":
            out[e] = acc.to(torch.bfloat16)
        else:
            out[e].add_(acc)
    return out


def macrobatch_windows(
    schedule: MoKSchedule, macrobatch_size: int | None
) -> list[tuple[int, MoKSchedule]]:
    """(first row, schedule of the rows) of each macrobatch of `schedule`, in row order; one
    macrobatch of every row for `macrobatch_size` None (or >= the capacity)."""
    capacity = schedule.capacity
    if macrobatch_size is None or macrobatch_size >= capacity:
        return [(0, schedule)]
    num_tokens, tokens_per_expert = macrobatch_schedules(
        schedule.num_tokens, schedule.tokens_per_expert, window_rows=macrobatch_size,
        capacity=capacity,
    )  # fmt: skip
    windows = []
    for m in range(num_tokens.shape[0]):
        rows = slice(m * macrobatch_size, min((m + 1) * macrobatch_size, capacity))
        windows.append((rows.start, MoKSchedule(
            schedule.peer_rank[rows], schedule.peer_token_idx[rows], num_tokens[m : m + 1],
            tokens_per_expert[m],
        )))  # fmt: skip
    return windows


# ----------------------------------------------------------------------------------------------
# SwiGLU
# ----------------------------------------------------------------------------------------------


def _clamped(gate: torch.Tensor, up: torch.Tensor, limit: float | None):
    g, u = gate.float(), up.float()
    if limit is not None:
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, -limit, limit)
    return g, u


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """hidden = bf16(SiLU(g) * u) in fp32, SiLU(g) = g / (1 + exp(-g)), clamp first if set."""
    g, u = _clamped(gate, up, limit)
    return (g / (1.0 + torch.exp(-g)) * u).to(torch.bfloat16)


def swiglu_backward(
    d_hidden: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, limit: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) in bf16 from fp32 d_hidden; zero where a clamp was active."""
    g, u = _clamped(gate, up, limit)
    sig = 1.0 / (1.0 + torch.exp(-g))
    d_up = d_hidden * (g * sig)
    d_gate = d_hidden * u * (sig * (1.0 + g * (1.0 - sig)))
    if limit is not None:
        d_gate = torch.where(gate.float() > limit, 0.0, d_gate)
        d_up = torch.where(up.float().abs() > limit, 0.0, d_up)
    return d_gate.to(torch.bfloat16), d_up.to(torch.bfloat16)


def _mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """fp32 product a @ b_t.T of bf16 operands (the tensor-core GEMM: bf16 in, fp32 out)."""
    return a.float() @ b_t.float().t()


def _mlp(x, gate_w, up_w, down_w, limit):
    gate = _mm(x, gate_w).to(torch.bfloat16)
    up = _mm(x, up_w).to(torch.bfloat16)
    hidden = swiglu(gate, up, limit)
    y = _mm(hidden, down_w).to(torch.bfloat16)
    return gate, up, hidden, y


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def fwd_epilogue(
    y_shared: torch.Tensor | None, slots: torch.Tensor, router_weights: torch.Tensor
) -> torch.Tensor:
    """out[t] = bf16(y_shared[t] + sum_j w[t, j] * slots[t*k + j]), fp32, j = 0..k-1 in order.

    Each step is a separate fp32 multiply and add (no FMA), as the epilogue kernel does.
    """
    num_tokens, topk = router_weights.shape
    slots = slots.view(num_tokens, topk, -1)
    acc = (
        y_shared.float()
        if y_shared is not None
        else torch.zeros(slots[:, 0].shape, device=slots.device)
    )
    for j in range(topk):
        acc = acc + router_weights[:, j : j + 1].float() * slots[:, j].float()
    return acc.to(torch.bfloat16)


def bwd_epilogue(d_x_shared: torch.Tensor | None, slots: torch.Tensor, topk: int) -> torch.Tensor:
    """d_x[t] = bf16(d_x_shared[t] + sum_j slots[t*k + j]), fp32, j = 0..k-1 in order."""
    slots = slots.view(-1, topk, slots.shape[-1])
    acc = (
        d_x_shared.float()
        if d_x_shared is not None
        else torch.zeros(slots[:, 0].shape, device=slots.device)
    )
    for j in range(topk):
        acc = acc + slots[:, j].float()
    return acc.to(torch.bfloat16)


def recompute_forward_context(
    schedule: MoKSchedule,
    x: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    routed_gate_weights: torch.Tensor,
    routed_up_weights: torch.Tensor,
    *,
    topk: int,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
) -> MoKForwardContext:
    """Rebuild what forward saved for backward: pull x, gate/up GEMMs, SwiGLU (no down GEMM)."""
    ctx, _ = _routed_forward(
        schedule,
        x,
        routed_gate_weights,
        routed_up_weights,
        None,
        topk=topk,
        group=group,
        swiglu_limit=swiglu_limit,
    )
    if shared_gate_weights is None:
        return ctx
    gate_s = _mm(x, shared_gate_weights).to(torch.bfloat16)
    up_s = _mm(x, shared_up_weights).to(torch.bfloat16)
    return MoKForwardContext(*ctx.tensors()[:4], gate_s, up_s, swiglu(gate_s, up_s, swiglu_limit))


def pull_x_rows(schedule, x, topk: int, group) -> torch.Tensor:
    """x_routed of `schedule`: each routed row's token of x, pulled from its rank."""
    return pull_rows(x, schedule.peer_rank, schedule.peer_token_idx.long() // topk, group)


def _routed_forward(schedule, x, gate_w, up_w, down_w, *, topk, group, swiglu_limit, mlp=None):
    """(context, y) of the routed experts; `mlp` (default `_mlp`) computes one row tile of an
    expert."""
    mlp = _mlp if mlp is None else mlp
    x_routed = pull_x_rows(schedule, x, topk, group)
    capacity, inter = schedule.capacity, gate_w.shape[1]
    gate = torch.zeros(capacity, inter, dtype=torch.bfloat16, device=x.device)
    up, hidden = torch.zeros_like(gate), torch.zeros_like(gate)
    y = torch.zeros(capacity, x.shape[1], dtype=torch.bfloat16, device=x.device)
    for e, (start, end) in enumerate(expert_segments(schedule)):
        for rows in _row_tiles(start, end):
            if down_w is None:
                gate[rows] = _mm(x_routed[rows], gate_w[e]).to(torch.bfloat16)
                up[rows] = _mm(x_routed[rows], up_w[e]).to(torch.bfloat16)
                hidden[rows] = swiglu(gate[rows], up[rows], swiglu_limit)
            else:
                gate[rows], up[rows], hidden[rows], y[rows] = mlp(
                    x_routed[rows], gate_w[e], up_w[e], down_w[e], swiglu_limit
                )
    return MoKForwardContext(x_routed, gate, up, hidden), y


def make_schedule(
    top_experts: torch.Tensor,
    *,
    num_local_experts: int,
    capacity: int,
    group: dist.ProcessGroup | None = None,
) -> MoKSchedule:
    """All-gather the routing and build this rank's schedule (collective over `group`)."""
    rank, _ = group_rank_size(group)
    gathered = all_gather_top_experts(top_experts, group)
    return build_schedule(
        gathered, ep_rank=rank, num_local_experts=num_local_experts, capacity=capacity
    )


def forward(
    schedule: MoKSchedule,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: torch.Tensor,
    routed_up_weights: torch.Tensor,
    routed_down_weights: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
    macrobatch_size: int | None = None,
    macrobatch_replay: str = "gate_up",
) -> tuple[torch.Tensor, MoKForwardContext]:
    """The MoE layer forward (SEMANTICS §1); returns (out bf16 [T, H], context).

    `macrobatch_size` (a multiple of 128; None: every routed row at once): the schedule's rows
    run in macrobatches of that many (`macrobatch_windows`), last to first, and the context
    holds macrobatch 0's rows only ([macrobatch_size, ...]); `backward` replays the others.
    With `macrobatch_replay` "gather" it holds gate, up and hidden of every row too, and
    `backward` pulls only x's rows again. Every output is bitwise the same for every macrobatch
    size and replay."""
    return _layer_forward(
        schedule, x, router_weights, (shared_gate_weights, shared_up_weights, shared_down_weights),
        (routed_gate_weights, routed_up_weights, routed_down_weights), group, swiglu_limit, _mlp,
        macrobatch_size, macrobatch_replay,
    )  # fmt: skip


def _layer_forward(schedule, x, router_weights, shared, routed, group, swiglu_limit, mlp,
                   macrobatch_size=None, macrobatch_replay="gate_up"):  # fmt: skip
    """forward's body; `mlp` computes one routed expert's rows (BF16 or MXFP8)."""
    ctx, slots, y_shared = _forward_to_slots(
        schedule, x, router_weights.shape[1], shared, routed, group, swiglu_limit, mlp,
        macrobatch_size, macrobatch_replay,
    )  # fmt: skip
    return fwd_epilogue(y_shared, slots, router_weights), ctx


def forward_to_slots(
    schedule: MoKSchedule,
    x: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: torch.Tensor,
    routed_up_weights: torch.Tensor,
    routed_down_weights: torch.Tensor,
    *,
    topk: int,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
) -> tuple[MoKForwardContext, torch.Tensor, torch.Tensor | None]:
    """`forward` up to its epilogue: (context, slots bf16 [T*k, H], y_shared bf16 [T, H] or
    None). Slot t*k + j holds token t's j-th expert output, unweighted (pushed to its token's
    rank); `forward` returns fwd_epilogue(y_shared, slots, router_weights)."""
    return _forward_to_slots(
        schedule, x, topk, (shared_gate_weights, shared_up_weights, shared_down_weights),
        (routed_gate_weights, routed_up_weights, routed_down_weights), group, swiglu_limit, _mlp,
    )  # fmt: skip


def _forward_to_slots(schedule, x, topk, shared, routed, group, swiglu_limit, mlp,
                      macrobatch_size=None, macrobatch_replay="gate_up"):  # fmt: skip
    shared_gate_weights, shared_up_weights, shared_down_weights = shared
    num_slots = x.shape[0] * topk
    slots = torch.zeros(num_slots, x.shape[1], dtype=torch.bfloat16, device=x.device)
    windows = macrobatch_windows(schedule, macrobatch_size)
    # "gather": gate, up and hidden of every macrobatch kept in tensors of every row.
    keep = macrobatch_replay == "gather" and len(windows) > 1
    kept = None
    # The macrobatches last to first (the original's order): the context left is macrobatch 0's.
    for first, window in reversed(windows):
        ctx, y_routed = _routed_forward(
            window, x, *routed, topk=topk, group=group, swiglu_limit=swiglu_limit, mlp=mlp
        )
        if keep:
            if kept is None:
                kept = [ctx.gate_routed.new_zeros(schedule.capacity, ctx.gate_routed.shape[1])
                        for _ in range(3)]  # fmt: skip
            for whole, rows in zip(kept, ctx.tensors()[1:4], strict=True):
                whole[first : first + window.capacity] = rows
        push_rows(y_routed, window.peer_rank, window.peer_token_idx, num_slots, group, out=slots)
    if keep:
        ctx = MoKForwardContext(ctx.x_routed, *kept)
    y_shared = None
    if shared_gate_weights is not None:
        gate_s, up_s, hidden_s, y_shared = _mlp(
            x, shared_gate_weights, shared_up_weights, shared_down_weights, swiglu_limit
        )
        ctx = MoKForwardContext(*ctx.tensors()[:4], gate_s, up_s, hidden_s)
    return ctx, slots, y_shared


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


def _mlp_backward(dy, x, gate, up, hidden, gate_w, up_w, down_w, limit):
    """One SwiGLU expert's backward from bf16 dy: (d_x fp32, dW_gate, dW_up, dW_down fp32)."""
    d_hidden = dy.float() @ down_w.float()
    d_gate, d_up = swiglu_backward(d_hidden, gate, up, limit)
    d_x = d_gate.float() @ gate_w.float() + d_up.float() @ up_w.float()
    d_down = dy.float().t() @ hidden.float()
    d_gate_w = d_gate.float().t() @ x.float()
    d_up_w = d_up.float().t() @ x.float()
    return d_x, d_gate_w, d_up_w, d_down


def backward(
    schedule: MoKSchedule,
    forward_context: MoKForwardContext,
    grad_output: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: torch.Tensor,
    routed_up_weights: torch.Tensor,
    routed_down_weights: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
    macrobatch_size: int | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """The MoE layer backward (SEMANTICS §2).

    Returns (d_x, d_router_weights fp32, d_routed_gate, d_routed_up, d_routed_down,
    d_shared_gate, d_shared_up, d_shared_down); shared gradients are None without a shared expert.
    Weight gradients are fp32 here (the caller rounds to bf16 or accumulates into main_grad),
    each expert's summed over its row tiles in order in fp32.

    `macrobatch_size` as `forward`'s: the context holds macrobatch 0 (or every row, e.g. a
    recomputed context); each later macrobatch is replayed (pull x, gate/up, SwiGLU) before its
    backward, and the weight-gradient sums go on across macrobatches in the same tile order, so
    every gradient is bitwise the same for every macrobatch size.
    """
    return _epilogue_of_backward(backward_to_slots(
        schedule, forward_context, grad_output, x, router_weights, shared_gate_weights,
        shared_up_weights, shared_down_weights, routed_gate_weights, routed_up_weights,
        routed_down_weights, group=group, swiglu_limit=swiglu_limit,
        macrobatch_size=macrobatch_size,
    ))  # fmt: skip


def backward_to_slots(
    schedule: MoKSchedule,
    forward_context: MoKForwardContext,
    grad_output: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: torch.Tensor,
    routed_up_weights: torch.Tensor,
    routed_down_weights: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
    macrobatch_size: int | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """`backward` up to its epilogue: (d_x_shared bf16 [T, H] or None, slots bf16 [T*k, H],
    d_router_weights fp32 [T, k], then the six weight gradients as `backward` returns them).
    Slot t*k + j holds token t's d_x through its j-th expert (pushed to its token's rank);
    `backward`'s d_x is bwd_epilogue(d_x_shared, slots, k). `macrobatch_size` as `backward`'s."""

    def replay(window):
        """A macrobatch's context, rebuilt: its x rows pulled, gate/up, SwiGLU."""
        ctx, _ = _routed_forward(
            window, x, routed_gate_weights, routed_up_weights, None,
            topk=router_weights.shape[1], group=group, swiglu_limit=swiglu_limit,
        )  # fmt: skip
        return ctx

    def expert(e, ctx, r, dy_e, dy_routed, w_routed):
        d_x, d_gate_w, d_up_w, d_down_w = _mlp_backward(
            dy_e, ctx.x_routed[r], ctx.gate_routed[r], ctx.up_routed[r], ctx.hidden_routed[r],
            routed_gate_weights[e], routed_up_weights[e], routed_down_weights[e], swiglu_limit,
        )  # fmt: skip
        # d_router[t, j] = <dY[t], y_e(x_t)>, y_e in fp32 from the saved hidden.
        y = _mm(ctx.hidden_routed[r], routed_down_weights[e])
        return d_x, d_gate_w, d_up_w, d_down_w, (dy_routed.float() * y).sum(dim=1)

    return _layer_backward(
        schedule, forward_context, grad_output, x, router_weights,
        (shared_gate_weights, shared_up_weights, shared_down_weights),
        routed_gate_weights.shape, group, swiglu_limit, expert, macrobatch_size, replay,
    )  # fmt: skip


def _macrobatch_context(ctx, schedule, windows, m, replay, pull_x) -> MoKForwardContext:
    """Macrobatch m's routed context: rows of a context that holds every row (no ring reuse,
    or a recomputed one), macrobatch 0's own context, `replay(window)`, or (gate, up and
    hidden of every row: macrobatch_replay "gather") their rows with x's pulled again by
    `pull_x(window)`."""
    first, window = windows[m]
    rows = slice(first, first + window.capacity)
    if ctx.x_routed.shape[0] == schedule.capacity:
        return MoKForwardContext(*(t[rows] for t in ctx.tensors()[:4]))
    if ctx.x_routed.shape[0] != windows[0][1].capacity:
        raise ValueError(
            f"forward_context.x_routed must have the schedule capacity ({schedule.capacity}) or "
            f"macrobatch 0's ({windows[0][1].capacity}) rows, got {ctx.x_routed.shape[0]}"
        )
    if ctx.gate_routed.shape[0] == schedule.capacity:
        x_rows = ctx.x_routed if m == 0 else pull_x(window)
        return MoKForwardContext(x_rows, *(t[rows] for t in ctx.tensors()[1:4]))
    if m == 0:
        return ctx
    if replay is None:
        raise ValueError("a context of macrobatch 0 needs a replay of the other macrobatches")
    return replay(window)


def _layer_backward(schedule, ctx, grad_output, x, router_weights, shared, routed_shape, group,
                    swiglu_limit, expert, macrobatch_size=None, replay=None):  # fmt: skip
    """backward_to_slots' body. `expert(e, ctx, rows, dy_e, dy_routed, w_routed)` gives one
    routed expert's (d_x fp32, dW_gate, dW_up, dW_down, d_router) of a row tile; the weight
    gradients are summed tile by tile in fp32, macrobatch after macrobatch."""
    num_tokens, topk = router_weights.shape
    num_experts, inter, hidden_size = routed_shape
    d_gate_w = torch.zeros(num_experts, inter, hidden_size, device=x.device)
    d_up_w = torch.zeros_like(d_gate_w)
    d_down_w = torch.zeros(num_experts, hidden_size, inter, device=x.device)
    num_slots = num_tokens * topk
    slots = torch.zeros(num_slots, hidden_size, dtype=torch.bfloat16, device=x.device)
    d_router = torch.zeros(num_slots, 1, device=x.device)
    windows = macrobatch_windows(schedule, macrobatch_size)

    def pull_x(window):
        return pull_x_rows(window, x, topk, group)

    for m, (_, window) in enumerate(windows):
        ctx_m = _macrobatch_context(ctx, schedule, windows, m, replay, pull_x)
        peer, slot = window.peer_rank, window.peer_token_idx
        # Pull dY and w for every routed row; dY_e = bf16(w * dY) on the expert's side.
        dy_routed = pull_rows(grad_output, peer, slot.long() // topk, group)
        w_routed = pull_rows(router_weights.reshape(-1, 1).float(), peer, slot, group)
        dy_e = (w_routed * dy_routed.float()).to(torch.bfloat16)
        d_x_routed = torch.zeros(window.capacity, hidden_size, dtype=torch.bfloat16,
                                 device=x.device)  # fmt: skip
        d_router_routed = torch.zeros(window.capacity, 1, device=x.device)
        # An expert with no rows keeps exact-zero weight gradients.
        for e, (start, end) in enumerate(expert_segments(window)):
            for r in _row_tiles(start, end):
                d_x, d_gate, d_up, d_down, d_router_routed[r, 0] = expert(
                    e, ctx_m, r, dy_e[r], dy_routed[r], w_routed[r, 0]
                )
                d_gate_w[e] += d_gate
                d_up_w[e] += d_up
                d_down_w[e] += d_down
                d_x_routed[r] = d_x.to(torch.bfloat16)
        push_rows(d_x_routed, peer, slot, num_slots, group, out=slots)
        push_rows(d_router_routed, peer, slot, num_slots, group, out=d_router)
    d_router = d_router.view(num_tokens, topk)

    shared_gate_weights, shared_up_weights, shared_down_weights = shared
    d_x_shared = d_shared = None
    if shared_gate_weights is not None:
        d_xs, *d_shared = _mlp_backward(
            grad_output, x, ctx.gate_shared, ctx.up_shared, ctx.hidden_shared,
            shared_gate_weights, shared_up_weights, shared_down_weights, swiglu_limit,
        )  # fmt: skip
        d_x_shared = d_xs.to(torch.bfloat16)
    shared_grads = tuple(d_shared) if d_shared is not None else (None, None, None)
    return (d_x_shared, slots, d_router, d_gate_w, d_up_w, d_down_w, *shared_grads)


def _epilogue_of_backward(to_slots: tuple) -> tuple[torch.Tensor | None, ...]:
    """A `*backward_to_slots` result as `*backward` returns it: d_x summed from the slots."""
    d_x_shared, slots, d_router, *weight_grads = to_slots
    return (bwd_epilogue(d_x_shared, slots, d_router.shape[1]), d_router, *weight_grads)


# ----------------------------------------------------------------------------------------------
# MXFP8 (SEMANTICS §5)
# ----------------------------------------------------------------------------------------------


def _as_rows(x: torch.Tensor, transpose: bool) -> torch.Tensor:
    if transpose:
        x = x.transpose(-1, -2)
    return x.reshape(-1, x.shape[-1])


def mxfp8_quantize(
    x: torch.Tensor, *, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise bf16 x [..., R, K] to E4M3 along its last dim (or along R when `transpose`).

    Returns (data float8_e4m3fn with the quantised layout's shape, scales uint8
    [rows/128, K/128, 32, 16]) where rows folds every leading dim. Scale = amax/448 (fp32) clamped
    below at 1e-12 and rounded up to a power of two (UE8M0 byte = its biased exponent); element =
    round-to-nearest-even, satfinite E4M3 of v * (1/scale).
    """
    # Contiguous: for one matrix, the transpose's reshape is a strided view, which `.float()`
    # keeps, and the data would come back strided.
    rows = _as_rows(x, transpose).float().contiguous()
    num_rows, num_cols = rows.shape
    blocks = rows.view(num_rows, num_cols // MXFP8_BLOCK, MXFP8_BLOCK)
    q = blocks.abs().amax(dim=-1) / E4M3_MAX
    q = torch.clamp_min(q, torch.tensor(MXFP8_MIN_SCALE, dtype=torch.float32))
    bits = q.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    # 1/scale is exact: a power of two whose biased exponent is 254 - exponent.
    inv_scale = ((254 - exponent) << 23).view(torch.float32)
    scaled = torch.clamp(blocks * inv_scale.unsqueeze(-1), -E4M3_MAX, E4M3_MAX)
    data = scaled.to(torch.float8_e4m3fn).view(num_rows, num_cols)
    out_shape = x.transpose(-1, -2).shape if transpose else x.shape
    return data.view(out_shape), _swizzle_scales(exponent.to(torch.uint8))


def _swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """[R, K/32] row-major scale bytes -> [R/128, K/128, 32, 16] (SWIZZLE_32_4_4)."""
    num_rows, num_blocks = scales.shape
    s = scales.view(num_rows // 128, 4, 32, num_blocks // 4, 4)  # r = 128*a + 32*b + c
    return s.permute(0, 3, 2, 1, 4).reshape(num_rows // 128, num_blocks // 4, 32, 16).contiguous()


def _unswizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    row_tiles, col_tiles = scales.shape[:2]
    s = scales.view(row_tiles, col_tiles, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return s.reshape(row_tiles * 128, col_tiles * 4)


def mxfp8_dequantize(
    data: torch.Tensor, scales: torch.Tensor, *, transpose: bool = False
) -> torch.Tensor:
    """fp32 values of an `mxfp8_quantize` result, in the layout of the original input."""
    rows = data.reshape(-1, data.shape[-1]).float()
    exponent = _unswizzle_scales(scales).to(torch.int32)
    scale = (exponent << 23).view(torch.float32)
    values = rows.view(rows.shape[0], -1, MXFP8_BLOCK) * scale.unsqueeze(-1)
    values = values.view(data.shape)
    return values.transpose(-1, -2) if transpose else values


# ----------------------------------------------------------------------------------------------
# The MXFP8 layer (SEMANTICS §5): products of dequantised MXFP8 operands, fp32 accumulation
# ----------------------------------------------------------------------------------------------
# What Blackwell's block-scaled MMA computes. Every GEMM operand is quantised along the GEMM's
# reduction dim: x and hidden along H / I in the forward; dY_e along H, d_gate / d_up along I in
# the activation gradients; every operand along the tokens in the weight gradients. Weights come
# pre-quantised (mxfp8_quantize): forward (fp8, scale) along K; backward gate / up also their
# transposed copy (along I) and down its transposed copy (along H). The shared expert is bf16.


def mxfp8_round_trip(a: torch.Tensor, *, along_rows: bool = False) -> torch.Tensor:
    """bf16 values of `a` quantised to MXFP8 and back (exact in bf16): along its last dim, or
    along its rows (the transposed quantisation)."""
    data, scales = mxfp8_quantize(a, transpose=along_rows)
    return mxfp8_dequantize(data, scales, transpose=along_rows).to(torch.bfloat16)


def _mxfp8_weight(pair, *, transposed: bool = False) -> torch.Tensor:
    """bf16 values of a pre-quantised weight (fp8, scale), in the weight's own layout."""
    data, scales = pair
    return mxfp8_dequantize(data, scales, transpose=transposed).to(torch.bfloat16)


def mxfp8_forward(
    schedule: MoKSchedule,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: tuple[torch.Tensor, torch.Tensor],
    routed_up_weights: tuple[torch.Tensor, torch.Tensor],
    routed_down_weights: tuple[torch.Tensor, torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
    macrobatch_size: int | None = None,
    macrobatch_replay: str = "gate_up",
) -> tuple[torch.Tensor, MoKForwardContext]:
    """`forward` with MXFP8 routed weights, each (fp8, scale) along its K: (out, context). The
    context holds the bf16 rows; `mxfp8_backward` quantises them as each GEMM reads them.
    `macrobatch_size` and `macrobatch_replay` as `forward`'s."""
    routed = tuple(
        _mxfp8_weight(w) for w in (routed_gate_weights, routed_up_weights, routed_down_weights)
    )
    return _layer_forward(
        schedule, x, router_weights, (shared_gate_weights, shared_up_weights, shared_down_weights),
        routed, group, swiglu_limit, _mlp_mxfp8, macrobatch_size, macrobatch_replay,
    )  # fmt: skip


def mxfp8_forward_to_slots(
    schedule: MoKSchedule,
    x: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: tuple[torch.Tensor, torch.Tensor],
    routed_up_weights: tuple[torch.Tensor, torch.Tensor],
    routed_down_weights: tuple[torch.Tensor, torch.Tensor],
    *,
    topk: int,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
) -> tuple[MoKForwardContext, torch.Tensor, torch.Tensor | None]:
    """`mxfp8_forward` up to its epilogue, as `forward_to_slots` returns it."""
    routed = tuple(
        _mxfp8_weight(w) for w in (routed_gate_weights, routed_up_weights, routed_down_weights)
    )
    return _forward_to_slots(
        schedule, x, topk, (shared_gate_weights, shared_up_weights, shared_down_weights), routed,
        group, swiglu_limit, _mlp_mxfp8,
    )  # fmt: skip


def _mlp_mxfp8(x, gate_w, up_w, down_w, limit):
    """`_mlp` with x and hidden quantised to MXFP8 before their GEMMs (weights dequantised)."""
    x_q = mxfp8_round_trip(x)
    gate = _mm(x_q, gate_w).to(torch.bfloat16)
    up = _mm(x_q, up_w).to(torch.bfloat16)
    hidden = swiglu(gate, up, limit)
    y = _mm(mxfp8_round_trip(hidden), down_w).to(torch.bfloat16)
    return gate, up, hidden, y


def mxfp8_recompute_forward_context(
    schedule: MoKSchedule,
    x: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    routed_gate_weights: tuple[torch.Tensor, torch.Tensor],
    routed_up_weights: tuple[torch.Tensor, torch.Tensor],
    *,
    topk: int,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
) -> MoKForwardContext:
    """`mxfp8_forward`'s context, rebuilt bitwise (no down GEMM). x is quantised before the
    pull: MXFP8 quantises each row on its own, so that equals quantising the pulled rows."""
    routed = recompute_forward_context(
        schedule, mxfp8_round_trip(x), None, None, _mxfp8_weight(routed_gate_weights),
        _mxfp8_weight(routed_up_weights), topk=topk, group=group, swiglu_limit=swiglu_limit,
    )  # fmt: skip
    bf16 = recompute_forward_context(
        schedule, x, shared_gate_weights, shared_up_weights, _mxfp8_weight(routed_gate_weights),
        _mxfp8_weight(routed_up_weights), topk=topk, group=group, swiglu_limit=swiglu_limit,
    )  # fmt: skip
    # The context keeps the bf16 rows of x; the shared expert reads bf16 x.
    return MoKForwardContext(bf16.x_routed, *routed.tensors()[1:4], *bf16.tensors()[4:])


def mxfp8_backward(
    schedule: MoKSchedule,
    forward_context: MoKForwardContext,
    grad_output: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: tuple[torch.Tensor, ...],
    routed_up_weights: tuple[torch.Tensor, ...],
    routed_down_weights: tuple[torch.Tensor, torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
    macrobatch_size: int | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """`backward` with MXFP8 routed weights: gate and up (fp8, scale, fp8_t, scale_t), down its
    transposed copy (fp8_t, scale_t). The SwiGLU backward reads the dequantised saved gate and
    up; d_router[t, j] = <bf16(SwiGLU(gate, up)), d_hidden> / w. Same returns as `backward`.
    `macrobatch_size` as `backward`'s: a later macrobatch's context is replayed as
    `mxfp8_recompute_forward_context` rebuilds it (bitwise `mxfp8_forward`'s rows)."""
    return _epilogue_of_backward(mxfp8_backward_to_slots(
        schedule, forward_context, grad_output, x, router_weights, shared_gate_weights,
        shared_up_weights, shared_down_weights, routed_gate_weights, routed_up_weights,
        routed_down_weights, group=group, swiglu_limit=swiglu_limit,
        macrobatch_size=macrobatch_size,
    ))  # fmt: skip


def mxfp8_backward_to_slots(
    schedule: MoKSchedule,
    forward_context: MoKForwardContext,
    grad_output: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: tuple[torch.Tensor, ...],
    routed_up_weights: tuple[torch.Tensor, ...],
    routed_down_weights: tuple[torch.Tensor, torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    swiglu_limit: float | None = None,
    macrobatch_size: int | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """`mxfp8_backward` up to its epilogue, as `backward_to_slots` returns it. The routed
    context is read only through its MXFP8 quantisation (x and hidden along the tokens, gate and
    up along I), so a context of values already MXFP8-exact gives the same results.
    `macrobatch_size` as `mxfp8_backward`'s."""
    # The activation gradients read each weight along its own dim of the reduction.
    gate_t = _mxfp8_weight(routed_gate_weights[2:], transposed=True)  # [E, I, H] along I
    up_t = _mxfp8_weight(routed_up_weights[2:], transposed=True)
    down_t = _mxfp8_weight(routed_down_weights, transposed=True)  # [E, H, I] along H
    by_token = dict(along_rows=True)

    def expert(e, ctx, r, dy_e, dy_routed, w_routed):
        d_hidden = mxfp8_round_trip(dy_e).float() @ down_t[e].float()
        gate_q, up_q = mxfp8_round_trip(ctx.gate_routed[r]), mxfp8_round_trip(ctx.up_routed[r])
        d_gate, d_up = swiglu_backward(d_hidden, gate_q, up_q, swiglu_limit)
        d_x = (mxfp8_round_trip(d_gate).float() @ gate_t[e].float()
               + mxfp8_round_trip(d_up).float() @ up_t[e].float())  # fmt: skip
        x_t = mxfp8_round_trip(ctx.x_routed[r], **by_token).float()
        d_down_w = (mxfp8_round_trip(dy_e, **by_token).float().t()
                    @ mxfp8_round_trip(ctx.hidden_routed[r], **by_token).float())  # fmt: skip
        d_gate_w = mxfp8_round_trip(d_gate, **by_token).float().t() @ x_t
        d_up_w = mxfp8_round_trip(d_up, **by_token).float().t() @ x_t
        hidden_q = swiglu(gate_q, up_q, swiglu_limit).float()
        d_router = (hidden_q * d_hidden).sum(dim=1) / w_routed.clamp_min(
            torch.finfo(torch.float32).tiny
        )
        return d_x, d_gate_w, d_up_w, d_down_w, d_router

    def replay(window):
        """A macrobatch's context, rebuilt: bf16 x rows, gate/up/SwiGLU from x's round trip."""
        return mxfp8_recompute_forward_context(
            window, x, None, None, routed_gate_weights[:2], routed_up_weights[:2],
            topk=router_weights.shape[1], group=group, swiglu_limit=swiglu_limit,
        )  # fmt: skip

    return _layer_backward(
        schedule, forward_context, grad_output, x, router_weights,
        (shared_gate_weights, shared_up_weights, shared_down_weights),
        gate_t.shape, group, swiglu_limit, expert, macrobatch_size, replay,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# An independent oracle: a per-expert loop differentiated by autograd
# ----------------------------------------------------------------------------------------------
# It shares no code with the functions above: no schedule, no padding, no hand-written backward.


def naive_moe(
    x,
    router_weights,
    top_experts,
    routed_gate,
    routed_up,
    routed_down,
    shared=None,
    *,
    swiglu_limit=None,
    dtype=torch.float64,
    expert_offset=0,
):
    """out[t] = shared(x_t) + sum_j w[t, j] * expert_{top_experts[t, j]}(x_t), in `dtype`.

    The routed weights are those of experts expert_offset .. expert_offset + E - 1 (all global
    experts by default); slots routed to other experts contribute nothing, so an EP rank can
    compute its own experts' share. Returns out in `dtype`.
    """

    def mlp(rows, gate_w, up_w, down_w):
        g = rows @ gate_w.t()
        u = rows @ up_w.t()
        if swiglu_limit is not None:
            g = torch.clamp(g, max=swiglu_limit)
            u = torch.clamp(u, -swiglu_limit, swiglu_limit)
        return (torch.nn.functional.silu(g) * u) @ down_w.t()

    xs = x.to(dtype)
    out = torch.zeros_like(xs)
    if shared is not None:
        out = out + mlp(xs, *(w.to(dtype) for w in shared))
    w = router_weights.to(dtype)
    for e in range(routed_gate.shape[0]):
        token, j = torch.nonzero(top_experts == e + expert_offset, as_tuple=True)
        if token.numel() == 0:
            continue
        y = mlp(
            xs[token], routed_gate[e].to(dtype), routed_up[e].to(dtype), routed_down[e].to(dtype)
        )
        out = out.index_add(0, token, w[token, j].unsqueeze(1) * y)
    return out


def naive_moe_with_grads(inputs: dict, grad_output, *, swiglu_limit=None, dtype=torch.float64):
    """(out, grads dict) of naive_moe by autograd; leaves are the given tensors upcast to dtype."""
    names = ["x", "router_weights", "routed_gate", "routed_up", "routed_down"]
    shared_names = ["shared_gate", "shared_up", "shared_down"]
    has_shared = inputs.get("shared_gate") is not None
    if has_shared:
        names += shared_names
    leaves = {n: inputs[n].detach().to(dtype).requires_grad_(True) for n in names}
    shared = tuple(leaves[n] for n in shared_names) if has_shared else None
    out = naive_moe(
        leaves["x"],
        leaves["router_weights"],
        inputs["top_experts"],
        leaves["routed_gate"],
        leaves["routed_up"],
        leaves["routed_down"],
        shared,
        swiglu_limit=swiglu_limit,
        dtype=dtype,
    )
    out.backward(grad_output.to(dtype))
    return out.detach(), {n: leaves[n].grad for n in names}
