"""One small forward + backward through every GPU path, for compute-sanitizer:

compute-sanitizer --tool memcheck python -m tools.sanitize_step

Runs the forward megakernel and the separate-kernel forward, then the backward through the
separate kernels and through the backward megakernel (with the weight gradients in the launch,
and with fp32 main_grads, which skips them), each on a shape with an expert left empty and a
token count that is not a multiple of 128. Prints one line per path; any memcheck error is
compute-sanitizer's to report.
"""

from __future__ import annotations

import torch

from mok.launchers import set_backward_path, set_forward_path
from mok.testing import make_inputs, run_layer


def step(inputs, num_experts, main_grads=None):
    out, _, grads, _ = run_layer(inputs, num_experts, main_grads=main_grads)
    return out, grads


def main() -> None:
    t, h, i, e, k = 300, 256, 256, 8, 2
    inputs = make_inputs(t, h, i, e, k, shared=True, routing="empty_experts", seed=7,
                         device=torch.device("cuda"))  # fmt: skip
    for forward_path in ("megakernel", "kernels"):
        for backward_path in ("kernels", "megakernel"):
            set_forward_path(forward_path)
            set_backward_path(backward_path)
            step(inputs, e)
            main_grads = tuple(
                torch.zeros(inputs[n].shape, dtype=torch.float32, device="cuda")
                for n in ("routed_gate", "routed_up", "routed_down", "shared_gate", "shared_up",
                          "shared_down")
            )  # fmt: skip
            step(inputs, e, main_grads=main_grads)
            print(f"forward {forward_path}, backward {backward_path}: ran (bf16 and main_grads)")


if __name__ == "__main__":
    main()
