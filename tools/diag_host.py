"""Host (Python) time of mok's forward and backward calls: cProfile of repeated calls of the
benchmark's mok row after warm-up, the GPU synchronised only around the profiled span.

python -m tools.diag_host [--shape qwen3-30b-a3b] [--calls 20] [--top 30]

Then torch.profiler over 5 more calls: host time by aten op and CUDA runtime call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tools.benchmark_row import benchmark_row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    shape, inputs, impl = benchmark_row(args.shape)
    for _ in range(3):
        _, state = impl.forward()
        impl.backward(state, inputs.grad_output)
    torch.cuda.synchronize()

    for name, call in (
        ("forward", impl.forward),
        ("backward", lambda: impl.backward(state, inputs.grad_output)),
    ):
        profiler = cProfile.Profile()
        begin = time.perf_counter()
        profiler.enable()
        for _ in range(args.calls):
            call()
        profiler.disable()
        host = (time.perf_counter() - begin) * 1e3 / args.calls
        torch.cuda.synchronize()
        print(f"== {shape.name} {name}: {host:.3f} ms of host time per call (profiled)")
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.top)
        torch.cuda.synchronize()
        # The same calls under torch.profiler: aten ops and CUDA runtime calls (cudaHostAlloc,
        # cudaStreamSynchronize, ...) that cProfile cannot see inside C++ dispatch.
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                        max_name_column_width=60))  # fmt: skip


if __name__ == "__main__":
    main()
