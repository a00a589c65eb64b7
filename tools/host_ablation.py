"""What a resolved eager step's host time is made of, by removal, in one process.

    python -m tools.host_ablation [--shape qwen3-30b-a3b] [--tokens 4096] [--rounds 5]
                                  [--profile FILE]

Rounds of back-to-back steps (as `benchmarks.host_time` measures them) of one `MoKExperts`
lone step, with parts of the launch path replaced by no-ops in turn: the driver call
(`Kernel.launch_packed`), the whole bound launch (`BoundLaunch.launch`: its packing too), and
the autograd floor (`benchmarks.host_time.autograd_floor`). Rounds alternate the variants, so
the process's drift touches each alike; the medians over rounds are printed. With no-op
launches the GPU runs nothing and the outputs are garbage: only the host time means anything.
Then the driver calls and allocations timed where they run (one `perf_counter` pair around each
`Kernel.launch_packed` and `torch.empty` of a resolved step; the pair and its wrapper add about
a microsecond), over the steps `measure` profiles: those with a sync before each (the GPU idle
at each step's start).
`--profile` writes a cProfile report (tottime) of the full step, over those steps too.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time

import torch

from benchmarks.host_time import autograd_floor, measure
from mok.runtime import module as runtime_module
from mok.runtime.bound_launch import BoundLaunch


@contextlib.contextmanager
def _no_op(owner, name):
    original = getattr(owner, name)
    setattr(owner, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        setattr(owner, name, original)


class _CallTimers:
    """Times each `Kernel.launch_packed` (by kernel) and `torch.empty` while enabled; passed to
    `measure` as its profiler, which enables it after the warm-up steps (the step resolved) and
    disables it after the synced steps."""

    def __init__(self):
        self.on, self.totals = False, {}
        self.launch_packed, self.empty = runtime_module.Kernel.launch_packed, torch.empty

    def enable(self):
        self.on = True

    def disable(self):
        self.on = False

    def _add(self, name, t0):
        if self.on:
            entry = self.totals.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t0

    def __enter__(self):
        launch_packed, empty = self.launch_packed, self.empty

        def timed_launch(kernel, *args):
            t0 = time.perf_counter()
            try:
                return launch_packed(kernel, *args)
            finally:
                self._add(f"launch {kernel.variant.name}", t0)

        def timed_empty(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return empty(*args, **kwargs)
            finally:
                self._add("torch.empty", t0)

        runtime_module.Kernel.launch_packed, torch.empty = timed_launch, timed_empty
        return self

    def __exit__(self, *exc):
        runtime_module.Kernel.launch_packed, torch.empty = self.launch_packed, self.empty


def _timed_calls(shape: str, tokens: int, steps: int = 20) -> dict:
    """{name: (calls per step, seconds per step)} of a resolved step's driver calls (by
    kernel) and allocations, over `measure`'s `steps` synced steps."""
    with _CallTimers() as timers:
        measure(shape, tokens, steps=steps, layers=1, profile=timers)
    count = steps
    return {
        name: (calls / count, seconds / count) for name, (calls, seconds) in timers.totals.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.host_ablation", description=__doc__)
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    variants = {
        "full step": contextlib.nullcontext,
        "driver calls removed": lambda: _no_op(runtime_module.Kernel, "launch_packed"),
        "bound launches removed": lambda: _no_op(BoundLaunch, "launch"),
    }
    results: dict[str, list[float]] = {name: [] for name in [*variants, "autograd floor"]}
    measure(args.shape, args.tokens, steps=5, layers=1)  # resolve the step's plans
    for _ in range(args.rounds):
        for name, context in variants.items():
            with context():
                results[name].append(measure(args.shape, args.tokens, layers=1)["host_ms"])
            torch.cuda.synchronize()
        results["autograd floor"].append(autograd_floor(args.shape, args.tokens)["host_ms"])
    print(f"{'variant':24} {'median ms':>9}  rounds")
    for name, values in results.items():
        runs = " ".join(f"{v:.3f}" for v in values)
        print(f"{name:24} {statistics.median(values):9.3f}  {runs}")
    timed = _timed_calls(args.shape, args.tokens)
    print(f"{'call':32} {'per step':>8} {'us each':>8} {'us per step':>11}")
    for name, (calls, seconds) in sorted(timed.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:32} {calls:8.1f} {seconds / calls * 1e6:8.2f} {seconds * 1e6:11.1f}")
    if args.profile:
        profile = cProfile.Profile()
        measure(args.shape, args.tokens, steps=50, layers=1, profile=profile)
        with open(args.profile, "w") as f:
            pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(45)


if __name__ == "__main__":
    main()
