"""The GPU forward op (`mok.ops.forward`) and the recomputed forward context, EP group of one.

    routed experts: the forward megakernel (forward_megakernel.py)
    shared expert:  expert_gemm's gate/up and down on one 'expert' of T rows (padded to 128)
    out = y_shared + sum_j w[t, j] * slots[t * k + j]  (fixed j order)   moe_combine_forward

The recomputed context runs the gather and gate/up as separate kernels. Current stream, no host
sync; every step is deterministic (no atomics, no split-K).
"""

from __future__ import annotations

import torch

from . import dispatch, epilogues, expert_gemm
from .checks import check_macrobatch, require_group_of_one
from .device_args import TILE_ROWS
from .forward_megakernel import routed_forward
from .rows import pad_rows


def _shared(x, gate_w, up_w, down_w, limit):
    """The shared expert as one expert over all T rows (padded to the 128-row tile)."""
    num_tokens = x.shape[0]
    padded = -(-num_tokens // TILE_ROWS) * TILE_ROWS
    rows = pad_rows(x, padded)
    tokens = torch.full((1,), padded, dtype=torch.int32, device=x.device)
    gate, up, hidden = expert_gemm.gate_up_swiglu(
        rows, gate_w.unsqueeze(0), up_w.unsqueeze(0), tokens, swiglu_limit=limit
    )
    y = None
    if down_w is not None:
        y = expert_gemm.down(hidden, down_w.unsqueeze(0), tokens)[:num_tokens]
    return gate[:num_tokens], up[:num_tokens], hidden[:num_tokens], y


def forward(
    ws, schedule, x, router_weights, shared_gate, shared_up, shared_down, routed_gate,
    routed_up, routed_down, swiglu_limit, fwd_num_comm_sms, minibatch_size, macrobatch_size,
):  # fmt: skip
    require_group_of_one(ws, "forward")
    check_macrobatch(macrobatch_size, x.shape[0], router_weights.shape[1], "forward")
    routed_ctx, slots = routed_forward(
        x, schedule, ws.topk, routed_gate, routed_up, routed_down, swiglu_limit=swiglu_limit,
        num_comm_ctas=fwd_num_comm_sms, minibatch_size=minibatch_size,
    )  # fmt: skip
    # Distinct empty tensors: custom-op outputs may not alias each other.
    shared_ctx, y_shared = tuple(x.new_empty(0) for _ in range(3)), None
    if shared_gate is not None:
        *shared_ctx, y_shared = _shared(x, shared_gate, shared_up, shared_down, swiglu_limit)
    out = epilogues.fwd_epilogue(y_shared, slots, router_weights)
    return (out, *routed_ctx, *shared_ctx)


def recompute_forward_context(
    ws, schedule, x, shared_gate, shared_up, routed_gate, routed_up, swiglu_limit
):
    require_group_of_one(ws, "recompute_forward_context")
    x_routed = dispatch.gather_rows(x, schedule.peer_rank, schedule.peer_token_idx,
                                    schedule.num_tokens, ws.topk)  # fmt: skip
    gate, up, hidden = expert_gemm.gate_up_swiglu(
        x_routed, routed_gate, routed_up, schedule.tokens_per_expert, swiglu_limit=swiglu_limit
    )
    shared_ctx = tuple(x.new_empty(0) for _ in range(3))
    if shared_gate is not None:
        shared_ctx = _shared(x, shared_gate, shared_up, None, swiglu_limit)[:3]
    return (x_routed, gate, up, hidden, *shared_ctx)
