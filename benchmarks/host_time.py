"""Host (enqueue) time of one eager `MoKExperts` forward + backward, apart from its GPU time.

    python -m benchmarks.host_time [--shape qwen3-30b-a3b] [--tokens 4096] [--layers 4]
                                   [--profile FILE] [--backward-on-caller] [--cpus 6]

Host time: from the step's first Python call until `backward()` returns. Measured twice: with
steps back to back (the training-loop case: the host runs ahead of the GPU, no launch waits for
queue space), and with a sync before each step (the GPU idle, the interpreter cold: slower).
GPU time: CUDA events around the steps. Beside the back-to-back host time, the process's CPU
time over each step (all its threads): well below the host time, the process waited for a CPU.
Gradients are set to None before each step (as a training loop's
`zero_grad(set_to_none=True)`), so neither time includes torch's gradient-accumulation adds. A training loop without CUDA graphs is host-bound when the first
exceeds the second.

A model's step runs many layers and one `backward()`; autograd's engine costs a fixed time per
`backward()` call (its start, the hand-off to the device's autograd thread) and per node. So
two more numbers, measured back to back in the same process: a stack of `--layers` modules
chained (each layer's output is the next one's x; each has its own weights and router
weights), whose host time per layer is what a model with many MoE layers sees; and the floor
of a `torch.autograd.Function` with the layer's inputs and gradients (x, router weights, three
weights; it saves its inputs, its forward and backward only allocate their outputs), the part
of a single-layer step that is autograd's and the allocator's, not mok's.

`--backward-on-caller` runs every measured step under
`torch.autograd.set_multithreading_enabled(False)`: autograd's engine runs the backward on the
thread that calls `backward()` instead of handing it to the device's autograd thread (torch's
own setting; mok's step does the same work either way). `--cpus LIST` (e.g. `6`, `6,7`,
`4-7`) runs the process on those CPUs only (`os.sched_setaffinity`, set before CUDA starts, so
every thread torch and the driver start later inherits it), as `taskset -c LIST` would.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
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


class _Empty(torch.autograd.Function):
    """The autograd floor of a layer with `MoKExperts`' gradient inputs (x, router weights and
    three weights): it saves its inputs as mok's Function does, and its forward and backward
    only allocate their outputs."""

    @staticmethod
    def forward(ctx, x, router_weights, *weights):
        ctx.save_for_backward(router_weights, *weights)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.empty_like(t) for t in ctx.saved_tensors))


def measure(shape: str, tokens: int, steps: int = 20, warmup: int = 3, profile=None,
            layers: int = 1, backward_on_caller: bool = False) -> dict:  # fmt: skip
    """Medians over `steps` eager forward + backward steps of `layers` chained modules:
    'host_ms' and 'gpu_ms' back to back (the training-loop case; 'host_cpu_ms' the process's CPU
    time over those steps), 'host_idle_gpu_ms' and 'gpu_idle_ms' with a sync before each step
    (the GPU idle when the step starts, the interpreter cold). Whole steps: divide by `layers` for a layer's share."""
    h, i, e, k = SHAPES[shape]
    device = torch.device("cuda")
    modules = [MoKExperts(e, h, i, k, device=device) for _ in range(layers)]
    x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    inputs = make_inputs(tokens, h, i, e, k, seed=0, device=device)
    top = inputs["top_experts"]
    weights = [inputs["router_weights"].clone().requires_grad_(True) for _ in range(layers)]
    grad = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)

    def step():
        y = x
        for module, w in zip(modules, weights, strict=True):
            y = module(y, w, top)
        y.backward(grad)

    return _timed(step, [x, *weights], modules, steps, warmup, profile, backward_on_caller)


def autograd_floor(shape: str, tokens: int, steps: int = 20, warmup: int = 3,
                   backward_on_caller: bool = False) -> dict:  # fmt: skip
    """`measure`'s numbers for one `_Empty` node with the layer's inputs at `shape`."""
    h, i, e, k = SHAPES[shape]
    device = torch.device("cuda")
    x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    router = torch.rand(tokens, k, device=device, requires_grad=True)
    weights = [torch.empty(e, *dims, device=device, dtype=torch.bfloat16, requires_grad=True)
               for dims in ((i, h), (i, h), (h, i))]  # fmt: skip
    grad = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)

    def step():
        _Empty.apply(x, router, *weights).backward(grad)

    return _timed(step, [x, router, *weights], [], steps, warmup, None, backward_on_caller)


