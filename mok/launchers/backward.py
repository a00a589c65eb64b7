"""Interim GPU backward (EP group of one) composed of the SM90 backward kernels.

Registered as `mok.ops.backward`'s CUDA path. Each kernel passed its own GPU tests on the H200
(tests/gpu/test_expert_gemm_bwd_gpu.py); the composition is checked against the fp64 oracle in
tests/gpu/test_backward_gpu.py, and bitwise against the reference's math on CPU
(tests/test_launcher_composition_cpu.py). Not the backward megakernel of DESIGN §4 (issue 5).

    dY_e = bf16(w[peer_token_idx] * dY[peer_token_idx // k])           gather_rows_scaled
    w_routed = w[peer_token_idx]  (padding 0)                           torch gather
    d_gate, d_up = SwiGLU'(dY_e @ W_down[e], gate, up)                  expert_gemm_bwd_d_hidden_swiglu
    slots[peer_token_idx] = d_gate @ W_gate[e] + d_up @ W_up[e]         expert_gemm_bwd_d_x_to_slots
    d_router = sum_b partials[:, b] / w, partials from the d_hidden epilogue (= <dY, y>)
    dW_down, dW_gate, dW_up = per-expert A^T B (one CTA a tile)          expert_gemm_bwd_weights_bf16
                             (or added into fp32 main_grads in place)  expert_gemm_bwd_weights_accumulate
    d_x = d_x_shared + sum_j slots                                      moe_combine_backward
    shared expert: the same kernels on one 'expert' of T rows (padded to 128)
"""

from __future__ import annotations

import torch

from . import dispatch, epilogues, expert_gemm_bwd, moe_backward
from .forward import (
    ROW_TILE,
    PathSwitch,
    _require_group_of_one,
    check_macrobatch,
    gather_routed_rows,
    pad_rows,
    scatter_to_slots,
)


def _weight_gradient(a_rows, b_rows, tokens, main_grad):
    """bf16 [E, M, N] gradient, or empty after adding it into the fp32 main_grad in place."""
    if main_grad is None:
        return expert_gemm_bwd.weight_gradient(a_rows, b_rows, tokens, output="bf16")
    out = main_grad if main_grad.dim() == 3 else main_grad.unsqueeze(0)
    expert_gemm_bwd.weight_gradient(a_rows, b_rows, tokens, output="accumulate", out=out)
    return a_rows.new_empty(0)


def _expert_backward(
    dy_e,
    x_rows,
    gate,
    up,
    hidden,
    weights,
    tokens,
    limit,
    main_grads,
    router_partials=None,
    slots=None,
):
    """(d_x rows bf16, [dW_gate, dW_up, dW_down]) of grouped experts over routed rows; each
    weight gradient bf16, or added into its main_grad (fp32) and returned empty.
    `router_partials` (fp32 [C, I / 128]) receives the d_hidden epilogue's router partials;
    with `slots` (peer_rank, peer_token_idx, num_slots) the d_x rows go to their slots."""
    gate_w, up_w, down_w = weights
    d_gate, d_up = expert_gemm_bwd.d_hidden_swiglu(
        dy_e, down_w, gate, up, tokens, swiglu_limit=limit, router_partials=router_partials
    )
    d_x_rows = expert_gemm_bwd.d_x(d_gate, d_up, gate_w, up_w, tokens, slots=slots)
    return d_x_rows, _weight_gradients(dy_e, x_rows, d_gate, d_up, hidden, tokens, main_grads)


def _weight_gradients(dy_e, x_rows, d_gate, d_up, hidden, tokens, main_grads):
    """[dW_gate, dW_up, dW_down], each bf16 or added into its main_grad and returned empty."""
    main_gate, main_up, main_down = main_grads
    return [
        _weight_gradient(d_gate, x_rows, tokens, main_gate),
        _weight_gradient(d_up, x_rows, tokens, main_up),
        _weight_gradient(dy_e, hidden, tokens, main_down),
    ]


# How the routed experts' backward runs: "kernels" (scaled gather, d_hidden, d_x, weights
# as separate launches, the default) or "megakernel" (mok/launchers/moe_backward.py: one
# persistent launch with the bf16 weight gradients, GPU-tested, bitwise equal, not faster yet:
# docs/NOTES.md, session 7). The combine is a separate launch on both, and so are weight
# gradients added into fp32 main_grads.
BACKWARD_PATHS = ("kernels", "megakernel")
_backward = PathSwitch(BACKWARD_PATHS, "kernels")


def set_backward_path(path: str) -> str:
    """Select how backward runs the routed experts (BACKWARD_PATHS); returns the previous one."""
    return _backward.set(path)


