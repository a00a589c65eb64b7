"""Interim GPU backward (EP group of one) composed of the SM90 backward kernels.

Registered as `mok.ops.backward`'s CUDA path. Each kernel passed its own GPU tests on the H200
(tests/gpu/test_expert_gemm_bwd_gpu.py); the composition is checked against the fp64 oracle in
tests/gpu/test_backward_gpu.py, and bitwise against the reference's math on CPU
(tests/test_launcher_composition_cpu.py). Not the backward megakernel of DESIGN §4 (issue 5).

    dy_routed = dY[peer_token_idx // k], w_routed = w[peer_token_idx]   gathers (padding 0)
    dY_e = bf16(w * dy_routed)                                          elementwise
    d_gate, d_up = SwiGLU'(dY_e @ W_down[e], gate, up)                  expert_gemm_bwd_d_hidden_swiglu
    d_x_routed = d_gate @ W_gate[e] + d_up @ W_up[e]                    expert_gemm_bwd_d_x
    d_router = <dy_routed, y> with y = hidden @ W_down[e]^T (bf16)      expert_gemm_down + row sums
    dW_down, dW_gate, dW_up = per-expert A^T B (fp32, one CTA a tile)   expert_gemm_bwd_weights
    slots = d_x_routed by slot; d_x = d_x_shared + sum_j slots          stable sort + moe_combine_backward
    shared expert: the same kernels on one 'expert' of T rows (padded to 128)
"""

from __future__ import annotations

import torch

from . import epilogues, expert_gemm, expert_gemm_bwd
from .forward import (
    ROW_TILE,
    _require_group_of_one,
    gather_routed_rows,
    pad_rows,
    scatter_to_slots,
)


def _expert_backward(dy_e, x_rows, gate, up, hidden, gate_w, up_w, down_w, tokens, limit):
    """(d_x rows bf16, dW_gate, dW_up, dW_down fp32) of grouped experts over routed rows."""
    d_gate, d_up = expert_gemm_bwd.d_hidden_swiglu(
        dy_e, down_w, gate, up, tokens, swiglu_limit=limit
    )
    d_x_rows = expert_gemm_bwd.d_x(d_gate, d_up, gate_w, up_w, tokens)
    d_down = expert_gemm_bwd.weight_gradient(dy_e, hidden, tokens)
    d_gate_w = expert_gemm_bwd.weight_gradient(d_gate, x_rows, tokens)
    d_up_w = expert_gemm_bwd.weight_gradient(d_up, x_rows, tokens)
    return d_x_rows, d_gate_w, d_up_w, d_down


def _shared_backward(grad_output, x, ctx_shared, weights, limit):
    """The shared expert (router weight 1) as one expert over all T rows, padded to 128."""
    num_tokens = x.shape[0]
    padded = -(-num_tokens // ROW_TILE) * ROW_TILE
    tokens = torch.full((1,), padded, dtype=torch.int32, device=x.device)
    gate_s, up_s, hidden_s = (pad_rows(t, padded) for t in ctx_shared)
    gate_w, up_w, down_w = (w.unsqueeze(0) for w in weights)
    d_x_rows, *grads = _expert_backward(
        pad_rows(grad_output, padded), pad_rows(x, padded), gate_s, up_s, hidden_s,
        gate_w, up_w, down_w, tokens, limit,
    )  # fmt: skip
    return d_x_rows[:num_tokens], [g[0] for g in grads]


def backward(
    ws, schedule, ctx_tensors, grad_output, x, router_weights, shared_gate, shared_up,
    shared_down, routed_gate, routed_up, routed_down, swiglu_limit, bwd_num_comm_sms,
    minibatch_size, macrobatch_size, main_grads,
):  # fmt: skip
    _require_group_of_one(ws, "backward")
    if routed_down.shape[2] % expert_gemm_bwd.N_ALIGNMENT:
        raise ValueError(
            f"intermediate_size must be a multiple of {expert_gemm_bwd.N_ALIGNMENT} on the "
            f"sm_90a backward kernel path, got {routed_down.shape[2]}"
        )
    x_routed, gate, up, hidden, gate_s, up_s, hidden_s = ctx_tensors
    num_tokens, topk = router_weights.shape
    peer, slot, tokens = schedule.peer_rank, schedule.peer_token_idx, schedule.tokens_per_expert

    # ---- pull dY and w; dY_e = bf16(w * dY) on the expert's side ----
    dy_routed = gather_routed_rows(grad_output, peer, slot, topk)
    # w[peer_token_idx] is the same gather as dY's with one "token" per slot (k = 1).
    w_routed = gather_routed_rows(router_weights.view(-1, 1), peer, slot, 1)
    dy_e = (w_routed * dy_routed.float()).to(torch.bfloat16)

    # ---- routed experts ----
    d_x_routed, d_gate_w, d_up_w, d_down_w = _expert_backward(
        dy_e, x_routed, gate, up, hidden, routed_gate, routed_up, routed_down, tokens,
        swiglu_limit,
    )  # fmt: skip
    # d_router[t, j] = <dY[t], y_e(x_t)>, y from the saved hidden (fp32 row sums, fixed order).
    y = expert_gemm.down(hidden, routed_down, tokens)
    d_router_routed = (dy_routed.float() * y.float()).sum(dim=1, keepdim=True)
    slots = scatter_to_slots(d_x_routed, peer, slot, num_tokens * topk)
    d_router = scatter_to_slots(d_router_routed, peer, slot, num_tokens * topk)
    d_router = d_router.view(num_tokens, topk)

    # ---- shared expert ----
    d_x_shared, shared_grads = None, [None, None, None]
    if shared_gate is not None:
        d_x_shared, shared_grads = _shared_backward(
            grad_output, x, (gate_s, up_s, hidden_s), (shared_gate, shared_up, shared_down),
            swiglu_limit,
        )  # fmt: skip
    d_x = epilogues.bwd_epilogue(d_x_shared, slots, topk)

    # ---- weight gradients: bf16 results, or accumulated into fp32 main_grads ----
    outs = []
    grads = (d_gate_w, d_up_w, d_down_w, *shared_grads)
    for grad, main_grad in zip(grads, main_grads, strict=True):
        if grad is None:
            outs.append(x.new_empty(0))
        elif main_grad is not None:
            main_grad.add_(grad)
            outs.append(x.new_empty(0))
        else:
            outs.append(grad.to(torch.bfloat16))
    return (d_x, d_router, *outs)
