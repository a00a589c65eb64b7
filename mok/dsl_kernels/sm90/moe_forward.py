"""SM90 forward megakernel: the routed experts' forward in one persistent launch (DESIGN §4).

Phases, in dependency order, each in its own module:
    schedule        the routing's receive schedule (schedule_entries > 0)          schedule_phase
    dispatch        x_routed[r] = x[peer_token_idx[r] // k], zeros for padding  dispatch_phase
    gate/up+SwiGLU  gate, up, hidden of every routed row                         gate_up_phase
    down to slots   slots[peer_token_idx[r]] = hidden[r] @ W_down[e]^T           down_phase
    combine         out[t] = sum_j w[t, j] * slots[t * k + j]  (combine_tokens > 0)  combine_phase
The combine runs here only for a group of one without a shared expert (the launcher passes
combine_tokens = T); otherwise combine_tokens is 0 and moe_combine_forward sums the slots.
The schedule runs here only for a layer step of such a group (schedule_entries = T * k: ids_ptr
the caller's int64 [T, k] routing, two int32 scratch arrays); otherwise the schedule kernel
wrote it before the launch.

Dispatching CTAs (all, or 0 .. num_comm_ctas - 1) take row tiles by the dispatch ticket and copy
them before the roles split. Then warp 0 takes tasks by the task ticket in pipelined minibatch
steps (task_walk.py), waiting (bounded) on the rows' counter; warpgroups 1-2 run the mainloops;
the crew stores tiles and releases row-tile counters. A task is a whole tile in a fixed K order:
any CTA computes the same bits.

Forward progress with any number of resident CTAs >= 1 (DESIGN §4; another kernel may hold SMs):
a CTA leaves dispatch only once every row tile has been taken by a running CTA, copying waits on
nothing, and a task waits only on row tiles and on gate/up tasks of lower tickets, all taken by
running CTAs. With comm CTAs the compute CTAs wait for rows only comm CTAs copy, so the pass
needs one of CTAs 0 .. num_comm_ctas - 1 resident: the lowest indices, which the hardware
starts first in practice, though CUDA does not promise an order.

Counters (int32, zero at the start: the launcher zeroes them once, then every launch's last CTA
leaves them zero, retire.py): dispatched[m] (to 1), hidden_done[m] (to I / 128) per row tile,
then the task ticket, the dispatch ticket, the down tiles stored (combine_phase.py), the
schedule phase's four words (schedule_phase.py) and the exit word. Writers fence the async proxy (TMA
readers), then `red.release.gpu`; the producer polls `ld.acquire.gpu` (GPU scope: only this GPU
writes and reads them).

Constraints (the launcher checks them): H % 256 == 0, I % 128 == 0, both < 2^16; schedule
segments multiples of 128; grid <= SM count; tensors 16-byte aligned and contiguous.

`mxfp8` (a compile-time variant, SEMANTICS §5; the weights are the bf16 values of the MXFP8
weights, dequantised by the launcher): dispatch also writes x's MXFP8 round trip along H
(x_rounded_ptr) and the crew hidden's along I (hidden_rounded_ptr), which tma_x and tma_h read;
x_routed, gate, up and hidden are the bf16 rows as in BF16. The BF16 variant ignores the two.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64

from ..common.params import bf16_pointer, fp32_pointer, int32_pointer, int64_pointer, placeholders
from ..common.peers import peer_table
from ..common.retire import retire_cta
from . import combine_phase, down_phase, gate_up_phase, schedule_phase
from . import epilogue_warps as handoff
from . import gemm_phases as phases
from .dispatch_phase import PHASE_DISPATCH, dispatch_rows
from .epilogue_warps import CREW, slot_stores
from .expert_tiles import TileList
from .gemm_phases import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    THREADS_PER_WARPGROUP,
    TILE_K,
    TILE_M,
    TILE_N,
)
from .minibatches import Minibatches, step_of
from .task_walk import (
    STEP_PARAMS,
    WALK_PARAMS,
    RowTileWait,
    consume_phase,
    produce_steps,
    store_steps,
)
from .tickets import SLOT_BYTES, Tickets, consumer_task, signal_no_task, task_slots

# `__call__`'s parameters, in order (the runtime encodes the tma_* descriptors, box 64 x 128,
# from `tma_specs`). Shapes: x [T, H], x_routed [C, H], gate/up/hidden [C, I], slots [T * k, H]
# bf16; W_gate, W_up viewed [E * I, H], W_down [E * H, I]; peer_rank, peer_token_idx [C],
# num_tokens [1], tokens_per_expert [E], counters [2 * ceil(C / 128) + COUNTER_TAIL] int32;
# out [T, H] bf16, router_weights [T, k] fp32, the value-status words (combine_tokens = T > 0);
# ids [T, k] int64, schedule counts [ceil(T * k / 4096), E] and [E] int32 (schedule_entries > 0).
# Counters after the two per-row-tile arrays: the task ticket, the dispatch ticket, the down
# tiles stored, the schedule phase's words, the exit word.
COUNTER_TAIL = 4 + schedule_phase.WORDS
PARAMS = (
    ("a_x", bf16_pointer),
    ("b_wg", bf16_pointer),
    ("b_wu", bf16_pointer),
    ("a_h", bf16_pointer),
    ("b_wd", bf16_pointer),
    ("x_ptr", bf16_pointer),
    ("x_routed_ptr", bf16_pointer),
    ("gate_ptr", bf16_pointer),
    ("up_ptr", bf16_pointer),
    ("hidden_ptr", bf16_pointer),
    ("slots_ptr", bf16_pointer),
    ("x_ptrs", int64_pointer),
    ("slots_ptrs", int64_pointer),
    ("x_rounded_ptr", bf16_pointer),
    ("hidden_rounded_ptr", bf16_pointer),
    ("out_ptr", bf16_pointer),
    ("router_weights_ptr", fp32_pointer),
    ("status_ptr", int32_pointer),
    ("combine_tokens", Int32(0)),
    ("ids_ptr", int32_pointer),
    ("schedule_counts_ptr", int32_pointer),
    ("schedule_expert_counts_ptr", int32_pointer),
    ("schedule_entries", Int32(0)),
    *WALK_PARAMS,
    *STEP_PARAMS,
)


@dataclass(frozen=True)
class Sm90MoeForward:
    """See the module docstring. `stages`: ring depth (3 fit beside the crew's hand-off
    blocks)."""

    stages: int = 3
    mxfp8: bool = False

    def validate(self) -> None:
        phases.validate_stages(self.stages, phases.MAX_STAGES_WITH_CREW)

    @property
    def threads(self) -> int:
        return phases.THREADS

    def tma_specs(self) -> list[dict]:
        box = [TILE_K, TILE_M]
        return [phases.tma_spec(name, box) for name in ("tma_x", "tma_wg", "tma_wu", "tma_h",
                                                        "tma_wd")]  # fmt: skip

    def stage_bytes(self) -> int:
        return phases.stage_bytes()

    def compile_arguments(self) -> tuple:
        return placeholders(PARAMS)

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
        x_ptrs: cute.Pointer,
        slots_ptrs: cute.Pointer,
        x_rounded_ptr: cute.Pointer,
        hidden_rounded_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        router_weights_ptr: cute.Pointer,
        status_ptr: cute.Pointer,
        combine_tokens: Int32,
        ids_ptr: cute.Pointer,
        schedule_counts_ptr: cute.Pointer,
        schedule_expert_counts_ptr: cute.Pointer,
        schedule_entries: Int32,
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
        ep_rank: Int32,
        capacity: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
        num_comm_ctas: Int32,
        minibatch_tiles: Int32,
        num_ctas: Int32,
    ):
        # The DSL's descriptors are discarded: the runtime encodes its own from the manifest.
        layout = phases.k_major_coords()
        a_smem = phases.k_major_smem_layout(TILE_M, self.stages)
        b_smem = phases.k_major_smem_layout(TILE_N, self.stages)
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
            x_ptrs,
            slots_ptrs,
            x_rounded_ptr,
            hidden_rounded_ptr,
            out_ptr,
            router_weights_ptr,
            status_ptr,
            combine_tokens,
            ids_ptr,
            schedule_counts_ptr,
            schedule_expert_counts_ptr,
            schedule_entries,
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
            ep_rank,
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
        x_ptrs: cute.Pointer,
        slots_ptrs: cute.Pointer,
        x_rounded_ptr: cute.Pointer,
        hidden_rounded_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        router_weights_ptr: cute.Pointer,
        status_ptr: cute.Pointer,
        combine_tokens: Int32,
        ids_ptr: cute.Pointer,
        schedule_counts_ptr: cute.Pointer,
        schedule_expert_counts_ptr: cute.Pointer,
        schedule_entries: Int32,
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
        ep_rank: Int32,
        capacity: Int32,
        has_limit: Int32,
        swiglu_limit: Float32,
        num_comm_ctas: Int32,
        minibatch_tiles: Int32,
    ):
        tma = (tma_x, mX, tma_wg, mWg, tma_wu, mWu, tma_h, mH, tma_wd, mWd)
        tidx, bidx, grid_size, warp_idx, warpgroup = phases.thread_roles()
        crew = CREW

        tiled_mma = phases.forward_mma()
        a_layout = phases.k_major_smem_layout(TILE_M, self.stages)
        b_layout = phases.k_major_smem_layout(TILE_N, self.stages)
        storage, sA, sB0, sB1, buffers = handoff.allocate_crew_storage(
            a_layout, b_layout, self.stages, SLOT_BYTES
        )
        ring = phases.make_operand_ring(storage, a_layout, b_layout, self.stages)
        loaded = (sA, sB0, sB1)
        if warp_idx == 0:
            for atom in (tma_x, tma_wg, tma_wu, tma_h, tma_wd):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

        # ---- the schedule's tasks (a group of one's layer step: schedule_entries = T * k) ----
        capacity_tiles = (capacity + TILE_M - 1) // TILE_M  # each per-row-tile counter array
        row_tile_bytes = Int64(4) * Int64(capacity_tiles)
        dispatched = counters_ptr.toint()
        hidden_done = dispatched + row_tile_bytes
        record = error_record_ptr.toint()
        task_ticket = hidden_done + row_tile_bytes
        down_done = task_ticket + Int64(8)  # after the task and dispatch tickets
        if schedule_entries > 0:
            schedule_phase.schedule_tasks(
                ids_ptr, schedule_counts_ptr, schedule_expert_counts_ptr, down_done + Int64(4),
                peer_rank_ptr, peer_token_idx_ptr, num_tokens_ptr, tokens_per_expert_ptr,
                status_ptr, record, timeout_ns, schedule_entries, num_experts, capacity,
                cute.recast_ptr(sA.iterator, dtype=Int32), tidx,
            )  # fmt: skip
            # The tables were generic-proxy writes to the ring, which TMA writes next.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

        # ---- tile lists, counters, the ticket ----
        tokens_per_expert = cute.make_tensor(
            tokens_per_expert_ptr, cute.make_layout(cutlass.max(num_experts, 1))
        )
        gate_up_cols = intermediate_size // TILE_N
        down_cols = hidden_size // (2 * TILE_N)
        tiles = (
            TileList(tokens_per_expert, num_experts, gate_up_cols),
            TileList(tokens_per_expert, num_experts, down_cols),
        )
        routed_rows = cute.make_tensor(num_tokens_ptr, cute.make_layout(1))[0]
        row_tiles_total = routed_rows // TILE_M
        batches = Minibatches(minibatch_tiles, row_tiles_total, gate_up_cols, down_cols)
        num_tasks = row_tiles_total * (gate_up_cols + down_cols)
        slots = task_slots(storage)
        tickets = Tickets(task_ticket, slots, num_tasks)
        # The int32 after the task ticket; both broadcast through the task slots, one at a time.
        row_tickets = Tickets(task_ticket + Int64(4), slots, row_tiles_total)

        # ---- dispatch: every thread of the dispatching CTAs, before the roles split ----
        dispatchers = cutlass.select_(num_comm_ctas > 0, num_comm_ctas, grid_size)
        if bidx < dispatchers:
            dispatch_rows(
                (x_ptr, peer_table(x_ptrs), ep_rank),
                x_routed_ptr, peer_rank_ptr, peer_token_idx_ptr, hidden_size, topk, capacity,
                dispatched, buffers[2], tidx, row_tickets,
                rounded_ptr=x_rounded_ptr if cutlass.const_expr(self.mxfp8) else None,
            )  # fmt: skip

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                # ---- producer: each task's loads after its rows' counter ----
                loads = (
                    gate_up_phase.producer_loads(ring, loaded, tma[:6], hidden_size,
                                                 intermediate_size),
                    down_phase.producer_loads(ring, loaded, tma[6:], hidden_size,
                                              intermediate_size),
                )  # fmt: skip
                waits = (
                    RowTileWait(dispatched, Int32(1), PHASE_DISPATCH, record, timeout_ns),
                    RowTileWait(hidden_done, gate_up_cols, gate_up_phase.PHASE_GATE_UP_GEMM,
                                record, timeout_ns),
                )  # fmt: skip
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                state, _, _ = produce_steps(state, batches, tiles, tickets, waits, loads)
                signal_no_task(ring, state)
                ring.producer_tail(state)
            else:
                # ---- crew: gate/up tiles (then their row tile's counter), down rows to slots ----
                stores = (
                    gate_up_phase.crew_stores(
                        hidden_ptr, gate_ptr, up_ptr, intermediate_size, has_limit,
                        swiglu_limit, crew.release_row_tile, (hidden_done,),
                        hidden_rounded_ptr if cutlass.const_expr(self.mxfp8) else None,
                    ),
                    slot_stores(slots_ptr, slots_ptrs, ep_rank, peer_rank_ptr, peer_token_idx_ptr,
                                hidden_size, down_done),
                )  # fmt: skip
                lane = tidx - 32 * crew.first_warp
                store_steps(crew, batches, tiles, tickets, buffers, lane, stores)
        else:
            # ---- consumers: each task's mainloop, then its accumulators to the crew ----
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, accs = phases.make_consumer_fragments(tiled_mma, tidx, sA, sB0, sB1)
            read_state, release_state = phases.make_consumer_states(self.stages)
            # Each phase has its own MMA object: `mma_k_tiles` sets its accumulate field inside
            # one loop, and a value made inside one loop may not be used by another.
            down_mma = phases.forward_mma()
            down_thr = down_mma.get_slice(tidx - phases.THREADS_PER_WARPGROUP)

            def run_task(states, mma, thr, k_tiles):
                read_state, release_state = phases.mma_k_tiles(
                    mma, ring, states[0], states[1], k_tiles, operands, accs
                )
                crew.hand_off(thr, accs, buffers)
                return read_state, release_state

            seq = Int32(0)
            task = consumer_task(ring, read_state, tickets, seq)
            states = (read_state, release_state)
            while task >= 0:
                (base, middle, _, _), (_, end, _, _) = step_of(batches, task)
                states, seq, task = consume_phase(
                    states, ring, tickets, seq, task, base, middle, run_task,
                    (tiled_mma, thr_mma, hidden_size // TILE_K),
                )  # fmt: skip
                states, seq, task = consume_phase(
                    states, ring, tickets, seq, task, middle, end, run_task,
                    (down_mma, down_thr, intermediate_size // TILE_K),
                )  # fmt: skip
            crew.hand_off_nothing()
            if combine_tokens > 0:
                combine_phase.combine_slots(
                    tidx - THREADS_PER_WARPGROUP, bidx, grid_size, down_done,
                    row_tiles_total * down_cols, (record, timeout_ns, ep_rank), out_ptr,
                    router_weights_ptr, slots_ptr, status_ptr, combine_tokens, hidden_size, topk,
                )  # fmt: skip
        retire_cta(dispatched, 2 * capacity_tiles + COUNTER_TAIL, warp_idx, grid_size)
