"""SM90 grouped activation-gradient GEMMs of the MoE backward, for the shared expert (the routed
backward runs in the backward megakernel); static tile walk (CTA c: tiles c, c + grid, ...).

`job="d_hidden_swiglu"`: d_hidden with the SwiGLU backward and router partials fused
(d_hidden_phase.py). `job="d_x"`: d_x[r] = bf16(d_gate[r] @ W_gate[e] + d_up[r] @ W_up[e]), one
K loop over 2 I. B is read as stored ([E, K, N], MN-major): no transposed weight copy.

Kernel parameters, in order:
- `tma_a0`, `tma_a1`  d_hidden_swiglu: dY_e bf16 [C, H] (twice); d_x: d_gate, d_up [C, I]
- `tma_b0`, `tma_b1`  d_hidden_swiglu: W_down [E * H, I] (twice); d_x: W_gate, W_up [E * I, H]
- `out0_ptr`, `out1_ptr`  d_hidden_swiglu: d_gate, d_up [C, I]; d_x: d_x [C, H], null
- `gate_ptr`, `up_ptr`, `partials_ptr`  d_hidden_swiglu: gate/up bf16 [C, I] (pre-clamp),
  partials fp32 [C, I / 128]; d_x: null
- `peer_rank_ptr`, `peer_token_idx_ptr` (null); `tokens_per_expert_ptr` int32 [E]
- `num_experts`, `k_size` (one K half: H or I), `n_size` (I or H), `has_limit`, `swiglu_limit`

Constraints (the launcher checks them): tokens_per_expert[e] % 128 == 0, sum <= C; k_size % 64
== 0; n_size % 256 == 0; 16-byte aligned, contiguous; C, E * k_size < 2^30; n_size, k_size <
2^16; grid <= SM count, block 384, cluster 1.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64

from ..common.params import Bf16Pointer, Fp32Pointer, Int32Pointer
from ..phases.expert_tiles import TileList, locate_first_tile, locate_tile
from . import epilogue_warps as handoff
from . import gemm_engine as engine
from .d_hidden_phase import prefetch_gate_up, swiglu_backward
from .epilogue_warps import CREW
from .gemm_engine import CONSUMER_REGISTERS, PRODUCER_REGISTERS, TILE_K, TILE_M, TILE_N

JOBS = ("d_hidden_swiglu", "d_x")


class ExpertGemmBwdOperands(NamedTuple):
    """The GEMM operands, from which `__call__` makes the TMA atoms."""

    a0_ptr: Bf16Pointer
    a1_ptr: Bf16Pointer
    b0_ptr: Bf16Pointer
    b1_ptr: Bf16Pointer


class ExpertGemmBwdTma(NamedTuple):
    """Each operand's TMA atom (a descriptor parameter) and coordinate tensor (static)."""

    tma_a0: cute.CopyAtom
    mA0: cute.Tensor
    tma_a1: cute.CopyAtom
    mA1: cute.Tensor
    tma_b0: cute.CopyAtom
    mB0: cute.Tensor
    tma_b1: cute.CopyAtom
    mB1: cute.Tensor


class ExpertGemmBwdArgs(NamedTuple):
    """The kernel's other parameters, in order (module docstring)."""

    out0_ptr: Bf16Pointer
    out1_ptr: Bf16Pointer
    gate_ptr: Bf16Pointer
    up_ptr: Bf16Pointer
    partials_ptr: Fp32Pointer
    peer_rank_ptr: Int32Pointer
    peer_token_idx_ptr: Int32Pointer
    tokens_per_expert_ptr: Int32Pointer
    num_experts: Int32
    k_size: Int32
    n_size: Int32
    has_limit: Int32
    swiglu_limit: Float32


