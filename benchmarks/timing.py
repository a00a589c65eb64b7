"""Timers (CUDA events on a GPU, perf_counter on a CPU) and the ceilings of this device."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TimingConfig:
    warmup: int
    reps: int


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    device: torch.device,
    config: TimingConfig,
    run: Callable[[object], object],
    setup: Callable[[], object] | None = None,
) -> list[float]:
    """Milliseconds of ``run(setup())`` per rep, ``setup`` (if any) outside the timed span.

    On CUDA each rep is bracketed by events on the current stream, so host work of ``setup``
    and launch gaps between reps are not counted; one synchronize at the end.
    """
    for _ in range(config.warmup):
        run(setup() if setup else None)
    synchronize(device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(config.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(config.reps)]
        for start, end in zip(starts, ends, strict=True):
            state = setup() if setup else None
            start.record()
            run(state)
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
    times = []
    for _ in range(config.reps):
        state = setup() if setup else None
        begin = time.perf_counter()
        run(state)
        times.append((time.perf_counter() - begin) * 1e3)
    return times


def max_over_ranks(times: list[float], device: torch.device, group=None) -> list[float]:
    """Per-rep time of the slowest rank (a layer is done when every rank is done)."""
    if group is None or dist.get_world_size(group) == 1:
        return times
    values = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values.tolist()


def median(times: list[float]) -> float:
    return statistics.median(times)


def _matmul_pairs(device: torch.device, size: int, seed: int) -> list[tuple]:
    """Three (a, b) pairs of random bf16 size x size matrices: rotated so that no matmul finds
    its operands in L2 from the one before."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        tuple(
            torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(2)
        )
        for _ in range(3)
    ]


def _burst_tflops(device, size: int, config: TimingConfig, pairs: list, matmul) -> float:
    """Median TFLOP/s of ``matmul(a, b)`` of size^3, the pairs rotated rep by rep."""
    counter = iter(range(1 << 30))

    def run(_state):
        a, b = pairs[next(counter) % len(pairs)]
        matmul(a, b)

    ms = median(time_ms(device, config, run))
    return 2 * size**3 / (ms * 1e-3) / 1e12


def gemm_ceiling_tflops(device: torch.device, size: int, config: TimingConfig) -> float:
    """Median TFLOP/s of a dense bf16 ``torch.matmul`` of size^3 on random data.

    Three input pairs are rotated so that no rep finds its operands in L2 from the rep before.
    """
    return _burst_tflops(device, size, config, _matmul_pairs(device, size, seed=1), torch.matmul)


def fp8_gemm_ceiling_tflops(
    device: torch.device, size: int, config: TimingConfig
) -> tuple[float | None, str | None]:
    """(TFLOP/s, None) of a dense FP8 E4M3 ``torch._scaled_mm`` of size^3 (a row-major, b
    column-major, unit fp32 scales, bf16 out), timed as `gemm_ceiling_tflops`; (None, why)
    off CUDA or where ``_scaled_mm`` raises."""
    if device.type != "cuda":
        return None, f"not measured on {device.type}: torch._scaled_mm FP8 needs CUDA"
    fp8, one = torch.float8_e4m3fn, torch.ones((), device=device, dtype=torch.float32)
    try:
        pairs = [(a.to(fp8), b.to(fp8).t()) for a, b in _matmul_pairs(device, size, seed=3)]

        def scaled_mm(a, b):
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        return _burst_tflops(device, size, config, pairs, scaled_mm), None
    except Exception as error:  # unsupported on this GPU or torch build: no number, no crash
        return None, f"torch._scaled_mm failed: {type(error).__name__}: {error}"


def sustained_gemm_tflops(
    device: torch.device, size: int, warm_s: float, measure_s: float
) -> float:
    """TFLOP/s of the same bf16 matmul run back to back for `measure_s` seconds, after
    `warm_s` seconds of it: the rate under the GPU's power limit, which a layer timed over
    many reps runs under too (an H200 capped near 690 W drops from ~1.98 GHz to ~1.5 GHz
    within a fraction of a second of dense GEMMs; docs/NOTES.md, section 2). The burst
    median of `gemm_ceiling_tflops` is measured before the clock comes down."""
    pairs = _matmul_pairs(device, size, seed=2)

    def run_for(seconds: float) -> tuple[int, float]:
        """(matmuls, seconds) of back-to-back matmuls for about `seconds`."""
        synchronize(device)
        begin, count = time.perf_counter(), 0
        while time.perf_counter() - begin < seconds:
            for a, b in pairs:
                torch.matmul(a, b)
            count += len(pairs)
            synchronize(device)
        return count, time.perf_counter() - begin

    run_for(warm_s)
    count, elapsed = run_for(measure_s)
    return 2 * size**3 * count / elapsed / 1e12


def copy_bandwidth_gbs(device: torch.device, num_bytes: int, config: TimingConfig) -> float:
    """Median GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median(time_ms(device, config, lambda _state: dst.copy_(src)))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def measure_ceilings(device: torch.device, quick: bool, config: TimingConfig) -> dict:
    """The GEMM (bf16; FP8 on CUDA) and copy ceilings of this device, measured now (tiny sizes
    with ``quick``)."""
    gemm_size = 512 if quick else 8192
    copy_bytes = (8 << 20) if quick else (2 << 30)
    ceilings = {
        "gemm_bf16_size": gemm_size,
        "gemm_bf16_tflops": gemm_ceiling_tflops(device, gemm_size, config),
    }
    # The FP8 burst (same size) before the sustained run brings the clock down.
    ceilings["gemm_fp8_tflops"], ceilings["gemm_fp8_note"] = fp8_gemm_ceiling_tflops(
        device, gemm_size, config
    )
    ceilings["gemm_bf16_sustained_tflops"] = sustained_gemm_tflops(
        device, gemm_size, *((0.01, 0.01) if quick else (1.5, 1.0))
    )
    ceilings["copy_bytes"] = copy_bytes
    ceilings["copy_gbs"] = copy_bandwidth_gbs(device, copy_bytes, config)
    return ceilings
