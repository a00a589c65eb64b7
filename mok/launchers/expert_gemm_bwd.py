"""Backward grouped expert GEMMs over the expert-major routed buffer (SM90, TMA + wgmma).

Kernels `expert_gemm_bwd_d_hidden_swiglu`, `expert_gemm_bwd_d_x`
(mok/dsl_kernels/sm90/expert_gemm_bwd.py) and `expert_gemm_bwd_weights` (expert_gemm_bwd_weights.py),
tiles located on the device from `tokens_per_expert` (no host sync):

    d_hidden_swiglu: d_gate, d_up = mok.reference.swiglu_backward(dY_e @ W_down[e], gate, up, limit)
    d_x:             d_x = bf16(d_gate @ W_gate[e] + d_up @ W_up[e]), one fp32 sum, gate half first
    weight_gradient: out[e] = A[rows of e]^T @ B[rows of e], one CTA a tile, zeros for no rows

Weights are read as stored ([E, K, N]); rows past sum(tokens_per_expert) are not written.
"""

from __future__ import annotations

import torch

from .checks import check_counts, check_cuda, check_expert_weights, check_extents, check_multiple
from .device_args import persistent_grid, sm_count, tma_descriptor
from .expert_gemm import K_ALIGNMENT

D_HIDDEN_KERNEL = "expert_gemm_bwd_d_hidden_swiglu"
D_X_KERNEL = "expert_gemm_bwd_d_x"
# weight_gradient's `output` -> (kernel, dtype of out)
WEIGHTS_KERNELS = {
    "fp32": ("expert_gemm_bwd_weights", torch.float32),
    "bf16": ("expert_gemm_bwd_weights_bf16", torch.bfloat16),
    "accumulate": ("expert_gemm_bwd_weights_accumulate", torch.float32),
}
M_ALIGNMENT = 128  # weight_gradient: output rows per tile
N_ALIGNMENT = 256  # output columns per tile: two 128-column accumulators


