"""SM90 weight-gradient GEMMs of the MoE backward (SEMANTICS §2), one per weight:

    out[e] = A[rows of e]^T @ B[rows of e]      [E, M, N], by `output`:
        "fp32"             stored fp32
        "bf16"             rounded to bf16 (the weight gradient mok.ops.backward returns)
        "fp32_accumulate"  out += A^T B in place (a caller's fp32 main_grad)
    dW_down[e] = dY_e^T hidden      (A = dY_e [C, H], B = hidden [C, I]: M = H, N = I)
    dW_gate[e] = d_gate^T x_routed  (A = d_gate [C, I], B = x_routed [C, H]: M = I, N = H)
    dW_up[e]   = d_up^T x_routed    (A = d_up [C, I],   B = x_routed [C, H])

K is expert e's padded token segment; both operands MN-major, 128-wide tiles as two 64 x 64 TMA
boxes. One CTA owns each 128 x 256 tile over its expert's K range in order (deterministic; zeros
without tokens). "bf16" tiles go to the crew (<= 3 stages); fp32 ones are stored from registers.

Kernel parameters, in order:
- `tma_a`  A bf16 [C, M], box 64 (M) x 64 (rows); `tma_b`  B bf16 [C, N], box 64 (N) x 64
- `out_ptr`  fp32 [E, M, N] (bf16 for output="bf16"), out[e] from row e * out_expert_rows of
  its [*, N] rows (M, or 2 M for a half of one [E, 2 M, N] gradient: dW_gate, dW_up)
- `tokens_per_expert_ptr`  int32 [num_experts], padded segment sizes
- `num_experts`, `m_size`, `n_size`, `out_expert_rows`

Constraints (the launcher checks them): tokens_per_expert[e] % 128 == 0, sum <= C; m_size % 128
== 0, n_size % 256 == 0, both < 2^16; out_expert_rows >= m_size, a multiple of 128; C,
num_experts * out_expert_rows < 2^30; 16-byte aligned; grid <= SM count, block 384, cluster 1.
"""

from dataclasses import dataclass
from typing import Annotated, NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.args import global_pointer
from ..common.params import Bf16Pointer, Int32Pointer
from . import epilogue_warps as handoff
from . import gemm_engine as engine
from .epilogue_warps import EpilogueCrew
from .gemm_engine import CONSUMER_REGISTERS, PRODUCER_REGISTERS, TILE_K, TILE_M, TILE_N

OUTPUTS = ("fp32", "bf16", "fp32_accumulate")
CREW = EpilogueCrew(first_warp=1, num_warps=3)  # stores the "bf16" output's tiles
GROUP_M = 16  # m tiles per group of the tile order (grouped_tile_coords)


