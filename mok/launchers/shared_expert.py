"""The shared expert on the CUDA path: one 'expert' over all T rows (padded to the 128-row
tile), through the separate expert-GEMM kernels (expert_gemm.py, expert_gemm_bwd.py). The forward
op, the backward op and their ring-reuse forms (macrobatch.py) all run it this way."""

from __future__ import annotations

import torch

from . import expert_gemm, expert_gemm_bwd
from .device_args import TILE_ROWS
from .rows import pad_rows


def shared_forward(x, gate_w, up_w, down_w, limit):
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


def shared_backward(grad_output, x, ctx_shared, weights, limit, main_grads):
    """The shared expert (weight 1) as one expert of T rows: (d_x rows, [dW_gate, dW_up, dW_down])."""
    num_tokens = x.shape[0]
    padded = -(-num_tokens // TILE_ROWS) * TILE_ROWS
    tokens = torch.full((1,), padded, dtype=torch.int32, device=x.device)
    gate, up, hidden = (pad_rows(t, padded) for t in ctx_shared)
    dy, x_rows = pad_rows(grad_output, padded), pad_rows(x, padded)
    gate_w, up_w, down_w = (w.unsqueeze(0) for w in weights)
    d_gate, d_up = expert_gemm_bwd.d_hidden_swiglu(dy, down_w, gate, up, tokens, swiglu_limit=limit)
    d_x_rows = expert_gemm_bwd.d_x(d_gate, d_up, gate_w, up_w, tokens)
    grads = expert_gemm_bwd.weight_gradients(dy, x_rows, d_gate, d_up, hidden, tokens, main_grads)
    return d_x_rows[:num_tokens], [g[0] if g.numel() else g for g in grads]
