"""SM90 grouped expert GEMM: persistent, warp-specialised, TMA + wgmma, two epilogues.

`Sm90ExpertGemm(epilogue="swiglu")` is the gate/up projection with SwiGLU fused:
    gate[r, :] = bf16(x[r, :] @ W_gate[e].T),  up[r, :] = bf16(x[r, :] @ W_up[e].T)
    hidden[r, :] = bf16(SiLU(g) * u),  g, u = fp32(gate), fp32(up), clamped first if has_limit
`Sm90ExpertGemm(epilogue="store")` is the down projection:
    out[r, :] = bf16(hidden[r, :] @ W_down[e].T)
`Sm90ExpertGemm(epilogue="slots")` is the down projection stored where the combine reads it
(DESIGN §4, group of one): out[peer_token_idx[r], :] = bf16(hidden[r, :] @ W_down[e].T) for
every row with peer_rank[r] >= 0; padding rows are not stored. `out` is then [T * k, H], one
row per (token, j) slot, each written exactly once.
for every routed row r of expert e (rows grouped by expert, see expert_tiles.py).

Engine (DESIGN §4): one producer warpgroup (warp 0 issues TMA loads, 40 registers) and two
consumer warpgroups (232 registers each) that each own 64 rows of the 128-row tile and run
wgmma from shared memory into fp32 register accumulators. A `stages`-deep ring of shared-memory
buffers, each guarded by a full mbarrier (TMA transaction bytes) and an empty mbarrier (one arrive
per consumer warp), lets the producer run ahead across tile boundaries.

Each CTA tile is 128 rows x (2 x 128) columns, computed as two 128x128 accumulators that share
the A tile: B0/B1 are the gate and up weight rows of the same 128 output columns (swiglu), or two
adjacent 128-column blocks of W_down (store). Two accumulators with the same register layout put
gate[i, j] and up[i, j] in the same thread, so SwiGLU is an elementwise register operation.

Epilogue (epilogue_warps.py): the consumers round their accumulators into two padded
shared-memory blocks and go straight on to the next tile's mainloop; warps 1-3 of the producer
warpgroup, the crew, compute SwiGLU and store the tile in 16-byte row chunks meanwhile (slot
rows looked up first). The mainloop alone runs at 93-100% of the GEMM ceiling and the epilogue
took 15-18% of each tile when the consumers ran it; moving it off them made gate/up 9-13%
faster on the H200 (docs/NOTES.md, session 5). Before that, the consumers staged their stores
through one shared buffer (session 4: 18-28% faster than 4-byte stores straight from the
accumulator layout, which stalled on the LSU queue). The two 34 KiB blocks leave 3 ring stages.

Kernel parameters, in order (the runtime encodes the three descriptors from the manifest's tma
specs; tensors are row-major, innermost dim last):
- `tma_a`   A = x_routed bf16 [C, H] (swiglu) or hidden bf16 [C, I] (store): box 64 x 128
- `tma_b0`  swiglu: W_gate viewed [E * I, H]; store: W_down viewed [E * H, I]: box 64 x 128
- `tma_b1`  swiglu: W_up viewed [E * I, H];   store: the same W_down descriptor again
- `out_ptr`  bf16 [C, n_size]: hidden (swiglu) or y (store)
- `gate_ptr`, `up_ptr`  bf16 [C, I] pre-clamp gate and up (swiglu; ignored by store, pass null)
- `peer_rank_ptr`, `peer_token_idx_ptr`  int32 [C], the schedule's (slots; null otherwise)
- `tokens_per_expert_ptr`  int32 [num_experts], padded segment sizes, read on the device
- `ticket_ptr`  int32 [1], zeroed: the tiles' dynamic ticket (tickets.py)
- `num_experts`, `k_size` (H for swiglu, I for store), `n_size` (I for swiglu, H for store)
- `has_limit` (int32, 0/1), `swiglu_limit` (fp32; ignored unless has_limit)

Constraints (the launcher checks them; the kernel does not):
- tokens_per_expert[e] % 128 == 0, sum <= C; rows past the sum are not written.
- k_size % 64 == 0; swiglu: n_size % 128 == 0; store: n_size % 256 == 0.
- every tensor 16-byte aligned and contiguous; C, E * n_size < 2^30 rows; k_size < 2^16.
- launch: grid (num_ctas, 1, 1) with num_ctas <= SM count (one CTA per SM: it takes all of the
  shared memory), block (384, 1, 1), cluster (1, 1, 1), dynamic smem from the manifest.

Why sm_90a only: wgmma and setmaxnreg-based warp specialisation are Hopper instructions; on
sm_100a the same job runs on tcgen05 MMAs with accumulators in tensor memory, a different engine.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.args import global_pointer
from . import epilogue_warps as handoff
from . import gemm_phases as phases
from .epilogue_warps import EpilogueCrew
from .expert_tiles import TileList
from .gemm_phases import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    TILE_K,
    TILE_M,
    TILE_N,
)
from .tickets import (
    SLOT_BYTES,
    Tickets,
    consume_phase,
    consumer_task,
    count_tiles,
    crew_task,
    produce_phase,
    signal_no_task,
    store_phase,
    take_ticket,
    task_slots,
)

EPILOGUES = ("swiglu", "store", "slots")
CREW = EpilogueCrew(first_warp=1, num_warps=3)  # epilogue_warps=True: warps 1-3 store tiles
# The TMA coordinate tensors are given static extents (the runtime's descriptor carries the
# real ones): coordinates only need to fit, and static shapes add no kernel parameters.
MAX_ROWS = 1 << 30
MAX_K = 1 << 16


@dataclass(frozen=True)
class Sm90ExpertGemm:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    epilogue: str = "swiglu"
    stages: int = 3

    def validate(self) -> None:
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        phases.validate_stages(self.stages, phases.MAX_STAGES_WITH_CREW)

    # ------------------------------------------------------------------ static configuration

    @property
    def threads(self) -> int:
        return phases.THREADS

    def _tiled_mma(self):
        # Both operands K-major (activations [C, K], weights viewed [E * N, K]).
        K = cute.nvgpu.warpgroup.OperandMajorMode.K
        return phases.make_tiled_mma(K, K)

    def _smem_layout(self, rows: int):
        return phases.k_major_smem_layout(rows, self.stages)

    def tma_specs(self) -> list[dict]:
        """How the runtime encodes each descriptor param (see runtime/tma.py): a rank-2 bf16
        tensor [rows, K] (dims innermost first: K, rows), one 64 x 128 box per stage load, the
        128-byte swizzle of the shared-memory layout built in `_smem_layout`."""
        box = [TILE_K, TILE_M]  # == [TILE_K, TILE_N]: A and B tiles have the same box
        return [phases.tma_spec(param, box) for param in ("tma_a", "tma_b0", "tma_b1")]

    def stage_bytes(self) -> int:
        """Bytes one ring stage receives (the mbarrier expect_tx count): A + B0 + B1 tiles."""
        return phases.stage_bytes()

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(BFloat16, 16),  # a_ptr
            global_pointer(BFloat16, 16),  # b0_ptr
            global_pointer(BFloat16, 16),  # b1_ptr
            global_pointer(BFloat16, 16),  # out_ptr
            global_pointer(BFloat16, 16),  # gate_ptr
            global_pointer(BFloat16, 16),  # up_ptr
            global_pointer(Int32, 4),  # peer_rank_ptr
            global_pointer(Int32, 4),  # peer_token_idx_ptr
            global_pointer(Int32, 4),  # tokens_per_expert_ptr
            global_pointer(Int32, 4),  # ticket_ptr (one int32, zeroed)
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
        a_ptr: cute.Pointer,
        b0_ptr: cute.Pointer,
        b1_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        ticket_ptr: cute.Pointer,
        num_experts: Int32,
        k_size: Int32,
        n_size: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
        num_ctas: Int32,
    ):
        # The descriptors the DSL would build here are thrown away: the runtime encodes its own
        # from the manifest (same box, swizzle and element type, the caller's real extents).
        operand_layout = cute.make_layout((MAX_ROWS, MAX_K), stride=(MAX_K, 1))
        a_smem = self._smem_layout(TILE_M)
        b_smem = self._smem_layout(TILE_N)
        tma_a, mA = phases.make_tma_load(a_ptr, operand_layout, a_smem, (TILE_M, TILE_K))
        tma_b0, mB0 = phases.make_tma_load(b0_ptr, operand_layout, b_smem, (TILE_N, TILE_K))
        tma_b1, mB1 = phases.make_tma_load(b1_ptr, operand_layout, b_smem, (TILE_N, TILE_K))
        self.kernel(
            tma_a,
            mA,
            tma_b0,
            mB0,
            tma_b1,
            mB1,
            out_ptr,
            gate_ptr,
            up_ptr,
            peer_rank_ptr,
            peer_token_idx_ptr,
            tokens_per_expert_ptr,
            ticket_ptr,
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
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b0: cute.CopyAtom,
        mB0: cute.Tensor,
        tma_b1: cute.CopyAtom,
        mB1: cute.Tensor,
        out_ptr: cute.Pointer,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        ticket_ptr: cute.Pointer,
        num_experts: Int32,
        k_size: Int32,
        n_size: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
    ):
        tidx, bidx, grid_size, warp_idx, warpgroup = phases.thread_roles()

        # ---- static layouts, MMA, shared storage ----
        tiled_mma = self._tiled_mma()
        a_layout = self._smem_layout(TILE_M)
        b_layout = self._smem_layout(TILE_N)
        storage, sA, sB0, sB1 = phases.allocate_operand_ring_storage(
            a_layout, b_layout, self.stages, handoff.BUFFER_BYTES + SLOT_BYTES
        )
        buffers = handoff.handoff_buffers(storage)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b0)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b1)

        # ---- operand ring ----
        ring = phases.make_operand_ring(storage, a_layout, b_layout, self.stages)

        # ---- tile list inputs ----
        tokens_per_expert = cute.make_tensor(
            tokens_per_expert_ptr, cute.make_layout(cutlass.max(num_experts, 1))
        )
        k_tiles = k_size // TILE_K
        col_tiles = n_size // TILE_N
        if cutlass.const_expr(self.epilogue != "swiglu"):
            col_tiles = n_size // (2 * TILE_N)
        tiles = TileList(tokens_per_expert, num_experts, col_tiles)
        # Tiles by a dynamic ticket (tickets.py); consumers and crew stop at NO_TASK.
        tickets = Tickets(ticket_ptr.toint(), task_slots(storage), Int32(0))
        no_end = Int32(2**31 - 1)

        if warpgroup == 0:
            # ======== producer warpgroup: warp 0 issues TMA, warps 1-3 store tiles ========
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                tAsA, tAgA = phases.partition_tma_load(tma_a, sA, mA, (TILE_M, TILE_K))
                tBsB0, tBgB0 = phases.partition_tma_load(tma_b0, sB0, mB0, (TILE_N, TILE_K))
                tBsB1, tBgB1 = phases.partition_tma_load(tma_b1, sB1, mB1, (TILE_N, TILE_K))
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )

                def load_tile(state, expert, col_tile, row_tile):
                    b0_row_tile, b1_row_tile = self._weight_row_tiles(expert, col_tile, n_size)
                    loads = (
                        (tma_a, tAgA, row_tile, None, tAsA),
                        (tma_b0, tBgB0, b0_row_tile, None, tBsB0),
                        (tma_b1, tBgB1, b1_row_tile, None, tBsB1),
                    )
                    return phases.load_k_tiles(ring, state, k_tiles, loads)

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
                    tiles, tickets, no_end, buffers, out_ptr, gate_ptr, up_ptr, peer_rank_ptr,
                    peer_token_idx_ptr, n_size, has_limit, swiglu_limit, tidx,
                )  # fmt: skip
        else:
            # ================= consumer warpgroups: wgmma mainloop + hand-off ================
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, (acc0, acc1) = phases.make_consumer_fragments(
                tiled_mma, tidx, sA, sB0, sB1
            )
            read_state, release_state = phases.make_consumer_states(self.stages)

            def run_tile(states):
                # ---- mainloop: keep one wgmma batch in flight, release the stage before it ----
                states = phases.mma_k_tiles(
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

    # ------------------------------------------------------------------ device helpers

    @cute.jit
    def _weight_row_tiles(self, expert: Int32, col_tile: Int32, n_size: Int32):
        """128-row tile indices of B0 and B1 in the [E * n_size, K] weight views."""
        expert_tiles = expert * (n_size // TILE_N)
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
        """Warps 1-3: store this CTA's tiles from the hand-off blocks, as the consumers take
        them (tickets.py)."""
        row_stride = cute.assume(Int64(n_size), divby=TILE_N)
        lane = tidx - 32 * CREW.first_warp
        seq = Int32(0)
        task = crew_task(CREW, tickets, seq)
        if cutlass.const_expr(self.epilogue == "swiglu"):
            store_args = (out_ptr, gate_ptr, up_ptr, row_stride, has_limit, swiglu_limit)
            store_phase(CREW, tiles, tickets, seq, task, Int32(0), no_end, buffers, lane, TILE_N,
                        None, self.store_swiglu_chunk, store_args)  # fmt: skip
        else:
            slots = None
            if cutlass.const_expr(self.epilogue == "slots"):
                slots = (peer_rank_ptr, peer_token_idx_ptr)
            store_phase(CREW, tiles, tickets, seq, task, Int32(0), no_end, buffers, lane,
                        2 * TILE_N, slots, handoff.store_pair, (out_ptr, row_stride))  # fmt: skip

    @cute.jit
    def store_swiglu_chunk(
        self, gate_chunk, up_chunk, target, chunk, first_col, out_ptr, gate_ptr, up_ptr,
        row_stride, has_limit, swiglu_limit,
    ):  # fmt: skip
        """One 16-byte chunk of row `target`: gate, up, and hidden = SwiGLU from the
        bf16-rounded values in fp32 (mok.reference.swiglu)."""
        at = cute.assume(target * row_stride + Int64(first_col + chunk * 8), divby=8)
        cute.make_tensor(gate_ptr + at, cute.make_layout(8)).store(gate_chunk)
        cute.make_tensor(up_ptr + at, cute.make_layout(8)).store(up_chunk)
        gate = cute.make_rmem_tensor((8,), BFloat16)
        up = cute.make_rmem_tensor((8,), BFloat16)
        hidden = cute.make_rmem_tensor((8,), Float32)
        gate.store(gate_chunk)
        up.store(up_chunk)
        for i in cutlass.range_constexpr(8):
            g = Float32(gate[i])
            u = Float32(up[i])
            if has_limit != 0:
                g = cutlass.min(g, swiglu_limit)
                u = cutlass.max(cutlass.min(u, swiglu_limit), -swiglu_limit)
            hidden[i] = g / (Float32(1.0) + cute.math.exp(-g)) * u
        cute.make_tensor(out_ptr + at, cute.make_layout(8)).store(hidden.load().to(BFloat16))
