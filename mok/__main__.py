"""`python -m mok`: run one small MoE layer forward + backward and check it.

Picks the best device available: a supported GPU whose shipped cubins hold the layer's kernels
runs them; otherwise the PyTorch reference path runs on CPU, and the report says why. Every
result is checked against an fp64 per-expert loop differentiated by autograd (an oracle that
shares no code with mok), held to 2x the error PyTorch itself makes in bf16.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from . import functional
from .config import FEATURE_ALIGNMENT, MAX_TOPK
from .testing import make_inputs, oracle_errors


def pick_device(requested: str) -> tuple[torch.device, str]:
    """(device, why) for --device auto|cpu|cuda."""
    if requested == "cpu":
        return torch.device("cpu"), "requested"
    if not torch.cuda.is_available():
        if requested == "cuda":
            raise SystemExit("--device cuda: no CUDA device is visible")
        return torch.device("cpu"), "no CUDA device visible"
    from . import launchers  # noqa: PLC0415 - the CUDA path's door, loaded for a GPU only

    device = torch.device("cuda", torch.cuda.current_device())
    missing = [
        op
        for op in ("build_schedule", "forward", "backward")
        if not launchers.available(op, device)
    ]
    if not missing:
        return device, "kernels shipped for this GPU"
    if requested == "cuda":
        launchers.require(missing[0], device)  # raises with the reason
    return torch.device("cpu"), f"GPU present, but no shipped kernel yet for {', '.join(missing)}"


def run(args: argparse.Namespace) -> int:
    device, why = pick_device(args.device)
    path = "CUDA kernels" if device.type == "cuda" else "PyTorch reference (CPU path)"
    t, h, i, e, k = args.tokens, args.hidden, args.intermediate, args.experts, args.topk
    inputs = make_inputs(t, h, i, e, k, shared=not args.no_shared, seed=args.seed, device=device)
    config = functional.MoKConfig()
    ws = functional.get_workspace(
        config, None, device=device, num_local_tokens=t, hidden_size=h, topk=k,
        num_local_experts=e,
    )  # fmt: skip
    weights = [inputs[n] for n in ("shared_gate", "shared_up", "shared_down",
                                   "routed_gate", "routed_up", "routed_down")]  # fmt: skip

    def step():
        schedule = functional.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
        out, ctx = functional.forward(config, ws, schedule, inputs["x"], inputs["router_weights"],
                                      *weights, swiglu_limit=args.swiglu_limit)  # fmt: skip
        grads = functional.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                                    inputs["router_weights"], *weights,
                                    swiglu_limit=args.swiglu_limit)  # fmt: skip
        return (out, *grads)

    step()  # warm-up (custom-op registration, allocator)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    results = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed_ms = (time.perf_counter() - start) * 1e3

    print(f"mok {sys.modules['mok'].__version__}: one MoE layer, forward + backward")
    print(
        f"  device : {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'})"
    )
    print(f"  path   : {path} ({why})")
    print(f"  shapes : T={t} H={h} I={i} experts={e} k={k} shared={not args.no_shared} "
          f"swiglu_limit={args.swiglu_limit}")  # fmt: skip
    print(f"  time   : {elapsed_ms:.1f} ms for schedule + forward + backward")
    print(f"  {'output':18s} {'rel err':>10s} {'bf16 torch':>10s}  check (<= 2x bf16 torch)")
    failures = 0
    for name, ok, err, base in oracle_errors(results, inputs, swiglu_limit=args.swiglu_limit):
        failures += not ok
        print(f"  {name:18s} {err:10.2e} {base:10.2e}  {'ok' if ok else 'FAIL'}")
    print("PASS" if failures == 0 else f"FAIL: {failures} outputs out of bounds")
    return 0 if failures == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mok", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--no-shared", action="store_true", help="routed experts only")
    parser.add_argument("--swiglu-limit", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    check_args(parser, args)
    return run(args)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit through parser.error (usage and the rule broken, no traceback) on a bad value."""
    align = FEATURE_ALIGNMENT
    if args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    for flag, value in (("--hidden", args.hidden), ("--intermediate", args.intermediate)):
        if value < align or value % align:
            parser.error(f"{flag} must be a positive multiple of {align}, got {value}")
    if args.experts < 1:
        parser.error(f"--experts must be >= 1, got {args.experts}")
    # The routing picks k distinct experts per token.
    most = min(args.experts, MAX_TOPK)
    if not 1 <= args.topk <= most:
        parser.error(
            f"--topk must be in [1, {most}] (at most --experts = {args.experts} and "
            f"{MAX_TOPK}), got {args.topk}"
        )
    limit = args.swiglu_limit
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        parser.error(f"--swiglu-limit must be a finite number > 0, got {limit}")


if __name__ == "__main__":
    sys.exit(main())
