"""The routed backward composed from the standalone GEMM kernels and torch gathers: what the
backward megakernel must equal bit for bit (same tiles, same K order, same epilogue math)."""

from __future__ import annotations

import torch

from mok import functional as F
from mok.launchers import expert_gemm_bwd
from mok.launchers.backward_megakernel import routed_backward

WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")


def scatter_to_slots(y, peer_rank, peer_token_idx, num_slots):
    """slots[peer_token_idx[r]] = y[r] for every real row r (each slot once); padding dropped."""
    keys = torch.where(peer_rank >= 0, peer_token_idx, num_slots).long()
    out = y.new_empty(num_slots + 1, *y.shape[1:])
    return out.index_copy_(0, keys, y)[:num_slots]


def megakernel_and_kernels_backward(inputs, num_experts, limit):
    """((dy_e, d_gate, d_up, partials, slots, dW_gate, dW_up, dW_down) of the megakernel, the
    same of the kernels); routed rows cut at the schedule's row count."""
    x, w, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    (t, h), k = x.shape, w.shape[1]
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=x.device, num_local_tokens=t, hidden_size=h,
                         topk=k, num_local_experts=num_experts)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=num_experts)
    weights = [inputs[n] for n in WEIGHTS]
    _, ctx = F.forward(config, ws, schedule, x, w, *weights, swiglu_limit=limit)
    gate_w, up_w, down_w = weights[3:]
    x_routed, gate, up, hidden = ctx.x_routed, ctx.gate_routed, ctx.up_routed, ctx.hidden_routed
    peer, slot, tokens = schedule.peer_rank, schedule.peer_token_idx, schedule.tokens_per_expert
    rows = int(schedule.num_tokens.item())

    dy_e, d_gate, d_up, partials, slots, grads = routed_backward(
        dy, w, schedule, x_routed, gate, up, hidden, gate_w, up_w, down_w, swiglu_limit=limit
    )
    mega = (dy_e[:rows], d_gate[:rows], d_up[:rows], partials[:rows], slots, *grads)

    real = peer >= 0
    source = torch.where(real, slot.long(), 0)
    w_routed = torch.where(real, w.reshape(-1)[source], 0.0)
    dy_rows = dy[torch.div(source, k, rounding_mode="floor")].float()
    dy_e_k = (w_routed[:, None] * dy_rows).to(torch.bfloat16)
    partials_k = torch.empty_like(partials)
    d_gate_k, d_up_k = expert_gemm_bwd.d_hidden_swiglu(
        dy_e_k, down_w, gate, up, tokens, swiglu_limit=limit, router_partials=partials_k
    )
    d_x_k = expert_gemm_bwd.d_x(d_gate_k, d_up_k, gate_w, up_w, tokens)
    slots_k = scatter_to_slots(d_x_k, peer, slot, t * k)
    grads_k = [
        expert_gemm_bwd.weight_gradient(a, b, tokens, output="bf16")
        for a, b in ((d_gate_k, x_routed), (d_up_k, x_routed), (dy_e_k, hidden))
    ]
    kernels = (dy_e_k[:rows], d_gate_k[:rows], d_up_k[:rows], partials_k[:rows], slots_k,
               *grads_k)  # fmt: skip
    return mega, kernels
