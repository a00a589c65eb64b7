"""The host cost of each piece of a resolved eager `MoKExperts` step, timed apart in one process.

    python -m tools.host_primitives [--shape qwen3-30b-a3b] [--tokens 4096] [--reps 200]

`tools.host_breakdown` times every function with wrappers that add their own cost; this times
each piece a resolved step is made of by itself, many times over, in one warm process: the
allocations it makes, its key, its forward (Function apply and launches, no backward), its
backward (`backward()` on autograd's thread), its forward megakernel's launch alone, and the
same numbers for an autograd Function that only allocates its outputs (the floor of
`benchmarks.host_time`). Medians in microseconds. The launches run on the GPU meanwhile, in
batches short enough that the launch queue never fills (a full queue blocks the host).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.host_time import SHAPES, _Empty
from mok.nn import MoKExperts
from mok.testing import make_inputs

_BATCH = 16  # launches between syncs: far below the queue's depth


def _median_us(fn, reps: int, batch: int = _BATCH) -> float:
    """Median host microseconds of fn(), called in batches with a sync between them (not
    timed)."""
    times = []
    for start in range(0, reps, batch):
        torch.cuda.synchronize()
        for _ in range(min(batch, reps - start)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _backward_us(make, grad, reps: int) -> float:
    """Median host microseconds of `make().backward(grad)`, the forward untimed."""
    times = []
    for _ in range(reps):
        y = make()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.backward(grad)
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def measure(shape: str, tokens: int, reps: int) -> list[tuple[str, float]]:
    h, i, e, k = SHAPES[shape]
    cuda = torch.device("cuda")
    module = MoKExperts(e, h, i, k, device=cuda)
    inputs = make_inputs(tokens, h, i, e, k, seed=0, device=cuda)
    x = inputs["x"].detach().requires_grad_(True)
    w = inputs["router_weights"].detach().requires_grad_(True)
    top = inputs["top_experts"]
    grad = torch.randn(tokens, h, device=cuda, dtype=torch.bfloat16)
    for _ in range(3):  # the full path, then the resolved step's forward and backward
        module(x, w, top).backward(grad)
    torch.cuda.synchronize()
    weights = module.weights()
    key = module._steps.key(module, x, w, top, weights)
    step = module._steps.get(key, module.config)
    if step is None:
        raise RuntimeError("the step did not resolve: nothing to time (see mok/layer_plan.py)")
    op, carve = step.forward_op, step.carve
    context = step._context(carve.new())
    rows = [
        ("torch.empty of the step's buffer", _median_us(carve.new, reps)),
        ("torch.empty_like(x)", _median_us(lambda: torch.empty_like(x), reps)),
        ("torch.empty(x.shape, dtype, device)",
         _median_us(lambda: torch.empty(x.shape, dtype=torch.bfloat16, device=cuda), reps)),
        ("step key + lookup",
         _median_us(lambda: module._steps.get(module._steps.key(module, x, w, top,
                                                                module.weights()),
                                              module.config), reps)),
    ]  # fmt: skip
    if op.combine:
        ids_at = top.data_ptr()
        rows.append(
            (
                "forward megakernel launch (+ out's empty_like)",
                _median_us(lambda: op.combined(x, w, weights[3:], context, ids_at), reps),
            )
        )
    with torch.no_grad():
        rows.append(
            (
                "resolved forward, no grad (apply, launches)",
                _median_us(lambda: module(x, w, top), reps),
            )
        )
    rows.append(
        ("resolved forward (apply, launches, saves)", _median_us(lambda: module(x, w, top), reps))
    )
    rows.append(
        (
            "resolved backward() (engine, launch, grads)",
            _backward_us(lambda: module(x, w, top), grad, max(reps // 4, 20)),
        )
    )
    # The floor: a Function with the same gradient inputs that only allocates its outputs.
    router = w.detach().requires_grad_(True)
    floor_weights = [p.detach().requires_grad_(True) for p in weights[3:]]
    rows.append(
        (
            "floor forward (Function apply, empty_like)",
            _median_us(lambda: _Empty.apply(x, router, *floor_weights), reps),
        )
    )
    rows.append(("floor backward() (engine, 4 empty_like)",
                 _backward_us(lambda: _Empty.apply(x, router, *floor_weights), grad,
                              max(reps // 4, 20))))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.host_primitives", description=__doc__)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    rows = measure(args.shape, args.tokens, args.reps)
    print(f"{args.shape}, T={args.tokens}: median host us of each piece ({args.reps} reps)")
    for name, us in rows:
        print(f"  {name:48} {us:8.1f}")


if __name__ == "__main__":
    main()
