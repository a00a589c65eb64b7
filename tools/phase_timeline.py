"""Where the forward megakernel's time goes, phase by phase and CTA by CTA (a diagnostic build).

    cp -r mok/dsl_kernels/cubins /tmp/timeline
    python -m mok.dsl_kernels.build --arch sm_90a --only moe_forward --set timeline=True --out /tmp/timeline
    MOK_KERNEL_DIR=/tmp/timeline python -m tools.phase_timeline [--shape qwen3-30b-a3b] [--tokens 2048,4096]

The diagnostic build of `moe_forward` (config `timeline`; the shipped cubins have none of it)
stamps `%globaltimer` at each CTA's phase boundaries (mok/dsl_kernels/sm90/moe_forward.py
TIMELINE_SLOTS): start, after the schedule phase, after dispatch, when the consumers have their
first task, when they finish their last, after the sums, when the producer and the crew finish,
at the exit, and the tasks each CTA ran. For each token count this runs `mok.functional.forward`
a few times (its schedule built by the schedule kernel before it, so the schedule phase is empty
here; `MoKExperts`' resolved steps run it in the launch) and prints, for the last launch, each phase's
duration over the CTAs (min / median / max, us) and the launch's span (first start to last
exit). The build is slower than the shipped one only by the stores; its times are the phases'
shape, and `benchmarks.moe` or tools/phase_times.py give the shipped kernel's time.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from benchmarks.shapes import SHAPES
from mok import functional as F
from mok.launchers import forward_megakernel, plans
from mok.launchers.megakernel_walk import FORWARD_COUNTER_TAIL, timeline_words
from mok.runtime.manifest import KERNEL_DIR_ENV_VAR
from tools.phase_times import layer

# (label, from slot, to slot) of each printed phase: mok/dsl_kernels/sm90/moe_forward.py's
# TIMELINE_SLOTS, by index.
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


def _forward_plan():
    """The routed megakernel plan the last forward used (this thread's launch plans)."""
    found = [p.routed for p in plans.plans_of_thread().values()
             if isinstance(getattr(p, "routed", None), forward_megakernel._ForwardPlan)]  # fmt: skip
    if not found:
        raise RuntimeError("no forward megakernel plan was made")
    return found[-1]


def run(shape_name: str, tokens: int, reps: int) -> None:
    _, inputs, config, ws, schedule = layer(shape_name, tokens)
    weights = [None, None, None, inputs["routed_gate"], inputs["routed_up"], inputs["routed_down"]]
    for _ in range(reps):
        F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)
    torch.cuda.synchronize()
    plan = _forward_plan()
    if not plan.timeline_ctas:
        raise SystemExit(f"the loaded moe_forward has no timeline: set {KERNEL_DIR_ENV_VAR} to a "
                         "diagnostic build (this module's docstring)")  # fmt: skip
    capacity = schedule.peer_rank.shape[0]
    words = timeline_words(plan.counters, capacity, FORWARD_COUNTER_TAIL, plan.timeline_ctas)
    stamps = words.cpu().tolist()
    at = {name: n for n, name in enumerate(SLOTS)}
    start = min(row[at["start"]] for row in stamps)
    end = max(row[at["exit"]] for row in stamps)
    tasks = [row[at["tasks"]] for row in stamps]
    print(f"\n== {shape_name}, {tokens} tokens, {plan.timeline_ctas} CTAs: launch span "
          f"{(end - start) / 1e3:.1f} us; tasks per CTA {min(tasks)} / "
          f"{statistics.median(tasks):.0f} / {max(tasks)}")  # fmt: skip
    print(f"  {'phase':<26} {'min':>8} {'median':>8} {'max':>8}  us")
    for label, a, b in PHASES:
        spans = [(row[at[b]] - row[at[a]]) / 1e3 for row in stamps]
        print(f"  {label:<26} {min(spans):8.1f} {statistics.median(spans):8.1f} "
              f"{max(spans):8.1f}")  # fmt: skip
    late = [(row[at["start"]] - start) / 1e3 for row in stamps]
    print(f"  {'CTA start after the first':<26} {min(late):8.1f} {statistics.median(late):8.1f} "
          f"{max(late):8.1f}")  # fmt: skip


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
