"""Where the megakernels' time goes, phase by phase and CTA by CTA (a diagnostic build).

    cp -r mok/dsl_kernels/cubins /tmp/timeline
    python -m mok.dsl_kernels.build --arch sm_90a --only moe_forward --set timeline=True --out /tmp/timeline
    python -m mok.dsl_kernels.build --arch sm_90a --only moe_backward --set timeline=True --out /tmp/timeline
    MOK_KERNEL_DIR=/tmp/timeline python -m tools.phase_timeline [--shape qwen3-30b-a3b] [--tokens 2048,4096]

The diagnostic builds of `moe_forward` and `moe_backward` (config `timeline`; the shipped cubins
have none of it) stamp `%globaltimer` at each CTA's phase boundaries (each kernel's
TIMELINE_SLOTS in mok/dsl_kernels/sm90/): the forward's start, schedule phase, dispatch, first
and last GEMM task, sums; the backward's start, dispatch, first and last d_hidden / d_x task,
weight tasks, finish; both kernels' producer and crew ends, the exit and the tasks each CTA ran.
For each token count this runs `mok.functional.forward` and `backward` a few times (the schedule
built by the schedule kernel before them, so the forward's schedule phase is empty here;
`MoKExperts`' resolved steps run it in the launch) and prints, for each kernel's last launch,
each phase's duration over the CTAs (min / median / max, us) and the launch's span (first start
to last exit). A diagnostic build is slower than the shipped one only by the stores; its times
show the phases' shape, and `benchmarks.moe` or tools/phase_times.py the shipped kernel's time.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from benchmarks.shapes import SHAPES
from mok import functional as F
from mok.launchers import backward_megakernel, forward_megakernel, plans
from mok.launchers.megakernel_walk import (
    BACKWARD_COUNTER_TAIL,
    FORWARD_COUNTER_TAIL,
    timeline_words,
)
from mok.runtime.manifest import KERNEL_DIR_ENV_VAR
from tools.phase_times import layer

# Each kernel's TIMELINE_SLOTS (mok/dsl_kernels/sm90/moe_forward.py, moe_backward.py) and the
# phases printed, (label, from slot, to slot).
SLOTS = ("start", "schedule", "dispatch", "first_task", "last_task", "sums", "producer_done",
         "crew_done", "exit", "tasks")  # fmt: skip
PHASES = (
    ("schedule phase", "start", "schedule"),
    ("dispatch", "schedule", "dispatch"),
    ("to the first task", "dispatch", "first_task"),
    ("GEMM tasks (consumers)", "first_task", "last_task"),
    ("sums", "last_task", "sums"),
    ("producer, from dispatch", "dispatch", "producer_done"),
    ("crew, from dispatch", "dispatch", "crew_done"),
    ("whole CTA", "start", "exit"),
)
BACKWARD_SLOTS = ("start", "dispatch", "first_task", "last_task", "weights", "finish",
                  "producer_done", "crew_done", "exit", "tasks")  # fmt: skip
BACKWARD_PHASES = (
    ("dispatch", "start", "dispatch"),
    ("to the first task", "dispatch", "first_task"),
    ("d_hidden, d_x (consumers)", "first_task", "last_task"),
    ("weight tasks", "last_task", "weights"),
    ("finish (d_x sums)", "weights", "finish"),
    ("producer, from dispatch", "dispatch", "producer_done"),
    ("crew, from dispatch", "dispatch", "crew_done"),
    ("whole CTA", "start", "exit"),
)


def _last_plan(kind: type):
    """The last launch plan of class `kind` this thread made (a plan's own, or an op's)."""
    found = []
    for made in plans.plans_of_thread().values():
        for candidate in (made, getattr(made, "routed", None)):
            if isinstance(candidate, kind):
                found.append(candidate)
    if not found:
        raise RuntimeError(f"no {kind.__name__} was made")
    return found[-1]


def report(name: str, plan, capacity: int, tail: int, slots: tuple, phases: tuple) -> None:
    """Print one kernel's last launch: its span, tasks per CTA and each phase over the CTAs."""
    if not plan.timeline_ctas:
        raise SystemExit(f"the loaded {name} has no timeline: set {KERNEL_DIR_ENV_VAR} to a "
                         "diagnostic build (this module's docstring)")  # fmt: skip
    stamps = timeline_words(plan.counters, capacity, tail, plan.timeline_ctas).cpu().tolist()
    at = {slot: n for n, slot in enumerate(slots)}
    start = min(row[at["start"]] for row in stamps)
    end = max(row[at["exit"]] for row in stamps)
    tasks = [row[at["tasks"]] for row in stamps]
    print(f"  {name}, {plan.timeline_ctas} CTAs: launch span {(end - start) / 1e3:.1f} us; "
          f"GEMM tasks per CTA {min(tasks)} / {statistics.median(tasks):.0f} / {max(tasks)}")  # fmt: skip
    print(f"    {'phase':<28} {'min':>8} {'median':>8} {'max':>8}  us")
    rows = [(label, [(row[at[b]] - row[at[a]]) / 1e3 for row in stamps]) for label, a, b in phases]
    rows.append(("CTA start after the first", [(row[at["start"]] - start) / 1e3 for row in stamps]))
    for label, spans in rows:
        print(f"    {label:<28} {min(spans):8.1f} {statistics.median(spans):8.1f} "
              f"{max(spans):8.1f}")  # fmt: skip


def run(shape_name: str, tokens: int, reps: int) -> None:
    _, inputs, config, ws, schedule = layer(shape_name, tokens)
    weights = [None, None, None, inputs["routed_gate"], inputs["routed_up"], inputs["routed_down"]]
    x, rw = inputs["x"], inputs["router_weights"]
    for _ in range(reps):
        _, ctx = F.forward(config, ws, schedule, x, rw, *weights)
        F.backward(config, ws, schedule, ctx, inputs["grad_output"], x, rw, *weights)
    torch.cuda.synchronize()
    capacity = schedule.peer_rank.shape[0]
    print(f"\n== {shape_name}, {tokens} tokens")
    report("moe_forward", _last_plan(forward_megakernel._ForwardPlan), capacity,
           FORWARD_COUNTER_TAIL, SLOTS, PHASES)  # fmt: skip
    report("moe_backward", _last_plan(backward_megakernel._BackwardPlan), capacity,
           BACKWARD_COUNTER_TAIL, BACKWARD_SLOTS, BACKWARD_PHASES)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.phase_timeline", description=__doc__)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=[s.name for s in SHAPES])
    parser.add_argument("--tokens", default="2048,4096")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if not os.environ.get(KERNEL_DIR_ENV_VAR):
        raise SystemExit(f"set {KERNEL_DIR_ENV_VAR} to a diagnostic build (see the docstring)")
    for tokens in (int(t) for t in args.tokens.split(",")):
        run(args.shape, tokens, args.reps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
