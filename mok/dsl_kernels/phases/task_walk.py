"""The megakernels' task walk: each role walks the CTA's ticketed tasks phase by phase, in the
pipelined steps of minibatches.py; the producer waits (bounded) for a task's row tile first.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..common.bounded_wait import OWN_MEMORY, bounded_wait_reached, ld_acquire_gpu_s32
from ..common.params import Int32Pointer
from .expert_tiles import TileList, locate_first_tile, locate_tile
from .minibatches import step_windows
from .tickets import PADDED_HALF, TASK_SLOTS, Tickets, consumer_task, crew_task, take_ticket
from .tiles import TILE_M, TILE_N


class WalkArgs(NamedTuple):
    """Both megakernels' parameters for the schedule, the counters, the sizes and the bounded
    waits (after each one's own tensors)."""

    peer_rank_ptr: Int32Pointer
    peer_token_idx_ptr: Int32Pointer
    num_tokens_ptr: Int32Pointer
    tokens_per_expert_ptr: Int32Pointer
    counters_ptr: Int32Pointer
    error_record_ptr: Int32Pointer
    timeout_ns: Int64
    num_experts: Int32
    hidden_size: Int32
    intermediate_size: Int32
    # Rows from one expert's W_gate (W_up) to the next's in their [rows, H] descriptor views:
    # I for separate [E, I, H] tensors, 2 I for the halves of a fused [E, 2 I, H].
    gate_up_expert_rows: Int32
    topk: Int32
    ep_rank: Int32
    capacity: Int32
    has_limit: Int32
    swiglu_limit: Float32


class StepArgs(NamedTuple):
    """Both megakernels' last parameters: the dispatching CTAs and the minibatch, in 128-row
    tiles (tickets.Minibatches)."""

    num_comm_ctas: Int32
    minibatch_tiles: Int32


class RowTileWait(NamedTuple):
    """Per-row-tile int32 counters at `counters`, each to reach `needed`; a timeout records
    `phase` and the task number."""

    counters: Int64
    needed: Int32
    phase: int
    record: Int64
    timeout_ns: Int64


@cute.jit
def locate_task(tiles: TileList, task: Int32, base: Int32, cursor: tuple, end_row=None):
    """(cursor, expert, row_tile, col_tile) of task `task` of a phase numbered from `base`
    (`end_row`: cut at a minibatch window); the cursor advanced for the next call."""
    cursor = locate_tile(tiles, task - base, cursor, end_row)
    expert, tile_base, row_base, row_tiles = cursor
    local = task - base - tile_base
    return cursor, expert, row_base // TILE_M + local % row_tiles, local // row_tiles


@cute.jit
def produce_phase(state, tiles: TileList, tickets: Tickets, seq: Int32, task: Int32, base: Int32,
                  end: Int32, wait: RowTileWait, load_task, load_args, first=None,
                  end_row=None, halves=None):  # fmt: skip
    """Producer warp: for the CTA's tasks in base .. end - 1, the bounded `wait` for the row
    tile (if any), `state = load_task(state, expert, col_tile, row_tile, *load_args)`, the next
    ticket. `first`, `end_row`: a minibatch window (step_windows). `halves` = (the schedule's
    peer_rank tensor, tickets.task_flags): each task's flag says whether its tile's rows
    64..127 are all padding (their first is: an expert's padding follows its rows). Returns
    (state, seq, task)."""
    cursor = first
    if cutlass.const_expr(first is None):
        cursor = locate_first_tile(tiles, Int32(0))
    while (task >= base) & (task < end):
        cursor, expert, row_tile, col_tile = locate_task(tiles, task, base, cursor, end_row)
        if cutlass.const_expr(halves is not None):
            rank_of, flags = halves
            padded = rank_of[row_tile * TILE_M + TILE_M // 2] < 0
            flags[seq % TASK_SLOTS] = cutlass.select_(padded, Int32(PADDED_HALF), Int32(0))
        if cutlass.const_expr(wait is not None):
            bounded_wait_reached(
                wait.counters + Int64(4) * Int64(row_tile), wait.needed, wait.timeout_ns,
                wait.record, Int32(0), Int32(wait.phase), row_tile, Int32(OWN_MEMORY), task,
                ld_acquire_gpu_s32,
            )  # fmt: skip
            # The loads are TMA (async proxy): order them after the acquire.
            cute.arch.fence_proxy("async.global")
        state = load_task(state, expert, col_tile, row_tile, *load_args)
        seq = seq + 1
        task = take_ticket(tickets, seq)
    return state, seq, task


@cute.jit
def produce_steps(state, batches, tiles: tuple, tickets: Tickets, waits: tuple, loads: tuple,
                  halves=None):  # fmt: skip
    """Producer warp: a two-phase megakernel's tasks step by step, produce_phase over each
    step's phase-1 part (index 0 of tiles, waits, loads), then phase 2 (`halves` for both).
    Ends at NO_TASK."""
    seq = Int32(0)
    task = take_ticket(tickets, seq)
    segments = ((Int32(0), Int32(0)), (Int32(0), Int32(0)))
    while task >= 0:
        segments, (base, middle, first, end_row), (_, end, first_2, end_row_2) = step_windows(
            batches, tiles[0], segments, task
        )
        state, seq, task = produce_phase(state, tiles[0], tickets, seq, task, base, middle,
                                         waits[0], loads[0], (), first, end_row,
                                         halves)  # fmt: skip
        state, seq, task = produce_phase(state, tiles[1], tickets, seq, task, middle, end,
                                         waits[1], loads[1], (), first_2, end_row_2,
                                         halves)  # fmt: skip
    return state, seq, task


@cute.jit
def consume_phase(states, ring, tickets: Tickets, seq: Int32, task: Int32, base: Int32,
                  end: Int32, run_task, run_args, tiles=None, first=None,
                  end_row=None, flags=None):  # fmt: skip
    """Consumers: for tasks in base .. end - 1, `states = run_task(states, *run_args)`, or with
    `tiles` `run_task(states, first_row, col_tile, *run_args)`; with `flags`
    (tickets.task_flags) the task's flag comes first: `run_task(states, flag, ...)`. Returns
    (states, seq, task)."""
    cursor = (Int32(0), Int32(0), Int32(0), Int32(0))
    if cutlass.const_expr(tiles is not None):
        cursor = first
        if cutlass.const_expr(first is None):
            cursor = locate_first_tile(tiles, Int32(0))
    while (task >= base) & (task < end):
        flag = ()
        if cutlass.const_expr(flags is not None):
            flag = (flags[seq % TASK_SLOTS],)
        if cutlass.const_expr(tiles is None):
            states = run_task(states, *flag, *run_args)
        else:
            cursor, _, row_tile, col_tile = locate_task(tiles, task, base, cursor, end_row)
            states = run_task(states, *flag, row_tile * TILE_M, col_tile, *run_args)
        seq = seq + 1
        task = consumer_task(ring, states[0], tickets, seq)
    return states, seq, task


@cute.jit
def past_last_task(ring, states):
    """Consumers, after NO_TASK when more ring work follows (the weight phase): release the
    stage the producer signalled on and step past it."""
    read_state, release_state = states
    ring.consumer_release(release_state)
    read_state.advance()
    release_state.advance()
    return read_state, release_state


@cute.jit
def store_phase(crew, tiles: TileList, tickets: Tickets, seq: Int32, task: Int32, base: Int32,
                end: Int32, buffers, lane, tile_cols: int, slots, store_chunk, store_args,
                after_tile=None, after_args=(), handoffs: int = 1, first=None,
                end_row=None):  # fmt: skip
    """Crew: store each hand-off of this phase's tasks, as EpilogueCrew.run (sm90) does for a
    static walk (`slots`, `handoffs`, `after_tile` alike; `first`, `end_row` as in
    produce_phase). Returns (seq, task)."""
    cursor = first
    if cutlass.const_expr(first is None):
        cursor = locate_first_tile(tiles, Int32(0))
    while (task >= base) & (task < end):
        cursor, _, row_tile, col_tile = locate_task(tiles, task, base, cursor, end_row)
        first_row = row_tile * TILE_M
        targets = None
        if cutlass.const_expr(slots is not None):
            targets = buffers[2]
            crew.look_up_targets(targets, lane, first_row, slots[0], slots[1])
        first_col = col_tile * tile_cols
        crew.copy_out(buffers, lane, first_row, first_col, targets, store_chunk, store_args)
        for h in cutlass.range_constexpr(1, handoffs):
            crew.store_handoff(buffers, lane, first_row, first_col + h * TILE_N, targets,
                               store_chunk, store_args)  # fmt: skip
        if cutlass.const_expr(after_tile is not None):
            after_tile(lane, first_row, *after_args)
        seq = seq + 1
        task = crew_task(crew, tickets, seq)
    return seq, task


@cute.jit
def store_steps(crew, batches, tiles: tuple, tickets: Tickets, buffers, lane, stores: tuple):
    """Crew: a two-phase megakernel's hand-offs step by step, store_phase over each step's
    phase-1 part (tiles[0], keywords stores[0]), then phase 2. Ends at NO_TASK."""
    seq = Int32(0)
    task = crew_task(crew, tickets, seq)
    segments = ((Int32(0), Int32(0)), (Int32(0), Int32(0)))
    while task >= 0:
        segments, (base, middle, first, end_row), (_, end, first_2, end_row_2) = step_windows(
            batches, tiles[0], segments, task
        )
        seq, task = store_phase(crew, tiles[0], tickets, seq, task, base, middle, buffers, lane,
                                first=first, end_row=end_row, **stores[0])  # fmt: skip
        seq, task = store_phase(crew, tiles[1], tickets, seq, task, middle, end, buffers, lane,
                                first=first_2, end_row=end_row_2, **stores[1])  # fmt: skip
    return seq, task


@cute.jit
def count_tiles(tiles: TileList) -> Int32:
    """Tiles of a grouped GEMM's tile list: one pass over tokens_per_expert."""
    rows = Int32(0)
    for expert in cutlass.range(tiles.num_experts, unroll=1):
        rows = rows + tiles.tokens_per_expert[expert]
    return rows // TILE_M * tiles.col_tiles
