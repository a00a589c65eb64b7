"""Forward time of both forward paths (megakernel, kernels) at the benchmark shapes, and each
kernel's share of the megakernel path (torch.profiler). For A/B runs of cubin sets.

python -m tools.diag_forward_paths [--shapes qwen3-30b-a3b,mixtral-8x7b] [--tokens 16384]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mok import functional as F
from mok.launchers import set_forward_path
from tools.diag_profile import SHAPES, setup_layer


def measure(shape: str, tokens: int, reps: int) -> str:
    inputs, config, ws, weights, e = setup_layer(shape, tokens)

    def step():
        schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
        F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)

    times = {}
    for path in ("megakernel", "kernels"):
        set_forward_path(path)
        for _ in range(3):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        times[path] = start.elapsed_time(end) / reps
    set_forward_path("megakernel")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [
        (ev.key, getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0)) / 1e3)
        for ev in prof.key_averages()
    ]
    top = sorted(events, key=lambda kv: -kv[1])[:4]
    shares = "  ".join(f"{name[:28]} {ms:.3f}" for name, ms in top)
    return (f"{shape:<14} megakernel {times['megakernel']:8.3f} ms  kernels "
            f"{times['kernels']:8.3f} ms  | {shares}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        print(measure(shape, args.tokens, args.reps), flush=True)


if __name__ == "__main__":
    main()
