"""The megakernels' dynamic ticket: each CTA takes its next task from one global int32 counter
(`atom.add`), so a CTA that runs slow takes fewer tasks instead of finishing last.

Measured with the phase clock (docs/NOTES.md, session 7): under the static ticket (CTA c ran
tasks c, c + grid, ...) the same few CTAs ended 0.2 ms (Qwen3-30B-A3B) to 0.35 ms (Mixtral)
after the median one, run after run, although every CTA had the same number of tasks within
one: the kernel waited for them.

Tickets are taken in increasing order, and a task waits only for the dispatch or for tasks of
smaller numbers (gate/up < down; d_hidden < d_x), each already taken by a running CTA that will
finish it: the waits cannot deadlock. Which CTA runs a task changes from run to run, never
what the task computes (one CTA per output tile, K in a fixed order): the results stay bitwise
deterministic.

The task list is cut into minibatches (Minibatches, `MoKConfig.minibatch_size`) and walked in
steps: step s is phase 1 of minibatch s, then phase 2 of minibatch s - 1. Every role walks the
same steps (produce_steps, consume_phase per part, store_steps); a phase-2 task still waits
only for phase-1 tasks of smaller numbers.

Inside a CTA the producer warp takes the tickets and tells the other roles through TASK_SLOTS
int32 slots in shared memory, slot `seq % TASK_SLOTS` for the CTA's seq-th task:
- the producer writes the task (-1: no task left) into its slot before the first load of the
  task, i.e. before the arrive on that ring stage's full barrier (release);
- the consumers wait on that full barrier (acquire), then read the slot; at -1 the producer
  arrived on the barrier without loading anything, and the consumers stop;
- the crew reads the slot after the consumers' hand-off of that task (named barriers order
  it after their read); at -1 the consumers handed off nothing (EpilogueCrew.hand_off_nothing),
  and the crew stops.
The producer is at most two tasks ahead of the consumers (3 ring stages, at least 2 K tiles a
task), which are at most two ahead of the crew (two hand-off blocks): 8 slots never overrun.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import (
    OWN_MEMORY,
    atom_add_relaxed_gpu_s32,
    bounded_wait_reached,
    ld_acquire_gpu_s32,
)
from .epilogue_warps import BUFFER_BYTES
from .expert_tiles import TileList, locate_first_tile, locate_tile, window_cursor
from .gemm_phases import TILE_M, TILE_N

TASK_SLOTS = 8
SLOT_BYTES = 4 * TASK_SLOTS
NO_TASK = -1


class RowTileWait(NamedTuple):
    """What a phase's tasks wait for: the int32 counters from byte address `counters`, one per
    row tile, each reaching `needed`; on a timeout the error record gets `phase` and the task
    (its number in the whole list)."""

    counters: Int64
    needed: Int32
    phase: int
    record: Int64
    timeout_ns: Int64


def task_slots(storage) -> cute.Tensor:
    """The CTA's TASK_SLOTS int32 slots: SLOT_BYTES after the crew's hand-off blocks in
    `storage.staging` (allocated with epilogue_warps.BUFFER_BYTES + SLOT_BYTES)."""
    return cute.make_tensor(
        cute.recast_ptr(storage.staging.data_ptr() + BUFFER_BYTES, dtype=Int32),
        cute.make_layout(TASK_SLOTS),
    )


class Tickets(NamedTuple):
    """The ticket counter (byte address of a zeroed int32), the CTA's task slots (shared Int32
    [TASK_SLOTS]) and the number of tasks."""

    counter: Int64
    slots: cute.Tensor
    total: Int32


@cute.jit
def take_ticket(tickets: Tickets, seq: Int32) -> Int32:
    """Producer warp (all lanes): the CTA's seq-th task, or NO_TASK past the end; written into
    its slot by every lane (the same value), so the lane that then arrives on the full barrier
    has written it itself."""
    task = Int32(0)
    if cute.arch.lane_idx() == 0:
        task = atom_add_relaxed_gpu_s32(tickets.counter, Int32(1))
    task = cute.arch.shuffle_sync(task, 0)
    task = cutlass.select_(task < tickets.total, task, Int32(NO_TASK))
    tickets.slots[seq % TASK_SLOTS] = task
    return task


@cute.jit
def signal_no_task(ring, state):
    """Producer warp, after take_ticket returned NO_TASK: wait for the next stage to be free
    and arrive on its full barrier without loading anything (the consumers wake and read
    NO_TASK). The stage is never released: `producer_tail` still finds every stage free."""
    ring.sync_object_empty.wait(state.index, state.phase)
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive(ring.producer_get_barrier(state))


@cute.jit
def consumer_task(ring, read_state, tickets: Tickets, seq: Int32) -> Int32:
    """Consumer warpgroups: the CTA's seq-th task (or NO_TASK), once the producer published it
    with the first stage of the task (which `mma_k_tiles` then waits for again, at once)."""
    ring.consumer_wait(read_state)
    return tickets.slots[seq % TASK_SLOTS]


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
def crew_task(crew, tickets: Tickets, seq: Int32) -> Int32:
    """The crew: wait for the consumers' next hand-off (or their `hand_off_nothing`) and
    return its task."""
    crew.wait_for_handoff()
    return tickets.slots[seq % TASK_SLOTS]


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


class Minibatches(NamedTuple):
    """The task list of a two-phase megakernel, cut by minibatch (`MoKConfig.minibatch_size`,
    DESIGN §4) and pipelined: minibatch b is routed row tiles b * row_tiles .. (the last one
    may be shorter); its phase-1 tiles (`cols_1` a row tile) come right after minibatch
    b - 1's, and its phase-2 tiles (`cols_2` a row tile) after minibatch b + 1's phase-1
    tiles. The list is made of steps, step s holding phase 1 of minibatch s then phase 2 of
    minibatch s - 1:

        P1(0) | P1(1) P2(0) | P1(2) P2(1) | ... | P2(last)

    A phase-2 tile waits only for phase-1 tiles of its own minibatch, a step earlier (a
    whole phase-1 minibatch of tasks in between, so they are done by the time it is taken),
    and phase 2 starts before later rows are dispatched. One minibatch is the plain order,
    every phase-1 tile then every phase-2 tile (measured: the first version, phase 2 right
    after phase 1 of the same minibatch, waited a wave per minibatch, 21% slower at
    Qwen3-30B-A3B's shape with 4096-row minibatches; docs/NOTES.md, session 8)."""

    row_tiles: Int32
    total_row_tiles: Int32
    cols_1: Int32
    cols_2: Int32


@cute.jit
def _rows_before(batches: Minibatches, index: Int32) -> Int32:
    """Row tiles in minibatches 0 .. index - 1 (index may be -1 or past the last)."""
    return cutlass.max(cutlass.min(index * batches.row_tiles, batches.total_row_tiles), 0)


@cute.jit
def _step_base(batches: Minibatches, step: Int32) -> Int32:
    """The first task of step `step`: phase 1 of every earlier minibatch, phase 2 of every
    minibatch before step - 1."""
    return (batches.cols_1 * _rows_before(batches, step)
            + batches.cols_2 * _rows_before(batches, step - 1))  # fmt: skip


@cute.jit
def step_of(batches: Minibatches, task: Int32):
    """The step of task `task` (>= 0): ((base, end, first_row, end_row) of its phase-1 part,
    the same of its phase-2 part): task numbers base .. end - 1, rows first_row .. end_row - 1
    (TILE_M rows a row tile)."""
    per_step = batches.row_tiles * (batches.cols_1 + batches.cols_2)
    last = (batches.total_row_tiles + batches.row_tiles - 1) // batches.row_tiles
    # Exact while every earlier minibatch is whole; the short last one only moves the bases
    # of the last two steps down, so the guess is at most that far behind.
    step = cutlass.min((task + batches.row_tiles * batches.cols_2) // per_step, last)
    while (step < last) & (task >= _step_base(batches, step + 1)):
        step = step + 1
    base = _step_base(batches, step)
    rows_1, rows_2 = _rows_before(batches, step), _rows_before(batches, step - 1)
    middle = base + batches.cols_1 * (_rows_before(batches, step + 1) - rows_1)
    end = middle + batches.cols_2 * (rows_1 - rows_2)
    return ((base, middle, rows_1 * TILE_M, _rows_before(batches, step + 1) * TILE_M),
            (middle, end, rows_2 * TILE_M, rows_1 * TILE_M))  # fmt: skip


@cute.jit
def step_windows(batches: Minibatches, tiles: TileList, segments: tuple, task: Int32):
    """step_of plus each part's tile-list window (expert_tiles.window_cursor; `segments`, one
    per phase, carried from the previous call): (segments, (base, end, first, end_row) of
    phase 1, the same of phase 2)."""
    parts = step_of(batches, task)
    new_segments = []
    windows = []
    for phase in cutlass.range_constexpr(2):
        base, end, first_row, end_row = parts[phase]
        segment, first = window_cursor(tiles, segments[phase], first_row, end_row)
        new_segments.append(segment)
        windows.append((base, end, first, end_row))
    return tuple(new_segments), windows[0], windows[1]
