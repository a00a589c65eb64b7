"""``python -m benchmarks.moe``: mok against the baselines, every shape, one run (DESIGN.md §6).

One GPU: ``python -m benchmarks.moe --json out.json --png out.png``.
With LigerMoE importable (installed, on PYTHONPATH, or ``--liger-site DIR``) a one-GPU run adds
its ``liger`` rows, each shape and token count in its own process (benchmarks/liger.py);
``--no-liger`` drops them. The ``sonicmoe`` rows are attempted whenever SonicMoE is importable (or
in ``--sonic-site DIR``), each shape's token counts in one process of its own (benchmarks/sonic.py);
``--no-sonic`` drops them.
The MXFP8 row (CUDA only, forward and backward, against an FP8 GEMM ceiling): add ``--mxfp8``.
Ring reuse: ``--macrobatch 16384`` adds the ``mok-mb16384`` and ``mok-mb16384-gather`` rows
(MoKConfig.macrobatch_size 16384 with either macrobatch_replay), each against the mok row
(``ratio_vs_mok_bf16``: the mok row's time over the row's).
EP over N GPUs: ``torchrun --nproc-per-node N -m benchmarks.moe`` (time = slowest rank).
Smoke test on a CPU in seconds: ``python -m benchmarks.moe --quick --device cpu``.

Order: ceilings of this device, then per shape: inputs, fp32 reference, each implementation
checked against it (a failed check is reported and never timed), then timed per pass. Every
row carries the pass's roofline floor against this run's ceilings (benchmarks/roofline.py), a
timed one its time over that floor. On one GPU a SIGTERM (``timeout``) stops the measurements
(and any peer worker) where they are; the table and JSON still come out, the pair it was in
and those after it listed as not reached (JSON: ``interrupted`` says when).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from benchmarks import ep_traffic, liger, report, sonic
from benchmarks.baselines import DEFAULT_ALIGN, grouped_mm_works
from benchmarks.impls import Impl, baseline_impl
from benchmarks.inputs import MoeInputs, make_inputs
from benchmarks.mok_impls import (
    MOK_IMPLS,
    MXFP8,
    MXFP8_IMPLS,
    NOT_AVAILABLE,
    build_mok_macrobatch,
    describe_failure,
    macrobatch_name,
    unavailable_reason,
)
from benchmarks.peer_worker import PeerJob
from benchmarks.reference import MAX_REL_ERR, compare, reference_results
from benchmarks.roofline import flops, pass_floor
from benchmarks.shapes import RunShape, scale_for_run, select_shapes
from benchmarks.timing import TimingConfig, max_over_ranks, measure_ceilings, median, time_ms

PASSES = ("fwd", "fwdbwd", "bwd")
FLOOR_MODEL = (
    "max(FLOPs / sustained bf16 GEMM, bytes / copy bandwidth), both measured in this run; "
    "fwdbwd = fwd + bwd (benchmarks/roofline.py)"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__)
    parser.add_argument("--shapes", default="all", help="comma list of shape names, or all")
    parser.add_argument(
        "--tokens", default=None,
        help="tokens per GPU, one count or a comma list: a row per count (16384; quick 64)",
    )  # fmt: skip
    parser.add_argument("--passes", default=",".join(PASSES), help="comma list of fwd,fwdbwd,bwd")
    parser.add_argument("--shared", action="store_true", help="add a shared expert of width I")
    parser.add_argument("--align", type=int, default=DEFAULT_ALIGN, help="baseline group rows")
    parser.add_argument("--warmup", type=int, default=None, help="untimed reps (5; quick 1)")
    parser.add_argument("--reps", type=int, default=None, help="timed reps (20; quick 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--json", default=None, help="write results and provenance here")
    parser.add_argument("--png", default=None, help="write a bar chart here")
    parser.add_argument("--no-liger", action="store_true", help="leave out the LigerMoE rows")
    parser.add_argument(
        "--mxfp8", action="store_true",
        help="add the mok-mxfp8 row (CUDA only; weights quantised once, untimed)",
    )  # fmt: skip
    parser.add_argument(
        "--macrobatch", default="", metavar="SIZES",
        help="add mok rows with ring reuse: routed rows held at once (comma list of multiples "
        "of 256), each with both macrobatch replays, against the mok row",
    )  # fmt: skip
    parser.add_argument(
        "--virtual-ep", default=None, metavar="SIZES",
        help="one GPU: add rows of P-rank virtual EP groups (comma list, e.g. 2,8) against EP=1 "
        "(needs CUDA_DEVICE_MAX_CONNECTIONS > P)",
    )  # fmt: skip
    parser.add_argument(
        "--host-time", action="store_true",
        help="add the host (enqueue) time of one eager MoKExperts forward + backward per shape",
    )  # fmt: skip
    parser.add_argument("--liger-site", default=None, help="a site dir that holds LigerMoE")
    parser.add_argument("--no-sonic", action="store_true", help="leave out the SonicMoE rows")
    parser.add_argument("--sonic-site", default=None, help="a site dir that holds SonicMoE")
    parser.add_argument(
        "--sonic-timeout", type=float, default=sonic.DEFAULT_TIMEOUT_S,
        help="seconds a SonicMoE worker may take over one token count of a shape (its start "
        "included for the first) before it is killed (%(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--liger-timeout", type=float, default=liger.DEFAULT_TIMEOUT_S,
        help="seconds per shape before its LigerMoE worker is killed (%(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--time-limit", type=float, default=None, metavar="SECONDS",
        help="one GPU: start no shape and token count that would end past SECONDS from the "
        "run's start, expecting its own rows to take as long as the longest so far and each "
        "peer worker that will run in it as long as that peer's longest so far; peer timeouts "
        "are cut to the time left; those left are listed (JSON: not_reached), and the table "
        "and JSON come out",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error(f"--time-limit: expected seconds > 0, got {args.time_limit}")
    args.passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    bad = [p for p in args.passes if p not in PASSES]
    if bad:
        parser.error(f"--passes: unknown {bad}; expected a comma list of {PASSES}")
    try:
        args.tokens = parse_tokens(args.tokens) if args.tokens else [64 if args.quick else 16384]
    except ValueError as error:
        parser.error(str(error))
    try:
        args.macrobatch = parse_macrobatch(args.macrobatch)
    except ValueError as error:
        parser.error(str(error))
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.reps = args.reps or (3 if args.quick else 20)
    args.liger = None  # main: a LigerAvailability when the liger row is attempted
    args.sonic = None  # main: a SonicAvailability unless --no-sonic
    args.upcoming = ()  # main: the (shape, token count) pairs after the one being run
    args.liger_started = None  # liger_rows: the next pair's Liger worker, started ahead
    args.peer_s = {}  # liger_rows, sonic_rows: each peer worker's call in the pair being run
    return args


def parse_tokens(text: str) -> list[int]:
    """``--tokens``: ``"4096"`` or ``"2048,4096,16384"`` to token counts, in the order given."""
    return _counts("--tokens", text, text.split(","), "positive integers", lambda n: n >= 1)


def parse_macrobatch(text: str) -> list[int]:
    """``--macrobatch``: ``""`` (no ring rows) or ``"4096,16384"`` to sizes, multiples of 256
    (a macrobatch is a multiple of the minibatch, which is one of 256)."""
    items = [part for part in text.split(",") if part.strip()]
    return _counts(
        "--macrobatch", text, items, "multiples of 256", lambda n: n >= 256 and n % 256 == 0
    )


def _counts(flag: str, text: str, items, expected: str, valid) -> list[int]:
    """`items` of `flag`'s `text` as ints, each `valid`, repeats dropped, in the order given."""
    counts = []
    for item in (part.strip() for part in items):
        if not item.isdigit() or not valid(int(item)):
            raise ValueError(f"{flag}: expected {expected} separated by commas, got {text!r}")
        counts.append(int(item))
    return list(dict.fromkeys(counts))


