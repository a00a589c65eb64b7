"""Per-kernel GPU time of one mok forward + backward at a benchmark shape (torch.profiler).

python tools/profile_step.py [--shape qwen3-30b-a3b] [--tokens 16384] [--macrobatch 0,16384]
    [--minibatch N] [--macrobatch-replay gather] [--main-grads] [--gaps N]

Each `--macrobatch` size (0: every routed row at once, the default config) profiles one step
after three warm ones and prints its kernels' GPU time by name (launches, total, mean), then
the step's span on the GPU (first kernel's start to last kernel's end), the time some kernel
ran, and the gaps between: where a macrobatched step's extra time goes. `--main-grads`: the
routed weights' gradients are added into fp32 main_grads (their own kernels, after the backward
megakernel, which then runs no weight tasks). `--gaps N`: the step's N longest gaps between
kernels, each with the kernels before and after it (where the GPU waited for the host).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from mok import functional as F
from mok.config import MACROBATCH_REPLAYS
from mok.testing import make_inputs

SHAPES = {  # H, I, E, k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 32, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")


def setup_layer(shape: str, tokens: int, macrobatch: int = 0, minibatch: int = 0,
                replay: str = "gate_up"):  # fmt: skip
    """(inputs, config, workspace, weights, num_experts) of one layer at a benchmark shape;
    `macrobatch` > 0: that many routed rows held at once, `replay` its
    MoKConfig.macrobatch_replay; `minibatch` > 0: the minibatch (else the default's, cut to
    the macrobatch)."""
    h, i, e, k = SHAPES[shape]
    inputs = make_inputs(tokens, h, i, e, k, seed=0, device="cuda")
    config = F.MoKConfig()
    if minibatch > 0:
        config = dataclasses.replace(config, minibatch_size=minibatch)
    if macrobatch > 0:
        config = dataclasses.replace(
            config,
            minibatch_size=min(config.minibatch_size, macrobatch),
            macrobatch_size=macrobatch,
            macrobatch_replay=replay,
        )
    ws = F.get_workspace(config, None, device=torch.device("cuda"), num_local_tokens=tokens,
                         hidden_size=h, topk=k, num_local_experts=e)  # fmt: skip
    return inputs, config, ws, [inputs[n] for n in WEIGHTS], e


def profile_one(args, size: int, inputs, weights, e, config, ws) -> None:
    """Profile one step under `config` (macrobatches of `size` rows, 0: none) and print its
    kernels and its span."""

    main_grads = None
    if args.main_grads:  # routed gate, up, down (the layer has no shared expert)
        main_grads = tuple(torch.zeros(w.shape, device="cuda") for w in weights[3:]) + (None,) * 3

    def step():
        schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
        out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)
        F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                   inputs["router_weights"], *weights, main_grads=main_grads)  # fmt: skip

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted(
        (ev for ev in prof.events() if ev.device_type == DeviceType.CUDA),
        key=lambda ev: ev.time_range.start,
    )
    totals: dict[str, list[float]] = {}
    busy, end = 0.0, None
    for ev in kernels:
        start, stop = ev.time_range.start, ev.time_range.end
        totals.setdefault(ev.name[:70], []).append(stop - start)
        # Time some kernel ran: the union of the intervals (kernels on one stream do not overlap).
        if end is None or start >= end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0.0
    replay = f" ({config.macrobatch_replay} replay)" if size else ""
    grads = ", fp32 main_grads" if args.main_grads else ""
    print(f"== {args.shape} T={args.tokens} macrobatch {size or 'all'}{replay}{grads}, "
          f"minibatch {config.minibatch_size}: "
          "one schedule + forward + backward")  # fmt: skip
    print(f"  {'kernel':70} {'launches':>8} {'total us':>10} {'mean us':>9}")
    for name, times in sorted(totals.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:70} {len(times):8d} {sum(times):10.1f} {sum(times) / len(times):9.1f}")
    print(f"  span {span:.1f} us, kernels running {busy:.1f} us, gaps {span - busy:.1f} us, "
          f"{len(kernels)} kernels")  # fmt: skip
    gaps = [(after.time_range.start - before.time_range.end, n, before.name, after.name)
            for n, (before, after) in enumerate(zip(kernels, kernels[1:], strict=False), 1)]  # fmt: skip
    for gap, n, before, after in sorted(gaps, reverse=True)[: args.gaps]:
        print(f"  gap {gap:8.1f} us before kernel {n:3d}: {before[:40]} -> {after[:40]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--macrobatch", default="0", help="comma list of sizes; 0: every row")
    parser.add_argument("--minibatch", type=int, default=0, help="0: the default's")
    parser.add_argument("--macrobatch-replay", default="gate_up", choices=MACROBATCH_REPLAYS,
                        help="MoKConfig.macrobatch_replay of the macrobatched steps")  # fmt: skip
    parser.add_argument("--main-grads", action="store_true",
                        help="add the routed weights' gradients into fp32 main_grads")  # fmt: skip
    parser.add_argument("--gaps", type=int, default=0, help="print the N longest gaps")
    args = parser.parse_args()
    for size in (int(v) for v in args.macrobatch.split(",")):
        inputs, config, ws, weights, e = setup_layer(args.shape, args.tokens, size, args.minibatch,
                                                     args.macrobatch_replay)  # fmt: skip
        profile_one(args, size, inputs, weights, e, config, ws)
        del inputs, ws, weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
