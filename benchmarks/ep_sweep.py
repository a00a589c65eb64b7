"""mok's EP settings swept: ``fwd_num_comm_sms``, ``bwd_num_comm_sms`` and ``minibatch_size``.

    torchrun --nproc-per-node N -m benchmarks.ep_sweep [--shapes qwen3-30b-a3b] [--tokens 16384]
    CUDA_DEVICE_MAX_CONNECTIONS=16 python -m benchmarks.ep_sweep --virtual-ep 2   # one GPU

One setting at a time, the others at their defaults: each forward communication-CTA count is
timed on the forward, each backward count on the backward (its forward untimed), each
minibatch size on forward + backward. Real ranks (torchrun): the slowest rank's median, as
benchmarks.moe times. A virtual group (one GPU, mok.virtual_ep): the median replay of a CUDA
graph of the P ranks' step (the device's time; the forward-only graph for the forward counts,
the training step's for the others). Every setting's outputs are first checked bitwise against
the defaults' (mok's results do not depend on these settings); a setting that differs or
raises is reported, never timed. The last lines give the fastest value of each setting.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks import moe
from benchmarks.inputs import make_inputs
from benchmarks.mok_impls import _build_mok_bf16
from benchmarks.shapes import SHAPES, scale_for_run, select_shapes
from benchmarks.timing import TimingConfig

# Setting -> (values tried, the pass it is timed on). Communication CTAs must be even.
SWEEPS = {
    "fwd_num_comm_sms": ((0, 2, 4, 8, 16, 24, 32), "fwd"),
    "bwd_num_comm_sms": ((0, 2, 4, 8, 16, 24, 32), "bwd"),
    "minibatch_size": ((4096, 8192, 16384, 32768, 65536, 131072), "fwdbwd"),
}
QUICK_VALUES = {
    "fwd_num_comm_sms": (0, 2),
    "bwd_num_comm_sms": (0, 2),
    "minibatch_size": (256, 512),
}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _real_rank_runs(shape, args, device, rank, world_size, group):
    """runs(settings) -> (outputs, time(pass) -> ms, close()) over real ranks (or one
    process)."""
    inputs = make_inputs(shape, args.tokens, rank=rank, world_size=world_size, device=device,
                         seed=args.seed, shared=False)  # fmt: skip
    inputs.release_group_tensors()

    def runs(settings):
        impl = _build_mok_bf16(inputs, group, settings)
        if impl is None:
            raise RuntimeError("mok is not available here (benchmarks.mok_impls)")
        out, state = impl.forward()
        outputs = {"out": out, **impl.backward(state, inputs.grad_output)}

        def time(pass_name):
            return moe.time_pass(impl, inputs, pass_name, args.timing, group)

        return outputs, time, lambda: None

    return runs


def _virtual_runs(shape, args, size):
    """The same over a virtual group of `size` ranks on one GPU (CUDA graph replays)."""
    from benchmarks import virtual_ep  # noqa: PLC0415 - CUDA only
    from mok import functional as F  # noqa: PLC0415
    from mok import testing  # noqa: PLC0415

    e = shape.experts_one_gpu
    inputs = testing.make_inputs(args.tokens, shape.hidden_size, shape.intermediate_size, e,
                                 shape.topk, seed=args.seed, device="cuda")  # fmt: skip

    def runs(settings):
        config = F.MoKConfig(schedule_capacity_multiplier=1.0, **settings)
        run, spaces = virtual_ep.layer_step(size, inputs, e, config)
        outputs = dict(zip(("out", "x", "router_weights"), run(True), strict=True))
        graphs = {}

        def time(pass_name):
            backward = pass_name != "fwd"
            if backward not in graphs:
                graphs[backward] = virtual_ep.graph_of(run, backward)
            ms = virtual_ep.median_ms(graphs[backward], backward, args.warmup, args.reps)
            if pass_name == "bwd":  # the training step's time less the forward's
                if False not in graphs:
                    graphs[False] = virtual_ep.graph_of(run, False)
                ms -= virtual_ep.median_ms(graphs[False], False, args.warmup, args.reps)
            return ms

        def close():
            for ws in spaces:
                ws.destroy()

        return outputs, time, close

    return runs


def sweep_shape(runs, values: dict, emit) -> list[dict]:
    """Rows of one shape: every value of every setting, checked against the defaults."""
    expected, _, close = runs({})
    close()
    rows = []
    for setting, (tried, pass_name) in values.items():
        for value in tried:
            row = {"setting": setting, "value": value, "pass": pass_name}
            try:
                outputs, time, close = runs({setting: value})
            except (ValueError, RuntimeError) as error:  # a value the config or group refuses
                row["status"] = f"error: {type(error).__name__}: {error}"
            else:
                if not _same(outputs, expected):
                    row["status"] = "outputs differ from the defaults'"
                else:
                    row["status"], row["ms"] = "ok", time(pass_name)
                close()
            emit(row)
            rows.append(row)
    return rows


def best_values(rows: list[dict]) -> dict:
    """{setting: fastest value} over the rows that were timed."""
    best = {}
    for row in rows:
        if row["status"] == "ok":
            kept = best.get(row["setting"])
            if kept is None or row["ms"] < kept["ms"]:
                best[row["setting"]] = row
    return {setting: row["value"] for setting, row in best.items()}


def format_row(shape_name: str, row: dict) -> str:
    head = f"{shape_name:<16} {row['setting']:<18} {row['value']:>7} {row['pass']:<6}"
    if row["status"] != "ok":
        return f"{head} {row['status']}"
    return f"{head} {row['ms']:9.3f} ms"


def main(argv: list[str] | None = None) -> int:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ep_sweep", description=__doc__)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per GPU (16384)")
    parser.add_argument("--virtual-ep", type=int, default=None, metavar="P",
                        help="one GPU: a virtual group of P ranks (tokens: the whole group's)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and two values each")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (64 if args.quick else 16384)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.reps = args.reps or (3 if args.quick else 10)
    args.timing = TimingConfig(warmup=args.warmup, reps=args.reps)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    values = {name: (QUICK_VALUES[name] if args.quick else tried, pass_name)
              for name, (tried, pass_name) in SWEEPS.items()}  # fmt: skip
    names = [m.name for m in select_shapes(args.shapes)]
    if args.virtual_ep is not None:
        if args.device != "cuda":
            parser.error("--virtual-ep needs CUDA")
        rank, world_size, group, lead = 0, args.virtual_ep, None, True
    else:
        device, rank, world_size, group = moe.init_device(args)
        lead = rank == 0
    if lead:
        where = f"virtual group of {world_size}" if args.virtual_ep else f"{world_size} rank(s)"
        print(f"EP settings sweep on {where}, {args.tokens} tokens, device {args.device}")
    result = {"world_size": world_size, "virtual": args.virtual_ep is not None, "shapes": []}
    for model in (m for m in SHAPES if m.name in names):
        if args.virtual_ep is not None:
            runs = _virtual_runs(model, args, args.virtual_ep)
        else:
            shape = scale_for_run(model, world_size, args.quick)
            runs = _real_rank_runs(shape, args, device, rank, world_size, group)

        def emit(row, name=model.name):
            if lead:
                print(format_row(name, row), flush=True)

        rows = sweep_shape(runs, values, emit)
        best = best_values(rows)
        if lead:
            print(f"{model.name}: fastest " + ", ".join(f"{k} = {v}" for k, v in best.items()))
        result["shapes"].append({"shape": model.name, "rows": rows, "fastest": best})
    if args.json and lead:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