def init_device(args) -> tuple[torch.device, int, int, object]:
    """Device, rank, world size and EP group (``None`` on one process); torchrun sets WORLD_SIZE."""
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return torch.device(kind), 0, 1, None
    local_rank = int(os.environ["LOCAL_RANK"])
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(kind)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", device_id=None)
    return device, dist.get_rank(), world_size, dist.group.WORLD


def check(impl: Impl, inputs: MoeInputs, reference: dict, group) -> dict:
    """Relative error of every output the reference has; same worst value on every rank."""
    out, state = impl.forward()
    results = {"out": out}
    if len(reference) > 1 and impl.backward is not None:
        results.update(impl.backward(state, inputs.grad_output))
    errors = compare(results, reference)
    worst = torch.tensor(max(errors.values()), dtype=torch.float64, device=inputs.x.device)
    if group is not None:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    result = {"rel_err": errors, "max_rel_err": float(worst)}
    if impl.state_bytes is not None:
        result["context_bytes"] = impl.state_bytes(state)
    return result


def refusal(check_result: dict, max_rel_err: float = MAX_REL_ERR) -> str | None:
    """Why a checked implementation is not timed (it raised, or its error is too large)."""
    if "error" in check_result:
        return check_result["error"]
    if check_result["max_rel_err"] > max_rel_err:
        return f"check failed: rel err {check_result['max_rel_err']:.2e} > {max_rel_err}"
    return None


