"""Where a megakernel's time goes, phase by phase, per CTA (dsl_kernels/common/phase_clock.py).

python -m tools.diag_phase_clock [--shape qwen3-30b-a3b] [--pass fwd|bwd]

Runs the benchmark's inputs through the forward megakernel (fwd) or the backward megakernel
(bwd, weight gradients in the launch) with the phase clock on, after warm-up, and prints for
each phase boundary the spread over CTAs of its time since the kernel's earliest start (ms):
min / median / max. Next to it, the separate kernels' times from torch.profiler for the same
step, to compare phase by phase.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.mok_impls import MOK_IMPLS
from mok.launchers.moe_forward import CLOCK_SLOTS, set_phase_clock
from tools.benchmark_row import benchmark_row, timed

SLOT_NAMES = {
    0: "start",
    1: "dispatched",
    2: "phase 1 done (consumers)",
    3: "phase 2 done (consumers)",
    4: "phase 3 done (consumers)",
    5: "crew done",
    6: "producer done",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--pass", dest="pass_name", default="bwd", choices=("fwd", "bwd"))
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    # The benchmark's rows switch the launch paths themselves: "mok" runs the backward as
    # separate kernels, "mok_bwd_megakernel" as the megakernel.
    shape, inputs, megakernel = benchmark_row(args.shape, "mok_bwd_megakernel")
    impls = {"kernels": MOK_IMPLS["mok"](inputs, None), "megakernel": megakernel}

    def step(path):
        impl = impls[path]
        _, state = impl.forward()
        if args.pass_name == "bwd":
            impl.backward(state, inputs.grad_output)

    for _ in range(3):
        step("megakernel")
        step("kernels")
    device = inputs.x.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    clock = torch.zeros(sms, CLOCK_SLOTS, dtype=torch.int64, device=device)
    torch.cuda.synchronize()
    set_phase_clock(clock)
    try:
        step("megakernel")
        torch.cuda.synchronize()
    finally:
        set_phase_clock(None)
    # The forward always stamps too; for bwd its stamps are overwritten by the backward's.
    stamps = clock.cpu()
    start = stamps[:, 0].min().item()
    kernel = "backward" if args.pass_name == "bwd" else "forward"
    print(f"== {shape.name}: {kernel} megakernel phase clock, ms since the first CTA started")
    for slot, name in SLOT_NAMES.items():
        column = stamps[:, slot]
        column = column[column > 0]
        if column.numel() == 0:
            continue
        ms = (column - start).double() / 1e6
        print(f"  {name:<28} min {ms.min():8.3f}  median {ms.median():8.3f}  max {ms.max():8.3f}"
              f"  ({column.numel()} CTAs)")  # fmt: skip

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step("kernels")
        torch.cuda.synchronize()
    print("== the separate kernels of the same step (torch.profiler)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10,
                                    max_name_column_width=50))  # fmt: skip
    if args.pass_name == "bwd":
        interleaved_backward_times(impls, inputs, args.reps)


def interleaved_backward_times(impls, inputs, reps: int) -> None:
    """Backward alone on both paths, alternating step by step (same clock and power state),
    CUDA events around each backward."""
    times = {path: [] for path in impls}
    for _ in range(reps):
        for path, impl in impls.items():
            _, state = impl.forward()
            ms, _ = timed(lambda impl=impl, state=state: impl.backward(state, inputs.grad_output))
            times[path].append(ms)
    print(f"== backward alone, {reps} alternating steps per path (ms): median / min")
    for path, values in times.items():
        values = sorted(values)
        print(f"  {path:<11} {values[len(values) // 2]:8.3f} {values[0]:8.3f}")


if __name__ == "__main__":
    main()
