"""SM90 backward megakernel: the routed experts' backward in one persistent launch (DESIGN §4).

Phases, in dependency order, each in its own module:
    dispatch     dY_e[r] = bf16(w[peer_token_idx[r]] * dY[peer_token_idx[r] // k])  dispatch_phase
    d_hidden     d_gate, d_up = SwiGLU'(dY_e @ W_down[e], gate, up), router partials d_hidden_phase
    d_x to slots slots[peer_token_idx[r]] = d_gate[r] @ W_gate[e] + d_up[r] @ W_up[e] d_x_phase
    weights      dW_down = dY_e^T hidden, dW_gate = d_gate^T x, dW_up = d_up^T x     weight_phase
    finish       d_x[t] = sum_j slots[t * k + j]; router-weight gradients  (finish_tokens > 0)
                                                                            combine_phase
Weight tasks run when `weight_gemms` is 3 (bf16 gradients; 0 for fp32 main_grads, which the
accumulate kernel adds). The `window` variant runs one macrobatch of ring reuse with its weight
tasks (launchers/macrobatch.py): each tile's part of its expert's segment of the whole schedule,
from and into fp32 partials (weight_phase.WeightWindow, the last parameters), the bits of one
pass. The finish runs here only for a group of one without a shared expert
(the launcher passes finish_tokens = T); otherwise finish_tokens is 0 and backward_finish (or
moe_combine_backward and router_grad_push) runs after the launch.

Dispatching CTAs (all, or 0 .. num_comm_ctas - 1) take row tiles by the dispatch ticket and copy
them first. d_hidden and d_x tasks are ticketed in pipelined minibatch steps (task_walk.py);
then CTA c runs weight tasks c, c + grid, ... d_hidden waits on dispatch, d_x on d_hidden,
weights on all of both (counted in tiles, not CTAs), all taken before any CTA runs out of
tickets: the waits cannot deadlock.

Forward progress with any number of resident CTAs >= 1 (DESIGN §4; another kernel may hold SMs):
a CTA leaves dispatch only once every row tile has been taken by a running CTA, and every
ticketed task waits only on work of lower tickets, taken by running CTAs; nothing waits on a
weight task. A CTA that starts late still runs its static share of weight tasks when it starts
(no deadlock, a tail). With comm CTAs the pass needs one of CTAs 0 .. num_comm_ctas - 1
resident, as in moe_forward.py.

Counters (int32, zero at the start: the launcher zeroes them once, then every launch's last CTA
leaves them zero, retire.py): dispatched[m] (to 1), dgu_done[m] (to I / 256) per 128-row tile
m, then dispatch_total (row tiles copied), dgu_total (d_hidden tiles stored), the task ticket,
the dispatch ticket, dx_done (d_x tiles stored) and the exit word; release/acquire at GPU scope.

`mxfp8` (a compile-time variant, SEMANTICS §5; weights are the dequantised bf16 values of the
transposed MXFP8 copies, gate/up the context's round trips along I, `weight_gemms` 0): dispatch
also writes dY_e's MXFP8 round trip along H (dy_rounded_ptr), which tma_dy reads, and the crew
d_gate's and d_up's along I (d_gate_rounded_ptr, d_up_rounded_ptr), which tma_dg / tma_du read.
The weight gradients' operands are round-tripped along the tokens after the launch.

Constraints (the launcher checks them): H, I multiples of 256, both < 2^16; schedule segments
multiples of 128; E * max(H, I) < 2^30; grid <= SM count; tensors 16-byte aligned, contiguous.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64

from ..common import timeline
from ..common.bounded_wait import red_add_release_gpu_s32
from ..common.params import (
    Bf16Pointer,
    Fp32Pointer,
    Int32Pointer,
    Int64Pointer,
)
from ..common.peers import D_X_ROUTED_BUFFER, D_Y_BUFFER, ROUTER_WEIGHT_BUFFER, peer_table
from ..common.retire import retire_cta
from ..phases import combine_phase
from ..phases.dispatch_phase import PHASE_BACKWARD_DISPATCH, dispatch_rows
from ..phases.expert_tiles import TileList
from ..phases.minibatches import Minibatches, step_windows
from ..phases.task_walk import (
    RowTileWait,
    StepArgs,
    WalkArgs,
    consume_phase,
    past_last_task,
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
from . import d_hidden_phase, d_x_phase
from . import epilogue_warps as handoff
from . import gemm_engine as engine
from .epilogue_warps import CREW, slot_stores
from .gemm_engine import CONSUMER_REGISTERS, PRODUCER_REGISTERS, TILE_K, TILE_M, TILE_N
from .weight_phase import (
    EAGER_MIN_K_TILES,
    PhaseWait,
    WeightTasks,
    WeightWindow,
    consume_weight_tasks,
    produce_weight_tasks,
    store_weight_tasks,
    weight_loads,
)

# Counters after the two per-row-tile arrays: dispatch_total, dgu_total, the task ticket, the
# dispatch ticket, dx_done, the exit word.
COUNTER_TAIL = 6
# A diagnostic build's (`timeline`, common/timeline.py) words of each CTA: %globaltimer at the
# start, after dispatch, when the consumers have their first task, when they finish their last
# d_hidden or d_x task, when they finish their weight tasks, after the finish phase, when the
# producer and the crew finish, at the exit; then the d_hidden and d_x tasks the CTA ran.
TIMELINE_SLOTS = ("start", "dispatch", "first_task", "last_task", "weights", "finish",
                  "producer_done", "crew_done", "exit", "tasks")  # fmt: skip
SLOT = {name: n for n, name in enumerate(TIMELINE_SLOTS)}

# Shapes: dY [T, H], dY_e and x_routed [C, H], gate/up/hidden/d_gate/d_up [C, I] bf16; router
# weights [T * k] and partials [C, I / 128] fp32; dW_down [E, H, I], dW_gate/dW_up [E, I, H]
# (their experts d_w_gate_up_rows rows apart: I, or 2 I for the halves of one [E, 2 I, H]) and
# slots [T * k, H] bf16; W_gate, W_up viewed [rows, H], experts walk.gate_up_expert_rows
# apart; counters [2 * ceil(C / 128) + COUNTER_TAIL] int32; d_x [T, H] bf16, d_router [T * k]
# fp32 and the value-status words (finish_tokens = T > 0).


class BackwardOperands(NamedTuple):
    """d_hidden's and d_x's GEMM operands, from which `__call__` makes the TMA atoms (the
    runtime encodes the descriptors from `tma_specs`)."""

    a_dy: Bf16Pointer
    b_wd: Bf16Pointer
    a_dg: Bf16Pointer
    a_du: Bf16Pointer
    b_wg: Bf16Pointer
    b_wu: Bf16Pointer


class WeightOperands(NamedTuple):
    """The weight phase's GEMM operands (MN-major: A = dY_e, d_gate, d_up; B = hidden,
    x_routed)."""

    a_xdy: Bf16Pointer
    a_xdg: Bf16Pointer
    a_xdu: Bf16Pointer
    b_xh: Bf16Pointer
    b_xx: Bf16Pointer


class BackwardTma(NamedTuple):
    """Each d_hidden / d_x operand's TMA atom (a descriptor parameter) and coordinate tensor."""

    tma_dy: cute.CopyAtom
    mDy: cute.Tensor
    tma_wd: cute.CopyAtom
    mWd: cute.Tensor
    tma_dg: cute.CopyAtom
    mDg: cute.Tensor
    tma_du: cute.CopyAtom
    mDu: cute.Tensor
    tma_wg: cute.CopyAtom
    mWg: cute.Tensor
    tma_wu: cute.CopyAtom
    mWu: cute.Tensor


