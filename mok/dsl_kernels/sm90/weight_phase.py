"""The backward megakernel's weight-gradient phase: expert_gemm_bwd_weights.py's three GEMMs
(bf16 output) as the launch's last tasks.

    GEMM 0  dW_down[e] = dY_e^T hidden       M = H, N = I   (A = dY_e, B = hidden)
    GEMM 1  dW_gate[e] = d_gate^T x_routed   M = I, N = H   (A = d_gate, B = x_routed)
    GEMM 2  dW_up[e]   = d_up^T x_routed     M = I, N = H   (A = d_up, B = x_routed)

Tasks: GEMM, expert, then grouped_tile_coords; CTA c takes c, c + grid, ... after its d_x tasks,
each tile's whole token range in order. The first waits (bounded) for every dispatch and d_hidden
tile (counted in tiles, which running CTAs took by ticket: no wait on a CTA that is not
resident), then fences the async proxy; nothing waits on weight tasks: no deadlock.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import OWN_MEMORY, bounded_wait_reached, ld_acquire_gpu_s32
from . import epilogue_warps as handoff
from . import gemm_engine as engine
from .expert_gemm_bwd_weights import grouped_tile_coords
from .gemm_engine import TILE_K, TILE_M, TILE_N

NUM_GEMMS = 3


class WeightTasks(NamedTuple):
    """What numbers the weight tasks: padded segment sizes (device), experts, H, I, the GEMMs
    to run (3, or 0 when the separate kernels do them), and the rows from one expert's dW_gate
    (dW_up) to the next's (I, or 2 I when both are halves of one [E, 2 I, H] gradient)."""

    tokens_per_expert: cute.Tensor
    num_experts: Int32
    hidden_size: Int32
    intermediate_size: Int32
    num_gemms: Int32
    gate_up_rows: Int32