def timed_fields(
    shape: RunShape,
    args,
    num_tokens: int,
    pass_name: str,
    ms: float,
    ceilings: dict,
    fp8: bool = False,
) -> dict:
    """A timed row's numbers; % of the GEMM ceiling only where the measured GEMM is one (and,
    for an ``fp8`` row, % of the FP8 GEMM's, where it was measured; same FLOP count)."""
    tflops = flops(shape, num_tokens, args.shared, pass_name) / (ms * 1e-3) / 1e12
    fields = {"status": "ok", "ms": ms, "tflops": tflops}
    floor = pass_floor(shape, num_tokens, args.shared, pass_name, ceilings)
    if floor is not None:
        fields["x_floor"] = ms / floor["ms"]
    if ceilings.get("gemm_is_ceiling", True):
        fields["pct_of_gemm_ceiling"] = 100 * tflops / ceilings["gemm_bf16_tflops"]
        fields["pct_of_sustained_gemm"] = 100 * tflops / ceilings["gemm_bf16_sustained_tflops"]
        if fp8 and ceilings.get("gemm_fp8_tflops"):
            fields["pct_of_fp8_ceiling"] = 100 * tflops / ceilings["gemm_fp8_tflops"]
    return fields


def floor_fields(shape: RunShape, args, num_tokens: int, pass_name: str, ceilings: dict) -> dict:
    """Every row's roofline floor (benchmarks/roofline.py): ``floor_ms`` and what it counts."""
    floor = pass_floor(shape, num_tokens, args.shared, pass_name, ceilings)
    return {} if floor is None else {"floor_ms": floor["ms"], "floor": floor}


def ep_traffic_fields(num_bytes: int, ms: float, ceilings: dict) -> dict:
    """A mok EP row's peer traffic: the bytes of the rank that moves the most, their rate over
    the whole pass, and that rate's share of the measured peer-copy bandwidth (CUDA)."""
    fields = {"peer_bytes": num_bytes, "peer_gbs": num_bytes / (ms * 1e-3) / 1e9}
    if ceilings.get("peer_copy_gbs"):
        fields["pct_of_peer_copy"] = 100 * fields["peer_gbs"] / ceilings["peer_copy_gbs"]
    return fields


def gemm_ceiling_note(device: torch.device, quick: bool) -> str | None:
    """Why the measured dense GEMM rate is no ceiling of the layer here, or ``None``."""
    if device.type != "cuda":
        # A CPU's bf16 matmul rate hangs on size and kernel path: the layer's small matmuls
        # have run at 5x the rate of its 512^3 one (rows read "510 % of GEMM").
        return f"on {device.type} a bf16 matmul rate, not a ceiling of the layer"
    if quick:
        return "--quick: a 512^3 GEMM is launch-bound, far below the GPU's ceiling"
    return None


def time_pass(impl: Impl, inputs: MoeInputs, pass_name: str, timing, group) -> float:
    """Median over reps of the slowest rank's ms for one pass (bwd: forward run untimed)."""
    device, grad_output = inputs.x.device, inputs.grad_output

    def forward(_):
        impl.forward()

    def forward_backward(_):
        _, state = impl.forward()
        impl.backward(state, grad_output)

    def backward(forward_result):
        impl.backward(forward_result[1], grad_output)

    if pass_name == "fwd":
        times = time_ms(device, timing, forward)
    elif pass_name == "fwdbwd":
        times = time_ms(device, timing, forward_backward)
    else:
        times = time_ms(device, timing, backward, setup=impl.forward)
    return median(max_over_ranks(times, device, group))


def build_impls(inputs: MoeInputs, args, group, probe) -> tuple[list[Impl], list[tuple]]:
    """Baseline first, then every mok row that can run here; (name, reason) of those that can't."""
    use_grouped_mm, detail = probe
    impls = [
        baseline_impl(
            inputs, align=args.align, use_grouped_mm=use_grouped_mm, detail=detail, group=group
        )
    ]
    missing = []
    builders = {**MOK_IMPLS, **(MXFP8_IMPLS if args.mxfp8 else {})}
    for size in args.macrobatch:
        for replay in ("gate_up", "gather"):
            builders[macrobatch_name(size, replay, inputs.x.device.type)] = functools.partial(
                build_mok_macrobatch, size=size, replay=replay
            )
    for name, build in builders.items():
        impl = build(inputs, group)
        if impl is None:
            missing.append((name, unavailable_reason(name)))
        else:
            impls.append(impl)
    return impls, missing