@cute.jit
def grouped_tile_coords(local: Int32, m_tiles: Int32, tiles_per_expert: Int32):
    """(m tile, 256-column pair) of tile `local`: groups of GROUP_M m tiles, m fastest, then n, so
    concurrent tiles share a few A and B slabs (m fastest over all M: 132 distinct A slabs a wave)."""
    group_tiles = GROUP_M * (tiles_per_expert // m_tiles)
    group = local // group_tiles
    first_m = group * GROUP_M
    rows = cutlass.min(m_tiles - first_m, GROUP_M)
    within = local - group * group_tiles
    return first_m + within % rows, within // rows


@cute.jit
def advance_to_expert(tokens_per_expert: cute.Tensor, expert: Int32, cursor: Int32,
                      row_base: Int32):  # fmt: skip
    """Move the cursor (expert, rows before it) forward to `expert` (never backward)."""
    while cursor < expert:
        row_base = row_base + tokens_per_expert[cursor]
        cursor = cursor + 1
    return cursor, row_base


@cute.jit
def locate_weight_tile(tile: Int32, tiles_per_expert: Int32, m_tiles: Int32,
                       tokens_per_expert: cute.Tensor, cursor: Int32, row_base: Int32):  # fmt: skip
    """(expert, m tile, 256-column pair, cursor, row_base) of tile `tile` of a walk in
    increasing tiles: the expert's segment starts at row_base (`advance_to_expert`)."""
    expert = tile // tiles_per_expert
    local = tile - expert * tiles_per_expert
    cursor, row_base = advance_to_expert(tokens_per_expert, expert, cursor, row_base)
    m_tile, n_pair = grouped_tile_coords(local, m_tiles, tiles_per_expert)
    return expert, m_tile, n_pair, cursor, row_base


def gradient_pointer(kernel):
    """The weight gradient's placeholder: bf16 or fp32 as the kernel's `output` says."""
    return global_pointer(BFloat16 if kernel.output == "bf16" else Float32, 16)


GradientPointer = Annotated[cute.Pointer, gradient_pointer]


class WeightGemmOperands(NamedTuple):
    """The GEMM operands, from which `__call__` makes the TMA atoms."""

    a_ptr: Bf16Pointer
    b_ptr: Bf16Pointer


class WeightGemmTma(NamedTuple):
    """Each operand's TMA atom (a descriptor parameter) and coordinate tensor (static)."""

    tma_a: cute.CopyAtom
    mA: cute.Tensor
    tma_b: cute.CopyAtom
    mB: cute.Tensor


class WeightGemmArgs(NamedTuple):
    """The kernel's other parameters, in order (module docstring)."""

    out_ptr: GradientPointer
    tokens_per_expert_ptr: Int32Pointer
    num_experts: Int32
    m_size: Int32
    n_size: Int32
    out_expert_rows: Int32


@dataclass(frozen=True)
class Sm90ExpertGemmBwdWeights:
    """See the module docstring. `stages`: ring depth; `output`: one of OUTPUTS."""

    stages: int = 4
    output: str = "fp32"

    def validate(self) -> None:
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {self.output!r}")
        engine.validate_stages(
            self.stages, engine.MAX_STAGES_WITH_CREW if self._crew else engine.MAX_STAGES
        )

    @property
    def _crew(self) -> bool:
        """The bf16 output is stored by the crew, beside the next tile's mainloop."""
        return self.output == "bf16"

    @property
    def threads(self) -> int:
        return engine.THREADS

    def _tiled_mma(self):
        # Both operands MN-major (activations stored [tokens, M] and [tokens, N]).
        MN = cute.nvgpu.OperandMajorMode.MN
        return engine.make_tiled_mma(MN, MN)

    def _smem_layout(self, extent: int):
        return engine.mn_major_smem_layout(extent, self.stages)

    def tma_specs(self) -> list[dict]:
        """Rank-2 bf16 [C, M or N], box 64 (one 128-byte swizzle row) x 64 tokens, innermost first."""
        return [engine.tma_spec(param, [64, TILE_K]) for param in ("tma_a", "tma_b")]

    def stage_bytes(self) -> int:
        return engine.stage_bytes()

    @cute.jit
    def __call__(self, operands: WeightGemmOperands, args: WeightGemmArgs, num_ctas: Int32):
        # Descriptors built here are thrown away: the runtime encodes its own from the manifest.
        operand_layout = engine.mn_major_coords()
        a_smem = self._smem_layout(TILE_M)
        b_smem = self._smem_layout(TILE_N)
        tma = WeightGemmTma(
            *engine.make_tma_load(operands.a_ptr, operand_layout, a_smem, (TILE_M, TILE_K)),
            *engine.make_tma_load(operands.b_ptr, operand_layout, b_smem, (TILE_N, TILE_K)),
        )
        self.kernel(tma, args).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(self, tma: WeightGemmTma, args: WeightGemmArgs):
        tidx, bidx, grid_size, warp_idx, warpgroup = engine.thread_roles()

        # ---- static layouts, MMA, shared storage ----
        tiled_mma = self._tiled_mma()
        a_layout = self._smem_layout(TILE_M)
        b_layout = self._smem_layout(TILE_N)
        storage, sA, sB0, sB1 = engine.allocate_operand_ring_storage(
            a_layout, b_layout, self.stages, handoff.BUFFER_BYTES if self._crew else 0
        )
        buffers = handoff.handoff_buffers(storage) if self._crew else None

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma.tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma.tma_b)

        # ---- operand ring ----
        ring = engine.make_operand_ring(storage, a_layout, b_layout, self.stages)

        # ---- tile list ----
        tokens_per_expert = cute.make_tensor(
            args.tokens_per_expert_ptr, cute.make_layout(cutlass.max(args.num_experts, 1))
        )
        m_tiles = args.m_size // TILE_M
        tiles_per_expert = m_tiles * (args.n_size // (2 * TILE_N))
        num_tiles = args.num_experts * tiles_per_expert

        if warpgroup == 0:
            # ======== producer warpgroup: warp 0 issues TMA, warps 1-3 store bf16 tiles ========
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                tAsA, tAgA = engine.partition_tma_load(tma.tma_a, sA, tma.mA, (TILE_M, TILE_K))
                tBsB0, tBsB1, tBgB = engine.partition_tma_load_pair(tma.tma_b, sB0, sB1, tma.mB)
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                cursor = Int32(0)
                row_base = Int32(0)
                tile = bidx
                while tile < num_tiles:
                    expert, m_tile, n_pair, cursor, row_base = locate_weight_tile(
                        tile, tiles_per_expert, m_tiles, tokens_per_expert, cursor, row_base
                    )
                    n_tile = 2 * n_pair  # in units of TILE_N
                    k_base = row_base // TILE_K
                    # Fixed K order: the expert's tokens in increasing order, one CTA.
                    loads = (
                        (tma.tma_a, tAgA, m_tile, k_base, tAsA),
                        (tma.tma_b, tBgB, n_tile, k_base, tBsB0),
                        (tma.tma_b, tBgB, n_tile + 1, k_base, tBsB1),
                    )
                    k_tiles = tokens_per_expert[expert] // TILE_K
                    state = engine.load_k_tiles(ring, state, k_tiles, loads)
                    tile = tile + grid_size
                # Keep the CTA alive until the consumers released every stage it filled.
                ring.producer_tail(state)
            if cutlass.const_expr(self._crew):
                if warp_idx != 0:
                    self._crew_stores(
                        buffers, args.out_ptr, num_tiles, tiles_per_expert, m_tiles,
                        args.out_expert_rows, args.n_size, tidx, bidx, grid_size,
                    )  # fmt: skip
        else:
            # ================= consumer warpgroups: wgmma mainloop + epilogue ================
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, (acc0, acc1) = engine.make_consumer_fragments(
                tiled_mma, tidx, sA, sB0, sB1
            )
            read_state, release_state = engine.make_consumer_states(self.stages)
            tile = bidx
            while tile < num_tiles:
                expert = tile // tiles_per_expert
                local = tile - expert * tiles_per_expert
                k_tiles = tokens_per_expert[expert] // TILE_K
                m_tile, n_pair = grouped_tile_coords(local, m_tiles, tiles_per_expert)
                first_row = m_tile * TILE_M
                first_col = n_pair * (2 * TILE_N)

                # ---- mainloop (none for an expert without tokens: the tile stays zero) ----
                read_state, release_state = engine.mma_k_tiles(
                    tiled_mma,
                    ring,
                    read_state,
                    release_state,
                    k_tiles,
                    operands,
                    (acc0, acc1),
                    may_be_empty=True,
                )

                # ---- epilogue: to the crew (bf16), or registers -> global ----
                if cutlass.const_expr(self._crew):
                    CREW.hand_off(thr_mma, (acc0, acc1), buffers)
                else:
                    expert_offset = Int64(expert) * Int64(args.out_expert_rows) * Int64(args.n_size)
                    for j in cutlass.range_constexpr(2):
                        tile_out = self._output_tile(
                            args.out_ptr,
                            expert_offset,
                            first_row,
                            first_col + j * TILE_N,
                            args.n_size,
                        )
                        self._store(acc0 if j == 0 else acc1, thr_mma.partition_C(tile_out))
                tile = tile + grid_size

    @cute.jit
    def _crew_stores(
        self, buffers, out_ptr, num_tiles, tiles_per_expert, m_tiles, out_expert_rows, n_size,
        tidx, bidx, grid_size,
    ):  # fmt: skip
        """Warps 1-3: store this CTA's bf16 tiles; out is one [*, n_size] matrix (< 2^30 rows),
        out[e] from row e * out_expert_rows."""
        lane = tidx - 32 * CREW.first_warp
        row_stride = cute.assume(Int64(n_size), divby=2 * TILE_N)
        tile = bidx
        while tile < num_tiles:
            expert = tile // tiles_per_expert
            local = tile - expert * tiles_per_expert
            m_tile, n_pair = grouped_tile_coords(local, m_tiles, tiles_per_expert)
            first_row = expert * out_expert_rows + m_tile * TILE_M
            first_col = n_pair * (2 * TILE_N)
            CREW.store_handoff(
                buffers, lane, first_row, first_col, None, handoff.store_pair,
                (out_ptr, row_stride),
            )  # fmt: skip
            tile = tile + grid_size

    @cute.jit
    def _store(self, acc: cute.Tensor, tCgOut: cute.Tensor):
        """One 128 x 128 accumulator into its output block, as `output` says."""
        if cutlass.const_expr(self.output == "bf16"):
            out = cute.make_rmem_tensor(acc.shape, BFloat16)
            out.store(acc.load().to(BFloat16))
            cute.autovec_copy(out, tCgOut)
        elif cutlass.const_expr(self.output == "fp32_accumulate"):
            # old + acc in fp32, the order of torch's main_grad.add_(grad): the same bits.
            old = cute.make_rmem_tensor(acc.shape, Float32)
            cute.autovec_copy(tCgOut, old)
            acc.store(old.load() + acc.load())
            cute.autovec_copy(acc, tCgOut)
        else:
            cute.autovec_copy(acc, tCgOut)

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
        return engine.output_tile(ptr, expert_offset, first_row, first_col, n_size, 2 * TILE_N)