class WeightTma(NamedTuple):
    """Each weight-phase operand's TMA atom and coordinate tensor."""

    tma_xdy: cute.CopyAtom
    mXdy: cute.Tensor
    tma_xdg: cute.CopyAtom
    mXdg: cute.Tensor
    tma_xdu: cute.CopyAtom
    mXdu: cute.Tensor
    tma_xh: cute.CopyAtom
    mXh: cute.Tensor
    tma_xx: cute.CopyAtom
    mXx: cute.Tensor


class BackwardTensors(NamedTuple):
    """The backward's own tensors and the finish switch (shapes above)."""

    d_w_down_ptr: Bf16Pointer
    d_w_gate_ptr: Bf16Pointer
    d_w_up_ptr: Bf16Pointer
    dy_ptr: Bf16Pointer
    weight_ptr: Fp32Pointer
    dy_routed_ptr: Bf16Pointer
    gate_ptr: Bf16Pointer
    up_ptr: Bf16Pointer
    d_gate_ptr: Bf16Pointer
    d_up_ptr: Bf16Pointer
    partials_ptr: Fp32Pointer
    slots_ptr: Bf16Pointer
    peer_table_ptr: Int64Pointer
    dy_rounded_ptr: Bf16Pointer
    d_gate_rounded_ptr: Bf16Pointer
    d_up_rounded_ptr: Bf16Pointer
    d_x_ptr: Bf16Pointer
    d_router_ptr: Fp32Pointer
    status_ptr: Int32Pointer
    finish_tokens: Int32


