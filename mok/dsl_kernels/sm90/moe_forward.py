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
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64

from ..common import timeline
from ..common.params import (
    Bf16Pointer,
    Fp32Pointer,
    Int32Pointer,
    Int64Pointer,
)
from ..common.peers import COMBINE_BUFFER, X_BUFFER, peer_table
from ..common.retire import retire_cta
from ..phases import combine_phase, schedule_phase
from ..phases.dispatch_phase import PHASE_DISPATCH, dispatch_rows
from ..phases.expert_tiles import TileList
from ..phases.minibatches import Minibatches, step_of
from ..phases.task_walk import (
    RowTileWait,
    StepArgs,
    WalkArgs,
    consume_phase,
    produce_steps,
    store_steps,
)
from ..phases.tickets import (
    PADDED_HALF,
    SLOT_BYTES,
    Tickets,
    consumer_task,
    signal_no_task,
    task_flags,
    task_slots,
)
from . import down_phase, gate_up_phase
from . import epilogue_warps as handoff
from . import gemm_engine as engine
from .epilogue_warps import CREW, slot_stores
from .gemm_engine import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    THREADS_PER_WARPGROUP,
    TILE_K,
    TILE_M,
    TILE_N,
)

# Shapes: x [T, H], x_routed [C, H], gate/up/hidden [C, I], slots [T * k, H] bf16; W_gate,
# W_up viewed [rows, H] (expert e from row e * walk.gate_up_expert_rows: I, or 2 I for the
# halves of one [E, 2 I, H]), W_down [E * H, I]; peer_rank, peer_token_idx [C], num_tokens [1],
# tokens_per_expert [E], counters [2 * ceil(C / 128) + COUNTER_TAIL] int32; out [T, H] bf16,
# router_weights [T, k] fp32, the value-status words (combine_tokens = T > 0); ids [T, k] int64,
# schedule counts [ceil(T * k / 4096), E] and [E] int32 (schedule_entries > 0).
# Counters after the two per-row-tile arrays: the task ticket, the dispatch ticket, the down
# tiles stored, the schedule phase's words, the exit word.
COUNTER_TAIL = 4 + schedule_phase.WORDS
# A diagnostic build's (`timeline`, common/timeline.py) words of each CTA: %globaltimer at the
# start, after the schedule phase, after dispatch, when the consumers have their first task,
# when they finish their last, after the sums, when the producer and the crew finish, at the
# exit; then the tasks the CTA's consumers ran.
TIMELINE_SLOTS = ("start", "schedule", "dispatch", "first_task", "last_task", "sums",
                  "producer_done", "crew_done", "exit", "tasks")  # fmt: skip
SLOT = {name: n for n, name in enumerate(TIMELINE_SLOTS)}


class ForwardOperands(NamedTuple):
    """The GEMMs' operands, from which `__call__` makes the TMA atoms (the runtime encodes the
    descriptors, box 64 x 128, from `tma_specs`)."""

    a_x: Bf16Pointer
    b_wg: Bf16Pointer
    b_wu: Bf16Pointer
    a_h: Bf16Pointer
    b_wd: Bf16Pointer


class ForwardTma(NamedTuple):
    """Each operand's TMA atom (a descriptor parameter) and coordinate tensor (static)."""

    tma_x: cute.CopyAtom
    mX: cute.Tensor
    tma_wg: cute.CopyAtom
    mWg: cute.Tensor
    tma_wu: cute.CopyAtom
    mWu: cute.Tensor
    tma_h: cute.CopyAtom
    mH: cute.Tensor
    tma_wd: cute.CopyAtom
    mWd: cute.Tensor


class ForwardTensors(NamedTuple):
    """The forward's own tensors and phase switches (shapes above)."""

    x_ptr: Bf16Pointer
    x_routed_ptr: Bf16Pointer
    gate_ptr: Bf16Pointer
    up_ptr: Bf16Pointer
    hidden_ptr: Bf16Pointer
    slots_ptr: Bf16Pointer
    peer_table_ptr: Int64Pointer
    x_rounded_ptr: Bf16Pointer
    hidden_rounded_ptr: Bf16Pointer
    out_ptr: Bf16Pointer
    router_weights_ptr: Fp32Pointer
    status_ptr: Int32Pointer
    combine_tokens: Int32
    ids_ptr: Int32Pointer
    schedule_counts_ptr: Int32Pointer
    schedule_expert_counts_ptr: Int32Pointer
    schedule_entries: Int32


