"""The forward megakernel's launcher (dsl_kernels/sm90/moe_forward.py): dispatch, gate/up +
SwiGLU and down to slots in one launch, before `epilogues.fwd_epilogue`. Its counters are zeroed
right before it on the same stream (graph-capturable, no host sync).
"""

from __future__ import annotations

import torch

from .checks import check_cuda, check_extents, check_multiple
from .comm import DEFAULT_TIMEOUT_NS
from .device_args import TILE_ROWS, sm_count, tma_descriptor
from .expert_gemm import DOWN_N_ALIGNMENT, GATE_UP_N_ALIGNMENT, K_ALIGNMENT
from .megakernel_walk import minibatch_row_tiles, walk_arguments

KERNEL = "moe_forward"


def routed_forward(
    x: torch.Tensor,
    schedule,
    topk: int,
    gate_weights: torch.Tensor,
    up_weights: torch.Tensor,
    down_weights: torch.Tensor,
    *,
    swiglu_limit: float | None = None,
    num_comm_ctas: int = 0,
    minibatch_size: int | None = None,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
    peers: tuple | None = None,
    slots: torch.Tensor | None = None,
    grid: int | None = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((x_routed, gate, up, hidden), slots) of this rank's routed experts, in one launch.

    x bf16 [T, H]; weights bf16 [E, I, H] (gate, up), [E, H, I] (down) of the local experts;
    `schedule` this rank's MoKSchedule. slots bf16 [T * k, H] (`slots`, or a new tensor): row
    t * k + j is token t's j-th expert output. `peers` = (ep_rank, x table, slots table), the
    int64 [P] tables of every rank's x and slots buffers (None: a group of one): rows of other
    ranks' tokens are pulled from their x buffers and pushed into their slots buffers.
    `num_comm_ctas`: CTAs that dispatch while the rest compute (0: all dispatch first).
    `minibatch_size` (routed rows; None: all) never changes the bits. `grid`: CTAs (None: the
    SM count).
    """
    from mok.runtime import get_kernel  # noqa: PLC0415

    num_tokens, hidden_size = x.shape
    num_experts, intermediate_size = gate_weights.shape[0], gate_weights.shape[1]
    capacity = schedule.peer_rank.shape[0]
    check_cuda("x", x, torch.bfloat16, (num_tokens, hidden_size))
    check_multiple("hidden_size", hidden_size, DOWN_N_ALIGNMENT)
    check_multiple("intermediate_size", intermediate_size, GATE_UP_N_ALIGNMENT)
    check_multiple("intermediate_size", intermediate_size, K_ALIGNMENT)
    for name, w, shape in (
        ("gate_weights", gate_weights, (num_experts, intermediate_size, hidden_size)),
        ("up_weights", up_weights, (num_experts, intermediate_size, hidden_size)),
        ("down_weights", down_weights, (num_experts, hidden_size, intermediate_size)),
    ):
        check_cuda(name, w, torch.bfloat16, shape)
    widest = max(hidden_size, intermediate_size)
    check_extents("weight rows", capacity, num_experts * widest, widest, widest)
    minibatch_tiles = minibatch_row_tiles(minibatch_size, capacity)  # before any allocation
    device = x.device
    x_routed = torch.empty(capacity, hidden_size, dtype=torch.bfloat16, device=device)
    gate, up, hidden = (
        torch.empty(capacity, intermediate_size, dtype=torch.bfloat16, device=device)
        for _ in range(3)
    )
    if slots is None:
        slots = torch.empty(num_tokens * topk, hidden_size, dtype=torch.bfloat16, device=device)
    check_cuda("slots", slots, torch.bfloat16, (num_tokens * topk, hidden_size))
    ep_rank, x_table, slots_table = peers if peers is not None else (0, None, None)
    if capacity == 0 or num_experts == 0 or num_tokens == 0:
        return (x_routed, gate, up, hidden), slots
    # dispatched[m], hidden_done[m] per 128-row tile, then the task ticket.
    counters = torch.zeros(2 * (-(-capacity // TILE_ROWS)) + 2, dtype=torch.int32, device=device)
    kernel = get_kernel(KERNEL, device=device)
    gate_up_flat = (num_experts * intermediate_size, hidden_size)
    grid = grid or sm_count(device)
    kernel.launch(
        (grid, 1, 1),
        {
            "tma_x": tma_descriptor(kernel, "tma_x", x_routed),
            "tma_wg": tma_descriptor(kernel, "tma_wg", gate_weights.view(gate_up_flat)),
            "tma_wu": tma_descriptor(kernel, "tma_wu", up_weights.view(gate_up_flat)),
            "tma_h": tma_descriptor(kernel, "tma_h", hidden),
            "tma_wd": tma_descriptor(
                kernel, "tma_wd", down_weights.view(num_experts * hidden_size, intermediate_size)
            ),
            "x_ptr": x,
            "x_routed_ptr": x_routed,
            "gate_ptr": gate,
            "up_ptr": up,
            "hidden_ptr": hidden,
            "slots_ptr": slots,
            "x_ptrs": x_table,
            "slots_ptrs": slots_table,
            **walk_arguments(
                schedule,
                counters,
                timeout_ns,
                x,
                gate_weights,
                topk,
                swiglu_limit,
                num_comm_ctas,
                grid,
                minibatch_tiles,
                ep_rank,
            ),  # fmt: skip
        },
    )
    return (x_routed, gate, up, hidden), slots
