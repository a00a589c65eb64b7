"""The warp-specialised TMA + wgmma engine of the SM90 grouped GEMMs and megakernels: a producer
warpgroup (warp 0 issues TMA) and two consumer warpgroups (64 rows each) into two fp32 128 x 128
accumulators sharing A, over a `stages`-deep mbarrier ring. The order of operations is pinned by
the byte-identical cubin check.

This module and the crew hand-off (epilogue_warps.py) implement the GEMM-engine interface that
the megakernels and the MMA phases call (docs/DESIGN.md §4, "The arch boundary"); the tile
geometry is phases/tiles.py's.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int8, Int32, Int64
from cutlass.tensor_utils import LayoutEnum

from ..common.ptx import fence_operand
from ..phases.tiles import TILE_M, TILE_N

# TILE_M x TILE_N (phases/tiles.py): the CTA tile's rows (two consumer warpgroups x 64 rows) and
# the columns of each of the two accumulators.
TILE_K = 64  # bf16 K elements per ring stage: one 128-byte swizzle atom row
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
THREADS_PER_WARPGROUP = 128
NUM_CONSUMER_WARPGROUPS = 2
THREADS = THREADS_PER_WARPGROUP * (1 + NUM_CONSUMER_WARPGROUPS)
# Static extents of the TMA coordinate tensors (the runtime's descriptor carries the real ones):
# coordinates only need to fit, and static shapes add no kernel parameters.
MAX_ROWS = 1 << 30
MAX_COLS = 1 << 16
# Epilogue block rows padded by 16 bytes: the accumulator layout's 4-byte shared stores hit 32
# distinct banks and 16-byte row chunks stay aligned (34 KiB a block).
STAGED_PAD = 8
STAGED_ROW = TILE_N + STAGED_PAD
STAGED_BYTES = 2 * TILE_M * STAGED_ROW
STAGED_CHUNKS = TILE_N // 8  # 16-byte chunks per staged row


# ---------------------------------------------------------------------- static configuration

# Ring stages that fit in the 227 KiB an SM90 CTA may have (48 KiB per stage: A + B0 + B1):
# 4 alone, 3 beside the epilogue crew's two 34 KiB hand-off blocks (epilogue_warps.py).
MAX_STAGES = 4
MAX_STAGES_WITH_CREW = 3


def validate_stages(stages: int, max_stages: int) -> None:
    """A kernel config's `stages`: 2 (the producer one stage ahead) to `max_stages`."""
    if not 2 <= stages <= max_stages:
        raise ValueError(f"stages must be in 2..{max_stages}, got {stages}")


def make_tiled_mma(a_major, b_major, dtype=BFloat16):
    """Two warpgroups along M of m64n128 `dtype` (bf16: k16) -> fp32 wgmma; majors are
    OperandMajorMode."""
    return sm90_utils.make_trivial_tiled_mma(
        dtype,
        dtype,
        a_major,
        b_major,
        Float32,
        (NUM_CONSUMER_WARPGROUPS, 1, 1),
        tiler_mn=(64, TILE_N),
    )


def forward_mma():
    """The forward GEMMs' MMA: both operands K-major (activations [C, K], weights [E * N, K])."""
    K = cute.nvgpu.OperandMajorMode.K
    return make_tiled_mma(K, K)


def backward_mma():
    """The activation-gradient GEMMs' MMA: A K-major, B MN-major (weights read as stored)."""
    return make_tiled_mma(cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN)


def k_major_smem_layout(rows: int, stages: int, dtype=BFloat16, tile_k: int = TILE_K):
    """Staged (rows, tile_k, stages) K-major `dtype` layout with the 128-byte swizzle."""
    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, tile_k),
        dtype,
    )
    return cute.tile_to_shape(atom, (rows, tile_k, stages), order=(0, 1, 2))


def mn_major_smem_layout(extent: int, stages: int):
    """(extent, TILE_K, stages) MN-major 128B-swizzle layout, tiled K first (64 x 64 = a TMA box)."""
    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.COL_MAJOR, BFloat16, extent),
        BFloat16,
    )
    return cute.tile_to_shape(atom, (extent, TILE_K, stages), order=(1, 0, 2))


def tma_spec(param: str, box: list) -> dict:
    """A manifest descriptor spec (mok/runtime/tma.py): rank-2 bf16, `box` innermost first, 128B swizzle."""
    return {
        "param": param,
        "dtype": "bf16",
        "rank": 2,
        "box": list(box),
        "swizzle": "128B",
        "l2_promotion": "128B",
        "oob_fill": "none",
    }


