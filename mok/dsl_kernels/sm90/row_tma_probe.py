"""Rows gathered into a 128-byte-swizzled stage, by one-row TMA boxes or by 16-byte `cp.async`:
whether the stage holds what wgmma reads, and how fast one SM fills stages each way
(docs/NOTES.md §18 item 9).

`src` is a bf16 [rows, H] tensor, read through two descriptors, `tma_rows` (box 64 x 1) and
`tma_tile` (box 64 x 128, the megakernels' operand box), both with the 128-byte swizzle, and
by `cp.async` from its address. A stage is A's 128 rows x 64 columns (16 KiB, 1024-byte
aligned), then room for two B boxes (48 KiB in all, the GEMMs' stage). Modes (the runtime
`mode`):

- CHECK (CTA 0): stage 0's A by one `tma_tile` box of rows 0..127, columns 0..63; stage 1's
  by 128 `tma_rows` boxes, row r from source row `index[r]` (negative: a row out of bounds,
  which TMA fills with zeros), columns 64..127, each lane of warp 0 issuing 4; stage 2's the
  same rows by `cp.async` (common/row_tma.gather_k_tile, each lane's `.noinc` arrival on a
  barrier expecting the 32). Then the three A tiles' raw bytes to `out` ([3, 128, 64] bf16):
  the host checks stage 0 against the 128-byte swizzle of the rows (the layout wgmma reads) and
  stages 1 and 2 against the same swizzle.
- The rates, every CTA: `k_tiles` stages through a ring of STAGES, as a GEMM producer fills
  them: a task is H / 64 k-tiles of the same 128 rows, CTA b's task t the rows
  index[(b + t * grid) * 128 + r] (modulo `index_count`). A by ROWS (128 one-row boxes a
  k-tile, 4 a lane of warp 0), CP_ASYNC (`gather_k_tile` by warp 0), CP_ASYNC_4 (the four
  warps, 32 rows each) or TILE (one 128-row box of rows ((b + t * grid) * 128) mod src rows,
  the same bytes in the megakernels' way); with `b_boxes`, each stage also two 128-row boxes
  of other rows by TMA as B. tools/row_tma_probe.py times them.

Launch: grid (n, 1, 1), block (128, 1, 1).
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64

from ..common.params import Bf16Pointer, Int32Pointer
from ..common.row_tma import (
    ROW_OUT_OF_BOUNDS,
    cp_async_arrive_noinc,
    descriptor_address,
    gather_k_tile,
    load_box_2d,
)
from .gemm_engine import TILE_K, TILE_M, k_major_coords, thread_roles, tma_spec

CHECK, ROWS, TILE, CP_ASYNC, CP_ASYNC_4 = 0, 1, 2, 3, 4
THREADS = 128
STAGES = 4
STAGE_BYTES = TILE_M * TILE_K * 2
# A stage holds A's tile and room for two B boxes (the GEMM's stage: `b_boxes`).
B_BYTES = 2 * STAGE_BYTES
STAGE_STRIDE = STAGE_BYTES + B_BYTES
LANE_ROWS = TILE_M // 32  # rows each lane of warp 0 gathers a k-tile


class RowTmaProbeArgs(NamedTuple):
    """`Sm90RowTmaProbe`'s parameters after its two descriptors, in order."""

    src_ptr: Bf16Pointer  # [src_rows, H]: the descriptors' tensor, and cp.async's source
    index_ptr: Int32Pointer  # [index_count]: source rows (negative: out of bounds)
    out_ptr: Bf16Pointer  # CHECK: [3, 128, 64], the three stages' raw bytes
    index_count: Int32
    src_rows: Int32
    hidden_size: Int32
    k_tiles: Int32  # the rates: stages each CTA fills
    mode: Int32
    b_boxes: Int32  # rates: nonzero also loads two 128-row boxes a stage as B, by TMA


