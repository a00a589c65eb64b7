"""SM90 backward megakernel, EP group of one, v2: the routed experts' backward in one persistent
launch (DESIGN §4, SEMANTICS §2).

    dY_e[r]        = bf16(w[peer_token_idx[r]] * dY[peer_token_idx[r] // k])   dispatch phase
    d_gate, d_up   = SwiGLU'(dY_e @ W_down[e], gate, up), router partials       d_hidden tasks
    slots[peer_token_idx[r]] = d_gate[r] @ W_gate[e] + d_up[r] @ W_up[e]         d_x tasks
    dW_down[e] = dY_e^T hidden, dW_gate[e] = d_gate^T x, dW_up[e] = d_up^T x    weight tasks

for every routed row r of expert e. The weight tasks (weight_phase.py) run when `weight_gemms`
is 3 (bf16 gradients); with fp32 main_grads the launcher passes 0 and adds them with the
separate accumulate kernel. The fixed-order d_x combine stays a separate launch.

The pieces are the separate kernels', in one launch:
- the dispatch phase of the forward megakernel (dispatch_phase.py), scaled by the router weight;
- the d_hidden_swiglu and d_x tasks of Sm90ExpertGemmBwd (expert_gemm_bwd.py): A K-major, B
  MN-major read in place, 3 ring stages, the crew of warps 1-3 storing every tile (d_hidden:
  two hand-offs per tile, gate/up prefetched into L2 by the producer when it takes the task;
  d_x: rows at their slots);
- the weight-gradient tiles of Sm90ExpertGemmBwdWeights (expert_gemm_bwd_weights.py), both
  operands MN-major through their own view of the ring, stored by the same crew.

Task list, in dependency order: the d_hidden tiles (expert by expert, m fastest, then the
256-column block of I) and d_x tiles (the same over 256-column blocks of H) minibatch by
minibatch as in the forward megakernel (`minibatch_tiles`; a minibatch's d_x tiles after the
next one's d_hidden tiles: tickets.Minibatches), taken by a
dynamic ticket as in the forward megakernel (tickets.py); then each CTA's weight tasks (CTA c:
c, c + grid, ...; weight_phase.py). With `num_comm_ctas` > 0 only CTAs 0 .. num_comm_ctas - 1
dispatch and the others start on tickets at once (the same bits; not faster on the H200,
moe_forward.py says why). Tickets are taken in list order; d_hidden tasks depend only on the
dispatch, which waits for nothing, d_x tasks only on d_hidden tasks, weight tasks only on the
dispatch and every d_hidden task (all taken before any CTA finds no ticket left): the waits
cannot deadlock.

Counters (int32, zeroed by the launcher before each launch):
    dispatched[m]  row tile m of dY_e is written: reaches 1 (phase BACKWARD_DISPATCH)
    dgu_done[m]    d_hidden tiles of row tile m written (d_gate, d_up): reaches I / 256
                   (phase BACKWARD_DHIDDEN_GEMM)
    dispatch_total CTAs done dispatching: reaches the number of dispatching CTAs (the weight
                   phase's wait)
    dgu_total      d_hidden tiles stored: reaches their number (the weight phase's wait)
    ticket         the next d_hidden / d_x task
Writers fence the async proxy (readers load with TMA), meet at a barrier (the CTA's after
dispatch, the crew's after a tile), then one thread adds 1 with `red.release.gpu`; the TMA
producer polls with `ld.acquire.gpu` and a bound (common/bounded_wait.py).

Kernel parameters, in order (descriptors encoded by the runtime from `tma_specs`):
- `tma_dy`  dY_e bf16 [C, H] (A, box 64 x 128)   `tma_wd`  W_down viewed [E * H, I] (B)
- `tma_dg`, `tma_du`  d_gate, d_up bf16 [C, I] (A)   `tma_wg`, `tma_wu`  W_gate, W_up viewed
  [E * I, H] (B: box 64 N x 64 K rows)
- the weight phase's, all MN-major with box 64 x 64: `tma_xdy` dY_e, `tma_xdg` d_gate,
  `tma_xdu` d_up (A); `tma_xh` hidden [C, I], `tma_xx` x_routed [C, H] (B)
- `d_w_down_ptr` bf16 [E, H, I], `d_w_gate_ptr`, `d_w_up_ptr` bf16 [E, I, H]
- `dy_ptr` bf16 [T, H]; `weight_ptr` fp32 [T * k]; `dy_routed_ptr` bf16 [C, H]; `gate_ptr`,
  `up_ptr` bf16 [C, I] (the forward context); `d_gate_ptr`, `d_up_ptr` bf16 [C, I];
  `partials_ptr` fp32 [C, I / 128]; `slots_ptr` bf16 [T * k, H]
- `peer_rank_ptr`, `peer_token_idx_ptr` int32 [C]; `num_tokens_ptr` int32 [1];
  `tokens_per_expert_ptr` int32 [E]; `counters_ptr` int32 [2 * ceil(C / 128) + 3], zeroed
- `error_record_ptr`, `clock_ptr` (int64 [grid, 8] phase clock, common/phase_clock.py; may
  be null), `timeout_ns` (int64)
- `num_experts`, `hidden_size`, `intermediate_size`, `topk`, `num_src_rows` (T), `capacity`
  (C), `has_limit`, `swiglu_limit`, `weight_gemms` (3 or 0), `num_comm_ctas` (0, or < grid),
  `minibatch_tiles` (>= 1)

Constraints (the launcher checks them): H and I multiples of 256, both < 2^16; the schedule's
segments multiples of 128; E * max(H, I) < 2^30; grid <= SM count; tensors 16-byte aligned and
contiguous.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import BFloat16, Float32, Int32, Int64

from ..common.args import global_pointer
from ..common.bounded_wait import red_add_release_gpu_s32
from ..common.phase_clock import (
    CLOCK_CREW_DONE,
    CLOCK_DISPATCHED,
    CLOCK_PHASE_1,
    CLOCK_PHASE_2,
    CLOCK_PHASE_3,
    CLOCK_PRODUCER_DONE,
    CLOCK_START,
    stamp,
)
from . import epilogue_warps as handoff
from . import gemm_phases as phases
from .dispatch_phase import dispatch_rows
from .expert_gemm import CREW
from .expert_gemm_bwd import MAX_COLS, MAX_ROWS, Sm90ExpertGemmBwd
from .expert_tiles import TileList
from .gemm_phases import CONSUMER_REGISTERS, PRODUCER_REGISTERS, TILE_K, TILE_M, TILE_N
from .tickets import (
    SLOT_BYTES,
    Minibatches,
    RowTileWait,
    Tickets,
    consume_phase,
    consumer_task,
    past_last_task,
    produce_steps,
    signal_no_task,
    step_windows,
    store_steps,
    task_slots,
)
from .weight_phase import (
    PhaseWait,
    WeightTasks,
    consume_weight_tasks,
    produce_weight_tasks,
    store_weight_tasks,
)

# WaitPhase ids (mok.runtime.WaitPhase; a wire format).
PHASE_BACKWARD_DISPATCH = 9
PHASE_BACKWARD_DHIDDEN_GEMM = 10
# The weight phase's descriptors (weight_phase.py), MN-major: A = dY_e, d_gate, d_up; B =
# hidden, x_routed.
WEIGHT_PHASE_TMA = ("tma_xdy", "tma_xdg", "tma_xdu", "tma_xh", "tma_xx")


@dataclass(frozen=True)
class Sm90MoeBackward:
    """See the module docstring. `stages`: depth of the shared-memory operand ring."""

    stages: int = 3

    def validate(self) -> None:
        phases.validate_stages(self.stages, phases.MAX_STAGES_WITH_CREW)

    @property
    def threads(self) -> int:
        return phases.THREADS

    def _engine(self) -> Sm90ExpertGemmBwd:
        """The separate d_hidden kernel's class: its MMA, layouts and epilogue helpers."""
        return Sm90ExpertGemmBwd("d_hidden_swiglu", self.stages)

    def tma_specs(self) -> list[dict]:
        a_box = [TILE_K, TILE_M]
        b_box = [64, TILE_K]  # 64 N (one 128-byte swizzle row) x 64 K rows, MN-major
        return [
            phases.tma_spec("tma_dy", a_box),
            phases.tma_spec("tma_wd", b_box),
            phases.tma_spec("tma_dg", a_box),
            phases.tma_spec("tma_du", a_box),
            phases.tma_spec("tma_wg", b_box),
            phases.tma_spec("tma_wu", b_box),
            # The weight phase: A and B both MN-major (weight_phase.py).
            *(phases.tma_spec(name, b_box) for name in WEIGHT_PHASE_TMA),
        ]

    def stage_bytes(self) -> int:
        return phases.stage_bytes()

    def compile_arguments(self) -> tuple:
        bf16 = global_pointer(BFloat16, 16)
        i32 = global_pointer(Int32, 4)
        f32 = global_pointer(Float32, 4)
        return (
            *(bf16 for _ in range(6)),  # tma_dy, tma_wd, tma_dg, tma_du, tma_wg, tma_wu sources
            *(bf16 for _ in WEIGHT_PHASE_TMA),  # tma_xdy, tma_xdg, tma_xdu, tma_xh, tma_xx
            bf16,  # d_w_down_ptr
            bf16,  # d_w_gate_ptr
            bf16,  # d_w_up_ptr
            bf16,  # dy_ptr
            f32,  # weight_ptr
            bf16,  # dy_routed_ptr
            bf16,  # gate_ptr
            bf16,  # up_ptr
            bf16,  # d_gate_ptr
            bf16,  # d_up_ptr
            f32,  # partials_ptr
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
            Int32(0),  # weight_gemms (3, or 0: the weight gradients run separately)
            Int32(0),  # num_comm_ctas
            Int32(2),  # minibatch_tiles
            Int32(1),  # num_ctas
        )

    @cute.jit
    def __call__(
        self,
        a_dy: cute.Pointer,
        b_wd: cute.Pointer,
        a_dg: cute.Pointer,
        a_du: cute.Pointer,
        b_wg: cute.Pointer,
        b_wu: cute.Pointer,
        a_xdy: cute.Pointer,
        a_xdg: cute.Pointer,
        a_xdu: cute.Pointer,
        b_xh: cute.Pointer,
        b_xx: cute.Pointer,
        d_w_down_ptr: cute.Pointer,
        d_w_gate_ptr: cute.Pointer,
        d_w_up_ptr: cute.Pointer,
        dy_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        dy_routed_ptr: cute.Pointer,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        d_gate_ptr: cute.Pointer,
        d_up_ptr: cute.Pointer,
        partials_ptr: cute.Pointer,
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
        weight_gemms: Int32,
        num_comm_ctas: Int32,
        minibatch_tiles: Int32,
        num_ctas: Int32,
    ):
        # The descriptors built here are thrown away: the runtime encodes its own from the
        # manifest (same box, swizzle and element type, the caller's real extents).
        engine = self._engine()
        a_layout = cute.make_layout((MAX_ROWS, MAX_COLS), stride=(MAX_COLS, 1))  # (rows, K)
        b_layout = cute.make_layout((MAX_COLS, MAX_ROWS), stride=(1, MAX_COLS))  # (N, K rows)
        a_smem = engine._a_smem_layout()
        b_smem = engine._b_smem_layout()
        tile_a = (TILE_M, TILE_K)
        tile_b = (TILE_N, TILE_K)
        tma_dy, mDy = phases.make_tma_load(a_dy, a_layout, a_smem, tile_a)
        tma_wd, mWd = phases.make_tma_load(b_wd, b_layout, b_smem, tile_b)
        tma_dg, mDg = phases.make_tma_load(a_dg, a_layout, a_smem, tile_a)
        tma_du, mDu = phases.make_tma_load(a_du, a_layout, a_smem, tile_a)
        tma_wg, mWg = phases.make_tma_load(b_wg, b_layout, b_smem, tile_b)
        tma_wu, mWu = phases.make_tma_load(b_wu, b_layout, b_smem, tile_b)
        w_smem = phases.mn_major_smem_layout(TILE_M, self.stages)
        tma_xdy, mXdy = phases.make_tma_load(a_xdy, b_layout, w_smem, tile_a)
        tma_xdg, mXdg = phases.make_tma_load(a_xdg, b_layout, w_smem, tile_a)
        tma_xdu, mXdu = phases.make_tma_load(a_xdu, b_layout, w_smem, tile_a)
        tma_xh, mXh = phases.make_tma_load(b_xh, b_layout, b_smem, tile_b)
        tma_xx, mXx = phases.make_tma_load(b_xx, b_layout, b_smem, tile_b)
        self.kernel(
            tma_dy, mDy, tma_wd, mWd, tma_dg, mDg, tma_du, mDu, tma_wg, mWg, tma_wu, mWu,
            tma_xdy, mXdy, tma_xdg, mXdg, tma_xdu, mXdu, tma_xh, mXh, tma_xx, mXx,
            d_w_down_ptr, d_w_gate_ptr, d_w_up_ptr, dy_ptr, weight_ptr, dy_routed_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr,
            partials_ptr, slots_ptr, peer_rank_ptr, peer_token_idx_ptr, num_tokens_ptr,
            tokens_per_expert_ptr, counters_ptr, error_record_ptr, clock_ptr, timeout_ns,
            num_experts,
            hidden_size, intermediate_size, topk, num_src_rows, capacity, has_limit,
            swiglu_limit, weight_gemms, num_comm_ctas, minibatch_tiles,
        ).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        tma_dy: cute.CopyAtom,
        mDy: cute.Tensor,
        tma_wd: cute.CopyAtom,
        mWd: cute.Tensor,
        tma_dg: cute.CopyAtom,
        mDg: cute.Tensor,
        tma_du: cute.CopyAtom,
        mDu: cute.Tensor,
        tma_wg: cute.CopyAtom,
        mWg: cute.Tensor,
        tma_wu: cute.CopyAtom,
        mWu: cute.Tensor,
        tma_xdy: cute.CopyAtom,
        mXdy: cute.Tensor,
        tma_xdg: cute.CopyAtom,
        mXdg: cute.Tensor,
        tma_xdu: cute.CopyAtom,
        mXdu: cute.Tensor,
        tma_xh: cute.CopyAtom,
        mXh: cute.Tensor,
        tma_xx: cute.CopyAtom,
        mXx: cute.Tensor,
        d_w_down_ptr: cute.Pointer,
        d_w_gate_ptr: cute.Pointer,
        d_w_up_ptr: cute.Pointer,
        dy_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        dy_routed_ptr: cute.Pointer,
        gate_ptr: cute.Pointer,
        up_ptr: cute.Pointer,
        d_gate_ptr: cute.Pointer,
        d_up_ptr: cute.Pointer,
        partials_ptr: cute.Pointer,
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
        weight_gemms: Int32,
        num_comm_ctas: Int32,
        minibatch_tiles: Int32,
    ):
        tma = (tma_dy, mDy, tma_wd, mWd, tma_dg, mDg, tma_du, mDu, tma_wg, mWg, tma_wu, mWu)
        weight_tma = (tma_xdy, mXdy, tma_xdg, mXdg, tma_xdu, mXdu, tma_xh, mXh, tma_xx, mXx)
        tidx, bidx, grid_size, warp_idx, warpgroup = phases.thread_roles()
        engine = self._engine()

        tiled_mma = engine._tiled_mma()
        a_layout = engine._a_smem_layout()
        b_layout = engine._b_smem_layout()
        storage, sA, sB0, sB1 = phases.allocate_operand_ring_storage(
            a_layout, b_layout, self.stages, handoff.BUFFER_BYTES + SLOT_BYTES
        )
        buffers = handoff.handoff_buffers(storage)
        if warp_idx == 0:
            for atom in (tma_dy, tma_wd, tma_dg, tma_du, tma_wg, tma_wu, tma_xdy, tma_xdg,
                         tma_xdu, tma_xh, tma_xx):  # fmt: skip
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        ring = phases.make_operand_ring(storage, a_layout, b_layout, self.stages)
        # The weight phase reads A MN-major: its own view of the same stage bytes.
        w_layout = phases.mn_major_smem_layout(TILE_M, self.stages)
        sA_w = storage.sA.get_tensor(w_layout.outer, swizzle=w_layout.inner)

        # ---- the two tile lists (128 x 256 tiles) and the counters ----
        tokens_per_expert = cute.make_tensor(
            tokens_per_expert_ptr, cute.make_layout(cutlass.max(num_experts, 1))
        )
        d_hidden_cols = intermediate_size // (2 * TILE_N)
        d_hidden_tiles = TileList(tokens_per_expert, num_experts, d_hidden_cols)
        d_x_cols = hidden_size // (2 * TILE_N)
        d_x_tiles = TileList(tokens_per_expert, num_experts, d_x_cols)
        routed_rows = cute.make_tensor(num_tokens_ptr, cute.make_layout(1))[0]
        row_tiles_total = routed_rows // TILE_M
        num_d_hidden = row_tiles_total * d_hidden_cols
        batches = Minibatches(minibatch_tiles, row_tiles_total, d_hidden_cols, d_x_cols)
        counter_base = counters_ptr.toint()
        dispatched = counter_base
        dgu_done = counter_base + Int64(4) * Int64((capacity + TILE_M - 1) // TILE_M)
        # After both per-row-tile arrays: CTAs done dispatching, d_hidden tiles stored.
        dispatch_total = dgu_done + Int64(4) * Int64((capacity + TILE_M - 1) // TILE_M)
        dgu_total = dispatch_total + Int64(4)
        record = error_record_ptr.toint()
        clock = clock_ptr.toint()
        if tidx == 0:
            stamp(clock, bidx, CLOCK_START)
        weight_tasks = WeightTasks(
            tokens_per_expert, num_experts, hidden_size, intermediate_size, weight_gemms
        )
        num_d_x = row_tiles_total * d_x_cols

        # ---- the communication CTAs dispatch (every CTA if none); then every CTA takes its
        # d_hidden and d_x tasks by the dynamic ticket (tickets.py) and its weight tasks by the
        # static one (bidx, + grid) ----
        dispatchers = cutlass.select_(num_comm_ctas > 0, num_comm_ctas, grid_size)
        tickets = Tickets(dgu_total + Int64(4), task_slots(storage), num_d_hidden + num_d_x)

        # ---- dispatch: dY_e = bf16(w * dY), every thread of a dispatching CTA, before the
        # roles split ----
        if bidx < dispatchers:
            dispatch_rows(
                dy_ptr, dy_routed_ptr, peer_rank_ptr, peer_token_idx_ptr, row_tiles_total,
                hidden_size, topk, num_src_rows, capacity, dispatched, buffers[2], tidx, bidx,
                dispatchers, weight_ptr,
            )  # fmt: skip
            if tidx == 0:  # after dispatch_rows' CTA barriers and per-row-tile releases
                red_add_release_gpu_s32(dispatch_total, Int32(1))
        if tidx == 0:
            stamp(clock, bidx, CLOCK_DISPATCHED)

        if warpgroup == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                state = self._producer(
                    engine, ring, (sA, sB0, sB1), tma, d_hidden_tiles, d_x_tiles, batches,
                    hidden_size, intermediate_size, dispatched, dgu_done, record, timeout_ns,
                    tickets, gate_ptr, up_ptr,
                )  # fmt: skip
                wait = PhaseWait(dispatch_total, dispatchers, dgu_total, num_d_hidden,
                                 PHASE_BACKWARD_DISPATCH, PHASE_BACKWARD_DHIDDEN_GEMM, record,
                                 timeout_ns)  # fmt: skip
                state = produce_weight_tasks(
                    ring,
                    state,
                    weight_tasks,
                    bidx,
                    grid_size,
                    wait,
                    self._weight_loads(sA_w, sB0, sB1, weight_tma),
                )
                ring.producer_tail(state)
                if tidx == 0:
                    stamp(clock, bidx, CLOCK_PRODUCER_DONE)
            else:
                self._store_tiles(
                    d_hidden_tiles, d_x_tiles, batches, buffers, d_gate_ptr, d_up_ptr,
                    slots_ptr, peer_rank_ptr, peer_token_idx_ptr, hidden_size, intermediate_size,
                    dgu_done, dgu_total, tidx, tickets,
                )  # fmt: skip
                store_weight_tasks(
                    CREW,
                    weight_tasks,
                    bidx,
                    grid_size,
                    buffers,
                    tidx,
                    (d_w_down_ptr, d_w_gate_ptr, d_w_up_ptr),
                )
                if tidx == 32 * CREW.first_warp:
                    stamp(clock, bidx, CLOCK_CREW_DONE)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            thr_mma, operands, accs = phases.make_consumer_fragments(tiled_mma, tidx, sA, sB0, sB1)
            read_state, release_state = phases.make_consumer_states(self.stages)

            # ---- d_hidden tasks: SwiGLU backward and partials here, d_gate/d_up to the crew;
            # then d_x tasks: one K loop over the gate half then the up half, rows to the
            # crew. The d_x phase has its own MMA object: `mma_k_tiles` sets its accumulate
            # field inside one loop, and a value made inside one loop may not be used by
            # another.
            def run_d_hidden(states, first_row, col_tile):
                read_state, release_state = phases.mma_k_tiles(
                    tiled_mma, ring, states[0], states[1], hidden_size // TILE_K, operands, accs
                )
                for j in cutlass.range_constexpr(2):
                    engine._swiglu_backward(
                        thr_mma, accs[j], gate_ptr, up_ptr, partials_ptr, first_row,
                        (2 * col_tile + j) * TILE_N, intermediate_size, has_limit,
                        swiglu_limit, buffers,
                    )  # fmt: skip
                return read_state, release_state

            d_x_mma = engine._tiled_mma()
            d_x_thr = d_x_mma.get_slice(tidx - phases.THREADS_PER_WARPGROUP)

            def run_d_x(states, first_row, col_tile):
                read_state, release_state = phases.mma_k_tiles(
                    d_x_mma, ring, states[0], states[1], 2 * (intermediate_size // TILE_K),
                    operands, accs,
                )  # fmt: skip
                CREW.hand_off(d_x_thr, accs, buffers)
                return read_state, release_state

            first_consumer = tidx == phases.THREADS_PER_WARPGROUP
            seq = Int32(0)
            task = consumer_task(ring, read_state, tickets, seq)
            states = (read_state, release_state)
            # CLOCK_PHASE_1: the end of the CTA's last d_hidden part (now, if it has none).
            if first_consumer:
                stamp(clock, bidx, CLOCK_PHASE_1)
            segments = ((Int32(0), Int32(0)), (Int32(0), Int32(0)))
            while task >= 0:
                segments, (base, middle, first, end_row), (_, end, first_2, end_row_2) = (
                    step_windows(batches, d_hidden_tiles, segments, task)
                )
                states, seq, task = consume_phase(
                    states, ring, tickets, seq, task, base, middle, run_d_hidden, (),
                    d_hidden_tiles, first, end_row,
                )  # fmt: skip
                if first_consumer:
                    stamp(clock, bidx, CLOCK_PHASE_1)
                states, seq, task = consume_phase(
                    states, ring, tickets, seq, task, middle, end, run_d_x, (), d_x_tiles,
                    first_2, end_row_2,
                )  # fmt: skip
            CREW.hand_off_nothing()
            states = past_last_task(ring, states)
            if first_consumer:
                stamp(clock, bidx, CLOCK_PHASE_2)
            # ---- weight tasks: both operands MN-major, their own MMA object and A view ----
            w_mma = phases.make_tiled_mma(
                cute.nvgpu.warpgroup.OperandMajorMode.MN, cute.nvgpu.warpgroup.OperandMajorMode.MN
            )
            w_thr, w_operands = phases.make_operand_fragments(w_mma, tidx, sA_w, sB0, sB1)
            consume_weight_tasks(
                states, weight_tasks, bidx, grid_size, w_mma, ring, w_operands, accs,
                CREW, w_thr, buffers,
            )  # fmt: skip
            if first_consumer:
                stamp(clock, bidx, CLOCK_PHASE_3)

    # ------------------------------------------------------------------ roles

    @cute.jit
    def _producer(
        self, engine, ring, smem, tma, d_hidden_tiles, d_x_tiles, batches, hidden_size,
        intermediate_size, dispatched, dgu_done, record, timeout_ns, tickets, gate_ptr, up_ptr,
    ):  # fmt: skip
        """Warp 0: takes the CTA's d_hidden and d_x tasks (tickets.py) and makes the TMA loads
        of each after its rows' counter (a d_hidden task's gate and up prefetched into L2 for
        the consumers' epilogue first); then wakes the consumers with no task. Returns the
        producer state past that signal."""
        sA, sB0, sB1 = smem
        tma_dy, mDy, tma_wd, mWd, tma_dg, mDg, tma_du, mDu, tma_wg, mWg, tma_wu, mWu = tma
        tile_a = (TILE_M, TILE_K)
        tDYsA, tDYgA = phases.partition_tma_load(tma_dy, sA, mDy, tile_a)
        tDGsA, tDGgA = phases.partition_tma_load(tma_dg, sA, mDg, tile_a)
        tDUsA, tDUgA = phases.partition_tma_load(tma_du, sA, mDu, tile_a)
        tWDsB0, tWDsB1, tWDgB = phases.partition_tma_load_pair(tma_wd, sB0, sB1, mWd)
        tWGsB0, tWGsB1, tWGgB = phases.partition_tma_load_pair(tma_wg, sB0, sB1, mWg)
        tWUsB0, tWUsB1, tWUgB = phases.partition_tma_load_pair(tma_wu, sB0, sB1, mWu)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        d_hidden_cols = intermediate_size // (2 * TILE_N)

        lane = cute.arch.lane_idx()
        i_stride = cute.assume(Int64(intermediate_size), divby=2 * TILE_N)

        def load_d_hidden(state, expert, col_tile, row_tile):
            engine._prefetch_gate_up(lane, row_tile * TILE_M, col_tile * (2 * TILE_N), gate_ptr,
                                     up_ptr, i_stride, threads=32)  # fmt: skip
            # A = dY_e rows (K = H), B = W_down[e] read [H, I] (K rows, N contiguous).
            b_k_base = expert * (hidden_size // TILE_K)
            loads = (
                (tma_dy, tDYgA, row_tile, None, tDYsA),
                (tma_wd, tWDgB, 2 * col_tile, b_k_base, tWDsB0),
                (tma_wd, tWDgB, 2 * col_tile + 1, b_k_base, tWDsB1),
            )
            return phases.load_k_tiles(ring, state, hidden_size // TILE_K, loads)

        def load_d_x(state, expert, col_tile, row_tile):
            # A = d_gate then d_up rows (K = I each), B = W_gate[e] then W_up[e] read [I, H].
            b_k_base = expert * (intermediate_size // TILE_K)
            halves = (
                (tma_dg, tDGgA, tDGsA, tma_wg, tWGgB, tWGsB0, tWGsB1),
                (tma_du, tDUgA, tDUsA, tma_wu, tWUgB, tWUsB0, tWUsB1),
            )
            for half in cutlass.range_constexpr(2):
                tma_a, tAgA, tAsA, tma_b, tBgB, tBsB0, tBsB1 = halves[half]
                loads = (
                    (tma_a, tAgA, row_tile, None, tAsA),
                    (tma_b, tBgB, 2 * col_tile, b_k_base, tBsB0),
                    (tma_b, tBgB, 2 * col_tile + 1, b_k_base, tBsB1),
                )
                state = phases.load_k_tiles(ring, state, intermediate_size // TILE_K, loads)
            return state

        rows_wait = RowTileWait(dispatched, Int32(1), PHASE_BACKWARD_DISPATCH, record,
                                timeout_ns)  # fmt: skip
        dgu_wait = RowTileWait(dgu_done, d_hidden_cols, PHASE_BACKWARD_DHIDDEN_GEMM, record,
                               timeout_ns)  # fmt: skip
        state, _, _ = produce_steps(state, batches, (d_hidden_tiles, d_x_tiles), tickets,
                                    (rows_wait, dgu_wait), (load_d_hidden, load_d_x))  # fmt: skip
        signal_no_task(ring, state)
        state.advance()
        return state

    @cute.jit
    def _store_tiles(
        self, d_hidden_tiles, d_x_tiles, batches, buffers, d_gate_ptr, d_up_ptr, slots_ptr,
        peer_rank_ptr, peer_token_idx_ptr, hidden_size, intermediate_size, dgu_done, dgu_total,
        tidx, tickets,
    ):  # fmt: skip
        """Warps 1-3, the crew: store the d_hidden and d_x tiles the consumers hand off, in
        their order: each d_hidden tile's d_gate and d_up (two hand-offs; then its row tile's
        counter and `dgu_total` released), then each d_x tile's rows at their slots, until the
        consumers' hand-off of no task."""
        lane = tidx - 32 * CREW.first_warp
        i_stride = cute.assume(Int64(intermediate_size), divby=2 * TILE_N)
        d_hidden_stores = dict(
            tile_cols=2 * TILE_N, slots=None, store_chunk=handoff.store_split,
            store_args=(d_gate_ptr, d_up_ptr, i_stride), after_tile=self._release_d_hidden_tile,
            after_args=(dgu_done, dgu_total), handoffs=2,
        )  # fmt: skip
        d_x_stores = dict(
            tile_cols=2 * TILE_N, slots=(peer_rank_ptr, peer_token_idx_ptr),
            store_chunk=handoff.store_pair,
            store_args=(slots_ptr, cute.assume(Int64(hidden_size), divby=2 * TILE_N)),
        )  # fmt: skip
        store_steps(CREW, batches, (d_hidden_tiles, d_x_tiles), tickets, buffers, lane,
                    (d_hidden_stores, d_x_stores))  # fmt: skip

    @cute.jit
    def _release_d_hidden_tile(self, lane, first_row, dgu_done, dgu_total):
        """After a d_hidden tile: its row tile's counter (CREW.release_row_tile: fence, crew
        barrier, one release), then the count of stored d_hidden tiles."""
        CREW.release_row_tile(lane, first_row, dgu_done)
        if lane == 0:
            red_add_release_gpu_s32(dgu_total, Int32(1))

    def _weight_loads(self, sA_w, sB0, sB1, weight_tma):
        """Per weight GEMM (dW_down, dW_gate, dW_up): (A atom, A gmem and smem partitions,
        B atom, B gmem partition, B smem partitions 0 and 1)."""
        tma_xdy, mXdy, tma_xdg, mXdg, tma_xdu, mXdu, tma_xh, mXh, tma_xx, mXx = weight_tma
        tile_a = (TILE_M, TILE_K)
        xdy_s, xdy_g = phases.partition_tma_load(tma_xdy, sA_w, mXdy, tile_a)
        xdg_s, xdg_g = phases.partition_tma_load(tma_xdg, sA_w, mXdg, tile_a)
        xdu_s, xdu_g = phases.partition_tma_load(tma_xdu, sA_w, mXdu, tile_a)
        xh_s0, xh_s1, xh_g = phases.partition_tma_load_pair(tma_xh, sB0, sB1, mXh)
        xx_s0, xx_s1, xx_g = phases.partition_tma_load_pair(tma_xx, sB0, sB1, mXx)
        return (
            (tma_xdy, xdy_g, xdy_s, tma_xh, xh_g, xh_s0, xh_s1),
            (tma_xdg, xdg_g, xdg_s, tma_xx, xx_g, xx_s0, xx_s1),
            (tma_xdu, xdu_g, xdu_s, tma_xx, xx_g, xx_s0, xx_s1),
        )
