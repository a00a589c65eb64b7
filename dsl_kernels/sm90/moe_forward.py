"""SM90 forward megakernel, EP group of one: dispatch, gate/up + SwiGLU, down to slots, in one
persistent launch (DESIGN §4). The fixed-order combine stays a separate kernel
(moe_combine_forward), as DESIGN §4 allows.

History (H200, docs/NOTES.md): v1 was 4-18% slower than the same tiles as separate kernels
(ptxas serialised its wgmmas, C7520). v2 fixed that but its two dispatch warps copied x
through registers, one 16-byte load in flight per lane, and the GEMMs waited for rows (1.54x /
1.40x / 1.05x of the baseline on Qwen / DeepSeek / Mixtral against the kernels' 2.27x / 1.45x /
1.11x). v3 moved rows with bulk copies through shared memory (within 0-5% of the kernels). v4
staged the epilogue stores like the separate GEMMs. v5 handed every tile to epilogue warps
(which made the separate GEMMs 9-15% faster on gate/up) but its dispatch warp, left 12 KiB
of staging, became the bound: the kernel without the copy was 2-5 ms faster on DeepSeek and
Mixtral. v6, this file, dispatches first, with all 384 threads of every CTA at copy speed
(the rows a CTA's first tasks need come from many CTAs anyway), then runs the GEMM tasks.

One CTA per SM (grid = SM count, all of shared memory each), 384 threads:

- dispatch, all threads, before the roles split: the CTA's row tiles of the routed buffer
  (x_routed[r] = x[peer_token_idx[r] // k], zeros for padding rows), a counter release after
  each tile. With `num_comm_ctas` = 0 every CTA dispatches tiles c, c + grid, ...; otherwise
  only CTAs 0 .. num_comm_ctas - 1 do (tiles c, c + num_comm_ctas, ...) and the others go
  straight to their tasks;
- warp 0, the TMA producer: takes the CTA's tasks one ticket at a time (tickets.py) and fills
  the operand ring; before the A loads of a task it waits (bounded) for the counter that
  guards those rows;
- warps 1-3, the crew (epilogue_warps.py): store each tile the consumers hand off through two
  shared-memory blocks (gate/up: SwiGLU, gate, up, hidden; down: rows at their slots) while
  the consumers run the next task, and release a counter per stored gate/up tile (in the
  consumers' code, a release atomic or a polling loop made ptxas serialise every wgmma of the
  kernel, warning C7520);
- warpgroups 1-2, the wgmma consumers (setmaxnreg 232): the mainloop of each task, then the
  hand-off of its rounded accumulators.

Task list, in dependency order, minibatch by minibatch (`minibatch_tiles` row tiles each;
tickets.Minibatches): a minibatch's gate/up tiles (tile list of expert_tiles.py over its rows:
expert by expert, m fastest, then the 128-column block of I) follow the previous minibatch's,
and its down tiles (the same over 256-column blocks of H) come after the next minibatch's
gate/up tiles; one minibatch is every gate/up tile, then every down tile. A CTA takes its
next task from one global counter (a dynamic ticket, tickets.py: a slow CTA takes fewer; a
static ticket, CTA c running tasks c, c + grid, ..., left the same CTAs 0.2-0.35 ms behind
the median, and the kernel 20% longer at Qwen3-30B-A3B's shape). Tickets are taken in list
order and a task waits only for tasks before it (gate/up only for dispatch, which waits for
nothing): the waits cannot deadlock. A task is always one CTA's whole tile in a fixed K
order, so any CTA computes the same bits.

Dependencies are int32 counters in global memory (zeroed by the launcher before each launch):
    dispatched[m]   routed-row tile m (rows 128 m .. 128 m + 127) is in x_routed: reaches 1
    hidden_done[m]  gate/up tiles of row tile m written (gate, up, hidden): reaches I / 128
Writers store their data, `fence.proxy.async.global` (the readers load it with TMA, the async
proxy), meet at a barrier (the CTA's after dispatch, the crew's 96 threads after a gate/up
tile), then one thread adds 1 with `red.release.gpu`. The producer
polls with `ld.acquire.gpu` (GPU scope: only this GPU writes these counters;
common/bounded_wait.py, phases DISPATCH and GATE_UP_GEMM), giving up after `timeout_ns` with the error record written and a trap, then fences the async proxy
before its TMA loads.

Why every CTA dispatches by default (`fwd_num_comm_sms` = 0): the copy runs at HBM bandwidth
when all CTAs do it (~2 TB/s written plus the gathered reads), but one CTA alone copies only
~22 GB/s, so communication CTAs must be many to keep ahead, and then they take about as much
SM time as the phase while their traffic slows the GEMMs beside them. Measured on the H200
(docs/NOTES.md, session 7): 16-48 communication CTAs were never faster. Overlapping the copy
for real needs the rows gathered straight into the A stage. EP > 1 adds peers to the same
dispatch (a peer pointer instead of x), not a second code path.

Kernel parameters, in order (descriptors encoded by the runtime from `tma_specs`):
- `tma_x`   x_routed bf16 [C, H]        `tma_wg`, `tma_wu`  W_gate, W_up viewed [E * I, H]
- `tma_h`   hidden bf16 [C, I]          `tma_wd`  W_down viewed [E * H, I]   (all box 64 x 128)
- `x_ptr` bf16 [T, H]; `x_routed_ptr` bf16 [C, H]; `gate_ptr`, `up_ptr`, `hidden_ptr` bf16
  [C, I]; `slots_ptr` bf16 [T * k, H]
- `peer_rank_ptr`, `peer_token_idx_ptr` int32 [C]; `num_tokens_ptr` int32 [1];
  `tokens_per_expert_ptr` int32 [E]; `counters_ptr` int32 [2 * ceil(C / 128) + 1] (the last
  is the ticket), zeroed
- `error_record_ptr` (the device's error record, may be null), `clock_ptr` (int64 [grid, 8]
  phase clock, common/phase_clock.py; may be null), `timeout_ns` (int64)
- `num_experts`, `hidden_size`, `intermediate_size`, `topk`, `num_src_rows` (T: rows of x),
  `capacity` (C), `has_limit`, `swiglu_limit`, `num_comm_ctas` (0, or < grid),
  `minibatch_tiles` (>= 1)

Constraints (the launcher checks them): H % 256 == 0, I % 128 == 0, both < 2^16; the schedule's
segments multiples of 128; grid <= SM count; tensors 16-byte aligned and contiguous.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.args import global_pointer
from ..common.phase_clock import (
    CLOCK_CREW_DONE,
    CLOCK_DISPATCHED,
    CLOCK_PHASE_1,
    CLOCK_PHASE_2,
    CLOCK_PRODUCER_DONE,
    CLOCK_START,
    stamp,
)
from . import epilogue_warps as handoff
from . import gemm_phases as phases
from .dispatch_phase import dispatch_rows
from .epilogue_warps import EpilogueCrew
from .expert_gemm import MAX_K, MAX_ROWS, Sm90ExpertGemm
from .expert_tiles import TileList
from .gemm_phases import CONSUMER_REGISTERS, PRODUCER_REGISTERS, TILE_K, TILE_M, TILE_N
from .tickets import (
    SLOT_BYTES,
    Minibatches,
    RowTileWait,
    Tickets,
    consume_phase,
    consumer_task,
    produce_steps,
    signal_no_task,
    step_of,
    store_steps,
    task_slots,
)

# WaitPhase ids (mok.runtime.WaitPhase; a wire format).
PHASE_DISPATCH = 5
PHASE_GATE_UP_GEMM = 6
# Warps 1-3 store the tiles the consumers hand off (epilogue_warps.py) and release a counter
# per stored gate/up tile. The release atomic stays out of the consumers' code: there, a
# release atomic or a polling loop makes ptxas serialise every wgmma of the kernel (C7520).
CREW = EpilogueCrew(first_warp=1, num_warps=3)


@dataclass(frozen=True)
class Sm90MoeForward:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    # The hand-off blocks (68.5 KiB) leave room for 3 ring stages.
    stages: int = 3

    def validate(self) -> None:
        phases.validate_stages(self.stages, phases.MAX_STAGES_WITH_CREW)

    @property
    def threads(self) -> int:
        return phases.THREADS

    def _engine(self) -> Sm90ExpertGemm:
        """The gate/up GEMM's class: the megakernel's MMA, shared-memory layouts and SwiGLU
        stores are its (both GEMMs read K-major operands)."""
        return Sm90ExpertGemm("swiglu", self.stages)

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
            global_pointer(Int64, 8),  # clock_ptr (phase clock, may be null)
            Int64(0),  # timeout_ns
            Int32(0),  # num_experts
            Int32(0),  # hidden_size
            Int32(0),  # intermediate_size
            Int32(1),  # topk
            Int32(0),  # num_src_rows
            Int32(0),  # capacity
            Int32(0),  # has_limit
            Float32(0.0),  # swiglu_limit
            Int32(0),  # num_comm_ctas
            Int32(2),  # minibatch_tiles
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
        clock_ptr: cute.Pointer,
        timeout_ns: Int64,
        num_experts: Int32,
        hidden_size: Int32,
        intermediate_size: Int32,
        topk: Int32,
        num_src_rows: Int32,
        capacity: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
        num_comm_ctas: Int32,
        minibatch_tiles: Int32,
        num_ctas: Int32,
    ):
        layout = cute.make_layout((MAX_ROWS, MAX_K), stride=(MAX_K, 1))
        a_smem = self._engine()._smem_layout(TILE_M)
        b_smem = self._engine()._smem_layout(TILE_N)
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
            clock_ptr,
            timeout_ns,
            num_experts,
            hidden_size,
            intermediate_size,
            topk,
            num_src_rows,
            capacity,
            has_limit,
            swiglu_limit,
            num_comm_ctas,
            minibatch_tiles,
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
        clock_ptr: cute.Pointer,
        timeout_ns: Int64,
        num_experts: Int32,
        hidden_size: Int32,
        intermediate_size: Int32,
        topk: Int32,
        num_src_rows: Int32,
        capacity: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
        num_comm_ctas: Int32,
        minibatch_tiles: Int32,
    ):
        tma = (tma_x, mX, tma_wg, mWg, tma_wu, mWu, tma_h, mH, tma_wd, mWd)
        tidx, bidx, grid_size, warp_idx, warpgroup = phases.thread_roles()

        engine = self._engine()
        tiled_mma = engine._tiled_mma()
        a_layout = engine._smem_layout(TILE_M)
        b_layout = engine._smem_layout(TILE_N)
        storage, sA, sB0, sB1 = phases.allocate_operand_ring_storage(
            a_layout, b_layout, self.stages, handoff.BUFFER_BYTES + SLOT_BYTES
        )
        buffers = handoff.handoff_buffers(storage)
        if warp_idx == 0:
            for atom in (tma_x, tma_wg, tma_wu, tma_h, tma_wd):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
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
        counter_base = counters_ptr.toint()
        dispatched = counter_base
        hidden_done = counter_base + Int64(4) * Int64((capacity + TILE_M - 1) // TILE_M)
        record = error_record_ptr.toint()
        clock = clock_ptr.toint()
        if tidx == 0:
            stamp(clock, bidx, CLOCK_START)

        # ---- dispatch: the communication CTAs (every CTA if none), before the roles split ----
        dispatchers = cutlass.select_(num_comm_ctas > 0, num_comm_ctas, grid_size)
        if bidx < dispatchers:
            dispatch_rows(
                x_ptr, x_routed_ptr, peer_rank_ptr, peer_token_idx_ptr, row_tiles_total,
                hidden_size, topk, num_src_rows, capacity, dispatched, buffers[2], tidx, bidx,
                dispatchers,
            )  # fmt: skip
        if tidx == 0:
            stamp(clock, bidx, CLOCK_DISPATCHED)

        # ---- the dynamic ticket (tickets.py) over the tasks, in pipelined minibatch steps:
        # step s = the gate/up tiles of minibatch s, then the down tiles of minibatch s - 1
        down_cols = hidden_size // (2 * TILE_N)
        batches = Minibatches(minibatch_tiles, row_tiles_total, gate_up_cols, down_cols)
        num_tasks = row_tiles_total * (gate_up_cols + down_cols)
        ticket = hidden_done + Int64(4) * Int64((capacity + TILE_M - 1) // TILE_M)
        tickets = Tickets(ticket, task_slots(storage), num_tasks)

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                self._producer(
                    ring, (sA, sB0, sB1), tma, gate_up_tiles, down_tiles, batches, hidden_size,
                    intermediate_size, dispatched, hidden_done, record, timeout_ns, tickets,
                )  # fmt: skip
                if tidx == 0:
                    stamp(clock, bidx, CLOCK_PRODUCER_DONE)
            else:
                self._store_tiles(
                    gate_up_tiles, down_tiles, batches, buffers, hidden_ptr, gate_ptr, up_ptr,
                    slots_ptr, peer_rank_ptr, peer_token_idx_ptr, hidden_size, intermediate_size,
                    has_limit, swiglu_limit, hidden_done, tidx, tickets,
                )  # fmt: skip
                if tidx == 32 * CREW.first_warp:
                    stamp(clock, bidx, CLOCK_CREW_DONE)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, accs = phases.make_consumer_fragments(tiled_mma, tidx, sA, sB0, sB1)
            read_state, release_state = phases.make_consumer_states(self.stages)
            # ---- gate/up tasks, handed to the crew (which stores them and releases the
            # counter of their row tile), then down tasks (the crew stores rows at their
            # (token, j) slots), then the end of the hand-offs. Each phase has its own MMA
            # object: `mma_k_tiles` sets its accumulate field inside one loop, and a value
            # made inside one loop may not be used by another.
            down_mma = engine._tiled_mma()
            down_thr = down_mma.get_slice(tidx - phases.THREADS_PER_WARPGROUP)

            def run_task(states, mma, thr, k_tiles):
                read_state, release_state = phases.mma_k_tiles(
                    mma, ring, states[0], states[1], k_tiles, operands, accs
                )
                CREW.hand_off(thr, accs, buffers)
                return read_state, release_state

            seq = Int32(0)
            task = consumer_task(ring, read_state, tickets, seq)
            states = (read_state, release_state)
            # CLOCK_PHASE_1: the end of the CTA's last gate/up part (now, if it has none).
            if tidx == phases.THREADS_PER_WARPGROUP:
                stamp(clock, bidx, CLOCK_PHASE_1)
            while task >= 0:
                (base, middle, _, _), (_, end, _, _) = step_of(batches, task)
                states, seq, task = consume_phase(
                    states, ring, tickets, seq, task, base, middle, run_task,
                    (tiled_mma, thr_mma, hidden_size // TILE_K),
                )  # fmt: skip
                if tidx == phases.THREADS_PER_WARPGROUP:
                    stamp(clock, bidx, CLOCK_PHASE_1)
                states, seq, task = consume_phase(
                    states, ring, tickets, seq, task, middle, end, run_task,
                    (down_mma, down_thr, intermediate_size // TILE_K),
                )  # fmt: skip
            CREW.hand_off_nothing()
            if tidx == phases.THREADS_PER_WARPGROUP:
                stamp(clock, bidx, CLOCK_PHASE_2)

    # ------------------------------------------------------------------ roles

    @cute.jit
    def _producer(
        self, ring, smem, tma, gate_up_tiles, down_tiles, batches, hidden_size,
        intermediate_size, dispatched, hidden_done, record, timeout_ns, tickets,
    ):  # fmt: skip
        """Warp 0: takes the CTA's tasks (tickets.py) and makes the TMA loads of each, after
        its rows' counter; then wakes the consumers with no task."""
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
        gate_up_cols = intermediate_size // TILE_N

        def load_gate_up(state, expert, col_tile, row_tile):
            weight_tile = expert * gate_up_cols + col_tile
            loads = (
                (tma_x, tXgX, row_tile, None, tXsX),
                (tma_wg, tGgG, weight_tile, None, tGsG),
                (tma_wu, tUgU, weight_tile, None, tUsU),
            )
            return phases.load_k_tiles(ring, state, hidden_size // TILE_K, loads)

        def load_down(state, expert, col_tile, row_tile):
            weight_tile = expert * (hidden_size // TILE_N) + 2 * col_tile
            loads = (
                (tma_h, tHgH, row_tile, None, tHsH),
                (tma_wd, tDgD, weight_tile, None, tDsD0),
                (tma_wd, tDgD, weight_tile + 1, None, tDsD1),
            )
            return phases.load_k_tiles(ring, state, intermediate_size // TILE_K, loads)

        rows_wait = RowTileWait(dispatched, Int32(1), PHASE_DISPATCH, record, timeout_ns)
        hidden_wait = RowTileWait(hidden_done, gate_up_cols, PHASE_GATE_UP_GEMM, record,
                                  timeout_ns)  # fmt: skip
        state, _, _ = produce_steps(state, batches, (gate_up_tiles, down_tiles), tickets,
                                    (rows_wait, hidden_wait),
                                    (load_gate_up, load_down))  # fmt: skip
        signal_no_task(ring, state)
        ring.producer_tail(state)

    @cute.jit
    def _store_tiles(
        self, gate_up_tiles, down_tiles, batches, buffers, hidden_ptr, gate_ptr, up_ptr,
        slots_ptr, peer_rank_ptr, peer_token_idx_ptr, hidden_size, intermediate_size,
        has_limit, swiglu_limit, hidden_done, tidx, tickets,
    ):  # fmt: skip
        """Warps 1-3, the crew: store every tile the consumers hand off, in their order: each
        gate/up tile's gate, up and hidden (then release its row tile's counter), then each
        down tile's rows at their slots."""
        swiglu_args = (
            hidden_ptr, gate_ptr, up_ptr, cute.assume(Int64(intermediate_size), divby=TILE_N),
            has_limit, swiglu_limit,
        )  # fmt: skip
        lane = tidx - 32 * CREW.first_warp
        gate_up_stores = dict(
            tile_cols=TILE_N, slots=None, store_chunk=self._engine().store_swiglu_chunk,
            store_args=swiglu_args, after_tile=CREW.release_row_tile, after_args=(hidden_done,),
        )  # fmt: skip
        down_stores = dict(
            tile_cols=2 * TILE_N, slots=(peer_rank_ptr, peer_token_idx_ptr),
            store_chunk=handoff.store_pair,
            store_args=(slots_ptr, cute.assume(Int64(hidden_size), divby=2 * TILE_N)),
        )  # fmt: skip
        store_steps(CREW, batches, (gate_up_tiles, down_tiles), tickets, buffers, lane,
                    (gate_up_stores, down_stores))  # fmt: skip
