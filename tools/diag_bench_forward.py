"""Where a benchmark forward's time goes: the benchmark's own inputs and mok row, timed as the
harness times it (events around each rep), next to the host time of one call and the GPU
kernels of three reps (torch.profiler).

python -m tools.diag_bench_forward [--shape mixtral-8x7b] [--pass fwd|bwd]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.mok_impls import MOK_IMPLS
from benchmarks.timing import TimingConfig, time_ms
from tools.benchmark_row import benchmark_row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--pass", dest="pass_name", default="fwd", choices=("fwd", "bwd"))
    parser.add_argument("--row", default="mok", choices=sorted(MOK_IMPLS))
    args = parser.parse_args()
    device = torch.device("cuda")
    shape, inputs, impl = benchmark_row(args.shape, args.row)

    if args.pass_name == "fwd":

        def run(_):
            return impl.forward()

        setup = None
    else:

        def run(state):
            return impl.backward(state[1], inputs.grad_output)

        setup = impl.forward
    times = time_ms(device, TimingConfig(warmup=3, reps=10), run, setup)
    print(
        f"== {shape.name} {args.pass_name} ({args.row}): events median "
        f"{statistics.median(times):.3f} ms, min {min(times):.3f}, max {max(times):.3f}"
    )

    state = setup() if setup else None
    torch.cuda.synchronize()
    begin = time.perf_counter()
    run(state)
    host = (time.perf_counter() - begin) * 1e3
    torch.cuda.synchronize()
    print(f"host time of one call (returns before the GPU is done): {host:.3f} ms")

    states = [setup() if setup else None for _ in range(3)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in states:
            run(s)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in events) / 1e3
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / 1e3
    print(f"3 reps: GPU span {span:.3f} ms, kernel time {busy:.3f} ms, idle {span - busy:.3f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                    max_name_column_width=50))  # fmt: skip


if __name__ == "__main__":
    main()
