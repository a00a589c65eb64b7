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
from .tickets import (
    PADDED_HALF,
    ROW_TILE_SHIFT,
    STORE_ROWS,
    TASK_SLOTS,
    Tickets,
    consumer_task,
    crew_task,
    take_ticket,
)
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


class SplitTiles(NamedTuple):
    """A phase's tile list (`tiles`, every column) with each row tile's column-0 task ahead of
    its other columns' (the megakernels' `gather_first_column` diagnostic builds: a column-0
    gate/up or d_hidden task gathers its rows and stores them for the others). In each minibatch window of R row
    tiles and c columns, the column-0 tasks (A: row order) and the others (B: as `tiles`
    numbers them, expert by expert, m fastest, then n from 1) merge as: A 0 .. P - 1 first,
    then one A before every c - 1 B until A runs out, then the rest of B. `lead` (a
    compile-time int): 0 makes P = R (every A first); else P = lead + the largest expert's row
    tiles (at most R), so each B task comes at least `lead` tasks after its row tile's A (the
    first experts' B follow the P prefix tasks; a later A leads its row tile's B by about c
    times that), while the other gathers spread over the phase."""

    tiles: TileList
    lead: int = 0


def tile_list(tiles) -> TileList:
    """The TileList under `tiles` (a TileList or a SplitTiles)."""
    return tiles.tiles if isinstance(tiles, SplitTiles) else tiles