def stage_bytes() -> int:
    """Bytes one ring stage receives (the mbarrier expect_tx count): A + B0 + B1 tiles."""
    return 2 * TILE_K * (TILE_M + 2 * TILE_N)


def k_major_coords():
    """Coordinate layout of a row-major [rows, K] operand (K contiguous)."""
    return cute.make_layout((MAX_ROWS, MAX_COLS), stride=(MAX_COLS, 1))


def mn_major_coords():
    """Coordinate layout of an operand stored [K rows, N] (N contiguous), viewed (N, K)."""
    return cute.make_layout((MAX_COLS, MAX_ROWS), stride=(1, MAX_COLS))


def make_tma_load(ptr: cute.Pointer, gmem_layout, smem_layout, tile_shape):
    """Host side: a TMA load atom for one stage of `smem_layout` and its coordinate tensor."""
    return cute.nvgpu.cpasync.make_tiled_tma_atom(
        cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
        cute.make_tensor(ptr, gmem_layout),
        cute.slice_(smem_layout, (None, None, 0)),
        tile_shape,
    )


# ---------------------------------------------------------------------- kernel prologue


def thread_roles():
    """(tidx, CTA index, grid size, warp index, warpgroup index) of the calling thread."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid_size, _, _ = cute.arch.grid_dim()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    warpgroup = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
    return tidx, bidx, grid_size, warp_idx, warpgroup


def allocate_operand_ring_storage(a_layout, b_layout, stages: int, staging_bytes: int = 0):
    """Ring shared memory: mbarriers, A, B0, B1 (1024-byte aligned for the 128B swizzle), then
    `staging_bytes` of `storage.staging` (0: none). Returns (storage, sA, sB0, sB1)."""

    @cute.struct
    class SharedStorage:
        ring_barriers: cute.struct.MemRange[Int64, stages * 2]
        sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_layout)], 1024]
        sB0: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_layout)], 1024]
        sB1: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_layout)], 1024]
        staging: cute.struct.Align[cute.struct.MemRange[Int8, staging_bytes], 128]

    storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
    sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
    sB0 = storage.sB0.get_tensor(b_layout.outer, swizzle=b_layout.inner)
    sB1 = storage.sB1.get_tensor(b_layout.outer, swizzle=b_layout.inner)
    return storage, sA, sB0, sB1


def make_operand_ring(storage, a_layout, b_layout, stages: int):
    """The operand ring: full barrier = TMA bytes landed (the bf16 A, B0 and B1 tiles), empty =
    every consumer warp done."""
    tx_count = cute.size_in_bytes(
        BFloat16, cute.slice_(a_layout, (None, None, 0))
    ) + 2 * cute.size_in_bytes(BFloat16, cute.slice_(b_layout, (None, None, 0)))
    ring = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.ring_barriers.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(
            pipeline.Agent.Thread, NUM_CONSUMER_WARPGROUPS * 4
        ),
        tx_count=tx_count,
        cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        defer_sync=True,
    )
    # mbarrier inits must be visible to the async proxy and every warp before first use.
    pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
    pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
    return ring


# ---------------------------------------------------------------------- producer: TMA loads


@cute.jit
def partition_tma_load(tma: cute.CopyAtom, smem: cute.Tensor, coords: cute.Tensor, tile_shape):
    """(smem, gmem) TMA partitions of one operand: gmem indexed (box, MN tile, K tile)."""
    tiles = cute.local_tile(coords, tile_shape, (None, None))
    return cute.nvgpu.cpasync.tma_partition(
        tma,
        0,
        cute.make_layout(1),
        cute.group_modes(smem, 0, 2),
        cute.group_modes(tiles, 0, 2),
    )


@cute.jit
def partition_tma_load_pair(
    tma: cute.CopyAtom, smem0: cute.Tensor, smem1: cute.Tensor, coords: cute.Tensor
):
    """(smem0, smem1, gmem) partitions of one gmem partition feeding both 128-column buffers."""
    tiles = cute.local_tile(coords, (TILE_N, TILE_K), (None, None))
    tXsX0, tXgX = cute.nvgpu.cpasync.tma_partition(
        tma, 0, cute.make_layout(1), cute.group_modes(smem0, 0, 2), cute.group_modes(tiles, 0, 2)
    )
    tXsX1, _ = cute.nvgpu.cpasync.tma_partition(
        tma, 0, cute.make_layout(1), cute.group_modes(smem1, 0, 2), cute.group_modes(tiles, 0, 2)
    )
    return tXsX0, tXsX1, tXgX


@cute.jit
def load_k_tiles(ring, state, k_tiles: Int32, loads):
    """Fill `k_tiles` stages in K order from `loads` (per TMA box: atom, gmem, MN tile, K0, smem)."""
    for k_tile in cutlass.range(k_tiles, unroll=1):
        ring.producer_acquire(state)
        full = ring.producer_get_barrier(state)
        for i in cutlass.range_constexpr(len(loads)):
            tma, tXgX, mn_tile, k_base, tXsX = loads[i]
            k = k_tile
            if cutlass.const_expr(k_base is not None):
                k = k_base + k_tile
            cute.copy(tma, tXgX[(None, mn_tile, k)], tXsX[(None, state.index)], tma_bar_ptr=full)
        ring.producer_commit(state)
        state.advance()
    return state


# ---------------------------------------------------------------------- consumers: wgmma


def make_operand_fragments(tiled_mma, tidx, sA: cute.Tensor, sB0: cute.Tensor, sB1: cute.Tensor):
    """(thr_mma, (tCrA, tCrB0, tCrB1)): this consumer's MMA slice and smem fragments, stage last."""
    consumer_tidx = tidx - THREADS_PER_WARPGROUP
    thr_mma = tiled_mma.get_slice(consumer_tidx)
    tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
    tCrB0 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB0))
    tCrB1 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB1))
    return thr_mma, (tCrA, tCrB0, tCrB1)


