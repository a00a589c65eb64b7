"""Host (enqueue) time of one eager `MoKExperts` forward + backward, apart from its GPU time.

    python -m benchmarks.host_time [--shape qwen3-30b-a3b] [--tokens 4096] [--profile FILE]

Host time: from the step's first Python call until `backward()` returns. Measured twice: with
steps back to back (the training-loop case: the host runs ahead of the GPU, no launch waits for
queue space), and with a sync before each step (the GPU idle, the interpreter cold: slower).
GPU time: CUDA events around the steps. Gradients are set to None before each step (as a
training loop's `zero_grad(set_to_none=True)`), so neither time includes torch's
gradient-accumulation adds. A training loop without CUDA graphs is host-bound when the first
exceeds the second.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from mok.nn import MoKExperts
from mok.testing import make_inputs

DEFAULT_TOKENS = 4096
SHAPES = {  # H, I, E, k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 32, 8),
}


def measure(shape: str, tokens: int, steps: int = 20, warmup: int = 3, profile=None) -> dict:
    """Medians over `steps` eager forward + backward steps: 'host_ms' and 'gpu_ms' back to back
    (the training-loop case), 'host_idle_gpu_ms' and 'gpu_idle_ms' with a sync before each step
    (the GPU idle when the step starts, the interpreter cold)."""
    h, i, e, k = SHAPES[shape]
    device = torch.device("cuda")
    layer = MoKExperts(e, h, i, k, device=device)
    x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    inputs = make_inputs(tokens, h, i, e, k, seed=0, device=device)
    top = inputs["top_experts"]
    weights = inputs["router_weights"].requires_grad_(True)
    grad = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)

    def step():
        layer(x, weights, top).backward(grad)

    host, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for n in range(warmup + steps):
        # As a training loop's zero_grad(set_to_none=True): no gradient-accumulation adds.
        x.grad = weights.grad = None
        layer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if profile is not None and n == warmup:
            profile.enable()
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if n >= warmup:
            host.append((t1 - t0) * 1e3)
            gpu.append(start.elapsed_time(end))
    if profile is not None:
        profile.disable()
    # Back to back, as a training loop runs: no sync between steps, so the host runs ahead of
    # the GPU (fewer launches than the queue holds) and each step's host time is its enqueue
    # time with the interpreter warm. GPU time: events around all the steps, per step.
    loop = []
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        x.grad = weights.grad = None
        layer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step()
        loop.append((time.perf_counter() - t0) * 1e3)
    end.record()
    torch.cuda.synchronize()
    host.sort(), gpu.sort(), loop.sort()
    return {
        "host_ms": loop[len(loop) // 2],
        "gpu_ms": start.elapsed_time(end) / steps,
        "host_idle_gpu_ms": host[len(host) // 2],
        "gpu_idle_ms": gpu[len(gpu) // 2],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=__doc__)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", default=None, help="write a cProfile text report here")
    args = parser.parse_args(argv)
    profile = cProfile.Profile() if args.profile else None
    result = measure(args.shape, args.tokens, args.steps, profile=profile)
    if profile is not None:
        with open(args.profile, "w") as f:
            stats = pstats.Stats(profile, stream=f).sort_stats("cumulative")
            stats.print_stats(60)
            stats.sort_stats("tottime").print_stats(40)
    print(
        f"host time per eager forward + backward ({args.shape}, T={args.tokens}): "
        f"{result['host_ms']:.3f} ms host, {result['gpu_ms']:.3f} ms GPU back to back; "
        f"{result['host_idle_gpu_ms']:.3f} ms host, {result['gpu_idle_ms']:.3f} ms GPU with "
        f"the GPU idle at each step's start"
    )


if __name__ == "__main__":
    main()
