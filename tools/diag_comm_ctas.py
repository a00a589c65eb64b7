"""How many communication CTAs the megakernels should have (0: every CTA dispatches first).

python -m tools.diag_comm_ctas [--shape qwen3-30b-a3b] [--counts 0,8,16,32] [--reps 10]

For each count (0: every CTA dispatches before its tasks, the old walk), in one process:
- the phase clock of one forward and one backward megakernel: the communication CTAs' copy
  time (median), the copy rate per communication CTA it implies, and the end of the first
  GEMM phase over all CTAs (median / max);
- forward and backward times (CUDA events, median of `reps` steps), the counts interleaved
  step by step so that all see the same clock and power state.
"""

from __future__ import annotations

import argparse

import torch

from mok.launchers.moe_forward import CLOCK_SLOTS, set_comm_ctas, set_phase_clock
from tools.benchmark_row import benchmark_row, timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--counts", default="0,8,16,32")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    shape, inputs, impl = benchmark_row(args.shape, "mok_bwd_megakernel")
    rows = inputs.num_tokens * shape.topk
    row_bytes = 2 * shape.hidden_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def step(count):
        set_comm_ctas(count)
        fwd_ms, (_, state) = timed(impl.forward)
        bwd_ms, _ = timed(lambda: impl.backward(state, inputs.grad_output))
        return fwd_ms, bwd_ms

    for count in counts:  # warm-up
        step(count)
    print(f"== {shape.name}: {rows} routed rows of {row_bytes} bytes, {sms} CTAs")
    print("count pass  copy ms  GB/s/CTA  phase-1 end med/max ms")
    for count in counts:
        for pass_name in ("fwd", "bwd"):
            clock = torch.zeros(sms, CLOCK_SLOTS, dtype=torch.int64, device="cuda")
            set_comm_ctas(count)
            _, state = impl.forward()
            torch.cuda.synchronize()
            set_phase_clock(clock)
            if pass_name == "fwd":
                impl.forward()
            else:
                impl.backward(state, inputs.grad_output)
            torch.cuda.synchronize()
            set_phase_clock(None)
            stamps = clock.cpu().double()
            start = stamps[:, 0].min()
            dispatchers = count if count > 0 else sms
            copy = (stamps[:dispatchers, 1] - stamps[:dispatchers, 0]) / 1e6
            rate = rows / dispatchers * row_bytes / (copy.median().item() * 1e6)
            phase1 = (stamps[:, 2] - start) / 1e6
            print(f"{count:5d} {pass_name}  {copy.median():7.3f}  {rate:8.1f}  "
                  f"{phase1.median():8.3f} / {phase1.max():8.3f}")  # fmt: skip
    times = {count: ([], []) for count in counts}
    for _ in range(args.reps):
        for count in counts:
            fwd_ms, bwd_ms = step(count)
            times[count][0].append(fwd_ms)
            times[count][1].append(bwd_ms)
    set_comm_ctas(None)
    print(f"== forward / backward megakernel steps, median of {args.reps} interleaved (ms)")
    for count, (fwd, bwd) in times.items():
        fwd, bwd = sorted(fwd), sorted(bwd)
        print(f"  comm {count:3d}  fwd {fwd[len(fwd) // 2]:8.3f}  bwd {bwd[len(bwd) // 2]:8.3f}")


if __name__ == "__main__":
    main()
