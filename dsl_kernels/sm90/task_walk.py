"""The megakernels' task walk: each role (producer, consumers, crew) walks the tasks the CTA
takes by ticket, phase by phase, in the pipelined minibatch steps of minibatches.py; a
producer waits (bounded) for the row tile a task reads before its loads.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import OWN_MEMORY, bounded_wait_reached, ld_acquire_gpu_s32
from .expert_tiles import TileList, locate_first_tile, locate_tile
from .gemm_phases import TILE_M, TILE_N
from .minibatches import step_windows
from .tickets import Tickets, consumer_task, crew_task, take_ticket


class RowTileWait(NamedTuple):
    """What a phase's tasks wait for: the int32 counters from byte address `counters`, one per
    row tile, each reaching `needed`; on a timeout the error record gets `phase` and the task
    (its number in the whole list)."""

    counters: Int64
    needed: Int32
    phase: int
    record: Int64
    timeout_ns: Int64


@cute.jit
def locate_task(tiles: TileList, task: Int32, base: Int32, cursor: tuple, end_row=None):
    """Task `task` of a phase whose tasks are numbered from `base` over `tiles` (cut at
    `end_row` in a minibatch window): (cursor, expert, row_tile, col_tile), the cursor
    advanced for the next call (expert_tiles.locate_tile)."""
    cursor = locate_tile(tiles, task - base, cursor, end_row)
    expert, tile_base, row_base, row_tiles = cursor
    local = task - base - tile_base
    return cursor, expert, row_base // TILE_M + local % row_tiles, local // row_tiles


@cute.jit
def produce_phase(state, tiles: TileList, tickets: Tickets, seq: Int32, task: Int32, base: Int32,
                  end: Int32, wait: RowTileWait, load_task, load_args, first=None,
                  end_row=None):  # fmt: skip
    """Producer warp: while the CTA's task is one of this phase's (numbers base .. end - 1),
    (with a `wait`, not None) the bounded wait for its row tile, then `state =
    load_task(state, expert, col_tile, row_tile, *load_args)`, then the next ticket. `first`
    and `end_row`: the cursor of the phase's tile 0 and the end of its rows, in a minibatch
    (step_windows); the whole tile list without. Returns (state, seq, task): the first task
    past the phase."""
    cursor = first
    if cutlass.const_expr(first is None):
        cursor = locate_first_tile(tiles, Int32(0))
    while (task >= base) & (task < end):
        cursor, expert, row_tile, col_tile = locate_task(tiles, task, base, cursor, end_row)
        if cutlass.const_expr(wait is not None):
            bounded_wait_reached(
                wait.counters + Int64(4) * Int64(row_tile), wait.needed, wait.timeout_ns,
                wait.record, Int32(0), Int32(wait.phase), row_tile, Int32(OWN_MEMORY), task,
                ld_acquire_gpu_s32,
            )  # fmt: skip
            cute.arch.fence_proxy("async.global")
        state = load_task(state, expert, col_tile, row_tile, *load_args)
        seq = seq + 1
        task = take_ticket(tickets, seq)
    return state, seq, task


@cute.jit
def produce_steps(state, batches, tiles: tuple, tickets: Tickets, waits: tuple, loads: tuple):
    """Producer warp: the CTA's tasks of a two-phase megakernel from its first ticket, step by
    step (Minibatches): produce_phase over each step's phase-1 part (tiles[0], waits[0],
    load_task loads[0]), then its phase-2 part (index 1). Returns (state, seq, task): task is
    NO_TASK."""
    seq = Int32(0)
    task = take_ticket(tickets, seq)
    segments = ((Int32(0), Int32(0)), (Int32(0), Int32(0)))
    while task >= 0:
        segments, (base, middle, first, end_row), (_, end, first_2, end_row_2) = step_windows(
            batches, tiles[0], segments, task
        )
        state, seq, task = produce_phase(state, tiles[0], tickets, seq, task, base, middle,
                                         waits[0], loads[0], (), first, end_row)  # fmt: skip
        state, seq, task = produce_phase(state, tiles[1], tickets, seq, task, middle, end,
                                         waits[1], loads[1], (), first_2,
                                         end_row_2)  # fmt: skip
    return state, seq, task


@cute.jit
def consume_phase(states, ring, tickets: Tickets, seq: Int32, task: Int32, base: Int32,
                  end: Int32, run_task, run_args, tiles=None, first=None,
                  end_row=None):  # fmt: skip
    """Consumer warpgroups: while the CTA's task is in base .. end - 1, `states =
    run_task(states, *run_args)`, or with `tiles` (the phase's TileList; `first`, `end_row`
    as in produce_phase) `states = run_task(states, first_row, col_tile, *run_args)`; then
    the next task. Returns (states, seq, task)."""
    cursor = (Int32(0), Int32(0), Int32(0), Int32(0))
    if cutlass.const_expr(tiles is not None):
        cursor = first
        if cutlass.const_expr(first is None):
            cursor = locate_first_tile(tiles, Int32(0))
    while (task >= base) & (task < end):
        if cutlass.const_expr(tiles is None):
            states = run_task(states, *run_args)
        else:
            cursor, _, row_tile, col_tile = locate_task(tiles, task, base, cursor, end_row)
            states = run_task(states, row_tile * TILE_M, col_tile, *run_args)
        seq = seq + 1
        task = consumer_task(ring, states[0], tickets, seq)
    return states, seq, task


@cute.jit
def past_last_task(ring, states):
    """Consumer warpgroups, after reading NO_TASK, when more ring work follows (the backward's
    weight phase): release the stage the producer signalled on and step past it. Returns the
    states."""
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
    """The crew: store each hand-off of this phase's tasks (as EpilogueCrew.run does for a
    static walk; `slots` None or the (peer_rank, peer_token_idx) pointers of rows stored at
    their slots), `after_tile(lane, first_row, *after_args)` after each; `handoffs` per tile,
    the h-th stored from column first_col + h * TILE_N; `first`, `end_row` as in
    produce_phase. Returns (seq, task)."""
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
    """The crew: the CTA's hand-offs of a two-phase megakernel from its first task, step by
    step (Minibatches): store_phase over each step's phase-1 part (tiles[0], store_phase's
    keyword arguments stores[0]: tile_cols, slots, store_chunk, store_args and optionally
    after_tile, after_args, handoffs), then its phase-2 part (index 1). Returns (seq, task):
    task is NO_TASK."""
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
    """The number of tiles of a grouped GEMM's tile list (its experts' row tiles times its
    column tiles): one pass over tokens_per_expert."""
    rows = Int32(0)
    for expert in cutlass.range(tiles.num_experts, unroll=1):
        rows = rows + tiles.tokens_per_expert[expert]
    return rows // TILE_M * tiles.col_tiles