@dataclass(frozen=True)
class Sm90MoeBackward:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    stages: int = 3
    mxfp8: bool = False
    # One macrobatch of ring reuse: its weight tasks go on from and into fp32 partials
    # (weight_phase.WeightWindow, the last parameters, which the other variants do not read).
    window: bool = False
    # A diagnostic build only: phase timestamps past the counters (common/timeline.py).
    timeline: bool = False
    # Diagnostic (the shipped value: weight_phase.EAGER_MIN_K_TILES): weight tasks of this many
    # k tiles or more release each ring stage when its own wgmma batch completes.
    eager_min_k_tiles: int = EAGER_MIN_K_TILES

    def validate(self) -> None:
        engine.validate_stages(self.stages, engine.MAX_STAGES_WITH_CREW)

    @property
    def threads(self) -> int:
        return engine.THREADS

    def tma_specs(self) -> list[dict]:
        a_box = [TILE_K, TILE_M]
        b_box = [64, TILE_K]  # 64 N (one 128-byte swizzle row) x 64 K rows, MN-major
        # A operands (rows x K) of d_hidden and d_x take a_box; the MN-major rest b_box.
        boxes = {"tma_dy": a_box, "tma_dg": a_box, "tma_du": a_box}
        names = (*BackwardTma._fields[::2], *WeightTma._fields[::2])
        return [engine.tma_spec(name, boxes.get(name, b_box)) for name in names]

    def stage_bytes(self) -> int:
        return engine.stage_bytes()

    @cute.jit
    def __call__(
        self,
        operands: BackwardOperands,
        weight_operands: WeightOperands,
        args: BackwardTensors,
        walk: WalkArgs,
        weight_gemms: Int32,
        d_w_gate_up_rows: Int32,
        steps: StepArgs,
        weight_window: WeightWindow,
        num_ctas: Int32,
    ):
        # The DSL's descriptors are discarded: the runtime encodes its own from the manifest.
        a_layout = engine.k_major_coords()  # (rows, K)
        b_layout = engine.mn_major_coords()  # (N, K rows)
        a_smem = engine.k_major_smem_layout(TILE_M, self.stages)
        b_smem = engine.mn_major_smem_layout(TILE_N, self.stages)
        tile_a = (TILE_M, TILE_K)
        tile_b = (TILE_N, TILE_K)
        tma = BackwardTma(
            *engine.make_tma_load(operands.a_dy, a_layout, a_smem, tile_a),
            *engine.make_tma_load(operands.b_wd, b_layout, b_smem, tile_b),
            *engine.make_tma_load(operands.a_dg, a_layout, a_smem, tile_a),
            *engine.make_tma_load(operands.a_du, a_layout, a_smem, tile_a),
            *engine.make_tma_load(operands.b_wg, b_layout, b_smem, tile_b),
            *engine.make_tma_load(operands.b_wu, b_layout, b_smem, tile_b),
        )
        w_smem = engine.mn_major_smem_layout(TILE_M, self.stages)
        weight_tma = WeightTma(
            *engine.make_tma_load(weight_operands.a_xdy, b_layout, w_smem, tile_a),
            *engine.make_tma_load(weight_operands.a_xdg, b_layout, w_smem, tile_a),
            *engine.make_tma_load(weight_operands.a_xdu, b_layout, w_smem, tile_a),
            *engine.make_tma_load(weight_operands.b_xh, b_layout, b_smem, tile_b),
            *engine.make_tma_load(weight_operands.b_xx, b_layout, b_smem, tile_b),
        )
        self.kernel(
            tma, weight_tma, args, walk, weight_gemms, d_w_gate_up_rows, steps, weight_window
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        tma: BackwardTma,
        weight_tma: WeightTma,
        args: BackwardTensors,
        walk: WalkArgs,
        weight_gemms: Int32,
        d_w_gate_up_rows: Int32,
        steps: StepArgs,
        weight_window: WeightWindow,
    ):
        tidx, bidx, grid_size, warp_idx, warpgroup = engine.thread_roles()

        tiled_mma = engine.backward_mma()
        a_layout = engine.k_major_smem_layout(TILE_M, self.stages)
        b_layout = engine.mn_major_smem_layout(TILE_N, self.stages)
        storage, sA, sB0, sB1, buffers = handoff.allocate_crew_storage(
            a_layout, b_layout, self.stages, SLOT_BYTES
        )
        if warp_idx == 0:
            for atom in (*tma[::2], *weight_tma[::2]):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        ring = engine.make_operand_ring(storage, a_layout, b_layout, self.stages)
        # The weight phase reads A MN-major: its own view of the same stage bytes.
        w_layout = engine.mn_major_smem_layout(TILE_M, self.stages)
        sA_w = storage.sA.get_tensor(w_layout.outer, swizzle=w_layout.inner)

        # ---- tile lists (128 x 256 tiles), counters, the ticket ----
        tokens_per_expert = cute.make_tensor(
            walk.tokens_per_expert_ptr, cute.make_layout(cutlass.max(walk.num_experts, 1))
        )
        d_hidden_cols = walk.intermediate_size // (2 * TILE_N)
        d_x_cols = walk.hidden_size // (2 * TILE_N)
        tiles = (
            TileList(tokens_per_expert, walk.num_experts, d_hidden_cols),
            TileList(tokens_per_expert, walk.num_experts, d_x_cols),
        )
        routed_rows = cute.make_tensor(walk.num_tokens_ptr, cute.make_layout(1))[0]
        row_tiles_total = routed_rows // TILE_M
        num_d_hidden = row_tiles_total * d_hidden_cols
        num_d_x = row_tiles_total * d_x_cols
        batches = Minibatches(steps.minibatch_tiles, row_tiles_total, d_hidden_cols, d_x_cols)
        capacity_tiles = (walk.capacity + TILE_M - 1) // TILE_M  # each per-row-tile counter array
        row_tile_bytes = Int64(4) * Int64(capacity_tiles)
        dispatched = walk.counters_ptr.toint()
        dgu_done = dispatched + row_tile_bytes
        dispatch_total = dgu_done + row_tile_bytes
        dgu_total = dispatch_total + Int64(4)
        record = walk.error_record_ptr.toint()
        # A diagnostic build's phase stamps (`timeline`); none at all in the shipped one.
        marks = (self.timeline, tidx, dispatched, capacity_tiles, COUNTER_TAIL, bidx)
        timeline.mark_time(*marks, 0, SLOT["start"])
        # The window variant's weight tasks walk the whole schedule's segments (the walk's are
        # the macrobatch's, clipped).
        window = weight_window if cutlass.const_expr(self.window) else None
        weight_tokens_per_expert = tokens_per_expert
        if cutlass.const_expr(self.window):
            weight_tokens_per_expert = cute.make_tensor(
                weight_window.schedule_tokens_per_expert_ptr,
                cute.make_layout(cutlass.max(walk.num_experts, 1)),
            )
        weight_tasks = WeightTasks(
            weight_tokens_per_expert,
            walk.num_experts,
            walk.hidden_size,
            walk.intermediate_size,
            weight_gemms,
            d_w_gate_up_rows,
        )
        dispatchers = cutlass.select_(steps.num_comm_ctas > 0, steps.num_comm_ctas, grid_size)
        task_ticket = dgu_total + Int64(4)
        dx_done = task_ticket + Int64(8)  # after the task and dispatch tickets
        tickets = Tickets(
            task_ticket, task_slots(storage, handoff.BUFFER_BYTES), num_d_hidden + num_d_x
        )
        # The int32 after the task ticket; both broadcast through the task slots, one at a time.
        row_tickets = Tickets(
            task_ticket + Int64(4), task_slots(storage, handoff.BUFFER_BYTES), row_tiles_total
        )
        # Whether each task's rows 64..127 are all padding: the second consumer warpgroup then
        # issues no wgmma for it (gemm_engine.mma_k_tiles `skip`).
        flags = task_flags(storage, handoff.BUFFER_BYTES)
        rank_of = cute.make_tensor(walk.peer_rank_ptr, cute.make_layout(walk.capacity))

        # ---- dispatch: dY_e = bf16(w * dY), every thread of the dispatching CTAs ----
        if bidx < dispatchers:
            copied = dispatch_rows(
                (args.dy_ptr, peer_table(args.peer_table_ptr, D_Y_BUFFER), walk.ep_rank),
                args.dy_routed_ptr,
                walk,
                dispatched,
                buffers[2],
                tidx,
                engine.THREADS,
                row_tickets,
                (args.weight_ptr, peer_table(args.peer_table_ptr, ROUTER_WEIGHT_BUFFER)),
                args.dy_rounded_ptr if cutlass.const_expr(self.mxfp8) else None,
            )
            # After dispatch_rows' last CTA barrier: every row tile this CTA copied is written.
            # Counted in tiles, so the weight phase waits for the tiles, not for every CTA.
            if tidx == 0:
                red_add_release_gpu_s32(dispatch_total, copied)
        timeline.mark_time(*marks, 0, SLOT["dispatch"])

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                # ---- producer: d_hidden and d_x loads after their rows, then weight loads ----
                smem = (sA, sB0, sB1)
                loads = (
                    d_hidden_phase.producer_loads(
                        ring,
                        smem,
                        tma[:4],
                        walk.hidden_size,
                        walk.intermediate_size,
                        args.gate_ptr,
                        args.up_ptr,
                    ),
                    d_x_phase.producer_loads(
                        ring, smem, tma[4:], walk.intermediate_size, walk.gate_up_expert_rows
                    ),
                )
                waits = (
                    RowTileWait(
                        dispatched, Int32(1), PHASE_BACKWARD_DISPATCH, record, walk.timeout_ns
                    ),
                    RowTileWait(
                        dgu_done,
                        d_hidden_cols,
                        d_hidden_phase.PHASE_BACKWARD_DHIDDEN_GEMM,
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
                state.advance()
                wait = PhaseWait(
                    dispatch_total,
                    row_tiles_total,
                    dgu_total,
                    num_d_hidden,
                    PHASE_BACKWARD_DISPATCH,
                    d_hidden_phase.PHASE_BACKWARD_DHIDDEN_GEMM,
                    record,
                    walk.timeout_ns,
                )
                state = produce_weight_tasks(
                    ring,
                    state,
                    weight_tasks,
                    bidx,
                    grid_size,
                    wait,
                    weight_loads(sA_w, sB0, sB1, weight_tma),
                    window,
                )
                ring.producer_tail(state)
                timeline.mark_time(*marks, 0, SLOT["producer_done"])
            else:
                # ---- crew: d_gate/d_up (then the counters), d_x rows to slots, weights ----
                stores = (
                    d_hidden_phase.crew_stores(
                        args.d_gate_ptr,
                        args.d_up_ptr,
                        walk.intermediate_size,
                        dgu_done,
                        dgu_total,
                        (args.d_gate_rounded_ptr, args.d_up_rounded_ptr)
                        if cutlass.const_expr(self.mxfp8)
                        else None,
                    ),
                    slot_stores(args, walk, dx_done, D_X_ROUTED_BUFFER),
                )
                lane = tidx - 32 * CREW.first_warp
                store_steps(CREW, batches, tiles, tickets, buffers, lane, stores)
                store_weight_tasks(
                    CREW,
                    weight_tasks,
                    bidx,
                    grid_size,
                    buffers,
                    tidx,
                    (args.d_w_down_ptr, args.d_w_gate_ptr, args.d_w_up_ptr),
                    window,
                )
                timeline.mark_time(*marks, 32 * CREW.first_warp, SLOT["crew_done"])
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, accs = engine.make_consumer_fragments(tiled_mma, tidx, sA, sB0, sB1)
            read_state, release_state = engine.make_consumer_states(self.stages)

            # ---- d_hidden tasks: the SwiGLU backward and partials here, d_gate/d_up to the crew
            second_half = warpgroup == 2

            def run_d_hidden(states, flag, first_row, col_tile):
                read_state, release_state = engine.mma_k_tiles(
                    tiled_mma,
                    ring,
                    states[0],
                    states[1],
                    walk.hidden_size // TILE_K,
                    operands,
                    accs,
                    skip=(flag == PADDED_HALF) & second_half,
                    eager=True,
                )
                for j in cutlass.range_constexpr(2):
                    d_hidden_phase.swiglu_backward(
                        thr_mma,
                        accs[j],
                        args.gate_ptr,
                        args.up_ptr,
                        args.partials_ptr,
                        first_row,
                        (2 * col_tile + j) * TILE_N,
                        walk.intermediate_size,
                        walk.has_limit,
                        walk.swiglu_limit,
                        buffers,
                    )
                return read_state, release_state

            # ---- d_x tasks: gate half then up half, rows to the crew. Own MMA object: `mma_k_tiles` sets
            # its accumulate field inside one loop, and a loop's values may not be used by another.
            d_x_mma = engine.backward_mma()
            d_x_thr = d_x_mma.get_slice(tidx - engine.THREADS_PER_WARPGROUP)

            def run_d_x(states, flag, first_row, col_tile):
                read_state, release_state = engine.mma_k_tiles(
                    d_x_mma,
                    ring,
                    states[0],
                    states[1],
                    2 * (walk.intermediate_size // TILE_K),
                    operands,
                    accs,
                    skip=(flag == PADDED_HALF) & second_half,
                    eager=True,
                )
                CREW.hand_off(d_x_thr, accs, buffers)
                return read_state, release_state

            seq = Int32(0)
            task = consumer_task(ring, read_state, tickets, seq)
            timeline.mark_time(*marks, engine.THREADS_PER_WARPGROUP, SLOT["first_task"])
            states = (read_state, release_state)
            segments = ((Int32(0), Int32(0)), (Int32(0), Int32(0)))
            while task >= 0:
                segments, (base, middle, first, end_row), (_, end, first_2, end_row_2) = (
                    step_windows(batches, tiles[0], segments, task)
                )
                states, seq, task = consume_phase(
                    states,
                    ring,
                    tickets,
                    seq,
                    task,
                    base,
                    middle,
                    run_d_hidden,
                    (),
                    tiles[0],
                    first,
                    end_row,
                    flags,
                )
                states, seq, task = consume_phase(
                    states,
                    ring,
                    tickets,
                    seq,
                    task,
                    middle,
                    end,
                    run_d_x,
                    (),
                    tiles[1],
                    first_2,
                    end_row_2,
                    flags,
                )
            CREW.hand_off_nothing()
            timeline.mark_time(*marks, engine.THREADS_PER_WARPGROUP, SLOT["last_task"])
            timeline.mark_value(*marks, engine.THREADS_PER_WARPGROUP, SLOT["tasks"], seq)
            states = past_last_task(ring, states)
            # ---- weight tasks: both operands MN-major, their own MMA object and A view ----
            w_mma = engine.make_tiled_mma(
                cute.nvgpu.OperandMajorMode.MN, cute.nvgpu.OperandMajorMode.MN
            )
            w_thr, w_operands = engine.make_operand_fragments(w_mma, tidx, sA_w, sB0, sB1)
            consume_weight_tasks(
                states,
                weight_tasks,
                bidx,
                grid_size,
                w_mma,
                ring,
                w_operands,
                accs,
                CREW,
                w_thr,
                buffers,
                window,
                self.eager_min_k_tiles,
            )
            timeline.mark_time(*marks, engine.THREADS_PER_WARPGROUP, SLOT["weights"])
            if args.finish_tokens > 0:
                combine_phase.finish_backward(
                    tidx - engine.THREADS_PER_WARPGROUP,
                    bidx,
                    grid_size,
                    ((dx_done, num_d_x), (dgu_total, num_d_hidden)),
                    (record, walk.timeout_ns, walk.ep_rank),
                    args.d_x_ptr,
                    args.slots_ptr,
                    args.finish_tokens,
                    walk.hidden_size,
                    walk.topk,
                    (
                        args.partials_ptr,
                        walk.peer_rank_ptr,
                        walk.peer_token_idx_ptr,
                        walk.num_tokens_ptr,
                        args.weight_ptr,
                        args.d_router_ptr,
                        walk.capacity,
                        walk.intermediate_size // TILE_N,
                        args.status_ptr,
                    ),
                )
            timeline.mark_time(*marks, engine.THREADS_PER_WARPGROUP, SLOT["finish"])
        timeline.mark_time(*marks, 0, SLOT["exit"])
        retire_cta(dispatched, 2 * capacity_tiles + COUNTER_TAIL, warp_idx, grid_size)