@dataclass(frozen=True)
class Sm90ExpertGemmBwd:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    job: str = "d_hidden_swiglu"
    stages: int = 3

    def validate(self) -> None:
        if self.job not in JOBS:
            raise ValueError(f"job must be one of {JOBS}, got {self.job!r}")
        engine.validate_stages(self.stages, engine.MAX_STAGES_WITH_CREW)

    @property
    def threads(self) -> int:
        return engine.THREADS

    @property
    def k_halves(self) -> int:
        """K segments of the fused loop: d_x runs over [d_gate | d_up] x [W_gate ; W_up]."""
        return 2 if self.job != "d_hidden_swiglu" else 1

    def tma_specs(self) -> list[dict]:
        """Runtime descriptor encoding (mok/runtime/tma.py), rank-2 bf16, box innermost first. A: [C, K],
        64 x 128 box. B: [E * K, N], 64 x 64 box (the swizzle caps it: a 128-column tile is two)."""
        return [
            engine.tma_spec("tma_a0", [TILE_K, TILE_M]),
            engine.tma_spec("tma_a1", [TILE_K, TILE_M]),
            engine.tma_spec("tma_b0", [64, TILE_K]),
            engine.tma_spec("tma_b1", [64, TILE_K]),
        ]

    def stage_bytes(self) -> int:
        """Bytes one ring stage receives (the mbarrier expect_tx count): A + B0 + B1 tiles."""
        return engine.stage_bytes()

    @cute.jit
    def __call__(self, operands: ExpertGemmBwdOperands, args: ExpertGemmBwdArgs, num_ctas: Int32):
        # The DSL's descriptors are discarded: the runtime encodes its own from the manifest.
        a_layout = engine.k_major_coords()  # (rows, K)
        b_layout = engine.mn_major_coords()  # (N, K rows)
        a_smem = engine.k_major_smem_layout(TILE_M, self.stages)
        b_smem = engine.mn_major_smem_layout(TILE_N, self.stages)
        tma = ExpertGemmBwdTma(
            *engine.make_tma_load(operands.a0_ptr, a_layout, a_smem, (TILE_M, TILE_K)),
            *engine.make_tma_load(operands.a1_ptr, a_layout, a_smem, (TILE_M, TILE_K)),
            *engine.make_tma_load(operands.b0_ptr, b_layout, b_smem, (TILE_N, TILE_K)),
            *engine.make_tma_load(operands.b1_ptr, b_layout, b_smem, (TILE_N, TILE_K)),
        )
        self.kernel(tma, args).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(self, tma: ExpertGemmBwdTma, args: ExpertGemmBwdArgs):
        tidx, bidx, grid_size, warp_idx, warpgroup = engine.thread_roles()

        # ---- static layouts, MMA, shared storage ----
        tiled_mma = engine.backward_mma()
        a_layout = engine.k_major_smem_layout(TILE_M, self.stages)
        b_layout = engine.mn_major_smem_layout(TILE_N, self.stages)
        storage, sA, sB0, sB1, buffers = handoff.allocate_crew_storage(
            a_layout, b_layout, self.stages
        )

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma.tma_a0)
            cute.nvgpu.cpasync.prefetch_descriptor(tma.tma_b0)
            if cutlass.const_expr(self.k_halves == 2):
                cute.nvgpu.cpasync.prefetch_descriptor(tma.tma_a1)
                cute.nvgpu.cpasync.prefetch_descriptor(tma.tma_b1)

        # ---- operand ring ----
        ring = engine.make_operand_ring(storage, a_layout, b_layout, self.stages)

        # ---- tile list inputs ----
        tokens_per_expert = cute.make_tensor(
            args.tokens_per_expert_ptr, cute.make_layout(cutlass.max(args.num_experts, 1))
        )
        k_half_tiles = args.k_size // TILE_K
        col_tiles = args.n_size // (2 * TILE_N)
        tiles = TileList(tokens_per_expert, args.num_experts, col_tiles)

        if warpgroup == 0:
            # ====== producer warpgroup: warp 0 issues TMA, warps 1-3 exit or store tiles ======
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                # Per K half: (atom, smem, gmem) of A; (atom, smem of B0, smem of B1, gmem) of B.
                a_loads = (
                    (
                        tma.tma_a0,
                        *engine.partition_tma_load(tma.tma_a0, sA, tma.mA0, (TILE_M, TILE_K)),
                    ),
                    (
                        tma.tma_a1,
                        *engine.partition_tma_load(tma.tma_a1, sA, tma.mA1, (TILE_M, TILE_K)),
                    ),
                )
                b_loads = (
                    (tma.tma_b0, *engine.partition_tma_load_pair(tma.tma_b0, sB0, sB1, tma.mB0)),
                    (tma.tma_b1, *engine.partition_tma_load_pair(tma.tma_b1, sB0, sB1, tma.mB1)),
                )
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                tile = bidx
                expert, tile_base, row_base, row_tiles = locate_first_tile(tiles, tile)
                while expert < args.num_experts:
                    local = tile - tile_base
                    a_row_tile = row_base // TILE_M + local % row_tiles
                    # B column blocks (units of TILE_N) and the expert's first K row tile.
                    b_col_tile = 2 * (local // row_tiles)
                    b_k_base = expert * k_half_tiles
                    # Fixed K order: the gate half, then the up half (d_x); one half otherwise.
                    for half in cutlass.range_constexpr(self.k_halves):
                        tma_a, tAsA, tAgA = a_loads[half]
                        tma_b, tBsB0, tBsB1, tBgB = b_loads[half]
                        loads = (
                            (tma_a, tAgA, a_row_tile, None, tAsA),
                            (tma_b, tBgB, b_col_tile, b_k_base, tBsB0),
                            (tma_b, tBgB, b_col_tile + 1, b_k_base, tBsB1),
                        )
                        state = engine.load_k_tiles(ring, state, k_half_tiles, loads)
                    tile = tile + grid_size
                    expert, tile_base, row_base, row_tiles = locate_tile(
                        tiles, tile, (expert, tile_base, row_base, row_tiles)
                    )
                # Keep the CTA alive until the consumers released every stage it filled.
                ring.producer_tail(state)
            if warp_idx != 0:
                row_stride = cute.assume(Int64(args.n_size), divby=2 * TILE_N)
                if cutlass.const_expr(self.job == "d_hidden_swiglu"):
                    CREW.run(
                        tiles, bidx, grid_size, buffers, tidx, 2 * TILE_N, None,
                        handoff.store_split, (args.out0_ptr, args.out1_ptr, row_stride), handoffs=2,
                        before_tile=prefetch_gate_up,
                        before_args=(args.gate_ptr, args.up_ptr, row_stride),
                    )  # fmt: skip
                else:
                    CREW.run(tiles, bidx, grid_size, buffers, tidx, 2 * TILE_N, None,
                             handoff.store_pair, (args.out0_ptr, row_stride))  # fmt: skip
        else:
            # ============ consumer warpgroups: wgmma mainloop + (epilogue +) hand-off ============
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, (acc0, acc1) = engine.make_consumer_fragments(
                tiled_mma, tidx, sA, sB0, sB1
            )
            k_tiles = self.k_halves * k_half_tiles
            read_state, release_state = engine.make_consumer_states(self.stages)
            tile = bidx
            expert, tile_base, row_base, row_tiles = locate_first_tile(tiles, tile)
            while expert < args.num_experts:
                local = tile - tile_base
                first_row = row_base + (local % row_tiles) * TILE_M
                first_col = (local // row_tiles) * (2 * TILE_N)

                # ---- mainloop: keep one wgmma batch in flight, release the stage before it ----
                read_state, release_state = engine.mma_k_tiles(
                    tiled_mma, ring, read_state, release_state, k_tiles, operands, (acc0, acc1)
                )

                # ---- the rounded tile to the crew (d_hidden: its SwiGLU backward first) ----
                if cutlass.const_expr(self.job != "d_hidden_swiglu"):
                    CREW.hand_off(thr_mma, (acc0, acc1), buffers)
                else:
                    for j in cutlass.range_constexpr(2):
                        swiglu_backward(
                            thr_mma,
                            acc0 if j == 0 else acc1,
                            args.gate_ptr,
                            args.up_ptr,
                            args.partials_ptr,
                            first_row,
                            first_col + j * TILE_N,
                            args.n_size,
                            args.has_limit,
                            args.swiglu_limit,
                            buffers,
                        )

                tile = tile + grid_size
                expert, tile_base, row_base, row_tiles = locate_tile(
                    tiles, tile, (expert, tile_base, row_base, row_tiles)
                )