@cute.jit
def split_cursor(split: SplitTiles, first: tuple, end_row: Int32):
    """A SplitTiles walk's cursor at its window's start, from the window's `first` cursor
    (window_cursor): A's and B's tile cursors (both at `first`), P and R (SplitTiles)."""
    expert, tile_base, row_base, row_tiles = first
    window_tiles = (end_row - row_base) // TILE_M
    firsts = window_tiles
    if cutlass.const_expr(split.lead > 0):
        whole = split.tiles
        largest = Int32(0)
        for e in cutlass.range(whole.num_experts, unroll=1):
            largest = cutlass.max(largest, whole.tokens_per_expert[e] // TILE_M)
        firsts = cutlass.min(window_tiles, split.lead + largest)
    return (expert, tile_base, row_base, row_tiles, expert, tile_base, row_base, row_tiles,
            firsts, window_tiles)  # fmt: skip


@cute.jit
def start_cursor(tiles, first, end_row):
    """A walk's cursor at its window's start: `first` (window_cursor), or the tile list's first
    tile when None; a SplitTiles walk's from it (split_cursor, which needs `end_row`)."""
    cursor = first
    if cutlass.const_expr(first is None):
        cursor = locate_first_tile(tile_list(tiles), Int32(0))
    if cutlass.const_expr(isinstance(tiles, SplitTiles)):
        cursor = split_cursor(tiles, cursor, end_row)
    return cursor


@cute.jit
def _locate_split(split: SplitTiles, task: Int32, base: Int32, cursor: tuple, end_row):
    """locate_task over a SplitTiles (cursor: split_cursor's)."""
    a_expert, a_base, a_row, a_tiles, b_expert, b_base, b_row, b_tiles, firsts, window_tiles = (
        cursor
    )
    whole = split.tiles
    cols = whole.col_tiles
    local = task - base
    # Which stream holds merged position `local`, and its index there.
    a_index = local
    b_index = Int32(-1)
    if local >= firsts:
        q = local - firsts
        interleaved = (window_tiles - firsts) * cols
        if q < interleaved:
            a_index = firsts + q // cols
            if q % cols != 0:
                b_index = q - q // cols - 1
        else:
            b_index = (window_tiles - firsts) * (cols - 1) + q - interleaved
    row_tile = Int32(0)
    col_tile = Int32(0)
    expert = Int32(0)
    if b_index < 0:
        column_0 = TileList(whole.tokens_per_expert, whole.num_experts, Int32(1))
        a_expert, a_base, a_row, a_tiles = locate_tile(
            column_0, a_index, (a_expert, a_base, a_row, a_tiles), end_row
        )
        expert = a_expert
        row_tile = a_row // TILE_M + (a_index - a_base)
    else:
        others = TileList(whole.tokens_per_expert, whole.num_experts, cols - 1)
        b_expert, b_base, b_row, b_tiles = locate_tile(
            others, b_index, (b_expert, b_base, b_row, b_tiles), end_row
        )
        expert = b_expert
        rest = b_index - b_base
        row_tile = b_row // TILE_M + rest % b_tiles
        col_tile = 1 + rest // b_tiles
    cursor = (a_expert, a_base, a_row, a_tiles, b_expert, b_base, b_row, b_tiles, firsts,
              window_tiles)  # fmt: skip
    return cursor, expert, row_tile, col_tile


@cute.jit
def locate_task(tiles, task: Int32, base: Int32, cursor: tuple, end_row=None):
    """(cursor, expert, row_tile, col_tile) of task `task` of a phase numbered from `base`
    (`end_row`: cut at a minibatch window); the cursor advanced for the next call. `tiles`: a
    TileList, or a SplitTiles (its cursor from split_cursor)."""
    if cutlass.const_expr(isinstance(tiles, SplitTiles)):
        return _locate_split(tiles, task, base, cursor, end_row)
    cursor = locate_tile(tiles, task - base, cursor, end_row)
    expert, tile_base, row_base, row_tiles = cursor
    local = task - base - tile_base
    return cursor, expert, row_base // TILE_M + local % row_tiles, local // row_tiles


@cute.jit
def _wait_row_tile(wait: RowTileWait, row_tile: Int32, task: Int32):
    """Producer warp: the bounded wait for `row_tile`'s counter, then the async proxy ordered
    after the acquire (the task's loads are TMA)."""
    bounded_wait_reached(
        wait.counters + Int64(4) * Int64(row_tile), wait.needed, wait.timeout_ns,
        wait.record, Int32(0), Int32(wait.phase), row_tile, Int32(OWN_MEMORY), task,
        ld_acquire_gpu_s32,
    )  # fmt: skip
    cute.arch.fence_proxy("async.global")


@cute.jit
def produce_phase(state, tiles: TileList, tickets: Tickets, seq: Int32, task: Int32, base: Int32,
                  end: Int32, wait: RowTileWait, load_task, load_args, first=None,
                  end_row=None, halves=None):  # fmt: skip
    """Producer warp: for the CTA's tasks in base .. end - 1, the bounded `wait` for the row
    tile (if any), `state = load_task(state, expert, col_tile, row_tile, *load_args)`, the next
    ticket. `first`, `end_row`: a minibatch window (step_windows). `halves` = (the schedule's
    peer_rank tensor, tickets.task_flags): each task's flag says whether its tile's rows
    64..127 are all padding (their first is: an expert's padding follows its rows). A
    SplitTiles walk's column-0 tasks wait for nothing: their flags carry STORE_ROWS and their
    row tile (they gather, and their consumers store the rows the others wait for). Returns
    (state, seq, task)."""
    split = isinstance(tiles, SplitTiles)
    cursor = start_cursor(tiles, first, end_row)
    while (task >= base) & (task < end):
        cursor, expert, row_tile, col_tile = locate_task(tiles, task, base, cursor, end_row)
        if cutlass.const_expr(halves is not None):
            rank_of, flags = halves
            padded = rank_of[row_tile * TILE_M + TILE_M // 2] < 0
            flag = cutlass.select_(padded, Int32(PADDED_HALF), Int32(0))
            if cutlass.const_expr(split):
                flag = flag | cutlass.select_(
                    col_tile == 0, Int32(STORE_ROWS) | (row_tile << ROW_TILE_SHIFT), Int32(0)
                )
            flags[seq % TASK_SLOTS] = flag
        if cutlass.const_expr(wait is not None):
            if cutlass.const_expr(split):
                if col_tile != 0:
                    _wait_row_tile(wait, row_tile, task)
            else:
                _wait_row_tile(wait, row_tile, task)
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
            batches, tile_list(tiles[0]), segments, task
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
        cursor = start_cursor(tiles, first, end_row)
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
    produce_phase; `tiles` a TileList or a SplitTiles). Returns (seq, task)."""
    cursor = start_cursor(tiles, first, end_row)
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
            batches, tile_list(tiles[0]), segments, task
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
