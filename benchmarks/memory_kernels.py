"""`python -m benchmarks.memory_kernels`: achieved bandwidth of mok's memory-bound kernels.

Each kernel's bytes are the fewest it must move (every input read once, every output written
once); achieved GB/s is set beside the device-to-device copy bandwidth measured in the same run
(the ceiling; the aim is >= 80% of it). Kernel time is measured on CUDA-graph replays of 20
calls (GPU time); the eager per-call time, which adds the Python launch path, is printed too. Results are checked bit-exact against mok.reference
before timing. Prints one line per case and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from mok import ops
from mok import reference as R

from .report import provenance, write_json
from .timing import TimingConfig, copy_bandwidth_gbs, median, time_ms


def cases():
    """(name, make_inputs, run, bytes moved) on shapes of the named models at 16384 tokens."""
    out = []
    for rows, cols in ((16384, 2048), (16384, 7168), (32 * 2048, 7168)):
        nbytes = rows * cols * 2 + rows * cols + rows * cols // 32
        for transpose in (False, True):
            name = f"mxfp8_quantize{'_t' if transpose else ''} [{rows}x{cols}]"
            out.append((name, (rows, cols), transpose, nbytes))
    for tokens, hidden, topk, shared in ((16384, 2048, 8, False), (16384, 7168, 8, True),
                                         (16384, 4096, 2, False)):  # fmt: skip
        slots = tokens * topk * hidden * 2
        fwd = slots + tokens * topk * 4 + tokens * hidden * 2 * (2 if shared else 1)
        out.append((f"fwd_epilogue [T={tokens} H={hidden} k={topk} shared={shared}]",
                    (tokens, hidden, topk, shared), "fwd", fwd))  # fmt: skip
        bwd = slots + tokens * hidden * 2 * (2 if shared else 1)
        out.append((f"bwd_epilogue [T={tokens} H={hidden} k={topk} shared={shared}]",
                    (tokens, hidden, topk, shared), "bwd", bwd))  # fmt: skip
    return out


def make_run(shape, kind, device):
    if isinstance(kind, bool):
        x = torch.randn(*shape, device=device).to(torch.bfloat16)
        want = R.mxfp8_quantize(x.cpu(), transpose=kind)
        got = (
            ops.mxfp8_quantize(x, not kind, kind)[2:]
            if kind
            else ops.mxfp8_quantize(x, True, False)[:2]
        )
        ok = torch.equal(got[1].cpu(), want[1]) and torch.equal(
            got[0].view(torch.uint8).cpu(), want[0].view(torch.uint8)
        )
        return ok, lambda _s: ops.mxfp8_quantize(x, not kind, kind)
    tokens, hidden, topk, shared = shape
    slots = torch.randn(tokens * topk, hidden, device=device).to(torch.bfloat16)
    w = torch.rand(tokens, topk, device=device) + 0.01
    base = torch.randn(tokens, hidden, device=device).to(torch.bfloat16) if shared else None
    if kind == "fwd":
        want = R.fwd_epilogue(None if base is None else base.cpu(), slots.cpu(), w.cpu())
        ok = torch.equal(ops.fwd_epilogue(base, slots, w).cpu(), want)
        return ok, lambda _s: ops.fwd_epilogue(base, slots, w)
    want = R.bwd_epilogue(None if base is None else base.cpu(), slots.cpu(), topk)
    ok = torch.equal(ops.bwd_epilogue(base, slots, topk).cpu(), want)
    return ok, lambda _s: ops.bwd_epilogue(base, slots, topk)


GRAPH_CALLS = 20


def graph_ms(run, timing: TimingConfig) -> float:
    """GPU milliseconds per call: GRAPH_CALLS calls captured in one CUDA graph, replays timed
    with events (host launch cost excluded; the eager time is printed beside it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        run(None)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_CALLS):
                run(None)
    torch.cuda.current_stream().wait_stream(stream)
    times = time_ms(torch.device("cuda"), timing, lambda _s: graph.replay())
    return median(times) / GRAPH_CALLS


def host_launch_cost(device, profile_path: str | None) -> None:
    """Host microseconds per call of a tiny epilogue (op path and bare Kernel.launch)."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415
    import time  # noqa: PLC0415

    from mok.runtime import get_kernel  # noqa: PLC0415

    slots = torch.randn(8, 64, device=device).to(torch.bfloat16)
    w = torch.rand(4, 2, device=device) + 0.1
    out = torch.empty(4, 64, device=device, dtype=torch.bfloat16)
    kernel = get_kernel("moe_combine_forward", device=device)
    args = {"out_ptr": out, "shared_ptr": None, "weight_ptr": w, "slots_ptr": slots,
            "num_tokens": 4, "hidden_size": 64, "topk": 2, "has_shared": 0}  # fmt: skip
    calls = {
        "ops.fwd_epilogue": lambda: ops.fwd_epilogue(None, slots, w),
        "Kernel.launch": lambda: kernel.launch((1, 4, 1), args),
        "torch add (for scale)": lambda: torch.add(slots, slots),
    }
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(500):
            fn()
        host_us = (time.perf_counter() - start) / 500 * 1e6
        torch.cuda.synchronize()
        print(f"host cost {name:24s} {host_us:8.1f} us/call")
    if profile_path:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            calls["ops.fwd_epilogue"]()
        prof.disable()
        with open(profile_path, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_kernels")
    parser.add_argument("--json", default="memory_kernels.json")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--profile", default=None, help="write a cProfile of host launch cost")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.memory_kernels needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    timing = TimingConfig(warmup=5, reps=args.reps)
    host_launch_cost(device, args.profile)
    copy_gbs = copy_bandwidth_gbs(device, 2 << 30, timing)
    print(f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s")
    rows = []
    for name, shape, kind, nbytes in cases():
        ok, run = make_run(shape, kind, device)
        if not ok:
            print(f"{name:58s} CHECK FAILED (not timed)")
            rows.append({"name": name, "ok": False})
            continue
        eager_ms = median(time_ms(device, timing, run))
        ms = graph_ms(run, timing)
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append({"name": name, "ok": True, "ms": ms, "eager_ms": eager_ms, "bytes": nbytes,
                     "gbs": gbs, "pct_copy": 100 * gbs / copy_gbs})  # fmt: skip
        print(f"{name:58s} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.1f}% of copy"
              f"  (eager call {eager_ms * 1e3:7.1f} us)")  # fmt: skip
    write_json(args.json, {"provenance": provenance(device, 1), "copy_gbs": copy_gbs, "rows": rows})
    print(json.dumps({"json": args.json}))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
