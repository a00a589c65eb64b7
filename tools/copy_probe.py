"""How fast one SM moves rows, by 16-byte loads and stores or by bulk copies, against the number
of CTAs doing it (mok/dsl_kernels/sm90/copy_probe.py; docs/NOTES.md §18, open question 7).

    python -m tools.copy_probe [--rows 65536] [--ctas 1,2,4,8,16,32,66,132] [--reps 5]

For each mode (`vector`: every thread, as the megakernels' dispatch copies; `bulk`: one thread
issuing `cp.async.bulk` through shared memory) and CTA count: a copy of `--rows` rows of 4096
bytes, each from a random source row, checked exactly against `src[index]` (the destination
poisoned first), then the median of `--reps` launches timed by CUDA events, as GB/s (bytes read
+ written) and GB/s per CTA, beside the device-to-device copy rate measured in the same run.
"""

from __future__ import annotations

import argparse

import torch

MODES = ("vector", "bulk")
ROW_ELEMENTS = 2048  # bf16 per row: 4096 bytes (sm90/copy_probe.py ROW_BYTES)


def make_rows(rows: int, device: torch.device, seed: int = 0):
    """(src [rows, 2048] bf16 random, index int32 [rows]: a random permutation)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    src = torch.randn(rows, ROW_ELEMENTS, generator=gen).to(torch.bfloat16).to(device)
    index = torch.randperm(rows, generator=gen).to(torch.int32).to(device)
    return src, index


def launch(mode: str, src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor, ctas: int):
    from mok.runtime import get_kernel  # noqa: PLC0415 - CUDA only

    kernel = get_kernel(f"copy_probe_{mode}", device=src.device)
    kernel.launch((ctas, 1, 1), {"src_ptr": src, "dst_ptr": dst, "index_ptr": index,
                                 "src_rows": src.shape[0], "rows": index.shape[0]})  # fmt: skip


def check(mode: str, src: torch.Tensor, index: torch.Tensor, ctas: int) -> bool:
    """Every destination row equals its source row bit for bit (destination poisoned first)."""
    dst = torch.full((index.shape[0], ROW_ELEMENTS), float("nan"), dtype=torch.bfloat16,
                     device=src.device)  # fmt: skip
    launch(mode, src, index, dst, ctas)
    return bool(torch.equal(dst.view(torch.int16), src[index.long()].view(torch.int16)))


def main(argv: list[str] | None = None) -> None:
    from benchmarks.timing import TimingConfig, copy_bandwidth_gbs, median, time_ms  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m tools.copy_probe", description=__doc__)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--ctas", default="1,2,4,8,16,32,66,132")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    counts = [min(int(c), sms) for c in args.ctas.split(",")]
    config = TimingConfig(warmup=2, reps=args.reps)
    src, index = make_rows(args.rows, device)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * src.element_size()
    ceiling = copy_bandwidth_gbs(device, 2 << 30, config)
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs; copy {ceiling:.0f} GB/s (read + write); "
          f"{args.rows} rows of 4096 bytes, random sources")  # fmt: skip
    print(
        f"{'mode':8s} {'CTAs':>5s} {'ms':>9s} {'GB/s':>8s} {'GB/s a CTA':>11s} {'of copy':>8s}  rows"
    )
    for mode in MODES:
        for ctas in counts:
            exact = check(mode, src, index, ctas)
            ms = median(
                time_ms(device, config, lambda _s, m=mode, n=ctas: launch(m, src, index, dst, n))
            )
            rate = moved / (ms * 1e-3) / 1e9
            print(f"{mode:8s} {ctas:5d} {ms:9.3f} {rate:8.0f} {rate / ctas:11.1f} "
                  f"{rate / ceiling:8.1%}  {'exact' if exact else 'WRONG'}")  # fmt: skip


if __name__ == "__main__":
    main()
