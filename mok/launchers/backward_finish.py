"""A group of one's router-gradient push and backward epilogue in one launch (kernel
`backward_finish`, mok/dsl_kernels/kernels/backward_finish.py): the push's CTAs after the
epilogue's. They read disjoint inputs and write disjoint outputs, and with no peers there is no
barrier between them, so one launch gives both kernels' bits. Used by the backward op of a group
of one when the epilogue fits one launch (num_tokens <= 262140); otherwise the two kernels run.
"""

from __future__ import annotations

import torch

from .backward_megakernel import check_router_grad_push
from .epilogues import check_epilogue, epilogue_launches
from .plans import current_stream
from .status import status_ptr


def finish_plan(d_x_shared, slots, topk, partials, schedule, router_weights, d_router):
    """The plan for these shapes (checked now), or None when the epilogue needs more than one
    launch: plan(d_x_shared, slots, partials_at, schedule_at, router_weights, d_router) -> d_x
    (partials and the schedule by address: `plans.schedule_addresses`)."""
    from mok.runtime import get_kernel  # noqa: PLC0415

    num_tokens, hidden, topk = check_epilogue(False, d_x_shared, slots, topk)
    num_rows, blocks = check_router_grad_push(partials, schedule, router_weights, d_router)
    kernel = get_kernel("backward_finish", device=slots.device)
    launches = list(epilogue_launches(kernel, num_tokens, hidden))
    if len(launches) != 1:
        return None
    (grid_x, grid_y, _), _, _ = launches[0]
    threads = int(kernel.variant.config["threads"])
    grid = grid_x * grid_y + -(-num_rows // threads)
    return _FinishPlan(kernel, grid, (num_tokens, hidden), slots.device, {
        "d_x_ptr": slots, "d_x_shared_ptr": d_x_shared, "slots_ptr": slots,
        "num_tokens": num_tokens, "hidden_size": hidden, "topk": topk,
        "has_shared": int(d_x_shared is not None), "partials_ptr": partials,
        "peer_rank_ptr": schedule.peer_rank, "peer_token_idx_ptr": schedule.peer_token_idx,
        "num_rows_ptr": schedule.num_tokens, "weight_ptr": router_weights,
        "d_router_ptr": d_router, "num_rows": num_rows, "blocks": blocks,
        "status_ptr": status_ptr(slots.device),
    })  # fmt: skip


class _FinishPlan:
    def __init__(self, kernel, grid: int, shape: tuple, device: torch.device, args: dict):
        self.shape, self.device, self.device_index = shape, device, kernel.device_index
        self.bound = kernel.bind((grid, 1, 1), args, dynamic=(
            "d_x_ptr", "d_x_shared_ptr", "slots_ptr", "partials_ptr", "peer_rank_ptr",
            "peer_token_idx_ptr", "num_rows_ptr", "weight_ptr", "d_router_ptr",
        ))  # fmt: skip

    def __call__(self, d_x_shared, slots, partials_at, schedule_at, router_weights, d_router):
        d_x = torch.empty(self.shape, dtype=torch.bfloat16, device=self.device)
        self.bound.launch(
            d_x.data_ptr(), 0 if d_x_shared is None else d_x_shared.data_ptr(), slots.data_ptr(),
            partials_at, *schedule_at[:3], router_weights.data_ptr(), d_router.data_ptr(),
            stream=current_stream(self.device_index),
        )  # fmt: skip
        return d_x
