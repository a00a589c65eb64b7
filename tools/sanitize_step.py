"""One small forward + backward on the GPU, for compute-sanitizer:

compute-sanitizer --tool memcheck python -m tools.sanitize_step

Runs the schedule, the forward megakernel and the backward megakernel twice: once returning
bf16 weight gradients, once accumulating them into fp32 main_grads. The shape leaves half the
experts empty and has a token count that is not a multiple of 128, so that empty experts and
partial tiles are covered. Prints one line per run; any memcheck error is compute-sanitizer's
to report.
"""

from __future__ import annotations

import torch

from mok.testing import make_inputs, run_layer

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


if __name__ == "__main__":
    main()
