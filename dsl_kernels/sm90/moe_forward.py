"""SM90 forward megakernel, EP group of one: dispatch, gate/up + SwiGLU, down to slots, in one
persistent launch (DESIGN §4). The fixed-order combine stays a separate kernel
(moe_combine_forward), as DESIGN §4 allows.

History (H200, docs/NOTES.md): v1 was 4-18% slower than the same tiles as separate kernels
(ptxas serialised its wgmmas, C7520). v2 fixed that but its two dispatch warps copied x
through registers, one 16-byte load in flight per lane, and the GEMMs waited for rows (1.54x /
1.40x / 1.05x of the baseline on Qwen / DeepSeek / Mixtral against the kernels' 2.27x / 1.45x /
1.11x). v3 moved rows with bulk copies (within 0-5% of the kernels). v4 staged the epilogue
stores through shared memory like the separate GEMMs (3 stages + 32 KiB dispatch staging + 34
KiB epilogue buffer): within 2-4% of the separate kernels. v5, this file, hands every tile to
epilogue warps like the separate GEMMs do since session 5 (they got 9-15% faster on gate/up):
3 stages + 68.5 KiB of hand-off blocks + 12 KiB dispatch staging.

One CTA per SM (grid = SM count, all of shared memory each), 384 threads in three roles:

- warp 0, the TMA producer: walks this CTA's tasks and fills the operand ring; before the A
  loads of a task it waits (bounded) for the counter that guards those rows;
- warp 1, the communication warp: pulls the routed rows of x into the routed buffer
  (x_routed[r] = x[peer_token_idx[r] // k], zeros for padding rows), 128-row tile by 128-row
  tile, with bulk copies through shared-memory staging slots, and releases a counter per tile;
- warps 2-3, the crew (epilogue_warps.py): store each tile the consumers hand off through two
  shared-memory blocks (gate/up: SwiGLU, gate, up, hidden; down: rows at their slots) while
  the consumers run the next task, and release a counter per stored gate/up tile (in the
  consumers' code, a release atomic or a polling loop made ptxas serialise every wgmma of the
  kernel, warning C7520);
- warpgroups 1-2, the wgmma consumers (setmaxnreg 232): the mainloop of each task, then the
  hand-off of its rounded accumulators.

Task list, in dependency order: every gate/up tile (tile list of expert_tiles.py: expert by
expert, m fastest, then the 128-column block of I), then every down tile (expert by expert, m
fastest, then the 256-column block of H). CTA c runs tasks c, c + grid, c + 2 grid, ... (a
static ticket: the task -> CTA map depends only on the grid, so results are deterministic).
Every CTA runs all of its gate/up tasks before any down task, and gate/up tasks depend only on
dispatch, which waits for nothing: the waits cannot deadlock.

Dependencies are int32 counters in global memory (zeroed by the launcher before each launch):
    dispatched[m]   routed-row tile m (rows 128 m .. 128 m + 127) is in x_routed: reaches 1
    hidden_done[m]  gate/up tiles of row tile m written (gate, up, hidden): reaches I / 128
Writers store their data, `fence.proxy.async.global` (the readers load it with TMA, the async
proxy), meet at a named barrier (the crew's 64 threads) or, for bulk copies, wait for their
completion, then one thread adds 1 with `red.release.gpu`. The producer
polls with `ld.acquire.gpu` (GPU scope: only this GPU writes these counters;
common/bounded_wait.py, phases DISPATCH and GATE_UP_GEMM), giving up after `timeout_ns` with the error record written and a trap, then fences the async proxy
before its TMA loads.

Why the communication role is a warp of each CTA and not separate CTAs: the producer
warpgroup's warps 1-3 idle in the GEMM engine (one warp issues all TMA), so dispatch costs no
SM of GEMM throughput; separate communication CTAs (`fwd_num_comm_sms`) would take SMs from
the GEMMs for the whole launch unless they could take GEMM tasks after dispatch. EP > 1 adds
peers to the same warps (a peer pointer instead of x), not a second code path.

Kernel parameters, in order (descriptors encoded by the runtime from `tma_specs`):
- `tma_x`   x_routed bf16 [C, H]        `tma_wg`, `tma_wu`  W_gate, W_up viewed [E * I, H]
- `tma_h`   hidden bf16 [C, I]          `tma_wd`  W_down viewed [E * H, I]   (all box 64 x 128)
- `x_ptr` bf16 [T, H]; `x_routed_ptr` bf16 [C, H]; `gate_ptr`, `up_ptr`, `hidden_ptr` bf16
  [C, I]; `slots_ptr` bf16 [T * k, H]
- `peer_rank_ptr`, `peer_token_idx_ptr` int32 [C]; `num_tokens_ptr` int32 [1];
  `tokens_per_expert_ptr` int32 [E]; `counters_ptr` int32 [2 * ceil(C / 128)], zeroed
- `error_record_ptr` (the device's error record, may be null), `timeout_ns` (int64)
- `num_experts`, `hidden_size`, `intermediate_size`, `topk`, `num_src_rows` (T, unused: the
  schedule never names a token past it), `capacity` (C), `has_limit`, `swiglu_limit`

Constraints (the launcher checks them): H % 256 == 0, I % 128 == 0, both < 2^16; the schedule's
segments multiples of 128; grid <= SM count; tensors 16-byte aligned and contiguous.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.args import global_pointer
from ..common.bounded_wait import (
    OWN_MEMORY,
    bounded_wait_reached,
    ld_acquire_gpu_s32,
    red_add_release_gpu_s32,
)
from ..common.bulk_copy import bulk_load_to_shared, bulk_store_from_shared
from ..common.row_chunks import VECTOR, chunked_row_views
from . import epilogue_warps as handoff
from . import gemm_phases as phases
from .epilogue_warps import EpilogueCrew
from .expert_gemm import MAX_K, MAX_ROWS, Sm90ExpertGemm
from .expert_tiles import TileList, locate_first_tile, locate_tile
from .gemm_phases import CONSUMER_REGISTERS, PRODUCER_REGISTERS, TILE_K, TILE_M, TILE_N

# WaitPhase ids (mok.runtime.WaitPhase; a wire format).
PHASE_DISPATCH = 5
PHASE_GATE_UP_GEMM = 6
COMM_WARP = 1  # pulls x rows with bulk copies (lane 0 issues them)
# Warps 2-3 store the tiles the consumers hand off (epilogue_warps.py) and release a counter
# per stored gate/up tile. The release atomic stays out of the consumers' code: there, a
# release atomic or a polling loop makes ptxas serialise every wgmma of the kernel (C7520).
CREW = EpilogueCrew(first_warp=2, num_warps=2)
CREW_BARRIER = 6  # named barrier of the crew's threads (1-2 staged epilogue, 3-5 hand-off)
# Dispatch staging: x rows travel global -> shared -> global in pieces of at most
# MAX_PIECE_BYTES through up to MAX_SLOTS slots in STAGING_BYTES, what shared memory has left
# beside the 3-stage ring (145 KiB) and the hand-off blocks (68.5 KiB). Small pieces keep
# more bytes in flight: STAGING_BYTES - piece.
STAGING_BYTES = 12288
MAX_SLOTS = 8
MAX_PIECE_BYTES = 2048
EXTRA_BARRIERS = MAX_SLOTS


@dataclass(frozen=True)
class Sm90MoeForward:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    # The gate/up and down epilogues stage their stores through shared memory
    # (gemm_phases.store_block): its 34 KiB and the dispatch staging fit beside 3 ring stages.
    stages: int = 3

    def validate(self) -> None:
        if not 2 <= self.stages <= 3:
            raise ValueError(f"stages must be in 2..3, got {self.stages}")

    @property
    def threads(self) -> int:
        return phases.THREADS

    def _tiled_mma(self):
        K = cute.nvgpu.warpgroup.OperandMajorMode.K
        return phases.make_tiled_mma(K, K)

    def _smem_layout(self, rows: int):
        return phases.k_major_smem_layout(rows, self.stages)

    def tma_specs(self) -> list[dict]:
        box = [TILE_K, TILE_M]
        return [
            phases.tma_spec(param, box)
            for param in ("tma_x", "tma_wg", "tma_wu", "tma_h", "tma_wd")
        ]

    def stage_bytes(self) -> int:
        return phases.stage_bytes()

    def compile_arguments(self) -> tuple:
        bf16 = global_pointer(BFloat16, 16)
        i32 = global_pointer(Int32, 4)
        return (
            *(bf16 for _ in range(5)),  # tma_x, tma_wg, tma_wu, tma_h, tma_wd sources
            bf16,  # x_ptr
            bf16,  # x_routed_ptr
            bf16,  # gate_ptr
            bf16,  # up_ptr
            bf16,  # hidden_ptr
            bf16,  # slots_ptr
            i32,  # peer_rank_ptr
            i32,  # peer_token_idx_ptr
            i32,  # num_tokens_ptr
            i32,  # tokens_per_expert_ptr
            i32,  # counters_ptr
            i32,  # error_record_ptr
            Int64(0),  # timeout_ns
            Int32(0),  # num_experts
            Int32(0),  # hidden_size
            Int32(0),  # intermediate_size
            Int32(1),  # topk
            Int32(0),  # num_src_rows
            Int32(0),  # capacity
            Int32(0),  # has_limit
            Float32(0.0),  # swiglu_limit
            Int32(1),  # num_ctas
        )

    @cute.jit
    def __call__(
        self,
        a_x: cute.Pointer,
        b_wg: cute.Pointer,
        b_wu: cute.Pointer,
        a_h: cute.Pointer,
        b_wd: cute.Pointer,
        x_ptr: cute.Pointer,
        x_routed_ptr: cute.Pointer,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        hidden_ptr: cute.Pointer,
        slots_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_tokens_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        counters_ptr: cute.Pointer,
        error_record_ptr: cute.Pointer,
        timeout_ns: Int64,
        num_experts: Int32,
        hidden_size: Int32,
        intermediate_size: Int32,
        topk: Int32,
        num_src_rows: Int32,
        capacity: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
        num_ctas: Int32,
    ):
        layout = cute.make_layout((MAX_ROWS, MAX_K), stride=(MAX_K, 1))
        a_smem = self._smem_layout(TILE_M)
        b_smem = self._smem_layout(TILE_N)
        tile_a = (TILE_M, TILE_K)
        tile_b = (TILE_N, TILE_K)
        tma_x, mX = phases.make_tma_load(a_x, layout, a_smem, tile_a)
        tma_wg, mWg = phases.make_tma_load(b_wg, layout, b_smem, tile_b)
        tma_wu, mWu = phases.make_tma_load(b_wu, layout, b_smem, tile_b)
        tma_h, mH = phases.make_tma_load(a_h, layout, a_smem, tile_a)
        tma_wd, mWd = phases.make_tma_load(b_wd, layout, b_smem, tile_b)
        self.kernel(
            tma_x,
            mX,
            tma_wg,
            mWg,
            tma_wu,
            mWu,
            tma_h,
            mH,
            tma_wd,
            mWd,
            x_ptr,
            x_routed_ptr,
            gate_ptr,
            up_ptr,
            hidden_ptr,
            slots_ptr,
            peer_rank_ptr,
            peer_token_idx_ptr,
            num_tokens_ptr,
            tokens_per_expert_ptr,
            counters_ptr,
            error_record_ptr,
            timeout_ns,
            num_experts,
            hidden_size,
            intermediate_size,
            topk,
            num_src_rows,
            capacity,
            has_limit,
            swiglu_limit,
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        tma_x: cute.CopyAtom,
        mX: cute.Tensor,
        tma_wg: cute.CopyAtom,
        mWg: cute.Tensor,
        tma_wu: cute.CopyAtom,
        mWu: cute.Tensor,
        tma_h: cute.CopyAtom,
        mH: cute.Tensor,
        tma_wd: cute.CopyAtom,
        mWd: cute.Tensor,
        x_ptr: cute.Pointer,
        x_routed_ptr: cute.Pointer,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        hidden_ptr: cute.Pointer,
        slots_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_tokens_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        counters_ptr: cute.Pointer,
        error_record_ptr: cute.Pointer,
        timeout_ns: Int64,
        num_experts: Int32,
        hidden_size: Int32,
        intermediate_size: Int32,
        topk: Int32,
        num_src_rows: Int32,
        capacity: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
    ):
        tma = (tma_x, mX, tma_wg, mWg, tma_wu, mWu, tma_h, mH, tma_wd, mWd)
        tidx, bidx, grid_size, warp_idx, warpgroup = phases.thread_roles()

        tiled_mma = self._tiled_mma()
        a_layout = self._smem_layout(TILE_M)
        b_layout = self._smem_layout(TILE_N)
        storage, sA, sB0, sB1 = phases.allocate_operand_ring_storage(
            a_layout, b_layout, self.stages, EXTRA_BARRIERS, STAGING_BYTES + handoff.BUFFER_BYTES
        )
        buffers = handoff.handoff_buffers(storage, STAGING_BYTES)
        extra_barriers = storage.extra_barriers.data_ptr()
        if warp_idx == 0:
            for atom in (tma_x, tma_wg, tma_wu, tma_h, tma_wd):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(MAX_SLOTS):
                    cute.arch.mbarrier_init(extra_barriers + s, 1)
        # The ring's set-up fences and syncs the staging mbarriers initialised above too.
        ring = phases.make_operand_ring(storage, a_layout, b_layout, self.stages)

        # ---- the two tile lists and the counters ----
        tokens_per_expert = cute.make_tensor(
            tokens_per_expert_ptr, cute.make_layout(cutlass.max(num_experts, 1))
        )
        gate_up_cols = intermediate_size // TILE_N
        gate_up_tiles = TileList(tokens_per_expert, num_experts, gate_up_cols)
        down_tiles = TileList(tokens_per_expert, num_experts, hidden_size // (2 * TILE_N))
        routed_rows = cute.make_tensor(num_tokens_ptr, cute.make_layout(1))[0]
        row_tiles_total = routed_rows // TILE_M
        num_gate_up = row_tiles_total * gate_up_cols
        counter_base = counters_ptr.toint()
        dispatched = counter_base
        hidden_done = counter_base + Int64(4) * Int64((capacity + TILE_M - 1) // TILE_M)
        record = error_record_ptr.toint()

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                self._producer(
                    ring, (sA, sB0, sB1), tma, gate_up_tiles, down_tiles, num_gate_up,
                    hidden_size, intermediate_size, dispatched, hidden_done, record, timeout_ns,
                    bidx, grid_size,
                )  # fmt: skip
            elif warp_idx == COMM_WARP:
                self._dispatch(
                    x_ptr, x_routed_ptr, peer_rank_ptr, peer_token_idx_ptr, row_tiles_total,
                    hidden_size, topk, capacity, dispatched, storage.staging.data_ptr(),
                    extra_barriers, tidx, bidx, grid_size,
                )  # fmt: skip
            else:
                self._store_tiles(
                    gate_up_tiles, down_tiles, num_gate_up, buffers, hidden_ptr, gate_ptr, up_ptr,
                    slots_ptr, peer_rank_ptr, peer_token_idx_ptr, hidden_size, intermediate_size,
                    has_limit, swiglu_limit, hidden_done, tidx, bidx, grid_size,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, accs = phases.make_consumer_fragments(tiled_mma, tidx, sA, sB0, sB1)
            read_state, release_state = phases.make_consumer_states(self.stages)
            acc0, acc1 = accs
            # ---- gate/up tasks, handed to the crew (which stores them and releases the
            # counter of their row tile) ----
            task = bidx
            expert, tile_base, row_base, row_tiles = locate_first_tile(gate_up_tiles, task)
            while expert < num_experts:
                read_state, release_state = phases.mma_k_tiles(
                    tiled_mma, ring, read_state, release_state, hidden_size // TILE_K,
                    operands, accs,
                )  # fmt: skip
                CREW.hand_off(thr_mma, accs, buffers)
                task = task + grid_size
                expert, tile_base, row_base, row_tiles = locate_tile(
                    gate_up_tiles, task, (expert, tile_base, row_base, row_tiles)
                )
            # ---- down tasks: the crew stores rows at their (token, j) slots ----
            task = task - num_gate_up
            # A fresh MMA object: `mma_k_tiles` sets its accumulate field inside the loop above,
            # and a value made inside one loop may not be used by another.
            down_mma = self._tiled_mma()
            down_thr = down_mma.get_slice(tidx - phases.THREADS_PER_WARPGROUP)
            expert, tile_base, row_base, row_tiles = locate_first_tile(down_tiles, task)
            while expert < num_experts:
                read_state, release_state = phases.mma_k_tiles(
                    down_mma, ring, read_state, release_state, intermediate_size // TILE_K,
                    operands, accs,
                )  # fmt: skip
                CREW.hand_off(down_thr, (acc0, acc1), buffers)
                task = task + grid_size
                expert, tile_base, row_base, row_tiles = locate_tile(
                    down_tiles, task, (expert, tile_base, row_base, row_tiles)
                )

    # ------------------------------------------------------------------ roles

    @cute.jit
    def _producer(
        self, ring, smem, tma, gate_up_tiles, down_tiles, num_gate_up, hidden_size,
        intermediate_size, dispatched, hidden_done, record, timeout_ns, bidx, grid_size,
    ):  # fmt: skip
        """Warp 0: TMA loads of every task of this CTA, each after its rows' counter."""
        sA, sB0, sB1 = smem
        tma_x, mX, tma_wg, mWg, tma_wu, mWu, tma_h, mH, tma_wd, mWd = tma
        tile_a = (TILE_M, TILE_K)
        tile_b = (TILE_N, TILE_K)
        tXsX, tXgX = phases.partition_tma_load(tma_x, sA, mX, tile_a)
        tGsG, tGgG = phases.partition_tma_load(tma_wg, sB0, mWg, tile_b)
        tUsU, tUgU = phases.partition_tma_load(tma_wu, sB1, mWu, tile_b)
        tHsH, tHgH = phases.partition_tma_load(tma_h, sA, mH, tile_a)
        tDsD0, tDgD = phases.partition_tma_load(tma_wd, sB0, mWd, tile_b)
        tDsD1, _ = phases.partition_tma_load(tma_wd, sB1, mWd, tile_b)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        num_experts = gate_up_tiles.num_experts
        gate_up_cols = intermediate_size // TILE_N

        task = bidx
        expert, tile_base, row_base, row_tiles = locate_first_tile(gate_up_tiles, task)
        while expert < num_experts:
            local = task - tile_base
            row_tile = row_base // TILE_M + local % row_tiles
            bounded_wait_reached(
                dispatched + Int64(4) * Int64(row_tile), Int32(1), timeout_ns, record,
                Int32(0), Int32(PHASE_DISPATCH), row_tile, Int32(OWN_MEMORY), task, ld_acquire_gpu_s32,
            )  # fmt: skip
            cute.arch.fence_proxy("async.global")
            weight_tile = expert * gate_up_cols + local // row_tiles
            loads = (
                (tma_x, tXgX, row_tile, None, tXsX),
                (tma_wg, tGgG, weight_tile, None, tGsG),
                (tma_wu, tUgU, weight_tile, None, tUsU),
            )
            state = phases.load_k_tiles(ring, state, hidden_size // TILE_K, loads)
            task = task + grid_size
            expert, tile_base, row_base, row_tiles = locate_tile(
                gate_up_tiles, task, (expert, tile_base, row_base, row_tiles)
            )

        task = task - num_gate_up
        expert, tile_base, row_base, row_tiles = locate_first_tile(down_tiles, task)
        while expert < num_experts:
            local = task - tile_base
            row_tile = row_base // TILE_M + local % row_tiles
            bounded_wait_reached(
                hidden_done + Int64(4) * Int64(row_tile), gate_up_cols, timeout_ns, record,
                Int32(0), Int32(PHASE_GATE_UP_GEMM), row_tile, Int32(OWN_MEMORY),
                task + num_gate_up, ld_acquire_gpu_s32,
            )  # fmt: skip
            cute.arch.fence_proxy("async.global")
            weight_tile = expert * (hidden_size // TILE_N) + 2 * (local // row_tiles)
            loads = (
                (tma_h, tHgH, row_tile, None, tHsH),
                (tma_wd, tDgD, weight_tile, None, tDsD0),
                (tma_wd, tDgD, weight_tile + 1, None, tDsD1),
            )
            state = phases.load_k_tiles(ring, state, intermediate_size // TILE_K, loads)
            task = task + grid_size
            expert, tile_base, row_base, row_tiles = locate_tile(
                down_tiles, task, (expert, tile_base, row_base, row_tiles)
            )
        ring.producer_tail(state)

    @cute.jit
    def _store_tiles(
        self, gate_up_tiles, down_tiles, num_gate_up, buffers, hidden_ptr, gate_ptr, up_ptr,
        slots_ptr, peer_rank_ptr, peer_token_idx_ptr, hidden_size, intermediate_size,
        has_limit, swiglu_limit, hidden_done, tidx, bidx, grid_size,
    ):  # fmt: skip
        """Warps 2-3, the crew: store every tile the consumers hand off, in their order: each
        gate/up tile's gate, up and hidden (then release its row tile's counter), then each
        down tile's rows at their slots."""
        swiglu_args = (
            hidden_ptr, gate_ptr, up_ptr, cute.assume(Int64(intermediate_size), divby=TILE_N),
            has_limit, swiglu_limit,
        )  # fmt: skip
        end = CREW.run(
            gate_up_tiles, bidx, grid_size, buffers, tidx, TILE_N, None,
            Sm90ExpertGemm("swiglu").store_swiglu_chunk, swiglu_args, self._release_row_tile,
            (hidden_done,),
        )  # fmt: skip
        CREW.run(
            down_tiles, end - num_gate_up, grid_size, buffers, tidx, 2 * TILE_N,
            (peer_rank_ptr, peer_token_idx_ptr), handoff.store_pair,
            (slots_ptr, cute.assume(Int64(hidden_size), divby=2 * TILE_N)),
        )  # fmt: skip

    @cute.jit
    def _release_row_tile(self, lane, first_row, hidden_done):
        """After a gate/up tile's stores: every crew thread fences its stores for the async
        proxy (the down tasks read hidden with TMA), the crew meets, and one thread releases
        hidden_done[row tile]."""
        cute.arch.fence_proxy("async.global")
        cute.arch.barrier(barrier_id=CREW_BARRIER, number_of_threads=CREW.threads)
        if lane == 0:
            red_add_release_gpu_s32(hidden_done + Int64(4) * Int64(first_row // TILE_M), Int32(1))

    @cute.jit
    def _dispatch(
        self, x_ptr, x_routed_ptr, peer_rank_ptr, peer_token_idx_ptr, row_tiles_total,
        hidden_size, topk, capacity, dispatched, staging, slot_barriers, tidx, bidx, grid_size,
    ):  # fmt: skip
        """Warp 1: x_routed row tiles bidx, bidx + grid, ... and a counter per tile.

        A routed row is a contiguous run of x (row peer_token_idx // k), moved in pieces by bulk
        copies through the staging slots: lane 0 keeps `slots - 1` loads in flight ahead of the
        store it issues (a slot is refilled once the store that read it last has read it,
        `wait_group.read 1`). Padding rows get zeros from all 32 lanes (plain stores). A tile's
        counter is released after its stores completed (`wait_group 0`) and the async proxy
        is fenced (the GEMM reads x_routed with TMA)."""
        lane = tidx % 32
        row_bytes = hidden_size * 2
        piece = row_bytes
        while piece > MAX_PIECE_BYTES:
            piece = piece // 2  # row_bytes is a multiple of 512: pieces stay 16-byte multiples
        pieces = row_bytes // piece
        slots = cutlass.min(Int32(MAX_SLOTS), Int32(STAGING_BYTES) // piece)
        rank = cute.make_tensor(peer_rank_ptr, cute.make_layout(capacity))
        slot_of = cute.make_tensor(peer_token_idx_ptr, cute.make_layout(capacity))
        x_base = x_ptr.toint()
        routed_base = x_routed_ptr.toint()
        staging_base = staging.toint()
        chunks, (mRouted,) = chunked_row_views(hidden_size, (x_routed_ptr, capacity))
        zeros = cute.make_rmem_tensor((VECTOR,), BFloat16)
        zeros.fill(0.0)

        # The load cursor: the next (row tile, row, piece) to load, padding rows skipped.
        cursor = self._first_routed_row(rank, bidx, Int32(0), row_tiles_total, grid_size)
        cursor = (cursor[0], cursor[1], Int32(0))
        loads = Int32(0)
        stores = Int32(0)
        for _ in cutlass.range(slots - 1, unroll=1):
            if cursor[0] < row_tiles_total:
                self._load_piece(
                    cursor, loads % slots, rank, slot_of, x_base, row_bytes, piece, topk,
                    staging_base, slot_barriers, lane,
                )  # fmt: skip
                loads = loads + 1
                cursor = self._next_piece(rank, cursor, pieces, row_tiles_total, grid_size)

        for row_tile in cutlass.range(bidx, row_tiles_total, grid_size, unroll=1):
            for r in cutlass.range(TILE_M, unroll=1):
                row = row_tile * TILE_M + r
                if rank[row] >= 0:
                    for p in cutlass.range(pieces, unroll=1):
                        s = stores % slots
                        cute.arch.mbarrier_wait(slot_barriers + s, (stores // slots) % 2)
                        if lane == 0:
                            bulk_store_from_shared(
                                routed_base + Int64(row) * Int64(row_bytes) + Int64(p * piece),
                                Int32(staging_base + s * piece),
                                piece,
                            )
                            cute.arch.cp_async_bulk_commit_group()
                        stores = stores + 1
                        if cursor[0] < row_tiles_total:
                            if lane == 0:
                                # The slot's last reader is the store before this one.
                                cute.arch.cp_async_bulk_wait_group(1, read=True)
                            self._load_piece(
                                cursor, loads % slots, rank, slot_of, x_base, row_bytes, piece,
                                topk, staging_base, slot_barriers, lane,
                            )  # fmt: skip
                            loads = loads + 1
                            cursor = self._next_piece(
                                rank, cursor, pieces, row_tiles_total, grid_size
                            )
                else:
                    for c in cutlass.range(lane, chunks, 32, unroll=4):
                        mRouted[None, c, row].store(zeros.load())
            if lane == 0:
                cute.arch.cp_async_bulk_wait_group(0)
            cute.arch.fence_proxy("async.global")
            cute.arch.sync_warp()
            if lane == 0:
                red_add_release_gpu_s32(dispatched + Int64(4) * Int64(row_tile), Int32(1))

    @cute.jit
    def _load_piece(
        self, cursor, s, rank, slot_of, x_base, row_bytes, piece, topk, staging_base,
        slot_barriers, lane,
    ):  # fmt: skip
        """Lane 0: bulk-load piece cursor[2] of routed row (cursor[0], cursor[1]) into slot s."""
        if lane == 0:
            row = cursor[0] * TILE_M + cursor[1]
            token = slot_of[row] // topk
            cute.arch.mbarrier_arrive_and_expect_tx(slot_barriers + s, piece)
            bulk_load_to_shared(
                Int32(staging_base + s * piece),
                x_base + Int64(token) * Int64(row_bytes) + Int64(cursor[2] * piece),
                piece,
                Int32((slot_barriers + s).toint()),
            )

    @cute.jit
    def _next_piece(self, rank, cursor, pieces, row_tiles_total, grid_size):
        """The load cursor after (row tile, row, piece): the next piece, or the first piece
        of the next routed (not padding) row of this CTA's tiles."""
        row_tile, r, p = cursor
        p = p + 1
        if p == pieces:
            p = Int32(0)
            row_tile, r = self._first_routed_row(rank, row_tile, r + 1, row_tiles_total, grid_size)
        return row_tile, r, p

    @cute.jit
    def _first_routed_row(self, rank, row_tile, r, row_tiles_total, grid_size):
        """(row tile, row) of the first routed row at or after row r of `row_tile`, walking
        this CTA's tiles (row_tile, + grid, ...); row_tile >= row_tiles_total when none is."""
        searching = row_tile < row_tiles_total
        while searching:
            if r == TILE_M:
                r = Int32(0)
                row_tile = row_tile + grid_size
                searching = row_tile < row_tiles_total
            else:
                if rank[row_tile * TILE_M + r] >= 0:
                    searching = False
                else:
                    r = r + 1
        return row_tile, r