def make_consumer_fragments(tiled_mma, tidx, sA: cute.Tensor, sB0: cute.Tensor, sB1: cute.Tensor):
    """(thr_mma, (tCrA, tCrB0, tCrB1), (acc0, acc1)): the fragments and two fp32 accumulators."""
    thr_mma, (tCrA, tCrB0, tCrB1) = make_operand_fragments(tiled_mma, tidx, sA, sB0, sB1)
    acc_shape = thr_mma.partition_shape_C((TILE_M, TILE_N))
    acc0 = cute.make_rmem_tensor(acc_shape, Float32)
    acc1 = cute.make_rmem_tensor(acc_shape, Float32)
    return thr_mma, (tCrA, tCrB0, tCrB1), (acc0, acc1)


def make_consumer_states(stages: int):
    """(read state, release state): release trails read by the one wgmma batch in flight."""
    read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    return read_state, release_state


@cute.jit
def mma_k_tiles(
    tiled_mma,
    ring,
    read_state,
    release_state,
    k_tiles: Int32,
    operands: tuple,
    accumulators: tuple,
    may_be_empty: bool = False,
    from_zero: bool = True,
    skip=None,
    eager=False,
):
    """acc0 = A @ B0, acc1 = A @ B1 over `k_tiles` stages from zero, one wgmma batch in flight and
    the stage before it released. `may_be_empty`: k_tiles may be 0. `from_zero` False: the
    accumulators go on from the values the caller put in them (every wgmma accumulates, so a
    sum continued from its stored fp32 partial is bitwise the uninterrupted one). `skip` (a
    Boolean, the same on the whole warpgroup; `from_zero` only): this warpgroup's 64 rows are
    all padding, so it issues no wgmma: it waits for and releases each of the `k_tiles` stages
    (the other warpgroup reads them) and its accumulators stay zero, what wgmma gives for zero
    rows. `eager` (a bool, or a Boolean the same on the whole warpgroup): each stage is released
    as soon as its own batch completes, none held past its batch (the megakernels' GEMM tasks,
    and weight tasks of enough k tiles: NOTES §18 item 13); the producer refills a stage one
    batch sooner, and the next batch waits for this one. Returns (read, release)."""
    # A skipping warpgroup hands off what it holds: zeros only when it started from them.
    assert from_zero or skip is None, "mma_k_tiles: skip needs from_zero"
    tCrA, tCrB0, tCrB1 = operands
    acc0, acc1 = accumulators
    k_blocks = cute.size(tCrA, mode=[2])
    if cutlass.const_expr(from_zero):
        acc0.fill(0.0)
        acc1.fill(0.0)
    mma_tiles = k_tiles
    if cutlass.const_expr(skip is not None):
        mma_tiles = cutlass.select_(skip, Int32(0), k_tiles)
    fence_accumulators(accumulators)
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    cute.nvgpu.warpgroup.fence()
    for k_tile in cutlass.range(mma_tiles, unroll=1):
        ring.consumer_wait(read_state)
        for k_block in cutlass.range_constexpr(k_blocks):
            coord = (None, None, k_block, read_state.index)
            cute.gemm(tiled_mma, acc0, tCrA[coord], tCrB0[coord], acc0)
            cute.gemm(tiled_mma, acc1, tCrA[coord], tCrB1[coord], acc1)
        cute.nvgpu.warpgroup.commit_group()
        read_state.advance()
        if cutlass.const_expr(isinstance(eager, bool)):
            release_state = _release_behind(ring, release_state, k_tile, eager)
        elif eager:
            release_state = _release_behind(ring, release_state, k_tile, True)
        else:
            release_state = _release_behind(ring, release_state, k_tile, False)
    cute.nvgpu.warpgroup.wait_group(0)
    fence_accumulators(accumulators)
    # The last stage read is still held unless it was released eagerly.
    if cutlass.const_expr(eager is True):
        pass
    elif cutlass.const_expr(eager is not False):
        if not eager and mma_tiles > 0:
            ring.consumer_release(release_state)
            release_state.advance()
    elif cutlass.const_expr(may_be_empty or skip is not None):
        if mma_tiles > 0:
            ring.consumer_release(release_state)
            release_state.advance()
    else:
        ring.consumer_release(release_state)
        release_state.advance()
    if cutlass.const_expr(skip is not None):
        for _ in cutlass.range(k_tiles - mma_tiles, unroll=1):
            ring.consumer_wait(read_state)
            read_state.advance()
            ring.consumer_release(release_state)
            release_state.advance()
    return read_state, release_state


