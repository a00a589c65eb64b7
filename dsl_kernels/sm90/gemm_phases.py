"""Phases shared by the SM90 grouped expert GEMMs (expert_gemm.py, expert_gemm_bwd.py,
expert_gemm_bwd_weights.py): the warp-specialised TMA + wgmma engine they all run.

One producer warpgroup (warp 0 issues TMA loads, 40 registers) and two consumer warpgroups
(232 registers each, 64 rows of the 128-row tile each) running wgmma from shared memory into
two fp32 128 x 128 register accumulators that share the A tile. A `stages`-deep ring of
shared-memory buffers (A, B0, B1 per stage), each guarded by a full mbarrier (TMA transaction
bytes) and an empty mbarrier (one arrive per consumer warp), lets the producer run ahead across
tile boundaries. The kernels differ in operand majorness, tile walk and epilogue; those stay in
their own files.

The helpers run at trace time inside the kernels' `@cute.kernel` bodies; their order of
operations is the order the kernels were verified with (the cubins are checked byte for byte).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int8, Int32, Int64

from ..common.ptx import fence_operand
from .expert_tiles import TILE_ROWS

TILE_M = TILE_ROWS  # rows per CTA tile (two consumer warpgroups x 64 rows)
TILE_N = 128  # columns of each of the two accumulators
TILE_K = 64  # bf16 K elements per ring stage: one 128-byte swizzle atom row
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
THREADS_PER_WARPGROUP = 128
NUM_CONSUMER_WARPGROUPS = 2
THREADS = THREADS_PER_WARPGROUP * (1 + NUM_CONSUMER_WARPGROUPS)
# A shared 128 x 128 bf16 block of the epilogue (`staged_block`; epilogue_warps.py hands tiles
# over in two): rows padded by 8 elements (16 bytes) so the accumulator layout's 4-byte shared
# stores hit 32 distinct banks and 16-byte row chunks stay aligned; 34 KiB.
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


def make_tiled_mma(a_major, b_major):
    """Two warpgroups along M (64 rows each), each running m64n128k16 bf16 -> fp32 wgmma;
    `a_major` / `b_major` are `cute.nvgpu.warpgroup.OperandMajorMode`s (MN: read transposed)."""
    return sm90_utils.make_trivial_tiled_mma(
        BFloat16,
        BFloat16,
        a_major,
        b_major,
        Float32,
        (NUM_CONSUMER_WARPGROUPS, 1, 1),
        tiler_mn=(64, TILE_N),
    )


def forward_mma():
    """The forward GEMMs' MMA: both operands K-major (activations [C, K], weights [E * N, K])."""
    K = cute.nvgpu.warpgroup.OperandMajorMode.K
    return make_tiled_mma(K, K)


def backward_mma():
    """The activation-gradient GEMMs' MMA: A K-major, B MN-major (weights read as stored,
    [K, N]: wgmma takes B transposed)."""
    return make_tiled_mma(
        cute.nvgpu.warpgroup.OperandMajorMode.K, cute.nvgpu.warpgroup.OperandMajorMode.MN
    )


def k_major_smem_layout(rows: int, stages: int):
    """Staged (rows, TILE_K, stages) K-major layout with the 128-byte swizzle."""
    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, BFloat16, TILE_K),
        BFloat16,
    )
    return cute.tile_to_shape(atom, (rows, TILE_K, stages), order=(0, 1, 2))


def mn_major_smem_layout(extent: int, stages: int):
    """Staged (extent, TILE_K, stages) MN-major layout with the 128-byte swizzle: atoms of
    64 MN x 8 K, tiled along K first (a 64 x 64 block is one TMA box), then along MN."""
    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(utils.LayoutEnum.COL_MAJOR, BFloat16, extent),
        BFloat16,
    )
    return cute.tile_to_shape(atom, (extent, TILE_K, stages), order=(1, 0, 2))