def compute_only_rows(
    shape, num_tokens, args, device, group, ceilings, base, emit
) -> tuple[list, dict]:
    """EP: each rank's compute-only time for its share, the slowest rank's: an EP = 1 mok layer
    of its E / P experts and T tokens routed top-k among them (the same routed rows per GPU,
    spread evenly), checked against its fp32 reference before it is timed. (rows, {pass: ms})."""
    local = dataclasses.replace(shape, num_experts=shape.experts_per_rank)
    row = {**base, "impl": "mok_compute_only", "label": "mok, EP = 1 on this rank's share",
           "baseline": False}  # fmt: skip
    status = None
    if local.topk > local.num_experts:
        status = f"no share to compare: topk {local.topk} > {local.num_experts} experts per GPU"
    else:
        inputs = make_inputs(local, num_tokens, rank=0, world_size=1, device=device,
                             seed=args.seed + 1, shared=args.shared)  # fmt: skip
        reference = reference_results(inputs, any(p != "fwd" for p in args.passes))
        inputs.release_group_tensors()
        impl = MOK_IMPLS["mok"](inputs, None)
        if impl is None:
            status = unavailable_reason("mok")
        else:
            try:
                checked = check(impl, inputs, reference, group)
            except Exception as error:  # the row says why, nothing is timed
                checked = {"error": describe_failure(error)}
                if not checked["error"].startswith(NOT_AVAILABLE):
                    raise  # another rank may be inside a collective: stop rather than hang
            status = refusal(checked)
            row.update({k: v for k, v in checked.items() if k != "error"})
        del reference
    rows, times = [], {}
    for pass_name in args.passes:
        pass_row = {**row, "pass": pass_name, **floor_fields(local, args, num_tokens, pass_name,
                                                                     ceilings)}  # fmt: skip
        if status is not None:
            pass_row["status"] = status
        else:
            ms = time_pass(impl, inputs, pass_name, args.timing, group)
            times[pass_name] = ms
            pass_row.update(timed_fields(local, args, num_tokens, pass_name, ms, ceilings))
        emit(pass_row)
        rows.append(pass_row)
    return rows, times


def run_shape(
    model, num_tokens, args, device, rank, world_size, group, ceilings, probe, emit
) -> list[dict]:
    """Every row of one shape at one token count per GPU."""
    shape = scale_for_run(model, world_size, args.quick)
    inputs = make_inputs(
        shape,
        num_tokens,
        rank=rank,
        world_size=world_size,
        device=device,
        seed=args.seed,
        shared=args.shared,
    )
    with_grads = any(p != "fwd" for p in args.passes)
    reference = reference_results(inputs, with_grads)
    inputs.release_group_tensors()
    impls, missing = build_impls(inputs, args, group, probe)
    base = {"shape": shape.as_dict(), "num_tokens": num_tokens, "world_size": world_size}
    traffic = None  # EP: the bytes mok's kernels move to and from peers, per pass (ep_traffic.py)
    if group is not None:
        traffic = ep_traffic.rank_pass_bytes(inputs.top_experts, shape.experts_per_rank,
                                             shape.hidden_size, group)  # fmt: skip
    checks = {}
    for impl in impls:
        try:
            checks[impl.name] = check(impl, inputs, reference, group)
        except Exception as error:  # reported in its rows; the other impls still run
            status = describe_failure(error)
            if group is not None and not status.startswith(NOT_AVAILABLE):
                # Another rank may be inside a collective: stop rather than hang. A missing
                # kernel is raised alike on every rank, so it is reported instead.
                raise
            checks[impl.name] = {"error": status}
    del reference
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows, best_baseline, mok_bf16_ms, compute_only = [], {}, {}, {}
    if group is not None:
        rows, compute_only = compute_only_rows(
            shape, num_tokens, args, device, group, ceilings, base, emit
        )
    for impl in impls:
        for pass_name in args.passes:
            row = {
                **base,
                "pass": pass_name,
                **floor_fields(shape, args, num_tokens, pass_name, ceilings),
                "impl": impl.name,
                "label": impl.label,
                "baseline": impl.is_baseline,
                **checks[impl.name],
            }
            status = refusal(row, impl.max_rel_err)
            if status is None and impl.backward is None and pass_name != "fwd":
                status = impl.no_backward
            row.pop("error", None)
            if status is not None:
                row["status"] = status
            else:
                ms = time_pass(impl, inputs, pass_name, args.timing, group)
                if impl.is_baseline:
                    best_baseline[pass_name] = min(ms, best_baseline.get(pass_name, ms))
                if impl.name in ("mok", "mok_cpu_path"):  # the bf16 mok row, GPU or CPU
                    mok_bf16_ms[pass_name] = ms
                fp8 = impl.name == MXFP8
                row.update(timed_fields(shape, args, num_tokens, pass_name, ms, ceilings, fp8))
                if pass_name in best_baseline:
                    row["speedup"] = best_baseline[pass_name] / ms
                if (impl.name == MXFP8 or impl.vs_mok) and pass_name in mok_bf16_ms:
                    row["ratio_vs_mok_bf16"] = mok_bf16_ms[pass_name] / ms
                if traffic is not None and impl.name in ("mok", "mok_cpu_path"):
                    row.update(ep_traffic_fields(traffic[pass_name], ms, ceilings))
                    if pass_name in compute_only:
                        row["vs_compute_only"] = ms / compute_only[pass_name]
            emit(row)
            rows.append(row)
    for name, reason in missing:
        for pass_name in args.passes:
            row = {
                **base,
                "pass": pass_name,
                **floor_fields(shape, args, num_tokens, pass_name, ceilings),
                "impl": name,
                "label": name,
                "baseline": False,
                "status": reason,
            }
            emit(row)
            rows.append(row)
    if args.liger is not None or sonic_runs(shape, args, device, world_size):
        # A worker needs the GPU's memory: free what this process holds first.
        del impls, inputs
        gc.collect()
        torch.cuda.empty_cache()
    if args.liger is not None:
        rows += liger_rows(shape, num_tokens, args, device, base, best_baseline, ceilings, emit)
    if args.sonic is not None:
        rows += sonic_rows(shape, num_tokens, args, device, world_size, base, best_baseline,
                           ceilings, emit)  # fmt: skip
    return rows


