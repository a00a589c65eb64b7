"""SM90 weight-gradient GEMMs of one macrobatch (ring reuse, MoKConfig.macrobatch_size below the
routed rows): each expert's sum over its rows, taken up where the previous macrobatch left it.

    out[e] = A[rows of e]^T @ B[rows of e]      [E, M, N], summed macrobatch after macrobatch

The macrobatch holds rows [first_row, first_row + window_rows) of the schedule and A, B are its
routed buffers ([window_rows, M], [window_rows, N]; the operands of expert_gemm_bwd_weights.py,
both MN-major). Expert e's segment [S, S + n) of the whole schedule (`tokens_per_expert` is the
schedule's, not the macrobatch's) meets the macrobatch in [max(S, first_row), min(S + n, end));
for each 128 x 256 output tile of e, one CTA:
    - starts from zero where the segment starts in this macrobatch, else from `partial_in`, the
      fp32 [M, N] tile sums the previous macrobatch stored (one expert crosses each edge);
    - runs the K loop over the macrobatch's part of the segment, 64 rows a stage, in order;
    - stores the fp32 sums into `partial_out` where the segment goes on past the macrobatch,
      else the result: bf16 (output "bf16", stored by the crew beside the next tile's mainloop,
      as in expert_gemm_bwd_weights.py; 3 ring stages) or out += sum in fp32 (output
      "fp32_accumulate", a caller's main_grad, as torch's `add_`).
Every wgmma accumulates (gemm_engine.mma_k_tiles), so the sum continued from its stored fp32
partial is bitwise the one-pass sum of expert_gemm_bwd_weights.py and of the backward
megakernel's weight phase, for any macrobatch edges on 128-row tiles. An expert without rows is
written (zeros, or out += 0) by the first macrobatch only; experts outside the macrobatch are
not touched. CTA c's tiles are c, c + grid, ... in order; its walk starts at its first tile of
the first expert whose segment does not end before the macrobatch and stops at the first
expert whose segment starts past it (`first_window_tile`, `next_window_tile`), so a launch does
not step through the other experts' tiles; the macrobatch at row 0 walks every tile (it writes
the experts without rows).

Kernel parameters, in order:
- `tma_a`  A bf16 [window_rows, M], box 64 (M) x 64 (rows); `tma_b`  B bf16 [window_rows, N]
- `out_ptr`  bf16 [E, M, N] (fp32 for output="fp32_accumulate"), out[e] from row
  e * out_expert_rows of its [*, N] rows (M, or 2 M for a half of one [E, 2 M, N] gradient)
- `partial_in_ptr`, `partial_out_ptr`  fp32 [M, N], different buffers
- `tokens_per_expert_ptr`  int32 [num_experts], the schedule's padded segment sizes
- `num_experts`, `m_size`, `n_size`, `out_expert_rows`, `first_row`, `window_rows`

Constraints (the launcher checks them): tokens_per_expert[e] % 128 == 0; first_row and
window_rows multiples of 128; out_expert_rows >= m_size, a multiple of 128; m_size % 128 == 0,
n_size % 256 == 0, both < 2^16; window_rows, num_experts * out_expert_rows < 2^30; 16-byte
aligned; grid <= SM count, block 384, cluster 1.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.params import Bf16Pointer, Int32Pointer, aligned_pointer
from . import epilogue_warps as handoff
from . import gemm_engine as engine
from .expert_gemm_bwd_weights import CREW, GradientPointer, locate_weight_tile
from .gemm_engine import CONSUMER_REGISTERS, PRODUCER_REGISTERS, TILE_K, TILE_M, TILE_N

OUTPUTS = ("bf16", "fp32_accumulate")


@cute.jit
def window_part(segment_start: Int32, segment_rows: Int32, first_row: Int32, window_rows: Int32):
    """(first K tile in the macrobatch's buffers, K tiles, from partial, into partial, writes)
    of an expert's segment [segment_start, + segment_rows) in rows [first_row, + window_rows).
    An expert with rows writes in every macrobatch it meets; one without, in the first only."""
    end_row = first_row + window_rows
    low = cutlass.max(segment_start, first_row)
    high = cutlass.min(segment_start + segment_rows, end_row)
    meets = high > low
    k_tiles = cutlass.max(high - low, Int32(0)) // TILE_K
    writes = meets | ((segment_rows == 0) & (first_row == 0))
    from_partial = meets & (segment_start < first_row)
    into_partial = meets & (segment_start + segment_rows > end_row)
    return (low - first_row) // TILE_K, k_tiles, from_partial, into_partial, writes


@cute.jit
def locate_window_tile(tile: Int32, tiles_per_expert: Int32, m_tiles: Int32,
                       tokens_per_expert: cute.Tensor, cursor: Int32, row_base: Int32, args):  # fmt: skip
    """`locate_weight_tile`, then the expert's `window_part` in the macrobatch of `args`
    (WindowGemmArgs): what every role's walk over the tiles needs."""
    expert, m_tile, n_pair, cursor, row_base = locate_weight_tile(
        tile, tiles_per_expert, m_tiles, tokens_per_expert, cursor, row_base
    )
    part = window_part(row_base, tokens_per_expert[expert], args.first_row, args.window_rows)
    return expert, m_tile, n_pair, cursor, row_base, part


@cute.jit
def first_expert_from(tokens_per_expert: cute.Tensor, num_experts: Int32, first_row: Int32):
    """(expert, rows before it): the first expert whose segment does not end before schedule
    row `first_row` (the last expert if every one does), or (0, 0) for `first_row` 0, where
    a macrobatch's walk starts (it also writes the experts without rows)."""
    expert = Int32(0)
    row_base = Int32(0)
    if first_row > 0:
        last = cutlass.max(num_experts, 1) - 1
        while (expert < last) & (row_base + tokens_per_expert[expert] <= first_row):
            row_base = row_base + tokens_per_expert[expert]
            expert = expert + 1
    return expert, row_base


@cute.jit
def first_window_tile(bidx: Int32, grid_size: Int32, tiles_per_expert: Int32,
                      tokens_per_expert: cute.Tensor, args):  # fmt: skip
    """(first tile, cursor, row_base) of CTA `bidx`'s walk (tiles bidx + j * grid): its first
    tile of the first expert whose segment does not end before the macrobatch, the cursor
    (`advance_to_expert`'s) at that expert. The macrobatch at row 0 walks from tile bidx: it
    also writes the experts without rows."""
    cursor, row_base = first_expert_from(tokens_per_expert, args.num_experts, args.first_row)
    first = cursor * tiles_per_expert
    tile = bidx
    if first > bidx:
        tile = bidx + (first - bidx + grid_size - 1) // grid_size * grid_size
    return tile, cursor, row_base


@cute.jit
def next_window_tile(tile: Int32, grid_size: Int32, num_tiles: Int32, row_base: Int32, args):
    """The walk's tile after `tile`, whose expert's segment starts at row_base: num_tiles (the
    end) once the segments start past the macrobatch, which then meets no later expert (the
    macrobatch at row 0 walks on: it writes the experts without rows)."""
    after = (args.first_row > 0) & (row_base >= args.first_row + args.window_rows)
    return cutlass.select_(after, num_tiles, tile + grid_size)


@cute.jit
def walk_window_tiles(bidx: Int32, grid_size: Int32, tiles_per_expert: Int32, m_tiles: Int32,
                      tokens_per_expert: cute.Tensor, args, visit, carried):  # fmt: skip
    """CTA `bidx`'s walk over its tiles, the same for every role: `carried = visit(carried,
    expert, m_tile, n_pair, part)` for each tile (part: its expert's `window_part`) from
    `first_window_tile` to `next_window_tile`'s end. Returns `carried`."""
    num_tiles = args.num_experts * tiles_per_expert
    tile, cursor, row_base = first_window_tile(
        bidx, grid_size, tiles_per_expert, tokens_per_expert, args
    )
    while tile < num_tiles:
        expert, m_tile, n_pair, cursor, row_base, part = locate_window_tile(
            tile, tiles_per_expert, m_tiles, tokens_per_expert, cursor, row_base, args
        )
        carried = visit(carried, expert, m_tile, n_pair, part)
        tile = next_window_tile(tile, grid_size, num_tiles, row_base, args)
    return carried


# The fp32 partial sums, 16-byte aligned: whole rows move as vectors.
PartialPointer = aligned_pointer(Float32, 16)


class WindowGemmOperands(NamedTuple):
    """The GEMM operands, from which `__call__` makes the TMA atoms."""

    a_ptr: Bf16Pointer
    b_ptr: Bf16Pointer


class WindowGemmTma(NamedTuple):
    """Each operand's TMA atom (a descriptor parameter) and coordinate tensor (static)."""

    tma_a: cute.CopyAtom
    mA: cute.Tensor
    tma_b: cute.CopyAtom
    mB: cute.Tensor


class WindowGemmArgs(NamedTuple):
    """The kernel's other parameters, in order (module docstring)."""

    out_ptr: GradientPointer
    partial_in_ptr: PartialPointer
    partial_out_ptr: PartialPointer
    tokens_per_expert_ptr: Int32Pointer
    num_experts: Int32
    m_size: Int32
    n_size: Int32
    out_expert_rows: Int32
    first_row: Int32
    window_rows: Int32


@dataclass(frozen=True)
class Sm90ExpertGemmBwdWeightsWindow:
    """See the module docstring. `stages`: ring depth; `output`: one of OUTPUTS."""

    stages: int = 4
    output: str = "bf16"

    def validate(self) -> None:
        if self.output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {self.output!r}")
        engine.validate_stages(
            self.stages, engine.MAX_STAGES_WITH_CREW if self._crew else engine.MAX_STAGES
        )

    @property
    def _crew(self) -> bool:
        """The bf16 results are stored by the crew, beside the next tile's mainloop (an fp32
        partial or sum does not fit the hand-off blocks: the consumers store those)."""
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
        """Rank-2 bf16 [rows, M or N], box 64 (one 128-byte swizzle row) x 64 rows."""
        return [engine.tma_spec(param, [64, TILE_K]) for param in ("tma_a", "tma_b")]

    def stage_bytes(self) -> int:
        return engine.stage_bytes()

    @cute.jit
    def __call__(self, operands: WindowGemmOperands, args: WindowGemmArgs, num_ctas: Int32):
        # Descriptors built here are thrown away: the runtime encodes its own from the manifest.
        operand_layout = engine.mn_major_coords()
        a_smem = self._smem_layout(TILE_M)
        b_smem = self._smem_layout(TILE_N)
        tma = WindowGemmTma(
            *engine.make_tma_load(operands.a_ptr, operand_layout, a_smem, (TILE_M, TILE_K)),
            *engine.make_tma_load(operands.b_ptr, operand_layout, b_smem, (TILE_N, TILE_K)),
        )
        self.kernel(tma, args).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(self, tma: WindowGemmTma, args: WindowGemmArgs):
        tidx, bidx, grid_size, warp_idx, warpgroup = engine.thread_roles()

        # ---- static layouts, MMA, shared storage, operand ring ----
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
        ring = engine.make_operand_ring(storage, a_layout, b_layout, self.stages)

        # ---- tile list: every expert's tiles; those of experts outside the macrobatch skip ----
        tokens_per_expert = cute.make_tensor(
            args.tokens_per_expert_ptr, cute.make_layout(cutlass.max(args.num_experts, 1))
        )
        m_tiles = args.m_size // TILE_M
        tiles_per_expert = m_tiles * (args.n_size // (2 * TILE_N))

        if warpgroup == 0:
            # ======== producer warpgroup: warp 0 issues TMA (the rest idle) ========
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                tAsA, tAgA = engine.partition_tma_load(tma.tma_a, sA, tma.mA, (TILE_M, TILE_K))
                tBsB0, tBsB1, tBgB = engine.partition_tma_load_pair(tma.tma_b, sB0, sB1, tma.mB)
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )

                def load_tile(state, expert, m_tile, n_pair, part):
                    k_base, k_tiles, _, _, _ = part
                    # Fixed K order: the expert's rows in this macrobatch, increasing.
                    loads = (
                        (tma.tma_a, tAgA, m_tile, k_base, tAsA),
                        (tma.tma_b, tBgB, 2 * n_pair, k_base, tBsB0),
                        (tma.tma_b, tBgB, 2 * n_pair + 1, k_base, tBsB1),
                    )
                    return engine.load_k_tiles(ring, state, k_tiles, loads)

                state = walk_window_tiles(bidx, grid_size, tiles_per_expert, m_tiles,
                                          tokens_per_expert, args, load_tile, state)  # fmt: skip
                # Keep the CTA alive until the consumers released every stage it filled.
                ring.producer_tail(state)
            if cutlass.const_expr(self._crew):
                if warp_idx != 0:
                    self._crew_stores(buffers, args, tokens_per_expert, tiles_per_expert,
                                      m_tiles, tidx, bidx, grid_size)  # fmt: skip
        else:
            # ========= consumer warpgroups: partial in, wgmma mainloop, partial or result out ==
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, (acc0, acc1) = engine.make_consumer_fragments(
                tiled_mma, tidx, sA, sB0, sB1
            )
            read_state, release_state = engine.make_consumer_states(self.stages)

            def run_tile(states, expert, m_tile, n_pair, part):
                read_state, release_state = states
                first_out_row = m_tile * TILE_M
                first_col = n_pair * (2 * TILE_N)
                _, k_tiles, from_partial, into_partial, writes = part

                if writes:
                    # ---- the sums so far: the previous macrobatch's partial, or zero ----
                    load_partial(thr_mma, (acc0, acc1), args.partial_in_ptr, None, from_partial,
                                 first_out_row, first_col, args.n_size)  # fmt: skip
                    read_state, release_state = engine.mma_k_tiles(
                        tiled_mma, ring, read_state, release_state, k_tiles, operands,
                        (acc0, acc1), may_be_empty=True, from_zero=False,
                    )  # fmt: skip

                    # ---- the sums on to the next macrobatch, or the result (bf16: the crew) ----
                    if into_partial:
                        copy_tile(thr_mma, (acc0, acc1), args.partial_out_ptr, None, first_out_row,
                                  first_col, args.n_size, "store")  # fmt: skip
                    else:
                        if cutlass.const_expr(self._crew):
                            CREW.hand_off(thr_mma, (acc0, acc1), buffers)
                        else:
                            expert_offset = (
                                Int64(expert) * Int64(args.out_expert_rows) * Int64(args.n_size)
                            )
                            copy_tile(thr_mma, (acc0, acc1), args.out_ptr, expert_offset,
                                      first_out_row, first_col, args.n_size, self.output)  # fmt: skip
                return read_state, release_state

            walk_window_tiles(bidx, grid_size, tiles_per_expert, m_tiles, tokens_per_expert, args,
                              run_tile, (read_state, release_state))  # fmt: skip

    @cute.jit
    def _crew_stores(self, buffers, args, tokens_per_expert, tiles_per_expert, m_tiles, tidx,
                     bidx, grid_size):  # fmt: skip
        """Warps 1-3: store the bf16 results of this CTA's tiles, the consumers' walk
        (`walk_window_tiles`), so each hand-off is met by exactly one store."""
        lane = tidx - 32 * CREW.first_warp
        row_stride = cute.assume(Int64(args.n_size), divby=2 * TILE_N)

        def store_tile(carried, expert, m_tile, n_pair, part):
            _, _, _, into_partial, writes = part
            stores = cutlass.select_(
                writes, cutlass.select_(into_partial, Int32(0), Int32(1)), Int32(0)
            )
            if stores > 0:
                CREW.store_handoff(
                    buffers, lane, expert * args.out_expert_rows + m_tile * TILE_M,
                    n_pair * (2 * TILE_N), None, handoff.store_pair, (args.out_ptr, row_stride),
                )  # fmt: skip
            return carried

        walk_window_tiles(bidx, grid_size, tiles_per_expert, m_tiles, tokens_per_expert, args,
                          store_tile, Int32(0))  # fmt: skip


@cute.jit
def load_partial(thr_mma, accumulators: tuple, ptr: cute.Pointer, base_offset, from_partial,
                 first_row: Int32, first_col: Int32, n_size: Int32):  # fmt: skip
    """The accumulators = the fp32 tile at (first_row, first_col) of the [*, n_size] partial at
    `ptr` + base_offset (None: none) if `from_partial`, else zero. The load goes through a staging fragment and a select:
    accumulator registers defined on one path of a branch make ptxas serialise every wgmma of
    the kernel (C7515), and an unconditional load would read 128 KiB a tile for nothing."""
    for j in cutlass.range_constexpr(2):
        acc = accumulators[j]
        staged = cute.make_rmem_tensor(acc.shape, Float32)
        staged.fill(0.0)
        if from_partial:
            block = engine.output_tile(ptr, base_offset, first_row, first_col + j * TILE_N,
                                       n_size, 2 * TILE_N)  # fmt: skip
            cute.autovec_copy(thr_mma.partition_C(block), staged)
        for i in cutlass.range(cute.size(acc), unroll_full=True):
            acc[i] = cutlass.select_(from_partial, staged[i], Float32(0.0))


@cute.jit
def copy_tile(thr_mma, accumulators: tuple, ptr: cute.Pointer, base_offset, first_row: Int32,
              first_col: Int32, n_size: Int32, how: cutlass.Constexpr):  # fmt: skip
    """The two 128 x 128 accumulators and the tile at (first_row, first_col) of the row-major
    [*, n_size] tensor at `ptr` + base_offset: "load" fp32 into them, "store" fp32 from them,
    "bf16" their rounding, or "fp32_accumulate" out += them in fp32 (old + sum, torch's `add_`)."""
    for j in cutlass.range_constexpr(2):
        block = engine.output_tile(ptr, base_offset, first_row, first_col + j * TILE_N, n_size,
                                   2 * TILE_N)  # fmt: skip
        tCgOut = thr_mma.partition_C(block)
        acc = accumulators[j]
        if cutlass.const_expr(how == "load"):
            cute.autovec_copy(tCgOut, acc)
        elif cutlass.const_expr(how == "store"):
            cute.autovec_copy(acc, tCgOut)
        elif cutlass.const_expr(how == "bf16"):
            rounded = cute.make_rmem_tensor(acc.shape, BFloat16)
            rounded.store(acc.load().to(BFloat16))
            cute.autovec_copy(rounded, tCgOut)
        else:
            old = cute.make_rmem_tensor(acc.shape, Float32)
            cute.autovec_copy(tCgOut, old)
            acc.store(old.load() + acc.load())
            cute.autovec_copy(acc, tCgOut)