@dataclass(frozen=True)
class Sm90MoeForward:
    """See the module docstring. `stages`: ring depth (3 fit beside the crew's hand-off
    blocks)."""

    stages: int = 3
    mxfp8: bool = False
    # A diagnostic build only: phase timestamps past the counters (common/timeline.py).
    timeline: bool = False

    def validate(self) -> None:
        engine.validate_stages(self.stages, engine.MAX_STAGES_WITH_CREW)

    @property
    def threads(self) -> int:
        return engine.THREADS

    def tma_specs(self) -> list[dict]:
        box = [TILE_K, TILE_M]
        return [engine.tma_spec(name, box) for name in ForwardTma._fields[::2]]

    def stage_bytes(self) -> int:
        return engine.stage_bytes()

    @cute.jit
    def __call__(
        self,
        operands: ForwardOperands,
        args: ForwardTensors,
        walk: WalkArgs,
        steps: StepArgs,
        num_ctas: Int32,
    ):
        # The DSL's descriptors are discarded: the runtime encodes its own from the manifest.
        layout = engine.k_major_coords()
        a_smem = engine.k_major_smem_layout(TILE_M, self.stages)
        b_smem = engine.k_major_smem_layout(TILE_N, self.stages)
        tile_a = (TILE_M, TILE_K)
        tile_b = (TILE_N, TILE_K)
        tma = ForwardTma(
            *engine.make_tma_load(operands.a_x, layout, a_smem, tile_a),
            *engine.make_tma_load(operands.b_wg, layout, b_smem, tile_b),
            *engine.make_tma_load(operands.b_wu, layout, b_smem, tile_b),
            *engine.make_tma_load(operands.a_h, layout, a_smem, tile_a),
            *engine.make_tma_load(operands.b_wd, layout, b_smem, tile_b),
        )
        self.kernel(tma, args, walk, steps).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1
        )

    @cute.kernel
    def kernel(self, tma: ForwardTma, args: ForwardTensors, walk: WalkArgs, steps: StepArgs):
        tidx, bidx, grid_size, warp_idx, warpgroup = engine.thread_roles()
        crew = CREW

        tiled_mma = engine.forward_mma()
        a_layout = engine.k_major_smem_layout(TILE_M, self.stages)
        b_layout = engine.k_major_smem_layout(TILE_N, self.stages)
        storage, sA, sB0, sB1, buffers = handoff.allocate_crew_storage(
            a_layout, b_layout, self.stages, SLOT_BYTES
        )
        ring = engine.make_operand_ring(storage, a_layout, b_layout, self.stages)
        loaded = (sA, sB0, sB1)
        if warp_idx == 0:
            for atom in (tma.tma_x, tma.tma_wg, tma.tma_wu, tma.tma_h, tma.tma_wd):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

        # ---- the schedule's tasks (a group of one's layer step: schedule_entries = T * k) ----
        capacity_tiles = (walk.capacity + TILE_M - 1) // TILE_M  # each per-row-tile counter array
        row_tile_bytes = Int64(4) * Int64(capacity_tiles)
        dispatched = walk.counters_ptr.toint()
        hidden_done = dispatched + row_tile_bytes
        record = walk.error_record_ptr.toint()
        task_ticket = hidden_done + row_tile_bytes
        down_done = task_ticket + Int64(8)  # after the task and dispatch tickets
        # A diagnostic build's phase stamps (`timeline`); none at all in the shipped one.
        marks = (self.timeline, tidx, dispatched, capacity_tiles, COUNTER_TAIL, bidx)

        timeline.mark_time(*marks, 0, SLOT["start"])
        if args.schedule_entries > 0:
            schedule_phase.schedule_tasks(
                args.ids_ptr,
                args.schedule_counts_ptr,
                args.schedule_expert_counts_ptr,
                down_done + Int64(4),
                walk,
                record,
                args.status_ptr,
                args.schedule_entries,
                cute.recast_ptr(sA.iterator, dtype=Int32),
                tidx,
            )
            # The tables were generic-proxy writes to the ring, which TMA writes next.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
        timeline.mark_time(*marks, 0, SLOT["schedule"])

        # ---- tile lists, counters, the ticket ----
        tokens_per_expert = cute.make_tensor(
            walk.tokens_per_expert_ptr, cute.make_layout(cutlass.max(walk.num_experts, 1))
        )
        gate_up_cols = walk.intermediate_size // TILE_N
        down_cols = walk.hidden_size // (2 * TILE_N)
        tiles = (
            TileList(tokens_per_expert, walk.num_experts, gate_up_cols),
            TileList(tokens_per_expert, walk.num_experts, down_cols),
        )
        routed_rows = cute.make_tensor(walk.num_tokens_ptr, cute.make_layout(1))[0]
        row_tiles_total = routed_rows // TILE_M
        batches = Minibatches(steps.minibatch_tiles, row_tiles_total, gate_up_cols, down_cols)
        num_tasks = row_tiles_total * (gate_up_cols + down_cols)
        slots = task_slots(storage, handoff.BUFFER_BYTES)
        tickets = Tickets(task_ticket, slots, num_tasks)
        # The int32 after the task ticket; both broadcast through the task slots, one at a time.
        row_tickets = Tickets(task_ticket + Int64(4), slots, row_tiles_total)
        # Whether each task's rows 64..127 are all padding: the second consumer warpgroup then
        # issues no wgmma for it (gemm_engine.mma_k_tiles `skip`).
        flags = task_flags(storage, handoff.BUFFER_BYTES)
        rank_of = cute.make_tensor(walk.peer_rank_ptr, cute.make_layout(walk.capacity))

        # ---- dispatch: every thread of the dispatching CTAs, before the roles split ----
        dispatchers = cutlass.select_(steps.num_comm_ctas > 0, steps.num_comm_ctas, grid_size)
        if bidx < dispatchers:
            dispatch_rows(
                (args.x_ptr, peer_table(args.peer_table_ptr, X_BUFFER), walk.ep_rank),
                args.x_routed_ptr,
                walk,
                dispatched,
                buffers[2],
                tidx,
                engine.THREADS,
                row_tickets,
                rounded_ptr=args.x_rounded_ptr if cutlass.const_expr(self.mxfp8) else None,
            )
        timeline.mark_time(*marks, 0, SLOT["dispatch"])

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                # ---- producer: each task's loads after its rows' counter ----
                loads = (
                    gate_up_phase.producer_loads(
                        ring, loaded, tma[:6], walk.hidden_size, walk.gate_up_expert_rows
                    ),
                    down_phase.producer_loads(
                        ring, loaded, tma[6:], walk.hidden_size, walk.intermediate_size
                    ),
                )
                waits = (
                    RowTileWait(dispatched, Int32(1), PHASE_DISPATCH, record, walk.timeout_ns),
                    RowTileWait(
                        hidden_done,
                        gate_up_cols,
                        gate_up_phase.PHASE_GATE_UP_GEMM,
                        record,
                        walk.timeout_ns,
                    ),
                )
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.stages
                )
                state, _, _ = produce_steps(
                    state, batches, tiles, tickets, waits, loads, (rank_of, flags)
                )
                signal_no_task(ring, state)
                ring.producer_tail(state)
                timeline.mark_time(*marks, 0, SLOT["producer_done"])
            else:
                # ---- crew: gate/up tiles (then their row tile's counter), down rows to slots ----
                stores = (
                    gate_up_phase.crew_stores(
                        args.hidden_ptr,
                        args.gate_ptr,
                        args.up_ptr,
                        walk.intermediate_size,
                        walk.has_limit,
                        walk.swiglu_limit,
                        crew.release_row_tile,
                        (hidden_done,),
                        args.hidden_rounded_ptr if cutlass.const_expr(self.mxfp8) else None,
                    ),
                    slot_stores(args, walk, down_done, COMBINE_BUFFER),
                )
                lane = tidx - 32 * crew.first_warp
                store_steps(crew, batches, tiles, tickets, buffers, lane, stores)
                timeline.mark_time(*marks, 32 * crew.first_warp, SLOT["crew_done"])
        else:
            # ---- consumers: each task's mainloop, then its accumulators to the crew ----
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, accs = engine.make_consumer_fragments(tiled_mma, tidx, sA, sB0, sB1)
            read_state, release_state = engine.make_consumer_states(self.stages)
            # Each phase has its own MMA object: `mma_k_tiles` sets its accumulate field inside
            # one loop, and a value made inside one loop may not be used by another.
            down_mma = engine.forward_mma()
            down_thr = down_mma.get_slice(tidx - engine.THREADS_PER_WARPGROUP)

            second_half = warpgroup == 2

            def run_task(states, flag, mma, thr, k_tiles):
                skip = (flag == PADDED_HALF) & second_half
                read_state, release_state = engine.mma_k_tiles(
                    mma,
                    ring,
                    states[0],
                    states[1],
                    k_tiles,
                    operands,
                    accs,
                    skip=skip,
                    eager=True,
                )
                crew.hand_off(thr, accs, buffers)
                return read_state, release_state

            seq = Int32(0)
            task = consumer_task(ring, read_state, tickets, seq)
            timeline.mark_time(*marks, THREADS_PER_WARPGROUP, SLOT["first_task"])
            states = (read_state, release_state)
            while task >= 0:
                (base, middle, _, _), (_, end, _, _) = step_of(batches, task)
                states, seq, task = consume_phase(
                    states,
                    ring,
                    tickets,
                    seq,
                    task,
                    base,
                    middle,
                    run_task,
                    (tiled_mma, thr_mma, walk.hidden_size // TILE_K),
                    flags=flags,
                )
                states, seq, task = consume_phase(
                    states,
                    ring,
                    tickets,
                    seq,
                    task,
                    middle,
                    end,
                    run_task,
                    (down_mma, down_thr, walk.intermediate_size // TILE_K),
                    flags=flags,
                )
            crew.hand_off_nothing()
            timeline.mark_time(*marks, THREADS_PER_WARPGROUP, SLOT["last_task"])
            timeline.mark_value(*marks, THREADS_PER_WARPGROUP, SLOT["tasks"], seq)
            if args.combine_tokens > 0:
                combine_phase.combine_slots(
                    tidx - THREADS_PER_WARPGROUP,
                    bidx,
                    grid_size,
                    down_done,
                    row_tiles_total * down_cols,
                    (record, walk.timeout_ns, walk.ep_rank),
                    args,
                    walk,
                )
            timeline.mark_time(*marks, THREADS_PER_WARPGROUP, SLOT["sums"])
        timeline.mark_time(*marks, 0, SLOT["exit"])
        retire_cta(dispatched, 2 * capacity_tiles + COUNTER_TAIL, warp_idx, grid_size)
