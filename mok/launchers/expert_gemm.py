"""Grouped expert GEMMs over the expert-major routed buffer (SM90, TMA + wgmma).

Kernels `expert_gemm_gate_up_swiglu`, `expert_gemm_down` (mok/dsl_kernels/sm90/expert_gemm.py), tiles
located on the device from `tokens_per_expert` (no host sync):

    gate_up_swiglu: gate, up = bf16(x @ W_gate[e].T), bf16(x @ W_up[e].T);
                    hidden = bf16(SiLU(g) * u) in fp32 from the bf16 g, u (clamped if a limit)
    down:           y = bf16(hidden @ W_down[e].T)

Segments as `mok.reference.expert_segments`; rows past sum(tokens_per_expert) are not written.
"""

from __future__ import annotations

import torch

from ..validation import tensor_key
from .checks import (
    MAX_COLS,
    MAX_ROWS,
    check_counts,
    check_cuda,
    check_gate_up_weights,
    check_multiple,
    expert_rows_view,
)
from .device_args import new_ticket, persistent_grid, tma_descriptor
from .plans import Descriptors, current_stream, plan, weight_key, zero_async

GATE_UP_KERNEL = "expert_gemm_gate_up_swiglu"
DOWN_KERNEL = "expert_gemm_down"
K_ALIGNMENT = 64  # K block of the mainloop
GATE_UP_N_ALIGNMENT = 128  # intermediate_size: one 128-column block of gate and of up per tile
DOWN_N_ALIGNMENT = 256  # hidden_size: two 128-column blocks per tile


