"""Rows gathered by one-row TMA boxes or by 16-byte cp.async (mok/dsl_kernels/sm90/row_tma_probe.py;
docs/NOTES.md §18 item 9): whether a 128-byte-swizzled stage filled row by row holds what one
128-row box writes, and how fast every SM fills stages each way against the 128-row box.

    python -m tools.row_tma_probe [--tokens 16384] [--hidden 2048] [--k-tiles 4096] [--reps 5]

The check: stage 0 by a 128-row box, stage 1 by 128 one-row boxes from random rows (some out
of bounds), stage 2 the same rows by cp.async, each compared bit for bit with the 128-byte
swizzle of the rows it should hold. The rates: every SM fills `--k-tiles` stages (A: 16 KiB)
through a ring of 4, a task's H / 64 k-tiles from the same 128 rows (rows: 128 one-row boxes
a k-tile from `--tokens` x 8 random routed rows; cp.async: the same rows by one warp's 16-byte
cp.async, or by four warps, 32 rows each; tile: one 128-row box), alone (B 0) and beside two
128-row boxes of B a stage by TMA (B 2: 48 KiB a stage, as the GEMMs load), as GB/s, GB/s per
SM and ns per k-tile per SM.
"""

from __future__ import annotations

import argparse

import torch

CHECK, ROWS, TILE, CP_ASYNC, CP_ASYNC_4 = 0, 1, 2, 3, 4  # sm90/row_tma_probe.py
STAGES_CHECKED = 3
TILE_M, TILE_K = 128, 64
STAGE_BYTES = TILE_M * TILE_K * 2


def make_inputs(src_rows: int, hidden: int, index_count: int, device, seed: int = 0):
    """(src bf16 [src_rows, hidden] random, index int32 [index_count] random rows of src)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    src = torch.randn(src_rows, hidden, generator=gen).to(torch.bfloat16).to(device)
    index = torch.randint(0, src_rows, (index_count,), generator=gen, dtype=torch.int32)
    return src, index.to(device)


def swizzled(rows: torch.Tensor) -> torch.Tensor:
    """The raw bytes (as bf16 [128, 64]) of a 128-byte-swizzled K-major stage holding `rows`
    ([128, 64]): row r's 16-byte chunk c at chunk c ^ (r % 8) of its 128 bytes."""
    chunks = rows.reshape(TILE_M, 8, 8)
    r = torch.arange(TILE_M, device=rows.device).view(-1, 1)
    c = torch.arange(8, device=rows.device).view(1, -1)
    out = torch.empty_like(chunks)
    out[r, c ^ (r % 8)] = chunks
    return out.reshape(TILE_M, TILE_K)


_DESCRIPTORS: dict = {}  # (address, shape) -> both descriptors: encoded once, outside timed spans


def launch(src, index, out, mode: int, ctas: int, k_tiles: int = 0, b_boxes: int = 0) -> None:
    from mok.runtime import get_kernel  # noqa: PLC0415 - CUDA only

    kernel = get_kernel("row_tma_probe", device=src.device)
    key = (src.data_ptr(), tuple(src.shape))
    if key not in _DESCRIPTORS:
        _DESCRIPTORS[key] = (kernel.make_tma_descriptor("tma_rows", src),
                             kernel.make_tma_descriptor("tma_tile", src))  # fmt: skip
    tma_rows, tma_tile = _DESCRIPTORS[key]
    kernel.launch((ctas, 1, 1), {
        "tma_rows": tma_rows, "tma_tile": tma_tile,
        "src_ptr": src, "index_ptr": index, "out_ptr": out, "index_count": index.shape[0],
        "src_rows": src.shape[0], "hidden_size": src.shape[1], "k_tiles": k_tiles, "mode": mode,
        "b_boxes": b_boxes,
    })  # fmt: skip


def check(src: torch.Tensor, index: torch.Tensor) -> tuple[bool, bool, bool]:
    """(stage 0 by one 128-row box, stage 1 by one-row boxes of index[:128], stage 2 the same rows
    by cp.async; negative rows zero) each equal bit for bit to the swizzle of the rows it
    should hold (`out` poisoned first)."""
    out = torch.full((STAGES_CHECKED, TILE_M, TILE_K), float("nan"), dtype=torch.bfloat16,
                     device=src.device)  # fmt: skip
    launch(src, index, out, CHECK, 1)
    rows = index[:TILE_M].long()
    gathered = src[rows.clamp(min=0), TILE_K : 2 * TILE_K].clone()
    gathered[rows < 0] = 0
    expected = (swizzled(src[:TILE_M, :TILE_K]), swizzled(gathered), swizzled(gathered))
    return tuple(
        bool(torch.equal(out[i].view(torch.int16), expected[i].view(torch.int16)))
        for i in range(STAGES_CHECKED)
    )


def main(argv: list[str] | None = None) -> None:
    from benchmarks.timing import TimingConfig, median, time_ms  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m tools.row_tma_probe", description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--k-tiles", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    src, index = make_inputs(args.tokens, args.hidden, 8 * args.tokens, device)
    checked = index[:TILE_M].clone()
    checked[::5] = -1
    verdicts = ["exact" if ok else "WRONG" for ok in check(src, checked)]
    print(f"{torch.cuda.get_device_name(device)}, {sms} SMs; x [{args.tokens}, {args.hidden}] "
          f"bf16; check: 128-row box {verdicts[0]}, one-row boxes {verdicts[1]}, cp.async "
          f"{verdicts[2]}")  # fmt: skip
    config = TimingConfig(warmup=2, reps=args.reps)
    out = torch.empty(STAGES_CHECKED, TILE_M, TILE_K, dtype=torch.bfloat16, device=device)
    print(
        f"{'mode':16s} {'B':>3s} {'ms':>8s} {'GB/s':>8s} {'GB/s an SM':>11s} {'ns a k-tile':>12s}"
    )
    modes = (
        ("rows", ROWS),
        ("cp.async", CP_ASYNC),
        ("cp.async 4 warps", CP_ASYNC_4),
        ("tile", TILE),
    )
    for b_boxes in (0, 2):
        # A's 16 KiB a stage, and with B's two boxes 48 KiB (the GEMMs' stage).
        moved = sms * args.k_tiles * STAGE_BYTES * (1 + b_boxes)
        for name, mode in modes:

            def run(_s, m=mode, b=b_boxes):
                launch(src, index, out, m, sms, args.k_tiles, b)

            ms = median(time_ms(device, config, run))
            rate = moved / (ms * 1e-3) / 1e9
            print(f"{name:16s} {b_boxes:3d} {ms:8.3f} {rate:8.0f} {rate / sms:11.1f} "
                  f"{ms * 1e6 / args.k_tiles:12.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