def liger_rows(shape, num_tokens, args, device, base, best_baseline, ceilings, emit) -> list[dict]:
    """LigerMoE's rows of one shape, measured by its own worker process (benchmarks/liger.py)."""
    availability = args.liger
    label = availability.label()
    status = availability.reason or liger.unsupported_reason(shape.swiglu_limit, args.shared)
    job = liger_job(shape, num_tokens, args, device) if status is None else None
    started, args.liger_started = args.liger_started, None
    if started is not None and (job is None or not started.job.same_work(job)):
        started.stop()  # started for a pair that was skipped
        started = None
    if job is None:
        outcomes, result = {p: {"status": status} for p in args.passes}, {}
    else:
        began = time.monotonic()
        result = liger.run_job(job, availability, started=started)
        args.peer_s["liger"] = time.monotonic() - began
        outcomes = liger.pass_outcomes(result, job.passes)
    rows = peer_rows("liger", label, outcomes, result, shape, num_tokens, args, base,
                     best_baseline, ceilings, emit)  # fmt: skip
    start_next_liger(args, device)
    return rows


def liger_runs(shape, args) -> bool:
    """Whether LigerMoE's worker runs for ``shape`` (a model or run shape): found, and its
    layer computes this shape's function."""
    return (
        args.liger is not None
        and args.liger.reason is None
        and liger.unsupported_reason(shape.swiglu_limit, args.shared) is None
    )


def sonic_runs(shape, args, device, world_size: int) -> bool:
    """Whether SonicMoE's worker runs for ``shape`` here (found, CUDA, EP=1, its function)."""
    return args.sonic is not None and (
        sonic.skip_reason(args.sonic, device.type, world_size, shape.swiglu_limit, args.shared)
        is None
    )


def liger_job(shape, num_tokens, args, device) -> liger.LigerJob:
    """The Liger worker's job for one shape at one token count, its heap sized for it."""
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    heap_gib = liger.symmetric_heap_gib(
        num_tokens, shape.num_experts, shape.hidden_size, shape.topk, sm_count
    )
    return liger.LigerJob(
        **peer_job_fields(shape, (num_tokens,), args, device, args.liger_timeout),
        heap_gib=heap_gib,
    )


# GPU memory a started Liger worker must leave free beside its heap, for the rows measured
# while it waits (the next pair's inputs, fp32 reference and mok's rows, and the SonicMoE
# worker's), in GiB; with less free the next worker starts in its turn, as every one did before.
LIGER_START_HEADROOM_GIB = 64


def start_next_liger(args, device) -> None:
    """Start the Liger worker of the next pair that has one (``args.upcoming``) now: its start
    (imports, NVSHMEM and Liger's configure, 10-15 s a worker) then runs beside the rows
    measured before its turn, and it waits, configured, for its gate before any GPU stage of
    its own (inputs, reference, check, timing). Only if the GPU has its heap and
    ``LIGER_START_HEADROOM_GIB`` free."""
    upcoming = next(((m, t) for m, t in args.upcoming if liger_runs(m, args)), None)
    if upcoming is None:
        return
    model, num_tokens = upcoming
    job = liger_job(scale_for_run(model, 1, args.quick), num_tokens, args, device)
    free, _total = torch.cuda.mem_get_info(device)
    if free < (job.heap_gib + LIGER_START_HEADROOM_GIB) * 2**30:
        return
    args.liger_started = liger.start(job, args.liger)


