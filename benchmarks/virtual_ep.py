"""Virtual-EP rows: the P-rank layer on one GPU (mok.virtual_ep) against EP = 1 on the same
global problem, in one run.

    CUDA_DEVICE_MAX_CONNECTIONS=16 python -m benchmarks.virtual_ep --sizes 2,8

For each shape (16384 tokens in all, split contiguously; experts split contiguously) and each
P: forward and forward + backward time (CUDA events around every rank's queued work, so the
slowest rank decides), the ratio to EP = 1, and the bytes each rank pulls and pushes through
peer memory (rows whose token lives on another rank). Each time is taken twice: issued eagerly
(one host thread issues every rank's ops, phase by phase) and replayed from a CUDA graph of the
same step (the device's time: real ranks issue in parallel, so the virtual group's serial issue
is not theirs). EP = 1 and the P-rank layer alternate round by round; the ratio is the median
of the rounds' ratios. Every P's outputs are checked bitwise against EP = 1 before timing.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks import ep_traffic
from benchmarks.shapes import SHAPES
from mok import functional as F
from mok.testing import WEIGHT_NAMES, make_inputs, rank_inputs
from mok.virtual_ep import VirtualEPGroup


def layer_step(size, inputs, num_experts, config):
    """(forward step, training step) closures of a virtual group of `size` ranks."""
    group = VirtualEPGroup(size)
    t, h = inputs["x"].shape
    k = inputs["top_experts"].shape[1]
    local_experts = num_experts // size
    spaces = group.workspaces(config, num_local_tokens=t // size, hidden_size=h, topk=k,
                              num_local_experts=local_experts)  # fmt: skip
    shards = [rank_inputs(inputs, rank, size) for rank in range(size)]

    def weights(rank):
        return [shards[rank][n] for n in WEIGHT_NAMES]

    def schedule(rank):
        return F.build_schedule(spaces[rank], config, shards[rank]["top_experts"],
                                num_local_experts=local_experts)  # fmt: skip

    def run(backward):
        # Phase by phase over the ranks (every rank's schedule, then every rank's forward, then
        # every rank's backward), as concurrent ranks issue them: a rank's device barrier then
        # waits for its peers' same phase, not for their whole step to be queued behind it.
        schedules = group.run(schedule)
        fwd = group.run(lambda r: F.forward(config, spaces[r], schedules[r], shards[r]["x"],
                                            shards[r]["router_weights"], *weights(r)))  # fmt: skip
        results = [(out,) for out, _ in fwd]
        if backward:
            grads = group.run(lambda r: F.backward(
                config, spaces[r], schedules[r], fwd[r][1], shards[r]["grad_output"],
                shards[r]["x"], shards[r]["router_weights"], *weights(r),
            ))  # fmt: skip
            results = [(out, *g[:2]) for (out,), g in zip(results, grads, strict=True)]
        group.join()
        return [torch.cat([r[i] for r in results]) for i in range(len(results[0]))]

    run.group = group
    return run, spaces


def _median(values):
    return sorted(values)[len(values) // 2]


def median_ms(run, backward, warmup, reps):
    """Median ms of `reps` runs of run(backward), each from an idle GPU, after `warmup`."""
    for _ in range(warmup):
        run(backward)
    return _median([_once(run, backward) for _ in range(reps)])


def _once(run, backward):
    """ms of one run(backward) from an idle GPU (CUDA events on the caller's stream)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(backward)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def graph_of(run, backward):
    """A replay closure of run(backward) captured once in a CUDA graph: the device's time with no
    host issue in it (one host thread issues all P ranks' ops eagerly; real ranks issue theirs
    in parallel). The first call runs outside capture (plans, modules, the error record)."""
    run(backward)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(backward)
    return lambda _: graph.replay()


def paired(base, run, backward, warmup, reps):
    """(median ms of run, median ms of base, median of the per-round ratios run / base): the two
    alternate round by round, so a drift of the GPU's clocks moves both alike."""
    for _ in range(warmup):
        base(backward)
        run(backward)
    rounds = [(_once(run, backward), _once(base, backward)) for _ in range(reps)]
    return (_median([r for r, _ in rounds]), _median([b for _, b in rounds]),
            _median([r / b for r, b in rounds]))  # fmt: skip


def _peer_bytes(inputs, num_experts, size):
    """Bytes one rank pulls (= pushes) per pass at most: rows of its experts from other ranks."""
    t, h = inputs["x"].shape
    owners = list((inputs["top_experts"] // (num_experts // size)).split(t // size))
    return max(ep_traffic.remote_rows_per_rank(owners, size)) * h * 2


def measure(shape_names, sizes, tokens=16384, warmup=2, reps=5) -> list[dict]:
    """One row per (shape, P): times, ratios to EP = 1, peer bytes, bitwise equality."""
    config = F.MoKConfig(schedule_capacity_multiplier=1.0)
    rows = []
    for shape in (s for s in SHAPES if s.name in shape_names):
        e = shape.experts_one_gpu
        inputs = make_inputs(tokens, shape.hidden_size, shape.intermediate_size, e,
                             shape.topk, seed=1, device="cuda")  # fmt: skip
        one, _ = layer_step(1, inputs, e, config)
        expected = one(True)
        one_graph = {p: graph_of(one, p) for p in (False, True)}
        for size in sizes:
            run, spaces = layer_step(size, inputs, e, config)
            got = run(True)
            same = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
            eager = {p: paired(one, run, p, warmup, reps) for p in (False, True)}
            replayed = {p: paired(one_graph[p], graph_of(run, p), p, warmup, reps)
                        for p in (False, True)}  # fmt: skip
            row = {"shape": shape.name, "num_tokens": tokens, "P": size,
                   "bitwise_equal_to_ep1": same}  # fmt: skip
            for mode, times in (("", eager), ("_graph", replayed)):
                for p, name in ((False, "fwd"), (True, "fwdbwd")):
                    ms, ep1_ms, ratio = times[p]
                    row |= {f"{name}{mode}_ms": ms, f"{name}{mode}_ep1_ms": ep1_ms,
                            f"{name}{mode}_ratio": ratio}  # fmt: skip
            row["peer_bytes_per_rank_per_pass"] = _peer_bytes(inputs, e, size)
            rows.append(row)
            print(
                f"{shape.name:16s} P={size}  "
                + "  ".join(
                    f"{label} {row[key + '_ms']:8.3f} ms vs EP=1 {row[key + '_ep1_ms']:8.3f} "
                    f"({row[key + '_ratio']:.3f}x)"
                    for label, key in (
                        ("fwd", "fwd"),
                        ("fwd+bwd", "fwdbwd"),
                        ("graph fwd", "fwd_graph"),
                        ("graph fwd+bwd", "fwdbwd_graph"),
                    )
                )
                + f"  pulled = pushed per rank per pass "
                f"{row['peer_bytes_per_rank_per_pass'] / 1e6:8.1f} MB  bitwise {same}",
                flush=True,
            )
            for ws in spaces:
                ws.destroy()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.virtual_ep", description=__doc__)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--sizes", default="2,8")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = measure(args.shapes.split(","), sizes, args.tokens, args.warmup, args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