def _timed(step, leaves, modules, steps, warmup, profile, backward_on_caller=False) -> dict:
    engine = (torch.autograd.set_multithreading_enabled(False) if backward_on_caller
              else contextlib.nullcontext())  # fmt: skip
    with engine:
        return _timed_steps(step, leaves, modules, steps, warmup, profile)


def _timed_steps(step, leaves, modules, steps, warmup, profile) -> dict:
    def zero_grad():
        # As a training loop's zero_grad(set_to_none=True): no gradient-accumulation adds.
        for leaf in leaves:
            leaf.grad = None
        for module in modules:
            module.zero_grad(set_to_none=True)

    host, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for n in range(warmup + steps):
        zero_grad()
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
    # The process's CPU time over the same span (every thread: autograd's engine runs the
    # backward): below the host time when the process waited for a CPU (a loaded host).
    loop, cpu = [], []
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        zero_grad()
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        loop.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    end.record()
    torch.cuda.synchronize()
    host.sort(), gpu.sort(), loop.sort(), cpu.sort()
    return {
        "host_ms": loop[len(loop) // 2],
        "host_cpu_ms": cpu[len(cpu) // 2],
        "gpu_ms": start.elapsed_time(end) / steps,
        "host_idle_gpu_ms": host[len(host) // 2],
        "gpu_idle_ms": gpu[len(gpu) // 2],
    }


def parse_cpus(text: str) -> set[int]:
    """`--cpus`' list: CPU numbers and ranges, comma-separated ("6", "6,7", "4-7,12")."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"--cpus must be CPU numbers or ranges like 4-7, got {text!r}")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(f"--cpus must name at least one CPU, got {text!r}")
    return cpus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_time", description=__doc__)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4,
                        help="modules in the stack (0: no stack)")  # fmt: skip
    parser.add_argument("--profile", default=None, help="write a cProfile text report here")
    parser.add_argument("--backward-on-caller", action="store_true",
                        help="run the backward on the calling thread (autograd multithreading "
                             "off) in every measurement")  # fmt: skip
    parser.add_argument("--cpus", default=None,
                        help="run on these CPUs only, e.g. 6 or 4-7 (as taskset -c)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.cpus is not None:
        try:
            cpus = parse_cpus(args.cpus)
            os.sched_setaffinity(0, cpus)
        except (ValueError, OSError) as error:
            parser.error(f"--cpus {args.cpus}: {error}")
    if args.layers < 0:
        parser.error(f"--layers must be >= 0, got {args.layers}")
    profile = cProfile.Profile() if args.profile else None
    on_caller = args.backward_on_caller
    result = measure(args.shape, args.tokens, args.steps, profile=profile,
                     backward_on_caller=on_caller)  # fmt: skip
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
        + ("; backward on the calling thread" if on_caller else "")
        + (f"; CPUs {sorted(os.sched_getaffinity(0))}" if args.cpus is not None else "")
    )
    print(f"process CPU time per step back to back: {result['host_cpu_ms']:.3f} ms")
    floor = autograd_floor(args.shape, args.tokens, args.steps, backward_on_caller=on_caller)
    print(
        f"autograd floor (a Function with the layer's inputs, allocating only): "
        f"{floor['host_ms']:.3f} ms host "
        f"back to back; {floor['host_idle_gpu_ms']:.3f} ms with the GPU idle at each step's start"
    )
    if args.layers:
        stack = measure(args.shape, args.tokens, args.steps, layers=args.layers,
                        backward_on_caller=on_caller)  # fmt: skip
        n = args.layers
        print(
            f"stack of {n} layers, per layer: {stack['host_ms'] / n:.3f} ms host, "
            f"{stack['gpu_ms'] / n:.3f} ms GPU back to back; {stack['host_idle_gpu_ms'] / n:.3f} "
            f"ms host, {stack['gpu_idle_ms'] / n:.3f} ms GPU with the GPU idle at each step's start"
        )


if __name__ == "__main__":
    main()