def peer_job_fields(shape, tokens: tuple[int, ...], args, device, timeout_s: float) -> dict:
    """A peer worker's PeerJob fields for one shape and token counts of this run. Under
    --time-limit a token count's timeout is at most the time left (at least 10 s)."""
    if args.time_limit is not None:
        timeout_s = min(timeout_s, max(10.0, args.run_start + args.time_limit - time.monotonic()))
    return dict(
        shape=shape.name,
        tokens=tuple(tokens),
        quick=args.quick,
        seed=args.seed,
        passes=tuple(args.passes),
        warmup=args.warmup,
        reps=args.reps,
        device_index=device.index if device.index is not None else torch.cuda.current_device(),
        timeout_s=timeout_s,
        result_path="",  # run_job gives it a folder of its own
    )


def sonic_rows(
    shape, num_tokens, args, device, world_size, base, best_baseline, ceilings, emit
) -> list[dict]:
    """SonicMoE's rows of one shape at one token count, or the reason it is not run here. The
    shape's first call runs its worker (benchmarks/sonic.py) over every token count of the run,
    and keeps the results in ``args.sonic_results`` for the later ones."""
    availability = args.sonic
    status = sonic.skip_reason(
        availability, device.type, world_size, shape.swiglu_limit, args.shared
    )
    if status is not None:
        outcomes, result = {p: {"status": status} for p in args.passes}, {}
    else:
        results = args.sonic_results
        if shape.name not in results:
            fields = peer_job_fields(shape, args.tokens, args, device, args.sonic_timeout)
            began = time.monotonic()
            results[shape.name] = sonic.run_job(PeerJob(**fields), availability)
            args.peer_s["sonic"] = time.monotonic() - began
        result = results[shape.name][num_tokens]
        outcomes = sonic.pass_outcomes(result, tuple(args.passes))
    label = availability.label() if availability.available else "SonicMoE"
    return peer_rows("sonicmoe", label, outcomes, result, shape, num_tokens, args, base,
                     best_baseline, ceilings, emit)  # fmt: skip


def peer_rows(
    name, label, outcomes, result, shape, num_tokens, args, base, best_baseline, ceilings, emit
) -> list[dict]:
    """A peer's rows from its worker's per-pass outcomes (benchmarks/peer_worker.py)."""
    rows, log_tail = [], result.get("log_tail")
    for pass_name, outcome in outcomes.items():
        row = {**base, "pass": pass_name, **floor_fields(shape, args, num_tokens, pass_name, ceilings),
               "impl": name, "label": label, "baseline": False}  # fmt: skip
        row.update(outcome)
        if outcome["status"] == "ok":
            row.update(timed_fields(shape, args, num_tokens, pass_name, outcome["ms"], ceilings))
            if pass_name in best_baseline:
                row["speedup"] = best_baseline[pass_name] / outcome["ms"]
        elif log_tail:
            row["log_tail"], log_tail = log_tail, None  # printed once, under the first failure
        if result.get("info"):
            row["peer"] = result["info"]
        if "wall_s" in result:  # its worker's time on this token count (run_worker)
            row["worker_s"] = result["wall_s"]
        if result.get("stage_s"):  # where that time went: each stage's start (Progress)
            row["worker_stage_s"] = result["stage_s"]
        if result.get("compiles"):  # what it compiled on this token count (sonic.py)
            row["worker_compiles"] = result["compiles"]
        emit(row)
        rows.append(row)
    return rows


def liger_availability(args, device: torch.device, world_size: int):
    """Where LigerMoE is, when its rows are attempted (CUDA, EP=1, not --no-liger); else None."""
    if args.no_liger or device.type != "cuda" or world_size != 1:
        return None
    return liger.find_liger(args.liger_site)


def extra_sections(args, device, world_size) -> dict:
    """The virtual-EP rows and host times (one GPU, CUDA only), printed and returned for JSON."""
    from benchmarks import host_time, virtual_ep  # noqa: PLC0415 - CUDA-only sections

    extra = {}
    names = [m.name for m in select_shapes(args.shapes)]
    if args.virtual_ep and device.type == "cuda" and world_size == 1:
        sizes = [int(s) for s in args.virtual_ep.split(",")]
        extra["virtual_ep"] = []
        for num_tokens in args.tokens:
            print(f"\nvirtual EP on one GPU ({num_tokens} tokens in all, split over P ranks):")
            extra["virtual_ep"] += virtual_ep.measure(names, sizes, num_tokens)
    if args.host_time and device.type == "cuda":
        extra["host_time"] = []
        for name in (n for n in names if n in host_time.SHAPES):
            result = host_time.measure(name, host_time.DEFAULT_TOKENS)
            extra["host_time"].append({"shape": name, "num_tokens": host_time.DEFAULT_TOKENS,
                                       **result})  # fmt: skip
            print(
                f"host time {name} T={host_time.DEFAULT_TOKENS}: eager MoKExperts forward + "
                f"backward {result['host_ms']:.3f} ms host, {result['gpu_ms']:.3f} ms GPU back to "
                f"back ({result['host_idle_gpu_ms']:.3f} ms host with the GPU idle at each step)"
            )
    return extra


