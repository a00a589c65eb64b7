"""The baseline MoE layer as torchtitan builds it, on ``torch._grouped_mm`` (or a matmul loop).

Steps (torchtitan models/moe: TokenReorderer, indices_padding_wrapper, _run_experts_grouped_mm):
stable argsort of the token slots by expert, gather x rows into an expert-major buffer whose
groups are padded to ``align`` rows (a permute index, padding rows zero), gate and up grouped
GEMMs on the transposed weight views, SwiGLU in fp32 -> bf16, down grouped GEMM, unpermute,
weighted sum over k in fp32 -> bf16. With EP > 1 the sorted rows go through NCCL
``all_to_all_single`` to the experts' ranks and back. EP = 1 is the same code with no exchange.
"""

from __future__ import annotations

import torch

from benchmarks.ep import all_to_all_rows, exchange_counts
from benchmarks.reference import swiglu_fp32

# torchtitan's TOKEN_GROUP_ALIGN_SIZE_M for bf16 (16 for fp8, 32 for mxfp8): each expert's row
# group is padded to a multiple of 8 rows (16 bytes of bf16), which the K-grouped weight-gradient
# GEMM of some torch versions requires; an empty expert still gets one group of `align` rows.
DEFAULT_ALIGN = 8


def expert_major_positions(
    counts: torch.Tensor, align: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each incoming row goes in the padded expert-major buffer, and the group offsets.

    ``counts`` [S, E] is the number of rows from source s for expert e, rows arriving source
    major (s, e) as all_to_all delivers them (S = 1 without EP). Returns positions [num_rows]
    int64 and offsets [E] int32 (cumulative padded group ends), computed on the device.
    """
    per_expert = counts.sum(dim=0)
    padded = torch.clamp_min((per_expert + align - 1) // align * align, align)
    expert_start = torch.cumsum(padded, 0) - padded
    dest_start = expert_start.unsqueeze(0) + torch.cumsum(counts, 0) - counts
    flat = counts.reshape(-1)
    src_start = torch.cumsum(flat, 0) - flat
    chunk = torch.repeat_interleave(
        torch.arange(flat.numel(), device=counts.device), flat, output_size=num_rows
    )
    row = torch.arange(num_rows, device=counts.device)
    positions = dest_start.reshape(-1)[chunk] + row - src_start[chunk]
    return positions, torch.cumsum(padded, 0).to(torch.int32)


def run_experts(xp, offsets, gate, up, down, swiglu_limit, use_grouped_mm: bool):
    """SwiGLU experts over the padded expert-major rows ``xp`` [R, H] -> [R, H] bf16.

    Rows past ``offsets[-1]`` belong to no group: their outputs are never read.
    """
    if use_grouped_mm:
        g = torch._grouped_mm(xp, gate.transpose(-2, -1), offs=offsets)
        u = torch._grouped_mm(xp, up.transpose(-2, -1), offs=offsets)
        hidden = swiglu_fp32(g, u, swiglu_limit).to(torch.bfloat16)
        return torch._grouped_mm(hidden, down.transpose(-2, -1), offs=offsets)
    # torchtitan's _run_experts_for_loop: host offsets (a sync), one matmul chain per expert.
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    pieces = []
    for e, (start, end) in enumerate(zip(starts, ends, strict=True)):
        rows = xp[start:end]
        hidden = swiglu_fp32(rows @ gate[e].T, rows @ up[e].T, swiglu_limit).to(torch.bfloat16)
        pieces.append(hidden @ down[e].T)
    pieces.append(xp.new_zeros((xp.shape[0] - ends[-1], down.shape[1])))
    return torch.cat(pieces)


def torchtitan_moe(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    router_weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    *,
    swiglu_limit: float | None,
    align: int = DEFAULT_ALIGN,
    use_grouped_mm: bool = True,
    group=None,
) -> torch.Tensor:
    """out [T, H] bf16 of the layer (SEMANTICS.md §1); differentiable in every float input.

    ``gate``/``up``/``down`` hold this rank's experts; ``group`` (EP > 1) is the process group
    over which experts are spread, ``None`` for one GPU.
    """
    num_tokens, topk = top_experts.shape
    local_experts = gate.shape[0]
    world = 1 if group is None else torch.distributed.get_world_size(group)
    flat = top_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // topk)
    # histc, as torchtitan's router: counts per expert without a host sync (bincount syncs).
    num_experts = local_experts * world
    tokens_per_expert = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts)
    tokens_per_expert = tokens_per_expert.to(torch.int64)
    if world == 1:
        counts = tokens_per_expert.unsqueeze(0)
        num_rows = flat.numel()
    else:
        counts, send_splits, recv_splits = exchange_counts(tokens_per_expert, group)
        num_rows = sum(recv_splits)
        rows = all_to_all_rows(rows, recv_splits, send_splits, group)
    positions, offsets = expert_major_positions(counts, align, num_rows)
    # Static buffer bound (no sync): every group grows by at most align rows.
    padded_rows = num_rows + local_experts * align
    xp = rows.new_zeros((padded_rows, x.shape[1])).index_copy(0, positions, rows)
    y = run_experts(xp, offsets, gate, up, down, swiglu_limit, use_grouped_mm)
    y = y.index_select(0, positions)
    if world > 1:
        y = all_to_all_rows(y, send_splits, recv_splits, group)
    slot_of_sorted = torch.empty_like(order)
    slot_of_sorted[order] = torch.arange(order.numel(), device=order.device)
    y_slots = y.index_select(0, slot_of_sorted).view(num_tokens, topk, -1)
    out = (y_slots.float() * router_weights.unsqueeze(-1)).sum(dim=1)
    if shared is not None:
        shared_gate, shared_up, shared_down = shared
        hidden = swiglu_fp32(x @ shared_gate.T, x @ shared_up.T, swiglu_limit)
        out = out + (hidden.to(torch.bfloat16) @ shared_down.T).float()
    return out.to(torch.bfloat16)


def grouped_mm_works(device: torch.device) -> tuple[bool, str]:
    """Probe ``torch._grouped_mm`` forward and backward on ``device`` with unaligned groups."""
    if not hasattr(torch, "_grouped_mm"):
        return False, "torch._grouped_mm missing"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(40, 64, device=device, dtype=torch.bfloat16, generator=gen)
        w = torch.randn(3, 32, 64, device=device, dtype=torch.bfloat16, generator=gen)
        x.requires_grad_(True)
        w.requires_grad_(True)
        offsets = torch.tensor([16, 16, 40], device=device, dtype=torch.int32)
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        y.backward(torch.ones_like(y))
        expected = x[16:40].float() @ w[2].float().T
        if not torch.allclose(y[16:40].float(), expected, rtol=2e-2, atol=2e-1):
            return False, "torch._grouped_mm gave wrong values"
    except Exception as error:  # any failure means: use the loop
        return False, f"torch._grouped_mm failed: {type(error).__name__}: {error}"
    return True, "ok"
