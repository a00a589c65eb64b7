"""Which `MoKConfig.minibatch_size` the forward megakernel should default to on this GPU.

python -m tools.diag_minibatch [--shapes qwen3-30b-a3b,deepseek-v3,mixtral-8x7b]
                               [--sizes 1024,4096,16384,0] [--reps 10]

Per shape, the harness's inputs (benchmark_row) and, for each size (0: all routed rows in one
minibatch), the schedule + forward and the backward megakernel's backward (from that forward's
context) timed with CUDA events, the sizes interleaved step by step so that all see the same
clock and power state; median of `reps`. Also checks that every size gives the forward output
and d_x of the first, bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from mok import functional as F
from mok.launchers import set_backward_path
from tools.benchmark_row import benchmark_row, timed


def forward_step(inputs, shape, workspace, config):
    schedule = F.build_schedule(workspace, config, inputs.top_experts,
                                num_local_experts=shape.experts_per_rank)  # fmt: skip
    out, context = F.forward(config, workspace, schedule, inputs.x, inputs.router_weights, None,
                             None, None, inputs.gate, inputs.up, inputs.down,
                             swiglu_limit=shape.swiglu_limit)  # fmt: skip
    return out, (schedule, context)


def backward_step(inputs, shape, workspace, config, state):
    """d_x of the backward megakernel from forward_step's state."""
    schedule, context = state
    previous = set_backward_path("megakernel")
    try:
        grads = F.backward(config, workspace, schedule, context, inputs.grad_output, inputs.x,
                           inputs.router_weights, None, None, None, inputs.gate, inputs.up,
                           inputs.down, swiglu_limit=shape.swiglu_limit)  # fmt: skip
    finally:
        set_backward_path(previous)
    return grads[0]


def sweep(name: str, sizes_arg: str, reps: int) -> None:
    """Time and check every minibatch size of `sizes_arg` at shape `name`; print the table."""
    shape, inputs, _ = benchmark_row(name)
    rows = inputs.num_tokens * shape.topk
    whole = -(-rows // 4096) * 4096 * 2  # past the routed rows with padding: one minibatch
    sizes = [int(s) or whole for s in sizes_arg.split(",")]
    configs = {
        size: dataclasses.replace(F.MoKConfig(), minibatch_size=size,
                                  macrobatch_size=size * -(-max(rows, size) // size))
        for size in sizes
    }  # fmt: skip
    workspace = F.get_workspace(configs[sizes[0]], None, device=inputs.x.device,
                                num_local_tokens=inputs.num_tokens, hidden_size=shape.hidden_size,
                                topk=shape.topk,
                                num_local_experts=shape.experts_per_rank)  # fmt: skip

    def both(size):
        out, state = forward_step(inputs, shape, workspace, configs[size])
        return out, backward_step(inputs, shape, workspace, configs[size], state)

    first = both(sizes[0])
    for size in sizes[1:]:
        for got, want in zip(both(size), first, strict=True):
            assert torch.equal(got, want), f"{name}: minibatch {size} changed the bits"
    times = {size: ([], []) for size in sizes}
    for _ in range(reps):
        for size in sizes:
            fwd_ms, (_, state) = timed(
                lambda s=size: forward_step(inputs, shape, workspace, configs[s])
            )
            bwd_ms, _ = timed(
                lambda s=size, st=state: backward_step(inputs, shape, workspace, configs[s], st)
            )
            times[size][0].append(fwd_ms)
            times[size][1].append(bwd_ms)
    print(
        f"== {name}: {rows} routed rows; forward (schedule + megakernel + combine) and "
        f"backward megakernel ms, median of {reps} interleaved; same bits at every size"
    )
    for size, (fwd, bwd) in times.items():
        label = "all" if size == whole else str(size)
        fwd, bwd = sorted(fwd)[len(fwd) // 2], sorted(bwd)[len(bwd) // 2]
        print(f"  minibatch {label:>6}  fwd {fwd:8.3f}  bwd {bwd:8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
    parser.add_argument("--sizes", default="1024,4096,16384,0")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    for name in args.shapes.split(","):
        sweep(name, args.sizes, args.reps)
        F.clear_workspace_cache()


if __name__ == "__main__":
    main()