@dataclasses.dataclass
class PairClock:
    """What ``--time-limit`` expects the next shape and token count to take, from those so far.

    A pair's wall time is the harness' own part (inputs, reference, baselines, mok) and each
    peer worker's call in it: LigerMoE's at every supported pair (10-19 s, most of it its
    start), SonicMoE's at a shape's first pair only, where it runs every token count and, on a
    machine that has not compiled the shape, compiles for minutes (docs/NOTES.md §4). So a
    pair is expected to take the longest harness part so far plus, for each worker that will
    run in it, that peer's longest call so far; a peer with no call yet counts as long as the
    longest whole pair. A pair with no peer worker (a clamped shape) is then expected to take
    seconds, not the minutes of a shape's first pair with both.
    """

    harness_s: float = 0.0
    pair_s: float = 0.0
    peer_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def expect(self, peers: tuple[str, ...]) -> float:
        return self.harness_s + sum(self._peer(p) for p in peers)

    def _peer(self, peer: str) -> float:
        return self.peer_s.get(peer, self.pair_s)

    def record(self, seconds: float, peer_s: dict[str, float]) -> None:
        """One pair's wall time and its peer workers' calls (``args.peer_s``)."""
        self.pair_s = max(self.pair_s, seconds)
        self.harness_s = max(self.harness_s, seconds - sum(peer_s.values()))
        for peer, spent in peer_s.items():
            self.peer_s[peer] = max(self.peer_s.get(peer, 0.0), spent)

    def describe(self, peers: tuple[str, ...]) -> str:
        parts = [f"harness {self.harness_s:.0f} s"]
        parts += [f"{p} {self._peer(p):.0f} s" for p in peers]
        return " + ".join(parts)


def pair_peers(model, args, device, world_size: int) -> tuple[str, ...]:
    """The peer workers that will run for ``model``'s next token count: LigerMoE's where its
    layer computes this shape's function, SonicMoE's likewise at the shape's first pair."""
    first = model.name not in args.sonic_results
    return (("liger",) if liger_runs(model, args) else ()) + (
        ("sonic",) if first and sonic_runs(model, args, device, world_size) else ()
    )


# What main keeps on args that is not an argument (left out of the JSON's "args").
PROCESS_STATE = ("timing", "liger", "sonic", "sonic_results", "run_start", "upcoming",
                 "liger_started", "peer_s")  # fmt: skip


class Interrupted(BaseException):
    """A SIGTERM during the measurements (one GPU): main stops them and reports what it has.
    Not an Exception, so the handlers that turn an implementation's error into its row's
    status let it through, as they do KeyboardInterrupt."""


def _interrupt(signum, _frame):
    raise Interrupted(f"interrupted by {signal.Signals(signum).name}")


def measure_in_order(order, args, device, rank, world_size, group, ceilings, probe, emit,
                     rows, not_reached, lead) -> None:  # fmt: skip
    """Every (shape, token count) of ``order`` in turn, rows into ``rows``; under --time-limit
    each one that would end past it into ``not_reached`` instead. Interrupted, it puts every
    pair neither measured nor listed yet into ``not_reached`` too, and raises on (the signal
    may land anywhere in a pair, before or after its rows are in)."""
    run_start = args.run_start
    clock = PairClock()
    try:
        for index, (model, num_tokens) in enumerate(order):
            args.upcoming = tuple(order[index + 1 :])
            start = time.monotonic()
            peers = pair_peers(model, args, device, world_size)
            estimate = clock.expect(peers)
            if args.time_limit is not None and start - run_start + estimate > args.time_limit:
                print(f"  ({model.name} {num_tokens} tokens: not started, {start - run_start:.0f} s "
                      f"into the run, {estimate:.0f} s expected ({clock.describe(peers)}): "
                      f"--time-limit {args.time_limit:.0f})", flush=True)  # fmt: skip
                not_reached.append({"shape": model.name, "num_tokens": num_tokens})
                continue
            args.peer_s = {}
            new_rows = run_shape(model, num_tokens, args, device, rank, world_size, group,
                                 ceilings, probe, emit)  # fmt: skip
            rows += new_rows
            gc.collect()
            end = time.monotonic()
            clock.record(end - start, args.peer_s)
            if lead:
                print(report.progress_line(new_rows, end - start, end - run_start), flush=True)
    except Interrupted:
        done = {(n["shape"], n["num_tokens"]) for n in not_reached}
        done |= {(row["shape"]["name"], row["num_tokens"]) for row in rows}
        not_reached.extend({"shape": m.name, "num_tokens": t} for m, t in order
                           if (m.name, t) not in done)  # fmt: skip
        raise


