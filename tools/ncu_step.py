"""One call of each kernel that ncu should profile at a benchmark shape and token count.

    ncu --clock-control none -k "regex:moe_forward|gate_up_swiglu|moe_backward" \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python -m tools.ncu_step [--shape qwen3-30b-a3b] [--tokens 2048]

In order: the forward megakernel on the layer's schedule (tools/phase_times.layer), the separate
gate/up + SwiGLU kernel on that forward's routed rows (the schedule's padding), the same kernel
with every expert's rows spread evenly (`T * k / E` rounded up to 128, no padding beyond it),
and the backward megakernel. Each runs once; ncu replays what it profiles. Nothing is timed or
checked here: the kernels' results are tested in tests/gpu.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.shapes import SHAPES
from mok import functional as F
from mok.launchers import expert_gemm
from tools.phase_times import WEIGHTS, even_rows, layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=[s.name for s in SHAPES])
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    shape, inputs, config, ws, schedule = layer(args.shape, args.tokens)
    h, i, e, k = shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.topk
    weights = [inputs[n] for n in WEIGHTS]
    x, rw, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    _, ctx = F.forward(config, ws, schedule, x, rw, *weights)
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    gw, uw = inputs["routed_gate"], inputs["routed_up"]
    rows = ctx.x_routed.shape[0]
    outs = {n: torch.empty(rows, i, **bf16) for n in ("gate", "up", "hidden")}
    expert_gemm.gate_up_swiglu(ctx.x_routed, gw, uw, schedule.tokens_per_expert, **outs)
    even, tpe_even = even_rows(args.tokens, k, e)
    x_even = torch.randn(even * e, h, device="cuda").to(torch.bfloat16)
    outs = {n: torch.empty(even * e, i, **bf16) for n in ("gate", "up", "hidden")}
    expert_gemm.gate_up_swiglu(x_even, gw, uw, tpe_even, **outs)
    F.backward(config, ws, schedule, ctx, dy, x, rw, *weights)
    torch.cuda.synchronize()
    print(
        f"{args.shape}, {args.tokens} tokens: forward, gate/up (schedule's rows), gate/up ({even} rows "
        "an expert), backward"
    )


if __name__ == "__main__":
    main()