@cute.jit
def _tiles_per_expert(tasks: WeightTasks):
    return (tasks.hidden_size // TILE_M) * (tasks.intermediate_size // (2 * TILE_N))


@cute.jit
def locate_weight_task(tasks: WeightTasks, task: Int32):
    """(GEMM, expert, m tile, 256-column pair, M of that GEMM) of weight task `task`."""
    per_expert = _tiles_per_expert(tasks)
    per_gemm = per_expert * tasks.num_experts
    gemm = task // per_gemm
    rest = task - gemm * per_gemm
    expert = rest // per_expert
    m_size = tasks.intermediate_size
    if gemm == 0:
        m_size = tasks.hidden_size
    m_tile, n_pair = grouped_tile_coords(rest - expert * per_expert, m_size // TILE_M, per_expert)
    return gemm, expert, m_tile, n_pair, m_size


@cute.jit
def num_weight_tasks(tasks: WeightTasks):
    return tasks.num_gemms * tasks.num_experts * _tiles_per_expert(tasks)


class PhaseWait(NamedTuple):
    """The whole-phase counters (addresses) the first task waits for, their targets (row tiles
    copied, d_hidden tiles stored), the record."""

    dispatch_total: Int64
    row_tiles: Int32
    dgu_total: Int64
    num_d_hidden: Int32
    dispatch_phase: int
    d_hidden_phase: int
    record: Int64
    timeout_ns: Int64


@cute.jit
def produce_weight_tasks(ring, state, tasks: WeightTasks, task: Int32, grid_size: Int32,
                         wait: PhaseWait, loads: tuple):  # fmt: skip
    """Producer: TMA loads of this CTA's weight tasks from `task`. `loads`: per GEMM (A atom, A gmem,
    A smem, B atom, B gmem, B smem 0 and 1). Returns the producer state."""
    total = num_weight_tasks(tasks)
    if task < total:
        bounded_wait_reached(
            wait.dispatch_total, wait.row_tiles, wait.timeout_ns, wait.record, Int32(0),
            Int32(wait.dispatch_phase), Int32(0), Int32(OWN_MEMORY), task, ld_acquire_gpu_s32,
        )  # fmt: skip
        bounded_wait_reached(
            wait.dgu_total, wait.num_d_hidden, wait.timeout_ns, wait.record, Int32(0),
            Int32(wait.d_hidden_phase), Int32(0), Int32(OWN_MEMORY), task, ld_acquire_gpu_s32,
        )  # fmt: skip
        cute.arch.fence_proxy("async.global")
    # A cursor (GEMM, expert, rows before it) that only moves forward inside a GEMM: the
    # tasks' experts grow with the task number, so tokens_per_expert is read once per expert.
    cursor_gemm = Int32(-1)
    cursor = Int32(0)
    row_base = Int32(0)
    while task < total:
        gemm, expert, m_tile, n_pair, _ = locate_weight_task(tasks, task)
        if gemm != cursor_gemm:
            cursor_gemm = gemm
            cursor = Int32(0)
            row_base = Int32(0)
        while cursor < expert:
            row_base = row_base + tasks.tokens_per_expert[cursor]
            cursor = cursor + 1
        k_base = row_base // TILE_K
        k_tiles = tasks.tokens_per_expert[expert] // TILE_K
        for g in cutlass.range_constexpr(NUM_GEMMS):
            if gemm == g:
                tma_a, tAgA, tAsA, tma_b, tBgB, tBsB0, tBsB1 = loads[g]
                stage_loads = (
                    (tma_a, tAgA, m_tile, k_base, tAsA),
                    (tma_b, tBgB, 2 * n_pair, k_base, tBsB0),
                    (tma_b, tBgB, 2 * n_pair + 1, k_base, tBsB1),
                )
                state = engine.load_k_tiles(ring, state, k_tiles, stage_loads)
        task = task + grid_size
    return state


@cute.jit
def consume_weight_tasks(states, tasks: WeightTasks, task: Int32, grid_size: Int32, tiled_mma,
                         ring, operands, accs, crew, thr_mma, buffers):  # fmt: skip
    """Consumer warpgroups: each weight task's K loop over the expert's tokens (none for an
    expert without tokens: the tile stays zero), the tile to the crew. Returns the states."""
    read_state, release_state = states
    total = num_weight_tasks(tasks)
    while task < total:
        _, expert, _, _, _ = locate_weight_task(tasks, task)
        read_state, release_state = engine.mma_k_tiles(
            tiled_mma, ring, read_state, release_state,
            tasks.tokens_per_expert[expert] // TILE_K, operands, accs, may_be_empty=True,
        )  # fmt: skip
        crew.hand_off(thr_mma, accs, buffers)
        task = task + grid_size
    return read_state, release_state


@cute.jit
def store_weight_tasks(crew, tasks: WeightTasks, task: Int32, grid_size: Int32, buffers, tidx,
                       outputs: tuple):  # fmt: skip
    """The crew: store each weight task's bf16 tile into out[gemm] ([E * M, N] rows, the
    tile's rows from expert * M, or expert * gate_up_rows for dW_gate, dW_up). `outputs`: the
    three bf16 output pointers, GEMM order."""
    lane = tidx - 32 * crew.first_warp
    total = num_weight_tasks(tasks)
    while task < total:
        gemm, expert, m_tile, n_pair, m_size = locate_weight_task(tasks, task)
        for g in cutlass.range_constexpr(NUM_GEMMS):
            if gemm == g:
                n_size = tasks.hidden_size
                expert_rows = tasks.gate_up_rows
                if cutlass.const_expr(g == 0):
                    n_size = tasks.intermediate_size
                    expert_rows = m_size
                first_row = expert * expert_rows + m_tile * TILE_M
                crew.store_handoff(
                    buffers, lane, first_row, n_pair * (2 * TILE_N), None, handoff.store_pair,
                    (outputs[g], cute.assume(Int64(n_size), divby=2 * TILE_N)),
                )  # fmt: skip
        task = task + grid_size


def weight_loads(sA_w, sB0, sB1, weight_tma):
    """`loads` of produce_weights per GEMM, from `weight_tma` = (tma_xdy, mXdy, tma_xdg, mXdg,
    tma_xdu, mXdu, tma_xh, mXh, tma_xx, mXx)."""
    tma_xdy, mXdy, tma_xdg, mXdg, tma_xdu, mXdu, tma_xh, mXh, tma_xx, mXx = weight_tma
    tile_a = (TILE_M, TILE_K)
    xdy_s, xdy_g = engine.partition_tma_load(tma_xdy, sA_w, mXdy, tile_a)
    xdg_s, xdg_g = engine.partition_tma_load(tma_xdg, sA_w, mXdg, tile_a)
    xdu_s, xdu_g = engine.partition_tma_load(tma_xdu, sA_w, mXdu, tile_a)
    xh_s0, xh_s1, xh_g = engine.partition_tma_load_pair(tma_xh, sB0, sB1, mXh)
    xx_s0, xx_s1, xx_g = engine.partition_tma_load_pair(tma_xx, sB0, sB1, mXx)
    return (
        (tma_xdy, xdy_g, xdy_s, tma_xh, xh_g, xh_s0, xh_s1),
        (tma_xdg, xdg_g, xdg_s, tma_xx, xx_g, xx_s0, xx_s1),
        (tma_xdu, xdu_g, xdu_s, tma_xx, xx_g, xx_s0, xx_s1),
    )
