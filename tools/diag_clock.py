"""SM clock and power while a workload runs back to back: the GEMM ceiling's 8192^3 bf16
matmul, or mok's forward / forward+backward at a benchmark shape (the benchmark's inputs).
Samples nvidia-smi every 50 ms in a subprocess; prints the TFLOP/s seen and the median clock
and power of the samples taken while the workload ran.

python -m tools.diag_clock --workload gemm|fwd|fwdbwd [--shape mixtral-8x7b] [--seconds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from tools.benchmark_row import benchmark_row


def workload(name: str, shape_name: str):
    """(one step, its FLOPs)."""
    device = torch.device("cuda")
    if name == "gemm":
        a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
        return (lambda: a @ b), 2 * 8192**3
    shape, inputs, impl = benchmark_row(shape_name)
    flops = 2 * 16384 * shape.topk * 3 * shape.hidden_size * shape.intermediate_size
    if name == "fwd":
        return (lambda: impl.forward()), flops

    def step():
        _, state = impl.forward()
        impl.backward(state, inputs.grad_output)

    return step, 3 * flops


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="gemm", choices=("gemm", "fwd", "fwdbwd"))
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    step, flops = workload(args.workload, args.shape)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
         "-lms", "50"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(0.3)
    begin = time.perf_counter()
    steps = 0
    while time.perf_counter() - begin < args.seconds:
        for _ in range(4):
            step()
        steps += 4
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - begin
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    # Drop the idle samples taken before the loop started and after it ended.
    busy = [(float(c), float(p)) for c, p in samples if float(p) > 200][2:-2]
    clocks, powers = [c for c, _ in busy], [p for _, p in busy]
    print(f"{args.workload} {args.shape if args.workload != 'gemm' else '8192^3'}: "
          f"{elapsed / steps * 1e3:.3f} ms per step, {flops * steps / elapsed / 1e12:.1f} TFLOP/s; "
          f"SM clock median {statistics.median(clocks):.0f} MHz (min {min(clocks):.0f}), "
          f"power median {statistics.median(powers):.0f} W over {len(busy)} samples")  # fmt: skip


if __name__ == "__main__":
    main()
