"""The backward megakernel's launcher (dsl_kernels/sm90/moe_backward.py): dispatch, d_hidden,
d_x to slots and (unless fp32 main_grads take them) the weight gradients in one launch. Its
counters are zeroed right before it on the same stream (graph-capturable, no host sync).
"""

from __future__ import annotations

import torch

from .checks import check_arg, check_cuda, check_extents, check_multiple
from .comm import DEFAULT_TIMEOUT_NS
from .device_args import TILE_ROWS, sm_count, tma_descriptor
from .expert_gemm_bwd import N_ALIGNMENT
from .megakernel_walk import minibatch_row_tiles, walk_arguments
from .status import status_ptr

KERNEL = "moe_backward"


def routed_backward(
    grad_output: torch.Tensor,
    router_weights: torch.Tensor,
    schedule,
    x_routed: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    hidden: torch.Tensor,
    gate_weights: torch.Tensor,
    up_weights: torch.Tensor,
    down_weights: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    weight_grads: bool = True,
    num_comm_ctas: int = 0,
    minibatch_size: int | None = None,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
    peers: tuple | None = None,
    slots: torch.Tensor | None = None,
    grid: int | None = None,
) -> tuple:
    """(dy_e, d_gate, d_up, router_partials, slots, [dW_gate, dW_up, dW_down] or None) in one launch.

    grad_output bf16 [T, H]; router_weights fp32 [T, k]; x_routed bf16 [C, H], gate, up, hidden
    bf16 [C, I] (forward context); weights bf16 [E, I, H] (gate, up), [E, H, I] (down); `schedule`
    this rank's MoKSchedule. `peers` = (ep_rank, dY table, router-weight table, slots table), the
    int64 [P] tables of every rank's buffers (None: a group of one): rows of other ranks' tokens
    pull dY and w from their buffers and push d_x into their slots. Outputs: dy_e bf16 [C, H]; d_gate, d_up bf16 [C, I];
    router_partials fp32 [C, I / 128]; slots bf16 [T * k, H] (row t * k + j: token t's d_x through
    expert j). `weight_grads`: bf16 weight gradients, bitwise expert_gemm_bwd.weight_gradient's.
    `num_comm_ctas`: CTAs that dispatch while the rest compute (0: all dispatch first).
    `minibatch_size` (routed rows; None: all) never changes the bits. `slots`: the d_x slots
    buffer to push into (None: a new one); `grid`: CTAs (None: the SM count).
    """
    from mok.runtime import get_kernel  # noqa: PLC0415

    num_tokens, hidden_size = grad_output.shape
    topk = router_weights.shape[1]
    num_experts, intermediate_size = gate_weights.shape[0], gate_weights.shape[1]
    capacity = schedule.peer_rank.shape[0]
    check_cuda("grad_output", grad_output, torch.bfloat16, (num_tokens, hidden_size))
    # Read as 4-byte scalars: a router-weight view needs no 16-byte alignment.
    check_arg("router_weights", router_weights, torch.float32, (num_tokens, topk), cuda=True,
              align=4)  # fmt: skip
    check_multiple("hidden_size", hidden_size, N_ALIGNMENT)
    check_multiple("intermediate_size", intermediate_size, N_ALIGNMENT)
    for name, t, shape in (
        ("x_routed", x_routed, (capacity, hidden_size)),
        ("gate", gate, (capacity, intermediate_size)),
        ("up", up, (capacity, intermediate_size)),
        ("hidden", hidden, (capacity, intermediate_size)),
        ("gate_weights", gate_weights, (num_experts, intermediate_size, hidden_size)),
        ("up_weights", up_weights, (num_experts, intermediate_size, hidden_size)),
        ("down_weights", down_weights, (num_experts, hidden_size, intermediate_size)),
    ):
        check_cuda(name, t, torch.bfloat16, shape)
    check_extents("weight rows", capacity, num_experts * max(hidden_size, intermediate_size),
                   max(hidden_size, intermediate_size), max(hidden_size, intermediate_size))  # fmt: skip
    minibatch_tiles = minibatch_row_tiles(minibatch_size, capacity)  # before any allocation
    device = grad_output.device
    dy_e = torch.empty(capacity, hidden_size, dtype=torch.bfloat16, device=device)
    d_gate, d_up = (
        torch.empty(capacity, intermediate_size, dtype=torch.bfloat16, device=device)
        for _ in range(2)
    )
    partials = torch.empty(capacity, intermediate_size // 128, dtype=torch.float32, device=device)
    if slots is None:
        slots = torch.empty(num_tokens * topk, hidden_size, dtype=torch.bfloat16, device=device)
    check_cuda("slots", slots, torch.bfloat16, (num_tokens * topk, hidden_size))
    ep_rank, dy_table, weight_table, slots_table = (
        peers if peers is not None else (0,) + (None,) * 3
    )
    d_weights = None
    if weight_grads:
        d_weights = [
            torch.empty(num_experts, *shape, dtype=torch.bfloat16, device=device)
            for shape in ((intermediate_size, hidden_size),) * 2 + ((hidden_size, intermediate_size),)
        ]  # fmt: skip
    if capacity == 0 or num_experts == 0 or num_tokens == 0:
        if d_weights is not None:
            for d_w in d_weights:
                d_w.zero_()
        return dy_e, d_gate, d_up, partials, slots, d_weights
    # dispatched[m], dgu_done[m] per 128-row tile, dispatch_total, dgu_total, then the ticket.
    counters = torch.zeros(2 * (-(-capacity // TILE_ROWS)) + 4, dtype=torch.int32,
                           device=device)  # fmt: skip
    # Without weight gradients the weight phase has no tasks; its outputs point anywhere.
    d_w_gate, d_w_up, d_w_down = d_weights if d_weights is not None else (dy_e,) * 3
    kernel = get_kernel(KERNEL, device=device)
    down_flat = (num_experts * hidden_size, intermediate_size)
    gate_up_flat = (num_experts * intermediate_size, hidden_size)
    grid = grid or sm_count(device)
    kernel.launch(
        (grid, 1, 1),
        {
            "tma_dy": tma_descriptor(kernel, "tma_dy", dy_e),
            "tma_wd": tma_descriptor(kernel, "tma_wd", down_weights.view(down_flat)),
            "tma_dg": tma_descriptor(kernel, "tma_dg", d_gate),
            "tma_du": tma_descriptor(kernel, "tma_du", d_up),
            "tma_wg": tma_descriptor(kernel, "tma_wg", gate_weights.view(gate_up_flat)),
            "tma_wu": tma_descriptor(kernel, "tma_wu", up_weights.view(gate_up_flat)),
            "tma_xdy": tma_descriptor(kernel, "tma_xdy", dy_e),
            "tma_xdg": tma_descriptor(kernel, "tma_xdg", d_gate),
            "tma_xdu": tma_descriptor(kernel, "tma_xdu", d_up),
            "tma_xh": tma_descriptor(kernel, "tma_xh", hidden),
            "tma_xx": tma_descriptor(kernel, "tma_xx", x_routed),
            "d_w_down_ptr": d_w_down,
            "d_w_gate_ptr": d_w_gate,
            "d_w_up_ptr": d_w_up,
            "dy_ptr": grad_output,
            "weight_ptr": router_weights,
            "dy_routed_ptr": dy_e,
            "gate_ptr": gate,
            "up_ptr": up,
            "d_gate_ptr": d_gate,
            "d_up_ptr": d_up,
            "partials_ptr": partials,
            "slots_ptr": slots,
            "dy_ptrs": dy_table,
            "weight_ptrs": weight_table,
            "slots_ptrs": slots_table,
            **walk_arguments(
                schedule,
                counters,
                timeout_ns,
                grad_output,
                gate_weights,
                topk,
                swiglu_limit,
                num_comm_ctas,
                grid,
                minibatch_tiles,
                ep_rank,
            ),  # fmt: skip
            "weight_gemms": 3 if weight_grads else 0,
        },
    )
    return dy_e, d_gate, d_up, partials, slots, d_weights


def push_router_grads(
    partials: torch.Tensor,
    schedule,
    router_weights: torch.Tensor,
    d_router: torch.Tensor,
    *,
    peers: tuple | None = None,
) -> torch.Tensor:
    """d_router fp32 [T, k] of this rank's tokens' slots that this rank's experts hold: each
    routed row's sum_b partials[r, b] / w, pushed to its token's rank (kernel router_grad_push;
    a weight <= 0 or non-finite sets the value-status words, launchers/status.py).
    `router_weights` fp32 [T, k] and `d_router` are this rank's; `peers` = (ep_rank, router-weight
    table, d_router table) or None (a group of one)."""
    from mok.runtime import get_kernel  # noqa: PLC0415

    capacity, blocks = partials.shape
    check_arg("router_weights", router_weights, torch.float32, tuple(router_weights.shape),
              cuda=True, align=4)  # fmt: skip
    check_arg("d_router", d_router, torch.float32, tuple(router_weights.shape), cuda=True, align=4)
    ep_rank, weight_table, d_router_table = peers if peers is not None else (0, None, None)
    if capacity == 0:
        return d_router
    kernel = get_kernel("router_grad_push", device=partials.device)
    threads = int(kernel.variant.config["threads"])
    kernel.launch(
        (-(-capacity // threads), 1, 1),
        {
            "partials_ptr": partials,
            "peer_rank_ptr": schedule.peer_rank,
            "peer_token_idx_ptr": schedule.peer_token_idx,
            "num_tokens_ptr": schedule.num_tokens,
            "weight_ptr": router_weights,
            "d_router_ptr": d_router,
            "weight_ptrs": weight_table,
            "d_router_ptrs": d_router_table,
            "ep_rank": ep_rank,
            "num_rows": capacity,
            "blocks": blocks,
            "status_ptr": status_ptr(partials.device),
        },
    )
    return d_router