def _shared_backward(grad_output, x, ctx_shared, weights, limit, main_grads):
    """The shared expert (router weight 1) as one expert over all T rows, padded to 128."""
    num_tokens = x.shape[0]
    padded = -(-num_tokens // ROW_TILE) * ROW_TILE
    tokens = torch.full((1,), padded, dtype=torch.int32, device=x.device)
    gate_s, up_s, hidden_s = (pad_rows(t, padded) for t in ctx_shared)
    d_x_rows, grads = _expert_backward(
        pad_rows(grad_output, padded), pad_rows(x, padded), gate_s, up_s, hidden_s,
        [w.unsqueeze(0) for w in weights], tokens, limit, main_grads,
    )  # fmt: skip
    return d_x_rows[:num_tokens], [g[0] if g.numel() else g for g in grads]


def backward(
    ws, schedule, ctx_tensors, grad_output, x, router_weights, shared_gate, shared_up,
    shared_down, routed_gate, routed_up, routed_down, swiglu_limit, bwd_num_comm_sms,
    minibatch_size, macrobatch_size, main_grads,
):  # fmt: skip
    _require_group_of_one(ws, "backward")
    check_macrobatch(macrobatch_size, x.shape[0], router_weights.shape[1], "backward")
    if routed_down.shape[2] % expert_gemm_bwd.N_ALIGNMENT:
        raise ValueError(
            f"intermediate_size must be a multiple of {expert_gemm_bwd.N_ALIGNMENT} on the "
            f"sm_90a backward kernel path, got {routed_down.shape[2]}"
        )
    x_routed, gate, up, hidden, gate_s, up_s, hidden_s = ctx_tensors
    num_tokens, topk = router_weights.shape
    peer, slot, tokens = schedule.peer_rank, schedule.peer_token_idx, schedule.tokens_per_expert

    # w[peer_token_idx] is the same gather as dY's with one "token" per slot (k = 1).
    w_routed = gather_routed_rows(router_weights.view(-1, 1), peer, slot, 1)

    # ---- routed experts: pull dY_e = bf16(w * dY) on the expert's side, then the GEMMs ----
    if _backward.path == "megakernel":
        # The weight gradients in the same launch, unless they go into fp32 main_grads.
        in_launch = all(g is None for g in main_grads[:3])
        dy_e, d_gate, d_up, partials, d_x_routed, routed_grads = moe_backward.routed_backward(
            grad_output, router_weights, schedule, x_routed, gate, up, hidden, routed_gate,
            routed_up, routed_down, swiglu_limit=swiglu_limit, weight_grads=in_launch,
            num_comm_ctas=bwd_num_comm_sms, minibatch_size=minibatch_size,
        )  # fmt: skip
        if not in_launch:
            routed_grads = _weight_gradients(dy_e, x_routed, d_gate, d_up, hidden, tokens,
                                             main_grads[:3])  # fmt: skip
    else:
        dy_e = dispatch.gather_rows(grad_output, peer, slot, schedule.num_tokens, topk,
                                    weights=router_weights)  # fmt: skip
        partials = torch.empty(dy_e.shape[0], gate.shape[1] // 128, dtype=torch.float32,
                               device=x.device)  # fmt: skip
        d_x_routed, routed_grads = _expert_backward(
            dy_e, x_routed, gate, up, hidden, (routed_gate, routed_up, routed_down), tokens,
            swiglu_limit, main_grads[:3], router_partials=partials,
            slots=(peer, slot, num_tokens * topk),
        )  # fmt: skip
    # d_router[t, j] = <dY[t], y_e(x_t)> = (sum_b partials[r, b]) / w[r]: the partials hold
    # <dY_e, y> with dY_e = w * dY (fixed-order sums). Padding rows (w = 0) give 0 and are
    # never scattered.
    tiny = torch.finfo(torch.float32).tiny
    d_router_routed = partials.sum(dim=1, keepdim=True) / w_routed.clamp_min(tiny)
    slots = d_x_routed  # already in slot order: [T * k, H]
    d_router = scatter_to_slots(d_router_routed, peer, slot, num_tokens * topk)
    d_router = d_router.view(num_tokens, topk)

    # ---- shared expert ----
    # Distinct empty tensors: custom-op outputs may not alias each other.
    d_x_shared, shared_grads = None, [x.new_empty(0) for _ in range(3)]
    if shared_gate is not None:
        d_x_shared, shared_grads = _shared_backward(
            grad_output, x, (gate_s, up_s, hidden_s), (shared_gate, shared_up, shared_down),
            swiglu_limit, main_grads[3:],
        )  # fmt: skip
    d_x = epilogues.bwd_epilogue(d_x_shared, slots, topk)
    return (d_x, d_router, *routed_grads, *shared_grads)
