"""SM90 weight-gradient GEMMs of the MoE backward (SEMANTICS §2), one per weight:

    out[e] = A[rows of e]^T @ B[rows of e]      fp32 [E, M, N]
    dW_down[e] = dY_e^T hidden      (A = dY_e [C, H], B = hidden [C, I]: M = H, N = I)
    dW_gate[e] = d_gate^T x_routed  (A = d_gate [C, I], B = x_routed [C, H]: M = I, N = H)
    dW_up[e]   = d_up^T x_routed    (A = d_up [C, I],   B = x_routed [C, H])

K is expert e's token segment (its padded size read from `tokens_per_expert` on the device).
Both operands are stored with their M / N extent contiguous, so both are MN-major: wgmma takes
A and B transposed (imm-trans-a = imm-trans-b = 1) from MN-major 128-byte-swizzled shared
tiles, each 128-wide operand tile loaded as two 64 x 64 TMA boxes.

Determinism (DESIGN §4): every 128 x 256 output tile is owned by one CTA, which runs the whole
K range of its expert in increasing order (no split-K, no atomics). An expert with no tokens
has no K blocks: its tiles are still visited and written with exact zeros.

Engine: the forward's (expert_gemm.py): a TMA producer warp, two wgmma consumer warpgroups of
64 rows each, a `stages`-deep mbarrier ring, persistent CTAs walking tiles tile = CTA index,
+ grid size. Tiles are numbered expert by expert, inside an expert m fastest, then n:
    tile = e * (M / 128) * (N / 256) + n * (M / 128) + m
A forward-only cursor (expert, rows before it) follows the walk, reading tokens_per_expert once
per expert. The epilogue stores the fp32 accumulators directly (8-byte fp32 pairs).

Kernel parameters, in order:
- `tma_a`  A bf16 [C, M] (dims innermost first: M, C): box 64 (M) x 64 (rows)
- `tma_b`  B bf16 [C, N]: box 64 (N) x 64 (rows)
- `out_ptr`  fp32 [E, M, N]
- `tokens_per_expert_ptr`  int32 [num_experts], padded segment sizes, read on the device
- `num_experts`, `m_size`, `n_size`

Constraints (the launcher checks them; the kernel does not):
- tokens_per_expert[e] % 128 == 0, sum <= C.
- m_size % 128 == 0, n_size % 256 == 0, both < 2^16; C < 2^30; every tensor 16-byte aligned.
- launch: grid (num_ctas, 1, 1), num_ctas <= SM count, block (384, 1, 1), cluster (1, 1, 1).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.args import global_pointer

TILE_M = 128  # output rows per CTA tile (two consumer warpgroups x 64)
TILE_N = 128  # columns of each of the two accumulators
TILE_K = 64  # tokens per ring stage
MAX_ROWS = 1 << 30
MAX_COLS = 1 << 16
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
THREADS_PER_WARPGROUP = 128
NUM_CONSUMER_WARPGROUPS = 2


@dataclass(frozen=True)
class Sm90ExpertGemmBwdWeights:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    stages: int = 4

    def validate(self) -> None:
        if not 2 <= self.stages <= 4:
            # 48 KiB per stage (A + B0 + B1 tiles): 4 stages is what fits in 227 KiB.
            raise ValueError(f"stages must be in 2..4, got {self.stages}")

    # ------------------------------------------------------------------ static configuration

    @property
    def threads(self) -> int:
        return THREADS_PER_WARPGROUP * (1 + NUM_CONSUMER_WARPGROUPS)

    def _tiled_mma(self):
        # Both operands MN-major (activations stored [tokens, M] and [tokens, N]).
        return sm90_utils.make_trivial_tiled_mma(
            BFloat16,
            BFloat16,
            cute.nvgpu.warpgroup.OperandMajorMode.MN,
            cute.nvgpu.warpgroup.OperandMajorMode.MN,
            Float32,
            (NUM_CONSUMER_WARPGROUPS, 1, 1),
            tiler_mn=(64, TILE_N),
        )

    def _smem_layout(self, extent: int):
        """Staged (extent, TILE_K, stages) MN-major layout, 128-byte swizzle: 64 x 8 atoms
        tiled along K first (a 64 x 64 block is one TMA box), then along M / N."""
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.COL_MAJOR, BFloat16, extent),
            BFloat16,
        )
        return cute.tile_to_shape(atom, (extent, TILE_K, self.stages), order=(1, 0, 2))

    def tma_specs(self) -> list[dict]:
        """Rank-2 bf16 [C, M or N] tensors, box 64 (contiguous extent, one 128-byte swizzle
        row) x 64 (tokens), dims innermost first."""
        return [
            {
                "param": param,
                "dtype": "bf16",
                "rank": 2,
                "box": [64, TILE_K],
                "swizzle": "128B",
                "l2_promotion": "128B",
                "oob_fill": "none",
            }
            for param in ("tma_a", "tma_b")
        ]

    def stage_bytes(self) -> int:
        return 2 * TILE_K * (TILE_M + 2 * TILE_N)

    def compile_arguments(self) -> tuple:
        return (
            global_pointer(BFloat16, 16),  # a_ptr
            global_pointer(BFloat16, 16),  # b_ptr
            global_pointer(Float32, 16),  # out_ptr
            global_pointer(Int32, 4),  # tokens_per_expert_ptr
            Int32(0),  # num_experts
            Int32(0),  # m_size
            Int32(0),  # n_size
            Int32(1),  # num_ctas
        )

    # ------------------------------------------------------------------ host side

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        num_experts: Int32,
        m_size: Int32,
        n_size: Int32,
        num_ctas: Int32,
    ):
        # Descriptors built here are thrown away: the runtime encodes its own from the manifest.
        operand_layout = cute.make_layout((MAX_COLS, MAX_ROWS), stride=(1, MAX_COLS))
        load = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        a_smem = cute.slice_(self._smem_layout(TILE_M), (None, None, 0))
        b_smem = cute.slice_(self._smem_layout(TILE_N), (None, None, 0))
        tma_a, mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, cute.make_tensor(a_ptr, operand_layout), a_smem, (TILE_M, TILE_K)
        )
        tma_b, mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, cute.make_tensor(b_ptr, operand_layout), b_smem, (TILE_N, TILE_K)
        )
        self.kernel(
            tma_a, mA, tma_b, mB, out_ptr, tokens_per_expert_ptr, num_experts, m_size, n_size
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        out_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        num_experts: Int32,
        m_size: Int32,
        n_size: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid_size, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)

        # ---- static layouts, MMA, shared storage ----
        tiled_mma = self._tiled_mma()
        a_layout = self._smem_layout(TILE_M)
        b_layout = self._smem_layout(TILE_N)
        stage_bytes = cute.size_in_bytes(
            BFloat16, cute.slice_(a_layout, (None, None, 0))
        ) + 2 * cute.size_in_bytes(BFloat16, cute.slice_(b_layout, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            ring_barriers: cute.struct.MemRange[Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_layout)], 1024]
            sB0: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_layout)], 1024]
            sB1: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_layout)], 1024]

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB0 = storage.sB0.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        sB1 = storage.sB1.get_tensor(b_layout.outer, swizzle=b_layout.inner)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

        # ---- operand ring: full barrier = TMA bytes landed, empty = every consumer warp done ----
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ring_barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, NUM_CONSUMER_WARPGROUPS * 4
            ),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        # mbarrier inits must be visible to the async proxy and every warp before first use.
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        # ---- tile list ----
        tokens_per_expert = cute.make_tensor(
            tokens_per_expert_ptr, cute.make_layout(cutlass.max(num_experts, 1))
        )
        m_tiles = m_size // TILE_M
        tiles_per_expert = m_tiles * (n_size // (2 * TILE_N))
        num_tiles = num_experts * tiles_per_expert

        if warpgroup == 0:
            # ================= producer warpgroup: warp 0 issues TMA, warps 1-3 exit =========
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                gA = cute.local_tile(mA, (TILE_M, TILE_K), (None, None))
                gB = cute.local_tile(mB, (TILE_N, TILE_K), (None, None))
                tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                    tma_a,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sA, 0, 2),
                    cute.group_modes(gA, 0, 2),
                )
                tBsB0, tBgB = cute.nvgpu.cpasync.tma_partition(
                    tma_b,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sB0, 0, 2),
                    cute.group_modes(gB, 0, 2),
                )
                tBsB1, _ = cute.nvgpu.cpasync.tma_partition(
                    tma_b,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sB1, 0, 2),
                    cute.group_modes(gB, 0, 2),
                )
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                cursor = Int32(0)
                row_base = Int32(0)
                tile = bidx
                while tile < num_tiles:
                    expert = tile // tiles_per_expert
                    local = tile - expert * tiles_per_expert
                    cursor, row_base = self._advance(tokens_per_expert, expert, cursor, row_base)
                    m_tile = local % m_tiles
                    n_tile = 2 * (local // m_tiles)  # in units of TILE_N
                    k_base = row_base // TILE_K
                    # Fixed K order: the expert's tokens in increasing order, one CTA.
                    for k_tile in cutlass.range(tokens_per_expert[expert] // TILE_K, unroll=1):
                        ring.producer_acquire(state)
                        full = ring.producer_get_barrier(state)
                        cute.copy(
                            tma_a,
                            tAgA[(None, m_tile, k_base + k_tile)],
                            tAsA[(None, state.index)],
                            tma_bar_ptr=full,
                        )
                        cute.copy(
                            tma_b,
                            tBgB[(None, n_tile, k_base + k_tile)],
                            tBsB0[(None, state.index)],
                            tma_bar_ptr=full,
                        )
                        cute.copy(
                            tma_b,
                            tBgB[(None, n_tile + 1, k_base + k_tile)],
                            tBsB1[(None, state.index)],
                            tma_bar_ptr=full,
                        )
                        ring.producer_commit(state)
                        state.advance()
                    tile = tile + grid_size
                # Keep the CTA alive until the consumers released every stage it filled.
                ring.producer_tail(state)
        else:
            # ================= consumer warpgroups: wgmma mainloop + epilogue ================
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            consumer_tidx = tidx - THREADS_PER_WARPGROUP
            thr_mma = tiled_mma.get_slice(consumer_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB0 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB0))
            tCrB1 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB1))
            acc_shape = thr_mma.partition_shape_C((TILE_M, TILE_N))
            acc0 = cute.make_rmem_tensor(acc_shape, Float32)
            acc1 = cute.make_rmem_tensor(acc_shape, Float32)
            k_blocks = cute.size(tCrA, mode=[2])

            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            release_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            tile = bidx
            while tile < num_tiles:
                expert = tile // tiles_per_expert
                local = tile - expert * tiles_per_expert
                k_tiles = tokens_per_expert[expert] // TILE_K
                first_row = (local % m_tiles) * TILE_M
                first_col = (local // m_tiles) * (2 * TILE_N)

                # ---- mainloop (none for an expert without tokens: the tile stays zero) ----
                acc0.fill(0.0)
                acc1.fill(0.0)
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
                if k_tiles > 0:
                    ring.consumer_release(release_state)
                    release_state.advance()

                # ---- epilogue: fp32 registers -> global ----
                expert_offset = Int64(expert) * Int64(m_size) * Int64(n_size)
                for j in cutlass.range_constexpr(2):
                    tile_out = self._output_tile(
                        out_ptr, expert_offset, first_row, first_col + j * TILE_N, n_size
                    )
                    cute.autovec_copy(acc0 if j == 0 else acc1, thr_mma.partition_C(tile_out))
                tile = tile + grid_size

    # ------------------------------------------------------------------ device helpers

    @cute.jit
    def _advance(self, tokens_per_expert: cute.Tensor, expert: Int32, cursor: Int32, row_base):
        """Move the cursor (expert, rows before it) forward to `expert` (never backward)."""
        while cursor < expert:
            row_base = row_base + tokens_per_expert[cursor]
            cursor = cursor + 1
        return cursor, row_base

    @cute.jit
    def _output_tile(
        self,
        ptr: cute.Pointer,
        expert_offset: Int64,
        first_row: Int32,
        first_col: Int32,
        n_size: Int32,
    ):
        """The 128 x 128 fp32 block at (first_row, first_col) of out[e] ([m_size, n_size])."""
        row_stride = cute.assume(Int64(n_size), divby=2 * TILE_N)
        offset = cute.assume(
            expert_offset + Int64(first_row) * row_stride + Int64(first_col), divby=TILE_N
        )
        return cute.make_tensor(
            ptr + offset, cute.make_layout((TILE_M, TILE_N), stride=(row_stride, 1))
        )