def tma_spec(param: str, box: list) -> dict:
    """One descriptor spec for the manifest (see runtime/tma.py): a rank-2 bf16 tensor, `box`
    dims innermost first, the 128-byte swizzle of the shared-memory layouts above."""
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
    """Shared memory of the ring: its mbarriers, then A, B0, B1 (1024-byte aligned, as the
    128-byte swizzle needs). Returns (storage, sA, sB0, sB1). A kernel with more to keep in
    shared memory (the epilogue crew's hand-off blocks) asks for a 128-byte-aligned byte
    buffer of `staging_bytes` (`storage.staging`) after the ring; 0 leaves it empty (the
    same shared-memory size and cubin as without the field)."""

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
    """The operand ring: full barrier = TMA bytes landed, empty = every consumer warp done."""
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
    """One gmem partition (box, N tile, K tile) feeding either 128-column shared buffer:
    (smem0 partition, smem1 partition, gmem partition)."""
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
    """Fill `k_tiles` ring stages in K order; returns the advanced producer state.

    `loads`: one (atom, gmem partition, MN tile, first K tile or None, smem partition) per TMA
    box of a stage, issued in that order on the stage's full barrier."""
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
    """This consumer thread's MMA slice and shared-memory operand fragments (stage last):
    (thr_mma, (tCrA, tCrB0, tCrB1))."""
    consumer_tidx = tidx - THREADS_PER_WARPGROUP
    thr_mma = tiled_mma.get_slice(consumer_tidx)
    tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
    tCrB0 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB0))
    tCrB1 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB1))
    return thr_mma, (tCrA, tCrB0, tCrB1)


def make_consumer_fragments(tiled_mma, tidx, sA: cute.Tensor, sB0: cute.Tensor, sB1: cute.Tensor):
    """This consumer thread's MMA slice, shared-memory operand fragments (stage last) and two
    fp32 128 x 128 accumulators: (thr_mma, (tCrA, tCrB0, tCrB1), (acc0, acc1))."""
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
):
    """acc0 = A @ B0, acc1 = A @ B1 over `k_tiles` ring stages, from zero (`operands` and
    `accumulators` as made by `make_consumer_fragments`). Keeps one wgmma batch in flight and
    releases the stage before it. `may_be_empty`: k_tiles can be 0 (no stage was read, so none
    is released). Returns the advanced (read state, release state)."""
    tCrA, tCrB0, tCrB1 = operands
    acc0, acc1 = accumulators
    k_blocks = cute.size(tCrA, mode=[2])
    acc0.fill(0.0)
    acc1.fill(0.0)
    fence_accumulators(accumulators)
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    cute.nvgpu.warpgroup.fence()
    for k_tile in cutlass.range(k_tiles, unroll=1):
        ring.consumer_wait(read_state)
        for k_block in cutlass.range_constexpr(k_blocks):
            coord = (None, None, k_block, read_state.index)
            cute.gemm(tiled_mma, acc0, tCrA[coord], tCrB0[coord], acc0)
            cute.gemm(tiled_mma, acc1, tCrA[coord], tCrB1[coord], acc1)
        cute.nvgpu.warpgroup.commit_group()
        read_state.advance()
        if k_tile > 0:
            # The batch of k_tile - 1 is complete: its stage can be refilled.
            cute.nvgpu.warpgroup.wait_group(1)
            ring.consumer_release(release_state)
            release_state.advance()
    cute.nvgpu.warpgroup.wait_group(0)
    fence_accumulators(accumulators)
    if cutlass.const_expr(may_be_empty):
        if k_tiles > 0:
            ring.consumer_release(release_state)
            release_state.advance()
    else:
        ring.consumer_release(release_state)
        release_state.advance()
    return read_state, release_state


@cute.jit
def fence_accumulators(accumulators: tuple):
    """Every register of the fp32 accumulators through `ptx.fence_operand`: nothing that reads
    them is scheduled before the wgmma.wait_group that precedes this, and the zero-fill before
    the first wgmma stays before it (else ptxas serialises the wgmmas, warning C7514)."""
    for acc in accumulators:
        for i in cutlass.range_constexpr(cute.size(acc)):
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
    """(row0, row1): the two rows this thread's elements of a 128 x 128 accumulator block lie
    on (r0 and r0 + 8 in the wgmma layout), relative to the block."""
    coords = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
    row0 = coords[0][0]
    row1 = row0
    for i in cutlass.range_constexpr(cute.size(coords)):
        row1 = cutlass.select_(coords[i][0] != row0, coords[i][0], row1)
    return row0, row1


def staged_block(storage, offset_bytes: int = 0):
    """A padded 128 x 128 bf16 epilogue block at `offset_bytes` (a multiple of 128)
    into `storage.staging` (allocated with at least offset_bytes + STAGED_BYTES)."""
    return cute.make_tensor(
        cute.recast_ptr(storage.staging.data_ptr() + offset_bytes, dtype=BFloat16),
        cute.make_layout((TILE_M, TILE_N), stride=(STAGED_ROW, 1)),
    )
