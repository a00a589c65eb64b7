"""SM90 grouped expert GEMM: persistent, warp-specialised, TMA + wgmma (gemm_engine.py).

`epilogue="swiglu"`: gate/up with SwiGLU fused (gate_up_phase.py); `epilogue="store"`: down,
out[r] = bf16(hidden[r] @ W_down[e].T). Used by the shared expert and the recomputed forward.
CTAs take 128 x 256 tiles (two 128 x 128 accumulators sharing A) by ticket (tickets.py); the
crew (epilogue_warps.py) stores each during the next mainloop.

Kernel parameters, in order (the runtime encodes the descriptors, box 64 x 128):
- `tma_a`  x_routed bf16 [C, H] (swiglu) or hidden bf16 [C, I] (store)
- `tma_b0`, `tma_b1`  swiglu: W_gate, W_up viewed [rows, H]; store: W_down [E * H, I] twice
- `out_ptr` bf16 [C, n_size]; `gate_ptr`, `up_ptr` bf16 [C, I] (swiglu, else null);
  `peer_rank_ptr`, `peer_token_idx_ptr` (null)
- `tokens_per_expert_ptr` int32 [E]; `ticket_ptr` int32 [1], zeroed
- `num_experts`, `k_size` (H or I), `n_size` (I or H), `b_expert_rows` (expert e's B rows start
  at e * b_expert_rows: I, or 2 I for the halves of one [E, 2 I, H]; H for W_down),
  `has_limit`, `swiglu_limit`

Constraints (the launcher checks them): tokens_per_expert[e] % 128 == 0, sum <= C; k_size % 64
== 0; n_size % 128 (swiglu) or 256 (store) == 0, b_expert_rows a multiple of it and >=
n_size; 16-byte aligned, rows contiguous; C, E * b_expert_rows < 2^30; k_size < 2^16; grid <=
SM count, block 384, cluster 1.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64

from ..common.params import Bf16Pointer, Int32Pointer
from ..phases.expert_tiles import TileList
from ..phases.task_walk import consume_phase, count_tiles, produce_phase, store_phase
from ..phases.tickets import (
    SLOT_BYTES,
    Tickets,
    consumer_task,
    crew_task,
    signal_no_task,
    take_ticket,
    task_slots,
)
from . import epilogue_warps as handoff
from . import gemm_engine as engine
from .epilogue_warps import CREW
from .gate_up_phase import store_swiglu_chunk
from .gemm_engine import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    TILE_K,
    TILE_M,
    TILE_N,
)

EPILOGUES = ("swiglu", "store")


class ExpertGemmOperands(NamedTuple):
    """The GEMM operands, from which `__call__` makes the TMA atoms."""

    a_ptr: Bf16Pointer
    b0_ptr: Bf16Pointer
    b1_ptr: Bf16Pointer


class ExpertGemmTma(NamedTuple):
    """Each operand's TMA atom (a descriptor parameter) and coordinate tensor (static)."""

    tma_a: cute.CopyAtom
    mA: cute.Tensor
    tma_b0: cute.CopyAtom
    mB0: cute.Tensor
    tma_b1: cute.CopyAtom
    mB1: cute.Tensor


class ExpertGemmArgs(NamedTuple):
    """The kernel's other parameters, in order (module docstring)."""

    out_ptr: Bf16Pointer
    gate_ptr: Bf16Pointer
    up_ptr: Bf16Pointer
    peer_rank_ptr: Int32Pointer
    peer_token_idx_ptr: Int32Pointer
    tokens_per_expert_ptr: Int32Pointer
    ticket_ptr: Int32Pointer
    num_experts: Int32
    k_size: Int32
    n_size: Int32
    b_expert_rows: Int32
    has_limit: Int32
    swiglu_limit: Float32


