"""Where the MXFP8 layer's time goes, kernel by kernel, beside the BF16 layer's.

    python -m tools.mxfp8_breakdown [--shape qwen|deepseek] [--reps 3]

One H200 (or any sm_90a GPU): the layer at 16384 tokens; its forward and backward `--reps`
times each under torch.profiler. Prints each kernel's CUDA time per call (summed over its
launches), heaviest first, and the totals. Times are the profiler's (kernels back to back, no
host gaps), so they add up to less than a benchmark's wall time.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

SHAPES = {  # (T, H, I, E, k)
    "qwen": (16384, 2048, 768, 128, 8),
    "deepseek": (16384, 7168, 2048, 32, 8),
}
WEIGHTS = ("routed_gate", "routed_up", "routed_down")


def _layer(shape):
    from mok import functional as F  # noqa: PLC0415
    from mok import ops  # noqa: PLC0415
    from mok.testing import make_inputs  # noqa: PLC0415

    t, h, i, e, k = shape
    inputs = make_inputs(t, h, i, e, k, shared=False, seed=1, device="cuda")
    rows, config = t * k, F.MoKConfig()
    if config.macrobatch_size < rows:  # every routed row at once (no ring reuse)
        step = config.minibatch_size
        config = F.MoKConfig(macrobatch_size=-(-rows // step) * step)
    ws = F.get_workspace(config, None, device="cuda", num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=e)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
    gate, up, down = (ops.mxfp8_quantize(inputs[n], True, True) for n in WEIGHTS)
    layers = {
        "bf16": ([inputs[n] for n in WEIGHTS],) * 2,
        "mxfp8": ([gate[:2], up[:2], down[:2]], [tuple(gate), tuple(up), down[2:]]),
    }
    return F, config, ws, schedule, inputs, layers


def _profile(run, reps: int) -> dict[str, float]:
    """ms per call of each kernel name over `reps` calls of `run`."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:70]] += event.device_time_total / 1000.0 / reps
    return dict(totals)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.mxfp8_breakdown")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    F, config, ws, schedule, inputs, layers = _layer(SHAPES[args.shape])
    for name, (fwd, bwd) in layers.items():

        def forward(fwd=fwd):
            return F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], None,
                             None, None, *fwd)[1]  # fmt: skip

        ctx = forward()

        def backward(ctx=ctx, bwd=bwd):
            F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], None, None, None, *bwd)  # fmt: skip

        for pass_name, run in (("forward", forward), ("backward", backward)):
            kernels = _profile(run, args.reps)
            print(f"{args.shape} {name} {pass_name}: {sum(kernels.values()):.3f} ms of kernels")
            for kernel, ms in sorted(kernels.items(), key=lambda item: -item[1]):
                print(f"  {ms:8.3f} ms  {kernel}")


if __name__ == "__main__":
    main()
