"""How fast each candidate MXFP8 GEMM engine could be on this GPU: the wgmma probe's compute
ceilings (mok/dsl_kernels/sm90/wgmma_probe.py) beside torch's dense GEMM ceilings, same run.

    python -m tools.wgmma_probe [--iterations 20000] [--reps 5]

For each engine (bf16, fp8, fp8_promote1, fp8_promote2): one CTA per SM, each `--iterations`
passes over a shared-memory stage (no memory traffic); first a 3-pass launch checked exactly
against the fp64 tile (`expected_tile`), then the median of `--reps` timed launches as TFLOP/s
and as a share of the bf16 probe. The ceilings: torch bf16 matmul and FP8 `torch._scaled_mm`
of 8192^3 (benchmarks/timing.py), the rates a memory-fed GEMM reaches.
"""

from __future__ import annotations

import argparse

import torch

ENGINES = ("bf16", "fp8", "fp8_promote1", "fp8_promote2")
TILE = 128
K_BLOCKS = 4
SCALE = 0.5  # fp8_promote1's uniform scale


def tile_k(engine: str) -> int:
    """K elements of one pass: 128 bytes of a row, 64 bf16 or 128 E4M3."""
    return 64 if engine == "bf16" else 128


def operands(engine: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's A [128, K] and B [128, K] (fp64), as the kernel writes them."""
    r = torch.arange(TILE, dtype=torch.float64)[:, None]
    k = torch.arange(tile_k(engine), dtype=torch.float64)[None, :]
    a = ((7 * r + 3 * k) % 5 - 2) / 2
    b = ((5 * r + k) % 5 - 2) / 2
    return a, b


def expected_tile(engine: str, iterations: int) -> torch.Tensor:
    """fp64 [128, 128]: `iterations` passes of sum_j s_j * (A_j B_j^T) over the K-blocks j."""
    a, b = operands(engine)
    depth = tile_k(engine) // K_BLOCKS
    idx = torch.arange(TILE, dtype=torch.float64)
    total = torch.zeros(TILE, TILE, dtype=torch.float64)
    for j in range(K_BLOCKS):
        block = a[:, j * depth : (j + 1) * depth] @ b[:, j * depth : (j + 1) * depth].T
        if engine == "fp8_promote1":
            block = block * SCALE
        elif engine == "fp8_promote2":
            rows = 2.0 ** ((idx + j) % 3 - 1)
            cols = 2.0 ** ((5 * idx + j) % 3 - 1)
            block = block * rows[:, None] * cols[None, :]
        total += block
    return total * iterations


def launch(engine: str, out: torch.Tensor, iterations: int, num_ctas: int) -> None:
    from mok.runtime import get_kernel  # noqa: PLC0415 - CUDA only

    kernel = get_kernel(f"wgmma_probe_{engine}", device=out.device)
    kernel.launch((num_ctas, 1, 1), {"out_ptr": out, "iterations": iterations, "scale": SCALE})


def check(engine: str, device: torch.device, num_ctas: int, iterations: int = 3) -> bool:
    """Every CTA's tile of a short launch equals the fp64 tile exactly (out poisoned first)."""
    out = torch.full((num_ctas, TILE, TILE), float("nan"), dtype=torch.float32, device=device)
    launch(engine, out, iterations, num_ctas)
    want = expected_tile(engine, iterations).to(torch.float32).to(device)
    return bool(torch.equal(out, want.expand_as(out)))


def tflops(engine: str, device: torch.device, num_ctas: int, iterations: int, reps: int) -> float:
    """Median TFLOP/s of `reps` launches (one warm-up), each timed by CUDA events."""
    from benchmarks.timing import TimingConfig, median, time_ms  # noqa: PLC0415

    out = torch.empty((num_ctas, TILE, TILE), dtype=torch.float32, device=device)
    times = time_ms(device, TimingConfig(warmup=1, reps=reps),
                    lambda _state: launch(engine, out, iterations, num_ctas))  # fmt: skip
    flop = 2 * TILE * TILE * tile_k(engine) * iterations * num_ctas
    return flop / (median(times) * 1e-3) / 1e12


def main(argv: list[str] | None = None) -> None:
    from benchmarks.timing import (  # noqa: PLC0415
        TimingConfig,
        fp8_gemm_ceiling_tflops,
        gemm_ceiling_tflops,
    )

    parser = argparse.ArgumentParser(prog="python -m tools.wgmma_probe", description=__doc__)
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.reps < 1:
        parser.error(f"--iterations and --reps must be >= 1, got {args.iterations}, {args.reps}")
    device = torch.device("cuda")
    num_ctas = torch.cuda.get_device_properties(device).multi_processor_count
    config = TimingConfig(warmup=3, reps=args.reps)
    bf16_ceiling = gemm_ceiling_tflops(device, 8192, config)
    fp8_ceiling, why = fp8_gemm_ceiling_tflops(device, 8192, config)
    print(f"{torch.cuda.get_device_name(device)}, {num_ctas} SMs, {args.iterations} passes a CTA")
    print(f"ceilings (8192^3): bf16 torch.matmul {bf16_ceiling:.0f} TFLOP/s, FP8 "
          f"torch._scaled_mm {fp8_ceiling:.0f} TFLOP/s" if fp8_ceiling else why)  # fmt: skip
    rates = {}
    for engine in ENGINES:
        exact = check(engine, device, num_ctas)
        rates[engine] = tflops(engine, device, num_ctas, args.iterations, args.reps)
        print(f"  {engine:14s} {rates[engine]:7.0f} TFLOP/s  {rates[engine] / rates['bf16']:5.2f}x "
              f"the bf16 probe  tile {'exact' if exact else 'WRONG'}")  # fmt: skip


if __name__ == "__main__":
    main()
