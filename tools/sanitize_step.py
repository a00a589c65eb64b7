"""One small forward + backward on the GPU, for compute-sanitizer:

compute-sanitizer --tool memcheck python -m tools.sanitize_step

Runs the schedule, the forward megakernel and the backward megakernel twice (once returning
bf16 weight gradients, once accumulating them into fp32 main_grads), then one step of a
virtual EP group of two. The shape leaves half the
experts empty and has a token count that is not a multiple of 128, so that empty experts and
partial tiles are covered. Prints one line per run; any memcheck error is compute-sanitizer's
to report.
"""

from __future__ import annotations

import torch

from mok import functional as F
from mok.testing import make_inputs, rank_inputs, run_layer, run_layer_step
from mok.virtual_ep import VirtualEPGroup

# mok.functional.backward's main_grads order.
MAIN_GRAD_NAMES = (
    "routed_gate", "routed_up", "routed_down", "shared_gate", "shared_up", "shared_down",
)  # fmt: skip


def main() -> None:
    t, h, i, e, k = 300, 256, 256, 8, 2
    inputs = make_inputs(t, h, i, e, k, shared=True, routing="empty_experts", seed=7,
                         device=torch.device("cuda"))  # fmt: skip
    run_layer(inputs, e)
    print("forward + backward, bf16 weight gradients: ran")
    main_grads = tuple(
        torch.zeros(inputs[n].shape, dtype=torch.float32, device="cuda") for n in MAIN_GRAD_NAMES
    )
    run_layer(inputs, e, main_grads=main_grads)
    print("forward + backward, fp32 main_grads: ran")
    # A virtual EP group of two: rows pulled from and pushed to the peer's buffers.
    ep_inputs = make_inputs(512, h, i, e, k, shared=True, seed=8, device=torch.device("cuda"))
    config = F.MoKConfig(schedule_capacity_multiplier=1.0)
    group = VirtualEPGroup(2)
    spaces = group.workspaces(config, num_local_tokens=256, hidden_size=h, topk=k,
                              num_local_experts=e // 2)  # fmt: skip
    group.run(lambda r: run_layer_step(config, spaces[r], rank_inputs(ep_inputs, r, 2), e // 2))
    group.join()
    for ws in spaces:
        F.check_errors(ws)
    print("forward + backward, virtual EP group of 2: ran")


if __name__ == "__main__":
    main()
