"""How fast one SM moves rows, two ways: a probe for docs/NOTES.md §18, open question 7.

Destination row r of `dst` is source row `index[r]` of `src`, rows of ROW_BYTES (4096: a row of
H = 2048 bf16, as the dispatch copies them); CTA b copies rows b, b + grid, b + 2 grid, ...
Modes (compile time):

- `vector`: every thread, as the megakernels' dispatch copies: each warp whole rows, a lane's
  8 16-byte loads of a row in flight, then its 8 stores.
- `bulk`: thread 0 alone: for each row a bulk copy global -> shared (`cp.async.bulk`, its bytes
  completing on the row's slot's mbarrier) and, LAG rows later, a bulk copy shared -> global
  from that slot; SLOTS slots of staging (160 KiB), a slot refilled only after its store has
  read it (`cp.async.bulk.wait_group.read`). Both copies are the async proxy's, so no fence.

tools/copy_probe.py times both against the number of CTAs (the GB/s each SM reaches) and
checks every row; tests/gpu/test_copy_probe_gpu.py checks the bits.

Launch: grid (n, 1, 1), block (128, 1, 1); one CTA an SM for n <= SM count.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from ..common.bounded_wait import _i32, _i64, side_effect_asm
from ..common.params import Bf16Pointer, Int32Pointer
from ..common.row_chunks import VECTOR, chunked_row_views
from .gemm_engine import thread_roles

MODES = ("vector", "bulk")
THREADS = 128
ROW_BYTES = 4096
ROW_ELEMENTS = ROW_BYTES // 2
SLOTS = 40  # bulk: rows of staging
LAG = 16  # bulk: loads issued ahead of their stores
LOADS_A_LANE = ROW_ELEMENTS // VECTOR // 32  # vector: 16-byte chunks of a row per lane


class CopyProbeArgs(NamedTuple):
    """`Sm90CopyProbe`'s parameters, in order."""

    src_ptr: Bf16Pointer  # [src_rows, 2048]
    dst_ptr: Bf16Pointer  # [rows, 2048]
    index_ptr: Int32Pointer  # [rows]: the source row of each destination row
    src_rows: Int32
    rows: Int32


@dsl_user_op
def bulk_load(smem: Int32, source: Int64, size: Int32, barrier: Int32, *, loc=None, ip=None):
    """`cp.async.bulk` of `size` bytes global -> shared, completing on `barrier`'s tx count."""
    side_effect_asm(
        None,
        [_i32(smem, loc, ip), _i64(source, loc, ip), _i32(size, loc, ip),
         _i32(barrier, loc, ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r,~{memory}",
        loc,
        ip,
    )  # fmt: skip


@dsl_user_op
def bulk_store(target: Int64, smem: Int32, size: Int32, *, loc=None, ip=None):
    """`cp.async.bulk` of `size` bytes shared -> global, in the thread's current bulk group."""
    side_effect_asm(
        None,
        [_i64(target, loc, ip), _i32(smem, loc, ip), _i32(size, loc, ip)],
        "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;",
        "l,r,r,~{memory}",
        loc,
        ip,
    )


@dataclass(frozen=True)
class Sm90CopyProbe:
    mode: str = "bulk"  # MODES; the build calls validate()

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    @cute.jit
    def __call__(self, args: CopyProbeArgs):
        # The runtime launches the cubin with its own grid.
        self.kernel(args).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, args: CopyProbeArgs):
        tidx, bidx, grid, _, _ = thread_roles()
        if cutlass.const_expr(self.mode == "vector"):
            self._vector(args, tidx, bidx, grid)
        else:
            self._bulk(args, tidx, bidx, grid)

    @cute.jit
    def _vector(self, args: CopyProbeArgs, tidx: Int32, bidx: Int32, grid: Int32):
        _, (src, dst) = chunked_row_views(
            Int32(ROW_ELEMENTS), (args.src_ptr, args.src_rows), (args.dst_ptr, args.rows)
        )
        index = cute.make_tensor(args.index_ptr, cute.make_layout(args.rows))
        warps = THREADS // 32
        lane = tidx % 32
        for row in cutlass.range(bidx * warps + tidx // 32, args.rows, grid * warps, unroll=1):
            source = index[row]
            chunks = cute.make_rmem_tensor((VECTOR, LOADS_A_LANE), cutlass.BFloat16)
            for i in cutlass.range_constexpr(LOADS_A_LANE):
                chunks[None, i].store(src[None, lane + 32 * i, source].load())
            for i in cutlass.range_constexpr(LOADS_A_LANE):
                dst[None, lane + 32 * i, row].store(chunks[None, i].load())

    @cute.jit
    def _bulk(self, args: CopyProbeArgs, tidx: Int32, bidx: Int32, grid: Int32):
        @cute.struct
        class SharedStorage:
            staging: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, SLOTS * ROW_BYTES], 128]
            barriers: cute.struct.Align[cute.struct.MemRange[Int64, SLOTS], 8]

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        staging = storage.staging.data_ptr().toint()
        barrier_ptr = storage.barriers.data_ptr()
        if tidx == 0:
            for slot in cutlass.range(SLOTS, unroll=1):
                cute.arch.mbarrier_init(barrier_ptr + slot, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx == 0:
            index = cute.make_tensor(args.index_ptr, cute.make_layout(args.rows))
            count = Int32(0)
            if bidx < args.rows:
                count = (args.rows - bidx + grid - 1) // grid
            src = args.src_ptr.toint()
            dst = args.dst_ptr.toint()
            for i in cutlass.range(count + LAG, unroll=1):
                if i < count:
                    slot = i % SLOTS
                    if i >= SLOTS:
                        # Row i - SLOTS's store (issued LAG rows after its load) has read the slot.
                        cute.arch.cp_async_bulk_wait_group(SLOTS - LAG - 1, read=True)
                    barrier = barrier_ptr + slot
                    cute.arch.mbarrier_arrive_and_expect_tx(barrier, ROW_BYTES)
                    source = Int64(index[bidx + i * grid]) * Int64(ROW_BYTES)
                    bulk_load(staging + slot * ROW_BYTES, src + source, Int32(ROW_BYTES),
                              barrier.toint())  # fmt: skip
                j = i - LAG
                if j >= 0:
                    slot = j % SLOTS
                    cute.arch.mbarrier_wait(barrier_ptr + slot, (j // SLOTS) % 2)
                    target = Int64(bidx + j * grid) * Int64(ROW_BYTES)
                    bulk_store(dst + target, staging + slot * ROW_BYTES, Int32(ROW_BYTES))
                    cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0)