@dataclass(frozen=True)
class Sm90ExpertGemm:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    epilogue: str = "swiglu"
    stages: int = 3

    def validate(self) -> None:
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        engine.validate_stages(self.stages, engine.MAX_STAGES_WITH_CREW)

    @property
    def threads(self) -> int:
        return engine.THREADS

    def tma_specs(self) -> list[dict]:
        """Runtime descriptor encoding per param (mok/runtime/tma.py): rank-2 bf16 [rows, K], one 64 x 128
        box per stage load, 128-byte swizzle."""
        box = [TILE_K, TILE_M]  # == [TILE_K, TILE_N]: A and B tiles have the same box
        return [engine.tma_spec(param, box) for param in ("tma_a", "tma_b0", "tma_b1")]

    def stage_bytes(self) -> int:
        """Bytes one ring stage receives (the mbarrier expect_tx count): A + B0 + B1 tiles."""
        return engine.stage_bytes()

    @cute.jit
    def __call__(self, operands: ExpertGemmOperands, args: ExpertGemmArgs, num_ctas: Int32):
        # The DSL's descriptors are discarded: the runtime encodes its own from the manifest.
        operand_layout = engine.k_major_coords()
        a_smem = engine.k_major_smem_layout(TILE_M, self.stages)
        b_smem = engine.k_major_smem_layout(TILE_N, self.stages)
        tma = ExpertGemmTma(
            *engine.make_tma_load(operands.a_ptr, operand_layout, a_smem, (TILE_M, TILE_K)),
            *engine.make_tma_load(operands.b0_ptr, operand_layout, b_smem, (TILE_N, TILE_K)),
            *engine.make_tma_load(operands.b1_ptr, operand_layout, b_smem, (TILE_N, TILE_K)),
        )
        self.kernel(tma, args).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(self, tma: ExpertGemmTma, args: ExpertGemmArgs):
        tidx, bidx, grid_size, warp_idx, warpgroup = engine.thread_roles()

        # ---- static layouts, MMA, shared storage ----
        tiled_mma = engine.forward_mma()
        a_layout = engine.k_major_smem_layout(TILE_M, self.stages)
        b_layout = engine.k_major_smem_layout(TILE_N, self.stages)
        storage, sA, sB0, sB1, buffers = handoff.allocate_crew_storage(
            a_layout, b_layout, self.stages, SLOT_BYTES
        )

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma.tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma.tma_b0)
            cute.nvgpu.cpasync.prefetch_descriptor(tma.tma_b1)

        # ---- operand ring ----
        ring = engine.make_operand_ring(storage, a_layout, b_layout, self.stages)

        # ---- tile list inputs ----
        tokens_per_expert = cute.make_tensor(
            args.tokens_per_expert_ptr, cute.make_layout(cutlass.max(args.num_experts, 1))
        )
        k_tiles = args.k_size // TILE_K
        col_tiles = args.n_size // TILE_N
        if cutlass.const_expr(self.epilogue != "swiglu"):
            col_tiles = args.n_size // (2 * TILE_N)
        tiles = TileList(tokens_per_expert, args.num_experts, col_tiles)
        # Tiles by a dynamic ticket (tickets.py); consumers and crew stop at NO_TASK.
        tickets = Tickets(
            args.ticket_ptr.toint(), task_slots(storage, handoff.BUFFER_BYTES), Int32(0)
        )
        no_end = Int32(2**31 - 1)

        if warpgroup == 0:
            # ======== producer warpgroup: warp 0 issues TMA, warps 1-3 store tiles ========
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                tAsA, tAgA = engine.partition_tma_load(tma.tma_a, sA, tma.mA, (TILE_M, TILE_K))
                tBsB0, tBgB0 = engine.partition_tma_load(tma.tma_b0, sB0, tma.mB0, (TILE_N, TILE_K))
                tBsB1, tBgB1 = engine.partition_tma_load(tma.tma_b1, sB1, tma.mB1, (TILE_N, TILE_K))
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )

                def load_tile(state, expert, col_tile, row_tile):
                    b0_row_tile, b1_row_tile = self._weight_row_tiles(
                        expert, col_tile, args.b_expert_rows
                    )
                    loads = (
                        (tma.tma_a, tAgA, row_tile, None, tAsA),
                        (tma.tma_b0, tBgB0, b0_row_tile, None, tBsB0),
                        (tma.tma_b1, tBgB1, b1_row_tile, None, tBsB1),
                    )
                    return engine.load_k_tiles(ring, state, k_tiles, loads)

                tickets = tickets._replace(total=count_tiles(tiles))
                seq = Int32(0)
                task = take_ticket(tickets, seq)
                state, seq, task = produce_phase(state, tiles, tickets, seq, task, Int32(0),
                                                 tickets.total, None, load_tile, ())  # fmt: skip
                signal_no_task(ring, state)
                # Keep the CTA alive until the consumers released every stage it filled.
                ring.producer_tail(state)
            if warp_idx != 0:
                self._epilogue_warps(
                    tiles, tickets, no_end, buffers, args.out_ptr, args.gate_ptr, args.up_ptr, args.peer_rank_ptr,
                    args.peer_token_idx_ptr, args.n_size, args.has_limit, args.swiglu_limit, tidx,
                )  # fmt: skip
        else:
            # ================= consumer warpgroups: wgmma mainloop + hand-off ================
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, (acc0, acc1) = engine.make_consumer_fragments(
                tiled_mma, tidx, sA, sB0, sB1
            )
            read_state, release_state = engine.make_consumer_states(self.stages)

            def run_tile(states):
                # ---- mainloop: keep one wgmma batch in flight, release the stage before it ----
                states = engine.mma_k_tiles(
                    tiled_mma, ring, states[0], states[1], k_tiles, operands, (acc0, acc1)
                )
                # ---- the rounded tile to the crew, which stores it during the next mainloop ----
                CREW.hand_off(thr_mma, (acc0, acc1), buffers)
                return states

            seq = Int32(0)
            task = consumer_task(ring, read_state, tickets, seq)
            consume_phase((read_state, release_state), ring, tickets, seq, task, Int32(0), no_end,
                          run_tile, ())  # fmt: skip
            CREW.hand_off_nothing()

    @cute.jit
    def _weight_row_tiles(self, expert: Int32, col_tile: Int32, b_expert_rows: Int32):
        """128-row tile indices of B0 and B1 in the [rows, K] weight views, whose expert e
        starts at row e * b_expert_rows."""
        expert_tiles = expert * (b_expert_rows // TILE_N)
        b0 = expert_tiles + col_tile
        b1 = b0
        if cutlass.const_expr(self.epilogue != "swiglu"):
            b0 = expert_tiles + 2 * col_tile
            b1 = b0 + 1
        return b0, b1

    @cute.jit
    def _epilogue_warps(
        self, tiles, tickets, no_end, buffers, out_ptr, gate_ptr, up_ptr, peer_rank_ptr,
        peer_token_idx_ptr, n_size, has_limit, swiglu_limit, tidx,
    ):  # fmt: skip
        """Warps 1-3: store this CTA's tiles from the hand-off blocks, in ticket order."""
        row_stride = cute.assume(Int64(n_size), divby=TILE_N)
        lane = tidx - 32 * CREW.first_warp
        seq = Int32(0)
        task = crew_task(CREW, tickets, seq)
        if cutlass.const_expr(self.epilogue == "swiglu"):
            store_args = (out_ptr, gate_ptr, up_ptr, row_stride, has_limit, swiglu_limit, None)
            store_phase(CREW, tiles, tickets, seq, task, Int32(0), no_end, buffers, lane, TILE_N,
                        None, store_swiglu_chunk, store_args)  # fmt: skip
        else:
            store_phase(CREW, tiles, tickets, seq, task, Int32(0), no_end, buffers, lane,
                        2 * TILE_N, None, handoff.store_pair, (out_ptr, row_stride))  # fmt: skip
