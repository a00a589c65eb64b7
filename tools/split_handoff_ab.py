"""The gate/up + SwiGLU kernel with the crew's split hand-off and 4 stages against the default
(3 stages, two hand-off blocks), on a layer's routed rows: docs/NOTES.md §18 question 8.

    python -m tools.split_handoff_ab [--shape qwen3-30b-a3b] [--tokens 2048,4096,16384] [--reps 20]

For each token count: the layer's forward makes x_routed and the schedule's padded segments
(tools/phase_times.layer); then the two kernels run in turn, `--reps` times each after a warm-up,
each launch timed by CUDA events, and their gate, up and hidden are compared bit for bit. Prints
the median and best ms of each, the split's median over the default's, and the GEMM's TFLOP/s
on the padded rows.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.shapes import SHAPES
from benchmarks.timing import TimingConfig, time_ms
from mok import functional as F
from mok.launchers import expert_gemm
from tools.phase_times import CUDA, WEIGHTS, layer

KERNELS = (expert_gemm.GATE_UP_KERNEL, expert_gemm.GATE_UP_SPLIT_KERNEL)


# One launch between CUDA events, the kernels in turn (benchmarks.timing).
ONE_LAUNCH = TimingConfig(warmup=0, reps=1)


def compare(shape_name: str, tokens: int, reps: int) -> str:
    """One token count's row: both kernels timed in turn, their outputs compared."""
    shape, inputs, config, ws, schedule = layer(shape_name, tokens)
    weights = [inputs[n] for n in WEIGHTS]
    _, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)
    x_routed, tpe = ctx.x_routed, schedule.tokens_per_expert
    gate_w, up_w = inputs["routed_gate"], inputs["routed_up"]
    rows, inter = x_routed.shape[0], shape.intermediate_size
    outs = {
        kernel: [torch.empty(rows, inter, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
        for kernel in KERNELS
    }

    def run(kernel):
        gate, up, hidden = outs[kernel]
        expert_gemm.gate_up_swiglu(x_routed, gate_w, up_w, tpe, gate=gate, up=up, hidden=hidden,
                                   kernel=kernel)  # fmt: skip

    times = {kernel: [] for kernel in KERNELS}
    for rep in range(reps + 3):
        for kernel in KERNELS:
            (ms,) = time_ms(CUDA, ONE_LAUNCH, lambda _, k=kernel: run(k))
            if rep >= 3:
                times[kernel].append(ms)
    routed = int(tpe.sum())
    same = all(
        torch.equal(a[:routed].view(torch.int16), b[:routed].view(torch.int16))
        for a, b in zip(outs[KERNELS[0]], outs[KERNELS[1]], strict=True)
    )
    flops = 2 * routed * shape.hidden_size * 2 * inter
    median = {kernel: statistics.median(times[kernel]) for kernel in KERNELS}
    cells = "".join(
        f"{median[k]:9.3f} {min(times[k]):9.3f} {flops / median[k] / 1e9:8.0f}" for k in KERNELS
    )
    ratio = median[KERNELS[1]] / median[KERNELS[0]]
    return f"{shape_name:16} {tokens:6d} {routed:7d} {cells} {ratio:7.3f}  {'bitwise' if same else 'DIFFER'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=[s.name for s in SHAPES])
    parser.add_argument("--tokens", default="2048,4096,16384")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    print(
        f"{torch.cuda.get_device_name()}; ms a launch (median, best) and TFLOP/s on the padded rows"
    )
    print(f"{'shape':16} {'tokens':>6} {'rows':>7} "
          f"{'default':>9} {'best':>9} {'TFLOP/s':>8}{'split':>9} {'best':>9} {'TFLOP/s':>8} "
          f"{'split/default':>7}  outputs")  # fmt: skip
    for tokens in (int(t) for t in args.tokens.split(",")):
        print(compare(args.shape, tokens, args.reps), flush=True)


if __name__ == "__main__":
    main()
