"""The backward megakernel's weight-gradient phase: expert_gemm_bwd_weights.py's three GEMMs
(bf16 output) as the launch's last tasks.

    GEMM 0  dW_down[e] = dY_e^T hidden       M = H, N = I   (A = dY_e, B = hidden)
    GEMM 1  dW_gate[e] = d_gate^T x_routed   M = I, N = H   (A = d_gate, B = x_routed)
    GEMM 2  dW_up[e]   = d_up^T x_routed     M = I, N = H   (A = d_up, B = x_routed)

Tasks: GEMM, expert, then grouped_tile_coords; CTA c takes c, c + grid, ... after its d_x tasks,
each tile's whole token range in order. The first waits (bounded) for every dispatch and d_hidden
tile (counted in tiles, which running CTAs took by ticket: no wait on a CTA that is not
resident), then fences the async proxy; nothing waits on weight tasks: no deadlock.

With a `WeightWindow` (the megakernel's `window` variant: one macrobatch of ring reuse, whose
operands are the macrobatch's rows) each tile runs the macrobatch's part of its expert's
segment of the whole schedule, as expert_gemm_bwd_weights_window.py does: from the fp32
partial where the segment began in an earlier macrobatch, into the other partial where it goes
on past this one (the consumers store it), else rounded to bf16 by the crew; tiles of experts
outside the macrobatch do nothing. The same wgmma chain as one pass: the same bits.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import OWN_MEMORY, bounded_wait_reached, ld_acquire_gpu_s32
from ..common.params import Int32Pointer
from . import epilogue_warps as handoff
from . import gemm_engine as engine
from .expert_gemm_bwd_weights import advance_to_expert, grouped_tile_coords
from .expert_gemm_bwd_weights_window import (
    PartialPointer,
    copy_tile,
    first_expert_from,
    load_partial,
    window_part,
)
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


class WeightWindow(NamedTuple):
    """The backward megakernel's last parameters, read by its `window` variant only: the whole
    schedule's padded segment sizes, the macrobatch's first schedule row and rows, and the fp32
    partial sums in and out ([3, H * I] each, GEMM g's [M, N] tile sums from g * H * I)."""

    schedule_tokens_per_expert_ptr: Int32Pointer
    window_first_row: Int32
    window_rows: Int32
    partial_in_ptr: PartialPointer
    partial_out_ptr: PartialPointer


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


@cute.jit
def advance_cursor(tasks: WeightTasks, gemm: Int32, expert: Int32, cursor_gemm: Int32,
                   cursor_expert: Int32, row_base: Int32, start: tuple):  # fmt: skip
    """The cursor (GEMM, expert, rows before it) moved to (gemm, expert): it only moves
    forward inside a GEMM (the tasks' experts grow with the task number), so each expert's
    segment size is read once; a new GEMM starts it at `start` = (expert, rows before it),
    the walk's first expert (`walk_start`)."""
    if gemm != cursor_gemm:
        cursor_gemm = gemm
        cursor_expert = start[0]
        row_base = start[1]
    cursor_expert, row_base = advance_to_expert(tasks.tokens_per_expert, expert, cursor_expert,
                                                row_base)  # fmt: skip
    return cursor_gemm, cursor_expert, row_base


@cute.jit
def _from_first_expert(tasks: WeightTasks, task: Int32, grid_size: Int32, first_expert: Int32,
                       min_gemm: Int32):  # fmt: skip
    """This CTA's first task (task + j * grid) in GEMM min_gemm or later whose expert is not
    before `first_expert`: each GEMM's tasks of earlier experts are skipped; a step past one
    GEMM's may land in the next GEMM's, so the skip is repeated once a GEMM."""
    per_expert = _tiles_per_expert(tasks)
    per_gemm = cutlass.max(per_expert * tasks.num_experts, 1)
    for _ in cutlass.range_constexpr(NUM_GEMMS):
        gemm = cutlass.max(task // per_gemm, min_gemm)
        first = gemm * per_gemm + first_expert * per_expert
        skip = cutlass.max(first - task + grid_size - 1, 0) // grid_size
        task = task + skip * grid_size
    return task


@cute.jit
def walk_start(tasks: WeightTasks, window, task: Int32, grid_size: Int32):
    """(first task, (first expert, rows before it)) of this CTA's walk from `task`. With a
    window past row 0: the first expert whose segment does not end before the macrobatch, and
    the CTA's first task of it (the macrobatch at row 0 walks every task: it writes the
    experts without rows)."""
    first_expert = Int32(0)
    first_base = Int32(0)
    if cutlass.const_expr(window is not None):
        first_expert, first_base = first_expert_from(
            tasks.tokens_per_expert, tasks.num_experts, window.window_first_row
        )
        task = _from_first_expert(tasks, task, grid_size, first_expert, Int32(0))
    return task, (first_expert, first_base)


@cute.jit
def walk_next(tasks: WeightTasks, window, task: Int32, grid_size: Int32, gemm: Int32,
              row_base: Int32, start: tuple):  # fmt: skip
    """This CTA's task after `task` (GEMM `gemm`, its expert's segment at row_base). With a
    window: past the macrobatch's last expert, on to the next GEMM; in a GEMM, from its first
    expert (`start`) on. Only tasks that write nothing are skipped."""
    nxt = task + grid_size
    if cutlass.const_expr(window is not None):
        end_row = window.window_first_row + window.window_rows
        after = (window.window_first_row > 0) & (row_base >= end_row)
        nxt = _from_first_expert(tasks, nxt, grid_size, start[0],
                                 cutlass.select_(after, gemm + 1, Int32(0)))  # fmt: skip
    return nxt


@cute.jit
def walk_weight_tasks(tasks: WeightTasks, window, task: Int32, grid_size: Int32, visit, carried):
    """This CTA's weight tasks from `task` (`window`: a macrobatch's, or None: every task), the
    walk the producer, the consumers and the crew take (walk_start, advance_cursor,
    walk_next), so each hand-off is met by exactly one store: `carried = visit(carried, task,
    gemm, m_tile, n_pair, part)` for each, part its `task_part`. Returns `carried`."""
    total = num_weight_tasks(tasks)
    task, start = walk_start(tasks, window, task, grid_size)
    cursor_gemm, cursor, row_base = Int32(-1), Int32(0), Int32(0)
    while task < total:
        gemm, expert, m_tile, n_pair, _ = locate_weight_task(tasks, task)
        cursor_gemm, cursor, row_base = advance_cursor(tasks, gemm, expert, cursor_gemm, cursor,
                                                       row_base, start)  # fmt: skip
        part = task_part(tasks, window, expert, row_base)
        carried = visit(carried, task, gemm, m_tile, n_pair, part)
        task = walk_next(tasks, window, task, grid_size, gemm, row_base, start)
    return carried


@cute.jit
def task_part(tasks: WeightTasks, window, expert: Int32, row_base: Int32):
    """(first K tile, K tiles, from partial, into partial, writes) of a task whose expert's
    segment starts at schedule row `row_base`: the whole segment without a window, else its
    part in the macrobatch (`window_part`)."""
    if cutlass.const_expr(window is None):
        return (row_base // TILE_K, tasks.tokens_per_expert[expert] // TILE_K, False, False,
                True)  # fmt: skip
    return window_part(row_base, tasks.tokens_per_expert[expert], window.window_first_row,
                       window.window_rows)  # fmt: skip


@cute.jit
def partial_offset(tasks: WeightTasks, gemm: Int32):
    """Where GEMM `gemm`'s [M, N] partial starts in a [3, H * I] fp32 partial (elements)."""
    return Int64(gemm) * Int64(tasks.hidden_size) * Int64(tasks.intermediate_size)


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
                         wait: PhaseWait, loads: tuple, window=None):  # fmt: skip
    """Producer: TMA loads of this CTA's weight tasks from `task`. `loads`: per GEMM (A atom, A gmem,
    A smem, B atom, B gmem, B smem 0 and 1). `window`: a WeightWindow, or None (every row).
    Returns the producer state."""
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

    def load_task(state, task, gemm, m_tile, n_pair, part, loads=loads):
        k_base, k_tiles, _, _, _ = part
        for g in cutlass.range_constexpr(NUM_GEMMS):
            if gemm == g:
                tma_a, tAgA, tAsA, tma_b, tBgB, tBsB0, tBsB1 = loads[g]
                stage_loads = (
                    (tma_a, tAgA, m_tile, k_base, tAsA),
                    (tma_b, tBgB, 2 * n_pair, k_base, tBsB0),
                    (tma_b, tBgB, 2 * n_pair + 1, k_base, tBsB1),
                )
                state = engine.load_k_tiles(ring, state, k_tiles, stage_loads)
        return state

    return walk_weight_tasks(tasks, window, task, grid_size, load_task, state)


# From this many k tiles (of the expert's tokens) on, a weight task releases each stage as soon
# as its own wgmma batch completes (gemm_engine.mma_k_tiles `eager`), as the GEMM tasks do; below
# it, one batch stays in flight behind the next. Measured (docs/NOTES.md §18 item 13): eager
# everywhere gained 2-4% forward + backward at 4096 and 16384 tokens and on Kimi-K2 at 2048, and
# lost 2-3% on Qwen3-30B-A3B at 2048 tokens, whose weight tasks run 2 or 4 k tiles (segments are
# padded to 128 rows); from 6 k tiles on, that 2048-token loss is gone and the rest kept.
EAGER_MIN_K_TILES = 6


@cute.jit
def weight_k_loop(tiled_mma, ring, read_state, release_state, k_tiles: Int32, operands, accs,
                  from_zero: cutlass.Constexpr, eager_min_k_tiles: cutlass.Constexpr):  # fmt: skip
    """One weight task's K loop (k_tiles may be 0), eager from `eager_min_k_tiles` on;
    `from_zero` False: on from the accumulators' values. Returns (read, release)."""
    return engine.mma_k_tiles(
        tiled_mma, ring, read_state, release_state, k_tiles, operands, accs, may_be_empty=True,
        from_zero=from_zero, eager=engine.eager_from(k_tiles, eager_min_k_tiles),
    )  # fmt: skip


@cute.jit
def consume_weight_tasks(states, tasks: WeightTasks, task: Int32, grid_size: Int32, tiled_mma,
                         ring, operands, accs, crew, thr_mma, buffers, window,
                         eager_min_k_tiles: cutlass.Constexpr):  # fmt: skip
    """Consumer warpgroups: each weight task's K loop over the expert's tokens (none for an
    expert without tokens: the tile stays zero), the tile to the crew (weight_k_loop, eager
    from `eager_min_k_tiles`). `window` (a WeightWindow, or None): from and into the fp32
    partials, tiles outside the macrobatch skipped. Returns the states."""
    read_state, release_state = states
    total = num_weight_tasks(tasks)
    if cutlass.const_expr(window is None):
        while task < total:
            _, expert, _, _, _ = locate_weight_task(tasks, task)
            read_state, release_state = weight_k_loop(
                tiled_mma, ring, read_state, release_state,
                tasks.tokens_per_expert[expert] // TILE_K, operands, accs, True, eager_min_k_tiles,
            )  # fmt: skip
            crew.hand_off(thr_mma, accs, buffers)
            task = task + grid_size
    else:

        def run_task(states, task, gemm, m_tile, n_pair, part, crew=crew):
            read_state, release_state = states
            _, k_tiles, from_partial, into_partial, writes = part
            if writes:
                n_size = tasks.hidden_size
                if gemm == 0:
                    n_size = tasks.intermediate_size
                first_row = m_tile * TILE_M
                first_col = n_pair * (2 * TILE_N)
                offset = partial_offset(tasks, gemm)
                load_partial(thr_mma, accs, window.partial_in_ptr, offset, from_partial,
                             first_row, first_col, n_size)  # fmt: skip
                read_state, release_state = weight_k_loop(
                    tiled_mma, ring, read_state, release_state, k_tiles, operands, accs, False,
                    eager_min_k_tiles,
                )  # fmt: skip
                if into_partial:
                    copy_tile(thr_mma, accs, window.partial_out_ptr, offset, first_row, first_col,
                              n_size, "store")  # fmt: skip
                else:
                    crew.hand_off(thr_mma, accs, buffers)
            return read_state, release_state

        read_state, release_state = walk_weight_tasks(
            tasks, window, task, grid_size, run_task, (read_state, release_state)
        )
    return read_state, release_state


@cute.jit
def store_weight_tasks(crew, tasks: WeightTasks, task: Int32, grid_size: Int32, buffers, tidx,
                       outputs: tuple, window=None):  # fmt: skip
    """The crew: store each weight task's bf16 tile into out[gemm] ([E * M, N] rows, the
    tile's rows from expert * M, or expert * gate_up_rows for dW_gate, dW_up). `outputs`: the
    three bf16 output pointers, GEMM order. `window`: only the tiles the consumers finish in
    this macrobatch (the consumers' walk, so each hand-off is met by exactly one store)."""
    lane = tidx - 32 * crew.first_warp
    total = num_weight_tasks(tasks)
    if cutlass.const_expr(window is None):
        while task < total:
            _store_tile(crew, tasks, task, buffers, lane, outputs)
            task = task + grid_size
    else:

        def store_task(carried, task, gemm, m_tile, n_pair, part, crew=crew):
            _, _, _, into_partial, writes = part
            stores = cutlass.select_(
                writes, cutlass.select_(into_partial, Int32(0), Int32(1)), Int32(0)
            )
            if stores > 0:
                _store_tile(crew, tasks, task, buffers, lane, outputs)
            return carried

        walk_weight_tasks(tasks, window, task, grid_size, store_task, Int32(0))


@cute.jit
def _store_tile(crew, tasks: WeightTasks, task: Int32, buffers, lane, outputs: tuple):
    """The crew: the next hand-off, weight task `task`'s bf16 tile, into out[gemm]."""
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
