"""GPU time of a group of one's op with its sums in the megakernels against the separate kernels.

    python -m tools.fusion_ab [--shape qwen3-30b-a3b] [--tokens 4096] [--iters 20] [--rounds 5]

Forward: `mok.functional.forward` without a shared expert (the forward megakernel writes out,
phases/combine_phase.py) against the megakernel without its combine (`routed_forward`) then the
epilogue kernel (`fwd_epilogue`). Backward: `mok.functional.backward` (d_x and d_router in the
backward megakernel's last phase) against `routed_backward`, then the router-gradient push and
the d_x epilogue kernels. Both sides get the same inputs and schedule; each side's outputs are
compared bitwise before timing. CUDA events around `--iters` back-to-back calls, rounds
alternating the sides; medians over rounds, in ms per call.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.host_time import SHAPES
from mok import functional as F
from mok.launchers.backward_megakernel import push_router_grads, routed_backward
from mok.launchers.epilogues import bwd_epilogue, fwd_epilogue
from mok.launchers.forward_megakernel import routed_forward
from mok.testing import make_inputs


def _timed(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.fusion_ab", description=__doc__)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    h, i, e, k = SHAPES[args.shape]
    cuda = torch.device("cuda")
    inputs = make_inputs(args.tokens, h, i, e, k, seed=0, device=cuda)
    x, w, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    names = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")
    weights = [inputs[n] for n in names]
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=cuda, num_local_tokens=args.tokens,
                         hidden_size=h, topk=k, num_local_experts=e)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
    _, ctx = F.forward(config, ws, schedule, x, w, *weights)
    routed_ctx = (ctx.x_routed, ctx.gate_routed, ctx.up_routed, ctx.hidden_routed)
    d_router = torch.empty_like(w)

    def fwd_fused():
        return F.forward(config, ws, schedule, x, w, *weights)[0]

    def fwd_separate():
        _, slots = routed_forward(x, schedule, k, *weights[3:])
        return fwd_epilogue(None, slots, w)

    def bwd_fused():
        return F.backward(config, ws, schedule, ctx, dy, x, w, *weights)[:2]

    def bwd_separate():
        *_, partials, slots, _ = routed_backward(dy, w, schedule, *routed_ctx, *weights[3:])
        push_router_grads(partials, schedule, w, d_router)
        return bwd_epilogue(None, slots, k), d_router

    same_fwd = torch.equal(fwd_fused(), fwd_separate())
    (dx_a, dr_a), (dx_b, dr_b) = bwd_fused(), bwd_separate()
    same_bwd = torch.equal(dx_a, dx_b) and torch.equal(dr_a, dr_b)
    F.check_errors(ws)
    pairs = (("forward", fwd_fused, fwd_separate), ("backward", bwd_fused, bwd_separate))
    times = {(name, side): [] for name, _, _ in pairs for side in ("fused", "separate")}
    for n in range(args.rounds):
        for name, fused, separate in pairs:
            order = (("fused", fused), ("separate", separate))
            for side, fn in order if n % 2 == 0 else order[::-1]:
                times[(name, side)].append(_timed(fn, args.iters))
    print(f"{args.shape}, T={args.tokens}: bitwise equal forward {same_fwd}, backward {same_bwd}")
    print(f"{'pass':9} {'in-kernel ms':>12} {'separate ms':>12} {'ratio':>6}  rounds (in-kernel)")
    for name, _, _ in pairs:
        fused = statistics.median(times[(name, "fused")])
        separate = statistics.median(times[(name, "separate")])
        rounds = " ".join(f"{t:.3f}" for t in times[(name, "fused")])
        print(f"{name:9} {fused:12.3f} {separate:12.3f} {fused / separate:6.3f}  {rounds}")


if __name__ == "__main__":
    main()