@dataclass(frozen=True)
class Sm90RowTmaProbe:
    def tma_specs(self) -> list[dict]:
        return [tma_spec("tma_rows", [TILE_K, 1]), tma_spec("tma_tile", [TILE_K, TILE_M])]

    @cute.jit
    def __call__(self, args: RowTmaProbeArgs):
        # The runtime encodes both descriptors from tma_specs; the DSL's only give them a place.
        coords = cute.make_tensor(args.src_ptr, k_major_coords())
        one_row = cute.make_layout((1, TILE_K), stride=(TILE_K, 1))
        tile = cute.make_layout((TILE_M, TILE_K), stride=(TILE_K, 1))
        op = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_rows, _ = cute.nvgpu.cpasync.make_tiled_tma_atom(op, coords, one_row, (1, TILE_K))
        tma_tile, _ = cute.nvgpu.cpasync.make_tiled_tma_atom(op, coords, tile, (TILE_M, TILE_K))
        self.kernel(tma_rows, tma_tile, args).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(self, tma_rows: cute.CopyAtom, tma_tile: cute.CopyAtom, args: RowTmaProbeArgs):
        tidx, bidx, grid, warp_idx, _ = thread_roles()
        lane = tidx % 32

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[Int64, STAGES]
            table: cute.struct.Align[cute.struct.MemRange[Int32, TILE_M], 16]
            stages: cute.struct.Align[
                cute.struct.MemRange[BFloat16, STAGES * STAGE_STRIDE // 2], 1024
            ]

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        barrier_ptr = storage.barriers.data_ptr()
        stages = storage.stages.data_ptr()
        stage_at = stages.toint()
        rows_desc = descriptor_address(tma_rows)
        tile_desc = descriptor_address(tma_tile)
        index = cute.make_tensor(args.index_ptr, cute.make_layout(args.index_count))
        table = cute.make_tensor(storage.table.data_ptr(), cute.make_layout(TILE_M))
        src_at = args.src_ptr.toint()
        row_bytes = Int64(args.hidden_size) * Int64(2)
        if tidx == 0:
            for s in cutlass.range(STAGES, unroll=1):
                # A stage filled by cp.async completes on warp 0's 32 arrivals.
                by_lanes = (args.mode == CP_ASYNC) | ((args.mode == CHECK) & (s == 2))
                arrivals = cutlass.select_(by_lanes, 32, 1)
                arrivals = cutlass.select_(args.mode == CP_ASYNC_4, THREADS, arrivals)
                # With B: warp 0 lane 0's arrival expecting B's bytes, beside the lanes' copies.
                b_arrival = (args.b_boxes != 0) & (
                    (args.mode == CP_ASYNC) | (args.mode == CP_ASYNC_4)
                )
                arrivals = arrivals + cutlass.select_(b_arrival, 1, 0)
                cute.arch.mbarrier_init(barrier_ptr + s, arrivals)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if args.mode == CHECK:
            if bidx == 0:
                if warp_idx == 0:
                    if lane == 0:
                        cute.arch.mbarrier_arrive_and_expect_tx(barrier_ptr, STAGE_BYTES)
                        load_box_2d(tile_desc, stage_at, barrier_ptr.toint(), Int32(0), Int32(0))
                        cute.arch.mbarrier_arrive_and_expect_tx(barrier_ptr + 1, STAGE_BYTES)
                    cute.arch.sync_warp()
                    for i in cutlass.range_constexpr(LANE_ROWS):
                        r = lane + 32 * i
                        source = index[r]
                        table[r] = source
                        row = cutlass.select_(source >= 0, source, Int32(ROW_OUT_OF_BOUNDS))
                        load_box_2d(rows_desc, stage_at + STAGE_STRIDE + 2 * TILE_K * r,
                                    (barrier_ptr + 1).toint(), Int32(TILE_K), row)  # fmt: skip
                    cute.arch.sync_warp()
                    gather_k_tile(stage_at + 2 * STAGE_STRIDE, table, src_at, row_bytes,
                                  Int32(TILE_K))  # fmt: skip
                    cp_async_arrive_noinc((barrier_ptr + 2).toint())
                for s in cutlass.range_constexpr(3):
                    cute.arch.mbarrier_wait(barrier_ptr + s, 0)
                # The three stages' A tiles, raw, 8 bytes a thread at a time.
                words = cute.make_tensor(
                    cute.recast_ptr(stages, dtype=Int64),
                    cute.make_layout((STAGE_BYTES // 8, 3), stride=(1, STAGE_STRIDE // 8)),
                )
                out = cute.make_tensor(
                    cute.recast_ptr(args.out_ptr, dtype=Int64),
                    cute.make_layout((STAGE_BYTES // 8, 3)),
                )
                for checked in cutlass.range_constexpr(3):
                    for w in cutlass.range(tidx, STAGE_BYTES // 8, THREADS, unroll=1):
                        out[w, checked] = words[w, checked]
        elif (warp_idx == 0) | (args.mode == CP_ASYNC_4):
            k_per_task = args.hidden_size // TILE_K
            row_tiles = args.src_rows // TILE_M
            tokens = cute.make_rmem_tensor((LANE_ROWS,), Int32)
            for j in cutlass.range(args.k_tiles + STAGES, unroll=1):
                if j >= STAGES:
                    # The stage's previous fill has landed: it may be refilled.
                    done = j - STAGES
                    cute.arch.mbarrier_wait(barrier_ptr + done % STAGES, (done // STAGES) % 2)
                if j < args.k_tiles:
                    s = j % STAGES
                    task = j // k_per_task
                    col = (j % k_per_task) * TILE_K
                    first = (bidx + task * grid) * TILE_M
                    barrier = (barrier_ptr + s).toint()
                    # CP_ASYNC and CP_ASYNC_4 stay two branches: one loop over 32-row groups for
                    # both measured the one-warp mode 8% slower (1.19 against 1.10 us a
                    # k-tile) than its single unrolled 128-row gather, what it is meant to time.
                    if args.mode == CP_ASYNC_4:
                        # Each warp its 32 rows of the task (its own part of the table).
                        mine = warp_idx * 32
                        if j % k_per_task == 0:
                            cute.arch.sync_warp()
                            table[mine + lane] = index[(first + mine + lane) % args.index_count]
                            cute.arch.sync_warp()
                        gather_k_tile(stage_at + s * STAGE_STRIDE, table, src_at, row_bytes, col,
                                      mine, 32)  # fmt: skip
                        cp_async_arrive_noinc(barrier)
                    elif args.mode == CP_ASYNC:
                        if j % k_per_task == 0:
                            # The task's rows (the cp.asyncs took their sources when issued).
                            cute.arch.sync_warp()
                            for i in cutlass.range_constexpr(LANE_ROWS):
                                r = lane + 32 * i
                                table[r] = index[(first + r) % args.index_count]
                            cute.arch.sync_warp()
                        gather_k_tile(stage_at + s * STAGE_STRIDE, table, src_at, row_bytes, col)
                        cp_async_arrive_noinc(barrier)
                    elif lane == 0:
                        # TILE / ROWS: one arrival expecting every box's bytes.
                        expected = STAGE_BYTES + cutlass.select_(args.b_boxes != 0, B_BYTES, 0)
                        cute.arch.mbarrier_arrive_and_expect_tx(barrier_ptr + s, expected)
                    if (args.b_boxes != 0) & (warp_idx == 0) & (lane == 0):
                        # B: two 128-row boxes of other row tiles, as a GEMM's stage loads (the
                        # cp.async modes' barrier expects this arrival too).
                        if (args.mode == CP_ASYNC) | (args.mode == CP_ASYNC_4):
                            cute.arch.mbarrier_arrive_and_expect_tx(barrier_ptr + s, B_BYTES)
                        for b in cutlass.range_constexpr(2):
                            b_row = (first // TILE_M + 1 + b) % row_tiles * TILE_M
                            load_box_2d(tile_desc, stage_at + s * STAGE_STRIDE + STAGE_BYTES * (1 + b),
                                        barrier, col, b_row)  # fmt: skip
                    cute.arch.sync_warp()
                    if args.mode == ROWS:
                        if j % k_per_task == 0:
                            for i in cutlass.range_constexpr(LANE_ROWS):
                                tokens[i] = index[(first + lane + 32 * i) % args.index_count]
                        for i in cutlass.range_constexpr(LANE_ROWS):
                            r = lane + 32 * i
                            load_box_2d(rows_desc, stage_at + s * STAGE_STRIDE + 2 * TILE_K * r,
                                        barrier, col, tokens[i])  # fmt: skip
                    elif (args.mode == TILE) & (lane == 0):
                        row = (first // TILE_M) % row_tiles * TILE_M
                        load_box_2d(tile_desc, stage_at + s * STAGE_STRIDE, barrier, col, row)