def d_hidden_swiglu(
    dy_routed: torch.Tensor,
    down_weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    d_gate: torch.Tensor | None = None,
    d_up: torch.Tensor | None = None,
    router_partials: torch.Tensor | None = None,
    manifest=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up), each bf16 [C, I], from dY_e bf16 [C, H] and W_down bf16 [E, H, I].

    `gate`, `up` bf16 [C, I]: the forward's pre-clamp gate/up. `tokens_per_expert` int32 [E]:
    padded segment sizes, multiples of 128, sum <= C (not checked: a host sync). `router_partials`
    fp32 [C, I / 128], if given, gets the fused router partials (summed over blocks: w * <dY, y>).
    Constraints: H % 64 == 0, I % 256 == 0. Current stream, no host sync.
    """
    from mok.runtime import get_kernel  # noqa: PLC0415

    capacity, hidden_size = dy_routed.shape if dy_routed.dim() == 2 else (-1, -1)
    if down_weights.dim() != 3:
        raise ValueError(f"down_weights must be [E, H, I], got shape {list(down_weights.shape)}")
    num_experts, intermediate_size = down_weights.shape[0], down_weights.shape[2]
    check_cuda("dy_routed", dy_routed, torch.bfloat16, (capacity, hidden_size))
    check_multiple("hidden_size (dy_routed.shape[1])", hidden_size, K_ALIGNMENT)
    check_multiple("intermediate_size (down_weights.shape[2])", intermediate_size, N_ALIGNMENT)
    check_cuda(
        "down_weights", down_weights, torch.bfloat16, (num_experts, hidden_size, intermediate_size)
    )
    check_cuda("gate", gate, torch.bfloat16, (capacity, intermediate_size))
    check_cuda("up", up, torch.bfloat16, (capacity, intermediate_size))
    check_counts("tokens_per_expert", tokens_per_expert, num_experts)
    check_extents(
        "num_experts * hidden_size",
        capacity,
        num_experts * hidden_size,
        hidden_size,
        intermediate_size,
    )
    device = dy_routed.device
    outputs = []
    for name, given in (("d_gate", d_gate), ("d_up", d_up)):
        if given is None:
            given = torch.empty(capacity, intermediate_size, dtype=torch.bfloat16, device=device)
        check_cuda(name, given, torch.bfloat16, (capacity, intermediate_size))
        outputs.append(given)
    d_gate, d_up = outputs
    blocks = intermediate_size // 128
    if router_partials is None:
        router_partials = torch.empty(capacity, blocks, dtype=torch.float32, device=device)
    check_cuda("router_partials", router_partials, torch.float32, (capacity, blocks))
    if capacity == 0 or num_experts == 0:
        return d_gate, d_up

    kernel = get_kernel(D_HIDDEN_KERNEL, device=device, manifest=manifest)
    dy = tma_descriptor(kernel, "tma_a0", dy_routed)
    weights = tma_descriptor(
        kernel, "tma_b0", down_weights.view(num_experts * hidden_size, intermediate_size)
    )
    kernel.launch(
        (persistent_grid(device, capacity, intermediate_size // N_ALIGNMENT), 1, 1),
        {
            # One K range: the second A/B descriptors are not read; pass the same ones.
            "tma_a0": dy,
            "tma_a1": dy,
            "tma_b0": weights,
            "tma_b1": weights,
            "out0_ptr": d_gate,
            "out1_ptr": d_up,
            "gate_ptr": gate,
            "up_ptr": up,
            "partials_ptr": router_partials,
            "peer_rank_ptr": None,
            "peer_token_idx_ptr": None,
            "tokens_per_expert_ptr": tokens_per_expert,
            "num_experts": num_experts,
            "k_size": hidden_size,
            "n_size": intermediate_size,
            "has_limit": int(swiglu_limit is not None),
            "swiglu_limit": 0.0 if swiglu_limit is None else float(swiglu_limit),
        },
    )
    return d_gate, d_up


def d_x(
    d_gate: torch.Tensor,
    d_up: torch.Tensor,
    gate_weights: torch.Tensor,
    up_weights: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    manifest=None,
) -> torch.Tensor:
    """d_x_routed bf16 [C, H] = d_gate @ W_gate[e] + d_up @ W_up[e] (one fp32 sum, gate half first)
    from d_gate/d_up bf16 [C, I], weights bf16 [E, I, H]. Constraints: I % 64 == 0, H % 256 == 0."""
    from mok.runtime import get_kernel  # noqa: PLC0415

    capacity, intermediate_size = d_gate.shape if d_gate.dim() == 2 else (-1, -1)
    if gate_weights.dim() != 3:
        raise ValueError(f"gate_weights must be [E, I, H], got shape {list(gate_weights.shape)}")
    num_experts, hidden_size = gate_weights.shape[0], gate_weights.shape[2]
    check_cuda("d_gate", d_gate, torch.bfloat16, (capacity, intermediate_size))
    check_cuda("d_up", d_up, torch.bfloat16, (capacity, intermediate_size))
    check_multiple("intermediate_size (d_gate.shape[1])", intermediate_size, K_ALIGNMENT)
    check_multiple("hidden_size (gate_weights.shape[2])", hidden_size, N_ALIGNMENT)
    weight_shape = (num_experts, intermediate_size, hidden_size)
    check_cuda("gate_weights", gate_weights, torch.bfloat16, weight_shape)
    check_cuda("up_weights", up_weights, torch.bfloat16, weight_shape)
    check_counts("tokens_per_expert", tokens_per_expert, num_experts)
    check_extents(
        "num_experts * intermediate_size",
        capacity,
        num_experts * intermediate_size,
        intermediate_size,
        hidden_size,
    )
    device = d_gate.device
    if out is None:
        out = torch.empty(capacity, hidden_size, dtype=torch.bfloat16, device=device)
    check_cuda("out", out, torch.bfloat16, (capacity, hidden_size))
    if capacity == 0 or num_experts == 0:
        return out

    kernel = get_kernel(D_X_KERNEL, device=device, manifest=manifest)
    flat = (num_experts * intermediate_size, hidden_size)
    kernel.launch(
        (persistent_grid(device, capacity, hidden_size // N_ALIGNMENT), 1, 1),
        {
            "tma_a0": tma_descriptor(kernel, "tma_a0", d_gate),
            "tma_a1": tma_descriptor(kernel, "tma_a1", d_up),
            "tma_b0": tma_descriptor(kernel, "tma_b0", gate_weights.view(flat)),
            "tma_b1": tma_descriptor(kernel, "tma_b1", up_weights.view(flat)),
            "out0_ptr": out,
            "out1_ptr": None,
            "gate_ptr": None,
            "up_ptr": None,
            "partials_ptr": None,
            "peer_rank_ptr": None,
            "peer_token_idx_ptr": None,
            "tokens_per_expert_ptr": tokens_per_expert,
            "num_experts": num_experts,
            "k_size": intermediate_size,
            "n_size": hidden_size,
            "has_limit": 0,
            "swiglu_limit": 0.0,
        },
    )
    return out


def weight_gradient(
    a_routed: torch.Tensor,
    b_routed: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    output: str = "fp32",
    out: torch.Tensor | None = None,
    manifest=None,
) -> torch.Tensor:
    """out [E, M, N], out[e] = a_routed[rows of e].T @ b_routed[rows of e] (bf16 [C, M], [C, N]).

    output: "fp32", "bf16" (rounded from the fp32 sum) or "accumulate" (fp32 out += sum in place,
    bitwise torch's `out.add_`). Every element is written (zeros for an expert with no rows).
    `out` may be a half of a fused [E, 2 M, N] tensor (checks.expert_rows), written in place.
    Constraints: M % 128 == 0, N % 256 == 0, both < 2^16; `tokens_per_expert` int32 [E].
    """
    from mok.runtime import get_kernel  # noqa: PLC0415

    capacity, m_size = a_routed.shape if a_routed.dim() == 2 else (-1, -1)
    n_size = b_routed.shape[1] if b_routed.dim() == 2 else -1
    num_experts = tokens_per_expert.shape[0] if tokens_per_expert.dim() == 1 else -1
    check_cuda("a_routed", a_routed, torch.bfloat16, (capacity, m_size))
    check_cuda("b_routed", b_routed, torch.bfloat16, (capacity, n_size))
    check_multiple("M (a_routed.shape[1])", m_size, M_ALIGNMENT)
    check_multiple("N (b_routed.shape[1])", n_size, N_ALIGNMENT)
    check_counts("tokens_per_expert", tokens_per_expert, num_experts)
    if output not in WEIGHTS_KERNELS:
        raise ValueError(f"output must be one of {sorted(WEIGHTS_KERNELS)}, got {output!r}")
    kernel_name, out_dtype = WEIGHTS_KERNELS[output]
    device = a_routed.device
    if out is None:
        if output == "accumulate":
            raise ValueError("output='accumulate' needs `out`, the fp32 tensor to add into")
        out = torch.empty(num_experts, m_size, n_size, dtype=out_dtype, device=device)
    out_rows = check_expert_weights("out", out, out_dtype, (num_experts, m_size, n_size))
    # The kernel numbers the rows of out as one [E * rows per expert, N] matrix.
    check_extents("E * out rows per expert", capacity, num_experts * out_rows, m_size, n_size)
    if num_experts == 0:
        return out
    if capacity == 0:
        return out if output == "accumulate" else out.zero_()

    kernel = get_kernel(kernel_name, device=device, manifest=manifest)
    tiles = num_experts * (m_size // M_ALIGNMENT) * (n_size // N_ALIGNMENT)
    kernel.launch(
        (max(1, min(sm_count(device), tiles)), 1, 1),
        {
            "tma_a": tma_descriptor(kernel, "tma_a", a_routed),
            "tma_b": tma_descriptor(kernel, "tma_b", b_routed),
            "out_ptr": out,
            "tokens_per_expert_ptr": tokens_per_expert,
            "num_experts": num_experts,
            "m_size": m_size,
            "n_size": n_size,
            "out_expert_rows": out_rows,
        },
    )
    return out


def gate_up_gradients(num_experts, inter, hidden_size, fused, device) -> list:
    """[dW_gate, dW_up] bf16 [E, I, H], new: two tensors, or (`fused`) the two halves of one
    [E, 2 I, H] (gate rows first), which the kernels write in place."""
    bf16 = dict(dtype=torch.bfloat16, device=device)
    if not fused:
        return [torch.empty(num_experts, inter, hidden_size, **bf16) for _ in range(2)]
    gate_up = torch.empty(num_experts, 2 * inter, hidden_size, **bf16)
    return [gate_up[:, :inter], gate_up[:, inter:]]


def _weight_gradient_into(a_rows, b_rows, tokens, main_grad, out=None):
    """bf16 [E, M, N] gradient (into `out` if given), or empty after adding it into the fp32
    main_grad in place."""
    if main_grad is None:
        return weight_gradient(a_rows, b_rows, tokens, output="bf16", out=out)
    out = main_grad if main_grad.dim() == 3 else main_grad.unsqueeze(0)
    weight_gradient(a_rows, b_rows, tokens, output="accumulate", out=out)
    return a_rows.new_empty(0)


def weight_gradients(dy_e, x_rows, d_gate, d_up, hidden, tokens, main_grads, fused=False):
    """[dW_gate, dW_up, dW_down], each bf16 or added into its main_grad and returned empty;
    `fused` (no gate/up main_grads): dW_gate, dW_up the halves of one [E, 2 I, H]."""
    main_gate, main_up, main_down = main_grads
    gate_up = (None, None)
    if fused:
        gate_up = gate_up_gradients(tokens.shape[0], d_gate.shape[1], x_rows.shape[1], True,
                                    x_rows.device)  # fmt: skip
    return [
        _weight_gradient_into(d_gate, x_rows, tokens, main_gate, gate_up[0]),
        _weight_gradient_into(d_up, x_rows, tokens, main_up, gate_up[1]),
        _weight_gradient_into(dy_e, hidden, tokens, main_down),
    ]
