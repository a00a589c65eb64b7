"""SM90 grouped expert GEMMs of the MoE backward (SEMANTICS §2): the activation-gradient GEMMs.

`Sm90ExpertGemmBwd(job="d_hidden_swiglu")`, d_hidden with the SwiGLU backward fused:
    d_hidden[r, :] = dY_e[r, :] @ W_down[e]            (fp32, never stored)
    d_gate, d_up   = mok.reference.swiglu_backward(d_hidden, gate[r, :], up[r, :], limit)
`Sm90ExpertGemmBwd(job="d_x")`, one fused K loop over 2 I (gate half first, then up half):
    d_x[r, :] = bf16(d_gate[r, :] @ W_gate[e] + d_up[r, :] @ W_up[e])
`Sm90ExpertGemmBwd(job="d_x_slots")` is d_x stored where the backward's combine reads it:
    d_x_slots[peer_token_idx[r], :] = d_x[r, :] for rows with peer_rank[r] >= 0 (padding rows
    are not stored), one row per (token, j) slot
for every routed row r of expert e (rows grouped by expert, see expert_tiles.py).

Epilogue (epilogue_warps.py): the consumers hand each rounded d_x tile to the crew (warps 1-3),
which stores it while they run the next tile. d_hidden_swiglu's consumers still compute d_gate,
d_up and the partials from their fp32 accumulators (the math needs them), then hand d_gate and
d_up over, one 128-column block at a time; the crew stores them and, during each tile's
mainloop, prefetches that tile's gate and up rows into L2 for the consumers' loads. Two 34 KiB
hand-off blocks: 3 ring stages.

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
The same epilogue also writes the router-weight partials (SEMANTICS §2's d_router, fused):
    hidden = bf16((g * sig) * u)                        (the forward's hidden, recomputed)
    partials[r, b] = sum over the 128 columns c of block b of hidden[r, c] * d_hidden[r, c]
in fp32, each thread's columns in increasing order, then across the 4 lanes that share a row
(butterfly: lanes ^1 then ^2), so every partial has one fixed summation order. Since
d_hidden = dY_e @ W_down[e] with dY_e = w * dY, sum_b partials[r, b] = w * <dY, y> for
y = hidden @ W_down[e]^T: the launcher divides by w.
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
- `partials_ptr`  d_hidden_swiglu: fp32 [C, I / 128] router-weight partials; d_x: null
- `peer_rank_ptr`, `peer_token_idx_ptr`  d_x_slots: int32 [C], the schedule's; others: null
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
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.args import global_pointer
from ..common.ptx import prefetch_l2
from . import epilogue_warps as handoff
from . import gemm_phases as phases
from .expert_gemm import CREW
from .expert_tiles import TileList, locate_first_tile, locate_tile
from .gemm_phases import CONSUMER_REGISTERS, PRODUCER_REGISTERS, TILE_K, TILE_M, TILE_N

JOBS = ("d_hidden_swiglu", "d_x", "d_x_slots")
# The TMA coordinate tensors get static extents (the runtime's descriptor carries the real ones).
MAX_ROWS = 1 << 30
MAX_COLS = 1 << 16


@dataclass(frozen=True)
class Sm90ExpertGemmBwd:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    job: str = "d_hidden_swiglu"
    stages: int = 3

    def validate(self) -> None:
        if self.job not in JOBS:
            raise ValueError(f"job must be one of {JOBS}, got {self.job!r}")
        phases.validate_stages(self.stages, phases.MAX_STAGES_WITH_CREW)

    # ------------------------------------------------------------------ static configuration

    @property
    def threads(self) -> int:
        return phases.THREADS

    @property
    def k_halves(self) -> int:
        """K segments of the fused loop: d_x runs over [d_gate | d_up] x [W_gate ; W_up]."""
        return 2 if self.job != "d_hidden_swiglu" else 1

    def _tiled_mma(self):
        # A K-major (activations, row-major [C, K]); B MN-major (weights stored [K, N]):
        # wgmma reads B transposed.
        return phases.make_tiled_mma(
            cute.nvgpu.warpgroup.OperandMajorMode.K, cute.nvgpu.warpgroup.OperandMajorMode.MN
        )

    def _a_smem_layout(self):
        return phases.k_major_smem_layout(TILE_M, self.stages)

    def _b_smem_layout(self):
        return phases.mn_major_smem_layout(TILE_N, self.stages)

    def tma_specs(self) -> list[dict]:
        """How the runtime encodes each descriptor param (see runtime/tma.py): rank-2 bf16
        tensors, box dims innermost first. A: [C, K] with a 64 (K) x 128 (rows) box. B: the
        weights viewed [E * K, N] with a 64 (N) x 64 (K rows) box: the innermost box is capped
        at the 128-byte swizzle span, so a 128-column B tile is two boxes."""
        return [
            phases.tma_spec("tma_a0", [TILE_K, TILE_M]),
            phases.tma_spec("tma_a1", [TILE_K, TILE_M]),
            phases.tma_spec("tma_b0", [64, TILE_K]),
            phases.tma_spec("tma_b1", [64, TILE_K]),
        ]

    def stage_bytes(self) -> int:
        """Bytes one ring stage receives (the mbarrier expect_tx count): A + B0 + B1 tiles."""
        return phases.stage_bytes()

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
            global_pointer(Float32, 4),  # partials_ptr
            global_pointer(Int32, 4),  # peer_rank_ptr
            global_pointer(Int32, 4),  # peer_token_idx_ptr
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
        partials_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
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
        a_smem = self._a_smem_layout()
        b_smem = self._b_smem_layout()
        tma_a0, mA0 = phases.make_tma_load(a0_ptr, a_layout, a_smem, (TILE_M, TILE_K))
        tma_a1, mA1 = phases.make_tma_load(a1_ptr, a_layout, a_smem, (TILE_M, TILE_K))
        tma_b0, mB0 = phases.make_tma_load(b0_ptr, b_layout, b_smem, (TILE_N, TILE_K))
        tma_b1, mB1 = phases.make_tma_load(b1_ptr, b_layout, b_smem, (TILE_N, TILE_K))
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
            partials_ptr,
            peer_rank_ptr,
            peer_token_idx_ptr,
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
        partials_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        num_experts: Int32,
        k_size: Int32,
        n_size: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
    ):
        tidx, bidx, grid_size, warp_idx, warpgroup = phases.thread_roles()

        # ---- static layouts, MMA, shared storage ----
        tiled_mma = self._tiled_mma()
        a_layout = self._a_smem_layout()
        b_layout = self._b_smem_layout()
        storage, sA, sB0, sB1 = phases.allocate_operand_ring_storage(
            a_layout, b_layout, self.stages, handoff.BUFFER_BYTES
        )
        buffers = handoff.handoff_buffers(storage)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a0)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b0)
            if cutlass.const_expr(self.k_halves == 2):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a1)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b1)

        # ---- operand ring ----
        ring = phases.make_operand_ring(storage, a_layout, b_layout, self.stages)

        # ---- tile list inputs ----
        tokens_per_expert = cute.make_tensor(
            tokens_per_expert_ptr, cute.make_layout(cutlass.max(num_experts, 1))
        )
        k_half_tiles = k_size // TILE_K
        col_tiles = n_size // (2 * TILE_N)
        tiles = TileList(tokens_per_expert, num_experts, col_tiles)

        if warpgroup == 0:
            # ====== producer warpgroup: warp 0 issues TMA, warps 1-3 exit or store tiles ======
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                # Per K half: (atom, smem, gmem) of A; (atom, smem of B0, smem of B1, gmem) of B.
                a_loads = (
                    (tma_a0, *phases.partition_tma_load(tma_a0, sA, mA0, (TILE_M, TILE_K))),
                    (tma_a1, *phases.partition_tma_load(tma_a1, sA, mA1, (TILE_M, TILE_K))),
                )
                b_loads = (
                    (tma_b0, *phases.partition_tma_load_pair(tma_b0, sB0, sB1, mB0)),
                    (tma_b1, *phases.partition_tma_load_pair(tma_b1, sB0, sB1, mB1)),
                )
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                tile = bidx
                expert, tile_base, row_base, row_tiles = locate_first_tile(tiles, tile)
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
                        loads = (
                            (tma_a, tAgA, a_row_tile, None, tAsA),
                            (tma_b, tBgB, b_col_tile, b_k_base, tBsB0),
                            (tma_b, tBgB, b_col_tile + 1, b_k_base, tBsB1),
                        )
                        state = phases.load_k_tiles(ring, state, k_half_tiles, loads)
                    tile = tile + grid_size
                    expert, tile_base, row_base, row_tiles = locate_tile(
                        tiles, tile, (expert, tile_base, row_base, row_tiles)
                    )
                # Keep the CTA alive until the consumers released every stage it filled.
                ring.producer_tail(state)
            if warp_idx != 0:
                slots = None
                if cutlass.const_expr(self.job == "d_x_slots"):
                    slots = (peer_rank_ptr, peer_token_idx_ptr)
                row_stride = cute.assume(Int64(n_size), divby=2 * TILE_N)
                if cutlass.const_expr(self.job == "d_hidden_swiglu"):
                    CREW.run(
                        tiles, bidx, grid_size, buffers, tidx, 2 * TILE_N, None,
                        handoff.store_split, (out0_ptr, out1_ptr, row_stride), handoffs=2,
                        before_tile=self._prefetch_gate_up,
                        before_args=(gate_ptr, up_ptr, row_stride),
                    )  # fmt: skip
                else:
                    CREW.run(tiles, bidx, grid_size, buffers, tidx, 2 * TILE_N, slots,
                             handoff.store_pair, (out0_ptr, row_stride))  # fmt: skip
        else:
            # ============ consumer warpgroups: wgmma mainloop + (epilogue +) hand-off ============
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, (acc0, acc1) = phases.make_consumer_fragments(
                tiled_mma, tidx, sA, sB0, sB1
            )
            k_tiles = self.k_halves * k_half_tiles
            read_state, release_state = phases.make_consumer_states(self.stages)
            tile = bidx
            expert, tile_base, row_base, row_tiles = locate_first_tile(tiles, tile)
            while expert < num_experts:
                local = tile - tile_base
                first_row = row_base + (local % row_tiles) * TILE_M
                first_col = (local // row_tiles) * (2 * TILE_N)

                # ---- mainloop: keep one wgmma batch in flight, release the stage before it ----
                read_state, release_state = phases.mma_k_tiles(
                    tiled_mma, ring, read_state, release_state, k_tiles, operands, (acc0, acc1)
                )

                # ---- the rounded tile to the crew (d_hidden: its SwiGLU backward first) ----
                if cutlass.const_expr(self.job != "d_hidden_swiglu"):
                    CREW.hand_off(thr_mma, (acc0, acc1), buffers)
                else:
                    for j in cutlass.range_constexpr(2):
                        self._swiglu_backward(
                            thr_mma,
                            acc0 if j == 0 else acc1,
                            gate_ptr,
                            up_ptr,
                            partials_ptr,
                            first_row,
                            first_col + j * TILE_N,
                            n_size,
                            has_limit,
                            swiglu_limit,
                            buffers,
                        )

                tile = tile + grid_size
                expert, tile_base, row_base, row_tiles = locate_tile(
                    tiles, tile, (expert, tile_base, row_base, row_tiles)
                )

    # ------------------------------------------------------------------ device helpers

    @cute.jit
    def _prefetch_gate_up(
        self, lane, first_row, first_col, gate_ptr, up_ptr, row_stride, threads: int = CREW.threads
    ):
        """Crew (or the backward megakernel's producer warp, `threads` 32), before a d_hidden
        tile's hand-offs (its mainloop is running): bring the tile's gate and up (128 rows x
        256 columns each, 4 lines of 128 bytes per row) into L2 for the consumers' epilogue
        loads."""
        lines_per_row = 2 * TILE_N * 2 // 128
        per_tensor = TILE_M * lines_per_row
        for idx in cutlass.range(lane, 2 * per_tensor, threads, unroll=1):
            base = gate_ptr.toint()
            if idx >= per_tensor:
                base = up_ptr.toint()
            line = idx % per_tensor
            row = Int64(first_row + line // lines_per_row)
            col = Int64(first_col + (line % lines_per_row) * 64)
            prefetch_l2(base + (row * row_stride + col) * 2)

    @cute.jit
    def _output_tile(self, ptr: cute.Pointer, first_row: Int32, first_col: Int32, n_size: Int32):
        """The 128 x 128 block at (first_row, first_col) of a row-major [*, n_size] tensor."""
        return phases.output_tile(ptr, None, first_row, first_col, n_size, 2 * TILE_N)

    @cute.jit
    def _swiglu_backward(
        self,
        thr_mma,
        acc: cute.Tensor,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        partials_ptr: cute.Pointer,
        first_row: Int32,
        first_col: Int32,
        n_size: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
        buffers,
    ):
        """d_gate, d_up of one 128 x 128 block from fp32 d_hidden (mok.reference order), and
        the block's router-weight partial of each of its rows. d_gate and d_up go to the crew
        (the hand-off `buffers`)."""
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
        # Rows of this thread's elements: two per thread, r0 and r0 + 8. In the wgmma
        # accumulator layout element i lies on row r0 + 8 * ((i // 2) % 2): a static choice.
        row0, row1 = phases.accumulator_rows(thr_mma)
        partial0 = Float32(0.0)
        partial1 = Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc)):
            gate_raw = Float32(gate[i])
            up_raw = Float32(up[i])
            # g's min as one NaN-propagating FMNMX.NaN (min(a, b) = -max(-a, -b)); the same
            # for u's clamp made ptxas spill (28 bytes), so it stays a compare and selects.
            g = -cute.arch.fmax(-gate_raw, -limit, nan=True)
            u = cutlass.max(cutlass.min(up_raw, limit), -limit)
            # ex2.approx and rcp.approx (a few ulp of fp32, far below the bf16 rounding of the
            # results): the epilogue is bound by its instruction count, and IEEE expf and
            # division took about 17 of its ~47 instructions per element.
            sig = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-g, fastmath=True))
            dh = acc[i]
            silu = g * sig
            d_up_i = dh * silu
            hidden_i = Float32((silu * u).to(BFloat16))
            if cutlass.const_expr((i // 2) % 2 == 0):
                partial0 = partial0 + hidden_i * dh
            else:
                partial1 = partial1 + hidden_i * dh
            d_gate_i = (dh * u) * (sig * (Float32(1.0) + g * (Float32(1.0) - sig)))
            # Zero where the clamp was active (torch.where(gate > limit, 0, d_gate) etc.).
            d_gate_i = Float32(cutlass.select_(gate_raw > limit, Float32(0.0), d_gate_i))
            d_up_i = Float32(
                cutlass.select_(cutlass.max(up_raw, -up_raw) > limit, Float32(0.0), d_up_i)
            )
            gate[i] = d_gate_i.to(BFloat16)
            up[i] = d_up_i.to(BFloat16)
        CREW.hand_off_bf16(thr_mma, (gate, up), buffers)
        self._store_partials(partials_ptr, (row0, row1), (partial0, partial1), first_row,
                             first_col, n_size)  # fmt: skip

    @cute.jit
    def _store_partials(
        self,
        partials_ptr: cute.Pointer,
        rows: tuple,
        row_partials: tuple,
        first_row: Int32,
        first_col: Int32,
        n_size: Int32,
    ):
        """Sum each row's partial over the 4 lanes that hold it (fixed butterfly order) and
        store it from lane 0 of the quad into partials[row, first_col / 128]."""
        row0, row1 = rows
        partial0, partial1 = row_partials
        for offset in cutlass.range_constexpr(2):
            partial0 = partial0 + cute.arch.shuffle_sync_bfly(partial0, offset=1 << offset)
            partial1 = partial1 + cute.arch.shuffle_sync_bfly(partial1, offset=1 << offset)
        lane = cute.arch.lane_idx()
        if lane % 4 == 0:
            blocks = n_size // TILE_N
            partials = cute.make_tensor(partials_ptr, cute.make_layout((1 << 30, blocks),
                                                                        stride=(blocks, 1)))  # fmt: skip
            block = first_col // TILE_N
            partials[first_row + row0, block] = partial0
            partials[first_row + row1, block] = partial1