def gate_up_swiglu(
    x_routed: torch.Tensor,
    gate_weights: torch.Tensor,
    up_weights: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    gate: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    manifest=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, up, hidden), each bf16 [C, I], for x_routed bf16 [C, H] and weights [E, I, H]
    (contiguous, or both halves of one fused [E, 2 I, H]: checks.expert_rows).

    `tokens_per_expert` int32 [E]: padded segment sizes, multiples of 128, sum <= C (not checked: a
    host sync). Constraints: H % 64 == 0, I % 128 == 0. Current stream, no host sync.
    """
    capacity, hidden_size = x_routed.shape if x_routed.dim() == 2 else (-1, -1)
    num_experts, intermediate_size = gate_weights.shape[0], gate_weights.shape[1]
    check_cuda("x_routed", x_routed, torch.bfloat16, (capacity, hidden_size))
    check_multiple("hidden_size (x_routed.shape[1])", hidden_size, K_ALIGNMENT)
    check_multiple(
        "intermediate_size (gate_weights.shape[1])", intermediate_size, GATE_UP_N_ALIGNMENT
    )
    weight_shape = (num_experts, intermediate_size, hidden_size)
    expert_rows = check_gate_up_weights(gate_weights, up_weights, weight_shape)
    check_counts("tokens_per_expert", tokens_per_expert, num_experts)
    if capacity >= MAX_ROWS or num_experts * expert_rows >= MAX_ROWS:
        raise ValueError(
            f"routed rows ({capacity}) and num_experts * rows per expert "
            f"({num_experts * expert_rows}) must be below {MAX_ROWS}"
        )
    if hidden_size >= MAX_COLS:
        raise ValueError(f"hidden_size must be below {MAX_COLS}, got {hidden_size}")
    device = x_routed.device
    outputs = []
    for name, given in (("gate", gate), ("up", up), ("hidden", hidden)):
        if given is None:
            given = torch.empty(capacity, intermediate_size, dtype=torch.bfloat16, device=device)
        check_cuda(name, given, torch.bfloat16, (capacity, intermediate_size))
        outputs.append(given)
    gate, up, hidden = outputs
    if capacity == 0 or num_experts == 0:
        return gate, up, hidden

    args = (x_routed, gate_weights, up_weights, tokens_per_expert, swiglu_limit, expert_rows)
    if manifest is not None:  # another build's kernels (tests): no plan of theirs is kept
        _GateUpPlan(*args, manifest=manifest)(x_routed, tokens_per_expert, gate, up, hidden)
        return gate, up, hidden
    key = (
        GATE_UP_KERNEL,
        tensor_key(x_routed),
        weight_key(gate_weights),
        weight_key(up_weights),
        tensor_key(tokens_per_expert),
        swiglu_limit,
        current_stream(x_routed.get_device()),
    )
    plan(key, lambda: _GateUpPlan(*args))(x_routed, tokens_per_expert, gate, up, hidden)
    return gate, up, hidden


class _GateUpPlan:
    """`gate_up_swiglu` for one (shapes, weights, limit): bound on its first call (the caller
    has checked the tensors); a call zeroes the plan's tile ticket on the stream, writes the
    addresses and launches."""

    def __init__(
        self,
        x_routed,
        gate_weights,
        up_weights,
        tokens_per_expert,
        swiglu_limit,
        expert_rows,
        *,
        manifest=None,
    ):
        from mok.runtime import get_kernel  # noqa: PLC0415

        device = x_routed.device
        capacity, hidden_size = x_routed.shape
        num_experts, intermediate_size = gate_weights.shape[0], gate_weights.shape[1]
        kernel = get_kernel(GATE_UP_KERNEL, device=device, manifest=manifest)
        self.device_index = x_routed.get_device()
        self.ticket = new_ticket(device)
        self.tma_a = Descriptors(kernel, "tma_a")
        col_tiles = intermediate_size // GATE_UP_N_ALIGNMENT
        self.bound = kernel.bind(
            (persistent_grid(device, capacity, col_tiles), 1, 1),
            {
                "tma_a": self.tma_a.get(x_routed),
                "tma_b0": tma_descriptor(
                    kernel, "tma_b0", expert_rows_view("gate_weights", gate_weights)[0]
                ),
                "tma_b1": tma_descriptor(
                    kernel, "tma_b1", expert_rows_view("up_weights", up_weights)[0]
                ),
                "out_ptr": None,
                "gate_ptr": None,
                "up_ptr": None,
                "peer_rank_ptr": None,
                "peer_token_idx_ptr": None,
                "tokens_per_expert_ptr": None,
                "ticket_ptr": self.ticket,
                "num_experts": num_experts,
                "k_size": hidden_size,
                "n_size": intermediate_size,
                "b_expert_rows": expert_rows,
                "has_limit": int(swiglu_limit is not None),
                "swiglu_limit": 0.0 if swiglu_limit is None else float(swiglu_limit),
            },
            dynamic=("tma_a", "out_ptr", "gate_ptr", "up_ptr", "tokens_per_expert_ptr"),
        )

    def __call__(self, x_routed, tokens_per_expert, gate, up, hidden) -> None:
        stream = current_stream(self.device_index)
        zero_async(self.ticket, stream)  # the kernel hands out tiles from zero, never resets it
        self.bound.launch(
            self.tma_a.get(x_routed),
            hidden.data_ptr(),
            gate.data_ptr(),
            up.data_ptr(),
            tokens_per_expert.data_ptr(),
            stream=stream,
        )


def down(
    hidden: torch.Tensor,
    down_weights: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    manifest=None,
) -> torch.Tensor:
    """y bf16 [C, H] = hidden bf16 [C, I] x W_down[e]^T (bf16 [E, H, I]); I % 64 == 0, H % 256 == 0."""
    from mok.runtime import get_kernel  # noqa: PLC0415

    capacity, intermediate_size = hidden.shape if hidden.dim() == 2 else (-1, -1)
    num_experts, hidden_size = down_weights.shape[0], down_weights.shape[1]
    check_cuda("hidden", hidden, torch.bfloat16, (capacity, intermediate_size))
    check_multiple("intermediate_size (hidden.shape[1])", intermediate_size, K_ALIGNMENT)
    check_multiple("hidden_size (down_weights.shape[1])", hidden_size, DOWN_N_ALIGNMENT)
    check_cuda(
        "down_weights", down_weights, torch.bfloat16, (num_experts, hidden_size, intermediate_size)
    )
    check_counts("tokens_per_expert", tokens_per_expert, num_experts)
    if capacity >= MAX_ROWS or num_experts * hidden_size >= MAX_ROWS:
        raise ValueError(
            f"routed rows ({capacity}) and num_experts * hidden_size "
            f"({num_experts * hidden_size}) must be below {MAX_ROWS}"
        )
    if intermediate_size >= MAX_COLS:
        raise ValueError(f"intermediate_size must be below {MAX_COLS}, got {intermediate_size}")
    device = hidden.device
    if out is None:
        out = torch.empty(capacity, hidden_size, dtype=torch.bfloat16, device=device)
    check_cuda("out", out, torch.bfloat16, (capacity, hidden_size))
    if capacity == 0 or num_experts == 0:
        return out

    kernel = get_kernel(DOWN_KERNEL, device=device, manifest=manifest)
    col_tiles = hidden_size // DOWN_N_ALIGNMENT
    weights = tma_descriptor(
        kernel, "tma_b0", down_weights.view(num_experts * hidden_size, intermediate_size)
    )
    kernel.launch(
        (persistent_grid(device, capacity, col_tiles), 1, 1),
        {
            "tma_a": tma_descriptor(kernel, "tma_a", hidden),
            # Both B descriptors are W_down: the two 128-column halves of a 256-column tile.
            "tma_b0": weights,
            "tma_b1": weights,
            "out_ptr": out,
            "gate_ptr": None,
            "up_ptr": None,
            "peer_rank_ptr": None,
            "peer_token_idx_ptr": None,
            "tokens_per_expert_ptr": tokens_per_expert,
            "ticket_ptr": new_ticket(device),
            "num_experts": num_experts,
            "k_size": intermediate_size,
            "n_size": hidden_size,
            "b_expert_rows": hidden_size,
            "has_limit": 0,
            "swiglu_limit": 0.0,
        },
    )
    return out
