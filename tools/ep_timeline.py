"""Where a virtual-EP step's time goes: every kernel of every rank on one timeline (torch.profiler).

    CUDA_DEVICE_MAX_CONNECTIONS=16 python -m tools.ep_timeline --shape qwen3-30b-a3b --sizes 1,8

For each P: the benchmark's step (benchmarks.virtual_ep, phase by phase over the ranks), once
forward only and once forward + backward, under the profiler. Per rank, each kernel's start and
end (us from the step's first kernel) and, summed over the ranks, each kernel's time. Beside
them, references replayed from CUDA graphs (no host issue): EP = 1 on the same problem, on every
SM and with the megakernels' grid cut to P x (the ranks' grid); one rank's share alone (E / P
experts with their EP = 1 rows, the ranks' grid, no peers); P such shares at once on P streams
(no peers: what sharing one GPU costs without the EP protocol); and the virtual group itself.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.shapes import SHAPES
from benchmarks.virtual_ep import graph_of, layer_step, median_ms
from mok import functional as F
from mok.testing import make_inputs
from mok.virtual_ep import VirtualEPGroup


def _markers(group):
    """A fill kernel on each rank's stream whose grid names the rank (the trace's stream ids are
    CUPTI's, not torch's)."""
    for rank, stream in enumerate(group.streams):
        with torch.cuda.stream(stream):
            torch.empty((rank + 1) << 24, device="cuda").fill_(1.0)


def _kernels(trace_path):
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("cat") == "kernel"]


def _short(name):
    for word in ("moe_forward", "moe_backward", "barrier", "schedule", "combine", "count",
                 "all_gather", "weight", "gather", "fill", "copy", "Memset", "memset"):  # fmt: skip
        if word.lower() in name.lower():
            return word
    return name[:28]


def _timeline(run, backward, size):
    """{rank: [(short name, start us, end us)]} of one step."""
    group = run.group
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _markers(group)
        run(backward)
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    return lanes_of(_kernels(path), size)


def lanes_of(kernels, size):
    """{rank: [(short name, start us, end us)]} of a trace's kernel events: the `size` largest
    float fills (`_markers`, grid growing with the rank) name each rank's stream; every other
    kernel on those streams goes to its rank, in start order, times from the first one's start."""
    fills = (k for k in kernels if "FillFunctor<float>" in k["name"])
    marks = sorted(fills, key=lambda k: k["args"]["grid"][0])[-size:]
    stream_rank = {m["args"]["stream"]: rank for rank, m in enumerate(marks)}
    step = [k for k in kernels if k not in marks and k["args"]["stream"] in stream_rank]
    t0 = min(k["ts"] for k in step)
    lanes = {r: [] for r in range(size)}
    for k in sorted(step, key=lambda k: k["ts"]):
        lanes[stream_rank[k["args"]["stream"]]].append(
            (_short(k["name"]), k["ts"] - t0, k["ts"] + k["dur"] - t0)
        )
    return lanes


def _print_lanes(lanes):
    totals = {}
    for rank, lane in lanes.items():
        cells = " ".join(f"{n}[{s:.0f},{e:.0f}]" for n, s, e in lane)
        print(f"  rank {rank}: {cells}")
        for n, s, e in lane:
            totals[n] = totals.get(n, 0.0) + (e - s)
    span = max(e for lane in lanes.values() for _, _, e in lane)
    by_time = sorted(totals.items(), key=lambda item: -item[1])
    summed = ", ".join(f"{n} {t:.0f}" for n, t in by_time)
    print(f"  span {span:.0f} us; kernel time summed over ranks: {summed}")


def _share(shape, tokens, size, ctas, seed):
    """One rank's share as an EP = 1 layer with no peers: E / P experts with the rows each gets
    at EP = 1 (T / P tokens; with fewer experts than k, k = E / P and the tokens scaled to keep
    the rows), `ctas` CTAs. Returns (run, workspaces)."""
    e = shape.experts_one_gpu // size
    k = min(shape.topk, e)
    inputs = make_inputs(tokens * shape.topk // (size * k), shape.hidden_size,
                         shape.intermediate_size, e, k, seed=seed, device="cuda")  # fmt: skip
    run, spaces = layer_step(1, inputs, e, F.MoKConfig(schedule_capacity_multiplier=1.0))
    spaces[0].megakernel_ctas = ctas
    return run, spaces


def _together(runs):
    """One closure running every closure of `runs` at once, each on its own stream (a virtual
    group's streams; the closures share no peers)."""
    group = VirtualEPGroup(len(runs))

    def run(backward):
        group.run(lambda rank: runs[rank](backward))
        group.join()

    return run


def _references(shape, inputs, config, size, ctas, virtual, warmup, reps):
    """Graph-replayed [fwd, fwd+bwd] ms of: EP = 1 (every SM), EP = 1 on size x ctas CTAs,
    one rank's share alone, `size` shares at once (no peers), and the virtual group."""
    e, tokens = shape.experts_one_gpu, inputs["x"].shape[0]
    cut = layer_step(1, inputs, e, config)
    cut[1][0].megakernel_ctas = size * ctas
    shares = [_share(shape, tokens, size, ctas, 3 + r) for r in range(size)]
    made = {
        "EP=1": layer_step(1, inputs, e, config),
        f"EP=1 on {size * ctas} CTAs": cut,
        f"one share alone ({ctas} CTAs)": _share(shape, tokens, size, ctas, 2),
        f"{size} shares at once, no peers": (
            _together([run for run, _ in shares]),
            [ws for _, wss in shares for ws in wss],
        ),
    }
    times = {}
    for name, (run, spaces) in made.items():
        times[name] = [median_ms(graph_of(run, p), p, warmup, reps) for p in (False, True)]
        for ws in spaces:
            ws.destroy()
    times[f"virtual EP P={size}"] = [
        median_ms(graph_of(virtual, p), p, warmup, reps) for p in (False, True)
    ]
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.ep_timeline", description=__doc__)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--sizes", default="1,8")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    shape = next(s for s in SHAPES if s.name == args.shape)
    e = shape.experts_one_gpu
    config = F.MoKConfig(schedule_capacity_multiplier=1.0)
    inputs = make_inputs(args.tokens, shape.hidden_size, shape.intermediate_size, e, shape.topk,
                         seed=1, device="cuda")  # fmt: skip
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for size in (int(s) for s in args.sizes.split(",")):
        run, spaces = layer_step(size, inputs, e, config)
        run(True)
        torch.cuda.synchronize()
        ctas = spaces[0].megakernel_ctas or sms
        times = {p: median_ms(run, p, args.warmup, args.reps) for p in (False, True)}
        print(f"== {shape.name} P={size} ({ctas} CTAs per rank): fwd {times[False]:.3f} ms, "
              f"fwd+bwd {times[True]:.3f} ms", flush=True)  # fmt: skip
        for backward in (False, True):
            print(f" {'fwd+bwd' if backward else 'fwd'} timeline (us):")
            _print_lanes(_timeline(run, backward, size))
        if size > 1:
            print(" graph-replayed references (fwd ms, fwd+bwd ms):")
            refs = _references(shape, inputs, config, size, ctas, run, args.warmup,
                               args.reps)  # fmt: skip
            for name, (fwd, fwdbwd) in refs.items():
                print(f"  {name:36s} {fwd:8.3f} {fwdbwd:8.3f}", flush=True)
        for ws in spaces:
            ws.destroy()


if __name__ == "__main__":
    main()
