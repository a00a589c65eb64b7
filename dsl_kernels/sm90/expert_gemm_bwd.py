"""SM90 grouped expert GEMMs of the MoE backward (SEMANTICS §2): the activation-gradient GEMMs.

`Sm90ExpertGemmBwd(job="d_hidden_swiglu")`, d_hidden with the SwiGLU backward fused:
    d_hidden[r, :] = dY_e[r, :] @ W_down[e]            (fp32, never stored)
    d_gate, d_up   = mok.reference.swiglu_backward(d_hidden, gate[r, :], up[r, :], limit)
`Sm90ExpertGemmBwd(job="d_x")`, one fused K loop over 2 I (gate half first, then up half):
    d_x[r, :] = bf16(d_gate[r, :] @ W_gate[e] + d_up[r, :] @ W_up[e])
for every routed row r of expert e (rows grouped by expert, see expert_tiles.py).

The engine is the forward's (expert_gemm.py): one producer warpgroup (warp 0 issues TMA, 40
registers), two consumer warpgroups (232 registers, 64 rows each) running wgmma from a
`stages`-deep mbarrier ring, a persistent walk over 128 x 256 output tiles located on the
device from `tokens_per_expert`. What differs is B: here the weights are read the way they are
stored, [E, K, N] with N contiguous (W_down [E, H, I]: K = H, N = I; W_gate/W_up [E, I, H]:
K = I, N = H), so B is MN-major and the wgmma takes it transposed (imm-trans-b = 1) from an
MN-major 128-byte-swizzled shared-memory tile. No transposed copy of any weight is made.

Each 128 x 256 tile is two 128 x 128 accumulators: B0 and B1 are the two adjacent 128-column
blocks of the same weight rows (both loaded with the descriptor of the current K half). Every
K block is one TMA load of A (box 64 x 128, K-major) and two of B per 128 columns (box 64 x 64:
64 contiguous N elements = one 128-byte swizzle row, 64 K rows).

d_hidden_swiglu epilogue (per accumulator, fp32 d_hidden in registers): load the bf16 gate/up
of the same rows and columns (the forward context, pre-clamp), then exactly the reference's
fp32 expression order:
    g, u = clamp(gate), clamp(up);  sig = 1 / (1 + exp(-g))
    d_up = dh * (g * sig);  d_gate = (dh * u) * (sig * (1 + g * (1 - sig)))
    d_gate = 0 where gate > limit;  d_up = 0 where |up| > limit   (only if has_limit)
`exp` is CuTe's `cute.math.exp`: a range-reduced expf (x = n ln2 + r with a two-constant
log2(e), `ex2.approx.ftz.f32` on r, times 2^n) within ~2 fp32 ulp of a correctly rounded expf;
1 / (1 + e) is `rcp.rn.f32`, correctly rounded like torch's division. ptxas contracts
`e * 2^n + 1` and `g * (1 - sig) + 1` into FMAs (one rounding instead of two). So the fp32
values differ from the reference's by a few fp32 ulp and the bf16 outputs by at most 1 bf16
ulp, on the rare elements that sit on a rounding boundary. Without a limit the clamps and
masks run against +inf (identities), so the epilogue is branch-free.

Kernel parameters, in order (the runtime encodes the descriptors from the manifest's specs;
tensors are row-major, innermost dim last):
- `tma_a0`  d_hidden_swiglu: dY_e bf16 [C, H];  d_x: d_gate bf16 [C, I]: box 64 x 128
- `tma_a1`  d_hidden_swiglu: the same descriptor as tma_a0 (unused);  d_x: d_up bf16 [C, I]
- `tma_b0`  d_hidden_swiglu: W_down viewed [E * H, I];  d_x: W_gate viewed [E * I, H]: box
            64 (N, innermost) x 64 (K rows)
- `tma_b1`  d_hidden_swiglu: the same descriptor as tma_b0 (unused);  d_x: W_up viewed [E * I, H]
- `out0_ptr`  d_hidden_swiglu: d_gate bf16 [C, I];  d_x: d_x bf16 [C, H]
- `out1_ptr`  d_hidden_swiglu: d_up bf16 [C, I];  d_x: unused (pass null)
- `gate_ptr`, `up_ptr`  d_hidden_swiglu: forward gate/up bf16 [C, I] (pre-clamp); d_x: null
- `tokens_per_expert_ptr`  int32 [num_experts], padded segment sizes, read on the device
- `num_experts`, `k_size` (one K half: H for d_hidden_swiglu, I for d_x), `n_size` (I or H)
- `has_limit` (int32, 0/1), `swiglu_limit` (fp32; ignored unless has_limit)

Constraints (the launcher checks them; the kernel does not):
- tokens_per_expert[e] % 128 == 0, sum <= C; rows past the sum are not written.
- k_size % 64 == 0; n_size % 256 == 0.
- every tensor 16-byte aligned and contiguous; C, E * k_size < 2^30 rows; n_size, k_size < 2^16.
- launch: grid (num_ctas, 1, 1) with num_ctas <= SM count (one CTA per SM: it takes all of the
  shared memory), block (384, 1, 1), cluster (1, 1, 1), dynamic smem from the manifest.

Why sm_90a only: wgmma and setmaxnreg are Hopper instructions (see expert_gemm.py).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.args import global_pointer
from .expert_tiles import TILE_ROWS, locate_tile, segment_row_tiles

JOBS = ("d_hidden_swiglu", "d_x")
TILE_M = TILE_ROWS  # rows per CTA tile (two consumer warpgroups x 64 rows)
TILE_N = 128  # columns of each of the two accumulators
TILE_K = 64  # K elements per ring stage
# The TMA coordinate tensors get static extents (the runtime's descriptor carries the real ones).
MAX_ROWS = 1 << 30
MAX_COLS = 1 << 16
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
THREADS_PER_WARPGROUP = 128
NUM_CONSUMER_WARPGROUPS = 2


@dataclass(frozen=True)
class Sm90ExpertGemmBwd:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    job: str = "d_hidden_swiglu"
    stages: int = 4

    def validate(self) -> None:
        if self.job not in JOBS:
            raise ValueError(f"job must be one of {JOBS}, got {self.job!r}")
        if not 2 <= self.stages <= 4:
            # 48 KiB per stage (A + B0 + B1 tiles): 4 stages is what fits in 227 KiB.
            raise ValueError(f"stages must be in 2..4, got {self.stages}")

    # ------------------------------------------------------------------ static configuration

    @property
    def threads(self) -> int:
        return THREADS_PER_WARPGROUP * (1 + NUM_CONSUMER_WARPGROUPS)

    @property
    def k_halves(self) -> int:
        """K segments of the fused loop: d_x runs over [d_gate | d_up] x [W_gate ; W_up]."""
        return 2 if self.job == "d_x" else 1

    def _tiled_mma(self):
        # A K-major (activations, row-major [C, K]); B MN-major (weights stored [K, N]):
        # wgmma reads B transposed. Two warpgroups along M, m64n128k16 instructions.
        return sm90_utils.make_trivial_tiled_mma(
            BFloat16,
            BFloat16,
            cute.nvgpu.warpgroup.OperandMajorMode.K,
            cute.nvgpu.warpgroup.OperandMajorMode.MN,
            Float32,
            (NUM_CONSUMER_WARPGROUPS, 1, 1),
            tiler_mn=(64, TILE_N),
        )

    def _a_smem_layout(self):
        """Staged (TILE_M, TILE_K, stages) K-major layout with the 128-byte swizzle."""
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, BFloat16, TILE_K),
            BFloat16,
        )
        return cute.tile_to_shape(atom, (TILE_M, TILE_K, self.stages), order=(0, 1, 2))

    def _b_smem_layout(self):
        """Staged (TILE_N, TILE_K, stages) MN-major layout with the 128-byte swizzle: atoms of
        64 N x 8 K, tiled along K first (a 64 x 64 block is one TMA box), then along N."""
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.COL_MAJOR, BFloat16, TILE_N),
            BFloat16,
        )
        return cute.tile_to_shape(atom, (TILE_N, TILE_K, self.stages), order=(1, 0, 2))

    def tma_specs(self) -> list[dict]:
        """How the runtime encodes each descriptor param (see runtime/tma.py): rank-2 bf16
        tensors, box dims innermost first. A: [C, K] with a 64 (K) x 128 (rows) box. B: the
        weights viewed [E * K, N] with a 64 (N) x 64 (K rows) box: the innermost box is capped
        at the 128-byte swizzle span, so a 128-column B tile is two boxes."""

        def spec(param, box):
            return {
                "param": param,
                "dtype": "bf16",
                "rank": 2,
                "box": box,
                "swizzle": "128B",
                "l2_promotion": "128B",
                "oob_fill": "none",
            }

        return [
            spec("tma_a0", [TILE_K, TILE_M]),
            spec("tma_a1", [TILE_K, TILE_M]),
            spec("tma_b0", [64, TILE_K]),
            spec("tma_b1", [64, TILE_K]),
        ]

    def stage_bytes(self) -> int:
        """Bytes one ring stage receives (the mbarrier expect_tx count): A + B0 + B1 tiles."""
        return 2 * TILE_K * (TILE_M + 2 * TILE_N)

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(BFloat16, 16),  # a0_ptr
            global_pointer(BFloat16, 16),  # a1_ptr
            global_pointer(BFloat16, 16),  # b0_ptr
            global_pointer(BFloat16, 16),  # b1_ptr
            global_pointer(BFloat16, 16),  # out0_ptr
            global_pointer(BFloat16, 16),  # out1_ptr
            global_pointer(BFloat16, 16),  # gate_ptr
            global_pointer(BFloat16, 16),  # up_ptr
            global_pointer(Int32, 4),  # tokens_per_expert_ptr
            Int32(0),  # num_experts
            Int32(0),  # k_size
            Int32(0),  # n_size
            Int32(0),  # has_limit
            Float32(0.0),  # swiglu_limit
            Int32(1),  # num_ctas
        )

    # ------------------------------------------------------------------ host side

    @cute.jit
    def __call__(
        self,
        a0_ptr: cute.Pointer,
        a1_ptr: cute.Pointer,
        b0_ptr: cute.Pointer,
        b1_ptr: cute.Pointer,
        out0_ptr: cute.Pointer,
        out1_ptr: cute.Pointer,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        num_experts: Int32,
        k_size: Int32,
        n_size: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
        num_ctas: Int32,
    ):
        # The descriptors built here are thrown away: the runtime encodes its own from the
        # manifest (same box, swizzle and element type, the caller's real extents).
        a_layout = cute.make_layout((MAX_ROWS, MAX_COLS), stride=(MAX_COLS, 1))  # (rows, K)
        b_layout = cute.make_layout((MAX_COLS, MAX_ROWS), stride=(1, MAX_COLS))  # (N, K rows)
        load = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        a_smem = cute.slice_(self._a_smem_layout(), (None, None, 0))
        b_smem = cute.slice_(self._b_smem_layout(), (None, None, 0))
        tma_a0, mA0 = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, cute.make_tensor(a0_ptr, a_layout), a_smem, (TILE_M, TILE_K)
        )
        tma_a1, mA1 = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, cute.make_tensor(a1_ptr, a_layout), a_smem, (TILE_M, TILE_K)
        )
        tma_b0, mB0 = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, cute.make_tensor(b0_ptr, b_layout), b_smem, (TILE_N, TILE_K)
        )
        tma_b1, mB1 = cute.nvgpu.cpasync.make_tiled_tma_atom(
            load, cute.make_tensor(b1_ptr, b_layout), b_smem, (TILE_N, TILE_K)
        )
        self.kernel(
            tma_a0,
            mA0,
            tma_a1,
            mA1,
            tma_b0,
            mB0,
            tma_b1,
            mB1,
            out0_ptr,
            out1_ptr,
            gate_ptr,
            up_ptr,
            tokens_per_expert_ptr,
            num_experts,
            k_size,
            n_size,
            has_limit,
            swiglu_limit,
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(
        self,
        tma_a0: cute.CopyAtom,
        mA0: cute.Tensor,
        tma_a1: cute.CopyAtom,
        mA1: cute.Tensor,
        tma_b0: cute.CopyAtom,
        mB0: cute.Tensor,
        tma_b1: cute.CopyAtom,
        mB1: cute.Tensor,
        out0_ptr: cute.Pointer,
        out1_ptr: cute.Pointer,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        num_experts: Int32,
        k_size: Int32,
        n_size: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid_size, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warpgroup = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)

        # ---- static layouts, MMA, shared storage ----
        tiled_mma = self._tiled_mma()
        a_layout = self._a_smem_layout()
        b_layout = self._b_smem_layout()
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
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a0)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b0)
            if cutlass.const_expr(self.k_halves == 2):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a1)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b1)

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

        # ---- tile list inputs ----
        tokens_per_expert = cute.make_tensor(
            tokens_per_expert_ptr, cute.make_layout(cutlass.max(num_experts, 1))
        )
        k_half_tiles = k_size // TILE_K
        col_tiles = n_size // (2 * TILE_N)

        if warpgroup == 0:
            # ================= producer warpgroup: warp 0 issues TMA, warps 1-3 exit =========
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                a_loads = (
                    self._partition_a(tma_a0, sA, mA0),
                    self._partition_a(tma_a1, sA, mA1),
                )
                b_loads = (
                    self._partition_b(tma_b0, sB0, sB1, mB0),
                    self._partition_b(tma_b1, sB0, sB1, mB1),
                )
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                expert = Int32(0)
                tile_base = Int32(0)
                row_base = Int32(0)
                row_tiles = segment_row_tiles(tokens_per_expert, expert, num_experts)
                tile = bidx
                expert, tile_base, row_base, row_tiles = locate_tile(
                    tokens_per_expert,
                    num_experts,
                    col_tiles,
                    tile,
                    expert,
                    tile_base,
                    row_base,
                    row_tiles,
                )
                while expert < num_experts:
                    local = tile - tile_base
                    a_row_tile = row_base // TILE_M + local % row_tiles
                    # B column blocks (units of TILE_N) and the expert's first K row tile.
                    b_col_tile = 2 * (local // row_tiles)
                    b_k_base = expert * k_half_tiles
                    # Fixed K order: the gate half, then the up half (d_x); one half otherwise.
                    for half in cutlass.range_constexpr(self.k_halves):
                        tma_a, tAsA, tAgA = a_loads[half]
                        tma_b, tBsB0, tBsB1, tBgB = b_loads[half]
                        for k_tile in cutlass.range(k_half_tiles, unroll=1):
                            ring.producer_acquire(state)
                            full = ring.producer_get_barrier(state)
                            cute.copy(
                                tma_a,
                                tAgA[(None, a_row_tile, k_tile)],
                                tAsA[(None, state.index)],
                                tma_bar_ptr=full,
                            )
                            cute.copy(
                                tma_b,
                                tBgB[(None, b_col_tile, b_k_base + k_tile)],
                                tBsB0[(None, state.index)],
                                tma_bar_ptr=full,
                            )
                            cute.copy(
                                tma_b,
                                tBgB[(None, b_col_tile + 1, b_k_base + k_tile)],
                                tBsB1[(None, state.index)],
                                tma_bar_ptr=full,
                            )
                            ring.producer_commit(state)
                            state.advance()
                    tile = tile + grid_size
                    expert, tile_base, row_base, row_tiles = locate_tile(
                        tokens_per_expert,
                        num_experts,
                        col_tiles,
                        tile,
                        expert,
                        tile_base,
                        row_base,
                        row_tiles,
                    )
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
            k_tiles = self.k_halves * k_half_tiles

            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            release_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.stages
            )
            expert = Int32(0)
            tile_base = Int32(0)
            row_base = Int32(0)
            row_tiles = segment_row_tiles(tokens_per_expert, expert, num_experts)
            tile = bidx
            expert, tile_base, row_base, row_tiles = locate_tile(
                tokens_per_expert,
                num_experts,
                col_tiles,
                tile,
                expert,
                tile_base,
                row_base,
                row_tiles,
            )
            while expert < num_experts:
                local = tile - tile_base
                first_row = row_base + (local % row_tiles) * TILE_M
                first_col = (local // row_tiles) * (2 * TILE_N)

                # ---- mainloop: keep one wgmma batch in flight, release the stage before it ----
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
                ring.consumer_release(release_state)
                release_state.advance()

                # ---- epilogue: registers -> global, no shared memory ----
                if cutlass.const_expr(self.job == "d_x"):
                    self._store(thr_mma, acc0, out0_ptr, first_row, first_col, n_size)
                    self._store(thr_mma, acc1, out0_ptr, first_row, first_col + TILE_N, n_size)
                else:
                    for j in cutlass.range_constexpr(2):
                        self._swiglu_backward(
                            thr_mma,
                            acc0 if j == 0 else acc1,
                            out0_ptr,
                            out1_ptr,
                            gate_ptr,
                            up_ptr,
                            first_row,
                            first_col + j * TILE_N,
                            n_size,
                            has_limit,
                            swiglu_limit,
                        )

                tile = tile + grid_size
                expert, tile_base, row_base, row_tiles = locate_tile(
                    tokens_per_expert,
                    num_experts,
                    col_tiles,
                    tile,
                    expert,
                    tile_base,
                    row_base,
                    row_tiles,
                )

    # ------------------------------------------------------------------ device helpers

    @cute.jit
    def _partition_a(self, tma_a: cute.CopyAtom, sA: cute.Tensor, mA: cute.Tensor):
        gA = cute.local_tile(mA, (TILE_M, TILE_K), (None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        return tma_a, tAsA, tAgA

    @cute.jit
    def _partition_b(
        self, tma_b: cute.CopyAtom, sB0: cute.Tensor, sB1: cute.Tensor, mB: cute.Tensor
    ):
        """One global partition (N tile, K tile) feeding either 128-column shared buffer."""
        gB = cute.local_tile(mB, (TILE_N, TILE_K), (None, None))
        tBsB0, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB0, 0, 2), cute.group_modes(gB, 0, 2)
        )
        tBsB1, _ = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB1, 0, 2), cute.group_modes(gB, 0, 2)
        )
        return tma_b, tBsB0, tBsB1, tBgB

    @cute.jit
    def _output_tile(self, ptr: cute.Pointer, first_row: Int32, first_col: Int32, n_size: Int32):
        """The 128 x 128 block at (first_row, first_col) of a row-major [*, n_size] tensor."""
        row_stride = cute.assume(Int64(n_size), divby=2 * TILE_N)
        # first_row and first_col are multiples of 128: 16-byte accesses stay provably aligned.
        offset = cute.assume(Int64(first_row) * row_stride + Int64(first_col), divby=TILE_N)
        return cute.make_tensor(
            ptr + offset, cute.make_layout((TILE_M, TILE_N), stride=(row_stride, 1))
        )

    @cute.jit
    def _store(
        self,
        thr_mma,
        acc: cute.Tensor,
        out_ptr: cute.Pointer,
        first_row: Int32,
        first_col: Int32,
        n_size: Int32,
    ):
        out = cute.make_rmem_tensor(acc.shape, BFloat16)
        out.store(acc.load().to(BFloat16))
        cute.autovec_copy(
            out, thr_mma.partition_C(self._output_tile(out_ptr, first_row, first_col, n_size))
        )

    @cute.jit
    def _swiglu_backward(
        self,
        thr_mma,
        acc: cute.Tensor,
        d_gate_ptr: cute.Pointer,
        d_up_ptr: cute.Pointer,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        first_row: Int32,
        first_col: Int32,
        n_size: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
    ):
        """d_gate, d_up of one 128 x 128 block from fp32 d_hidden (mok.reference order)."""
        gate = cute.make_rmem_tensor(acc.shape, BFloat16)
        up = cute.make_rmem_tensor(acc.shape, BFloat16)
        cute.autovec_copy(
            thr_mma.partition_C(self._output_tile(gate_ptr, first_row, first_col, n_size)), gate
        )
        cute.autovec_copy(
            thr_mma.partition_C(self._output_tile(up_ptr, first_row, first_col, n_size)), up
        )
        # Each result overwrites the bf16 input it came from, once both inputs of that element
        # are read: the epilogue holds no fp32 fragment beyond the two accumulators (a third
        # one spills at 232 registers).
        # Branch-free: without a limit the clamps and masks run against +inf, where they are
        # the identity (min(g, inf) == g, and NaN still propagates: it compares false).
        limit = swiglu_limit
        if has_limit == 0:
            limit = Float32(float("inf"))
        for i in cutlass.range_constexpr(cute.size(acc)):
            gate_raw = Float32(gate[i])
            up_raw = Float32(up[i])
            g = cutlass.min(gate_raw, limit)
            u = cutlass.max(cutlass.min(up_raw, limit), -limit)
            sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))
            dh = acc[i]
            d_up_i = dh * (g * sig)
            d_gate_i = (dh * u) * (sig * (Float32(1.0) + g * (Float32(1.0) - sig)))
            # Zero where the clamp was active (torch.where(gate > limit, 0, d_gate) etc.).
            d_gate_i = Float32(cutlass.select_(gate_raw > limit, Float32(0.0), d_gate_i))
            d_up_i = Float32(
                cutlass.select_(cutlass.max(up_raw, -up_raw) > limit, Float32(0.0), d_up_i)
            )
            gate[i] = d_gate_i.to(BFloat16)
            up[i] = d_up_i.to(BFloat16)
        cute.autovec_copy(
            gate,
            thr_mma.partition_C(self._output_tile(d_gate_ptr, first_row, first_col, n_size)),
        )
        cute.autovec_copy(
            up,
            thr_mma.partition_C(self._output_tile(d_up_ptr, first_row, first_col, n_size)),
        )