def eager_from(k_tiles, min_k_tiles: int):
    """`mma_k_tiles`' `eager` for a task of `k_tiles` (an Int32) under a kernel's
    `eager_min_k_tiles`: 1 or less always (a bool: no branch in the loop), else whether k_tiles
    reaches it (a Boolean: a branch in the loop, which ptxas serialised the wgmmas over in the
    standalone window weight kernel (C7520) but not in the megakernels)."""
    if min_k_tiles <= 1:
        return True
    return k_tiles >= min_k_tiles


@cute.jit
def _release_behind(ring, release_state, k_tile: Int32, eager: cutlass.Constexpr):
    """After k tile `k_tile`'s batch is committed: release its stage once it completes
    (`eager`), else the stage of the batch before it (none after the first). Returns the
    release state."""
    if cutlass.const_expr(eager):
        cute.nvgpu.warpgroup.wait_group(0)
        ring.consumer_release(release_state)
        release_state.advance()
    elif k_tile > 0:
        # The batch of k_tile - 1 is complete: its stage can be refilled.
        cute.nvgpu.warpgroup.wait_group(1)
        ring.consumer_release(release_state)
        release_state.advance()
    return release_state


@cute.jit
def fence_accumulators(accumulators: tuple):
    """`ptx.fence_operand` on every accumulator register: readers stay after the wait_group and the
    zero-fill before the first wgmma (else ptxas serialises the wgmmas, warning C7514)."""
    for acc in accumulators:
        for i in cutlass.range(cute.size(acc), unroll_full=True):
            acc[i] = fence_operand(acc[i])


# ---------------------------------------------------------------------- epilogues


@cute.jit
def output_tile(
    ptr: cute.Pointer,
    base_offset,
    first_row: Int32,
    first_col: Int32,
    n_size: Int32,
    n_size_divisor: int,
):
    """The TILE_M x TILE_N block at (first_row, first_col) of a row-major [*, n_size] tensor at
    `ptr + base_offset` (None: no offset); `n_size_divisor` divides n_size."""
    row_stride = cute.assume(Int64(n_size), divby=n_size_divisor)
    # first_row and first_col are multiples of 128: 16-byte accesses stay provably aligned.
    if cutlass.const_expr(base_offset is None):
        offset = cute.assume(Int64(first_row) * row_stride + Int64(first_col), divby=TILE_N)
    else:
        offset = cute.assume(
            base_offset + Int64(first_row) * row_stride + Int64(first_col), divby=TILE_N
        )
    return cute.make_tensor(
        ptr + offset, cute.make_layout((TILE_M, TILE_N), stride=(row_stride, 1))
    )


@cute.jit
def accumulator_rows(thr_mma):
    """(row0, row1): rows r0, r0 + 8 of this thread's elements in a 128 x 128 accumulator block."""
    coords = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
    row0 = coords[0][0]
    row1 = row0
    for i in cutlass.range(cute.size(coords), unroll_full=True):
        row1 = cutlass.select_(coords[i][0] != row0, coords[i][0], row1)
    return row0, row1


def staged_block(storage, offset_bytes: int = 0):
    """A padded 128 x 128 bf16 block at `offset_bytes` (a multiple of 128) of `storage.staging`."""
    ptr = cute.recast_ptr(storage.staging.data_ptr() + offset_bytes, dtype=BFloat16)
    return cute.make_tensor(ptr, cute.make_layout((TILE_M, TILE_N), stride=(STAGED_ROW, 1)))
