"""Per-kernel GPU time of one mok forward + backward at a benchmark shape (torch.profiler).

python tools/profile_step.py [--shape qwen3-30b-a3b] [--tokens 16384]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mok import functional as F
from mok.testing import make_inputs

SHAPES = {  # H, I, E, k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 32, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")


def setup_layer(shape: str, tokens: int):
    """(inputs, config, workspace, weights, num_experts) of one layer at a benchmark shape."""
    h, i, e, k = SHAPES[shape]
    inputs = make_inputs(tokens, h, i, e, k, seed=0, device="cuda")
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=torch.device("cuda"), num_local_tokens=tokens,
                         hidden_size=h, topk=k, num_local_experts=e)  # fmt: skip
    return inputs, config, ws, [inputs[n] for n in WEIGHTS], e


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    t = args.tokens
    inputs, config, ws, weights, e = setup_layer(args.shape, t)

    def step():
        schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
        out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)
        F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                   inputs["router_weights"], *weights)  # fmt: skip

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"== {args.shape} T={t}: one schedule + forward + backward")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    )


if __name__ == "__main__":
    main()