def main(argv: list[str] | None = None) -> int:
    # NVLink multicast (NVLS) can take shared GPU hosts out of service: never use it.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    args = parse_args(argv)
    args.run_start = time.monotonic()  # the run's clock (progress lines, --time-limit)
    args.timing = TimingConfig(warmup=args.warmup, reps=args.reps)
    device, rank, world_size, group = init_device(args)
    if args.time_limit is not None and group is not None:
        # Each rank's clock would decide alone, and a rank that skips leaves the others waiting.
        raise SystemExit(f"--time-limit: one GPU only (world size {world_size})")
    lead = rank == 0

    def emit(row):
        if lead:
            print(report.format_row(row), flush=True)

    ceilings = measure_ceilings(device, args.quick, args.timing)
    if group is not None and device.type == "cuda":
        ceilings["peer_copy_gbs"] = ep_traffic.peer_copy_gbs(
            device, group, args.timing, (8 << 20) if args.quick else ep_traffic.PEER_COPY_BYTES
        )
    note = gemm_ceiling_note(device, args.quick)
    ceilings.update(gemm_is_ceiling=note is None, gemm_ceiling_note=note)
    probe = grouped_mm_works(device)
    args.liger = liger_availability(args, device, world_size)
    args.sonic = None if args.no_sonic else sonic.find_sonic(args.sonic_site)
    args.sonic_results = {}  # shape name -> token count -> its worker's result (sonic_rows)
    if lead:
        print(f"device {device}, world size {world_size}, torch {torch.__version__}")
        print(report.ceilings_line(ceilings))
        print(f"floor of a pass: {FLOOR_MODEL}")
        print(f"torch._grouped_mm: {probe[1]}")
        if args.liger is not None:
            print(f"liger: {args.liger.reason or args.liger.label() + ' at ' + args.liger.site}")
        elif device.type == "cuda" and world_size != 1 and not args.no_liger:
            print(f"liger: not run: its rows are measured at EP=1 (world size {world_size})")
        if args.sonic is not None:
            where = f" at {args.sonic.site}" if args.sonic.available else ""
            print(f"sonicmoe: {args.sonic.reason or args.sonic.label() + where}")
    rows, not_reached, interrupted = [], [], None
    order = [
        (model, num_tokens) for model in select_shapes(args.shapes) for num_tokens in args.tokens
    ]
    # One GPU: a SIGTERM (`timeout`) stops the measurements where they are, and the run still
    # prints its table and writes its JSON with what it measured.
    main_thread = threading.current_thread() is threading.main_thread()
    on_term = signal.signal(signal.SIGTERM, _interrupt) if group is None and main_thread else None
    try:
        measure_in_order(order, args, device, rank, world_size, group, ceilings, probe, emit,
                         rows, not_reached, lead)  # fmt: skip
    except Interrupted as error:
        interrupted = f"{error} {time.monotonic() - args.run_start:.0f} s into the run"
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
        if args.liger_started is not None:  # started for a pair the run did not reach
            args.liger_started.stop()
    extra = extra_sections(args, device, world_size) if lead and interrupted is None else {}
    if lead:
        print()
        print(report.summary_table(rows))
        if not_reached:
            left = ", ".join(f"{n['shape']} {n['num_tokens']}" for n in not_reached)
            why = interrupted or f"--time-limit {args.time_limit:.0f} s"
            print(f"not reached ({why}): {left}")
        record = {
            "provenance": report.provenance(device, world_size),
            "args": {k: v for k, v in vars(args).items() if k not in PROCESS_STATE},
            "liger": dataclasses.asdict(args.liger) if args.liger is not None else None,
            "sonic": dataclasses.asdict(args.sonic) if args.sonic is not None else None,
            "timing": {"warmup": args.warmup, "reps": args.reps, "statistic": "median"},
            "reference": "benchmarks.reference.moe_reference: fp32 per-expert loop, autograd",
            "max_rel_err": MAX_REL_ERR,
            "floor_model": FLOOR_MODEL,
            "grouped_mm_probe": probe[1],
            "ceilings": ceilings,
            "rows": rows,
            "not_reached": not_reached,
            "interrupted": interrupted,
            **extra,
        }
        if args.json:
            report.write_json(args.json, record)
            print(f"wrote {args.json}")
        if args.png:
            where = record["provenance"]["gpu"] or str(device)
            tokens = ",".join(str(t) for t in args.tokens)
            title = f"MoE layer, {tokens} tokens/GPU, EP {world_size}, {where}"
            print(report.write_png(args.png, rows, ceilings, title))
    if group is not None:
        dist.barrier(group)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
