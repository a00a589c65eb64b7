"""The two-phase megakernels' task list cut into minibatches (`MoKConfig.minibatch_size`) and
pipelined: step s runs phase 1 (gate/up; d_hidden) of minibatch s, then phase 2 (down; d_x) of
minibatch s - 1, so a phase-2 task's rows were finished a whole minibatch earlier.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .expert_tiles import TileList, window_cursor
from .gemm_phases import TILE_M


class Minibatches(NamedTuple):
    """Minibatch b is routed row tiles b * row_tiles .. (the last may be shorter), with
    `cols_1` phase-1 and `cols_2` phase-2 tiles a row tile. Step s holds phase 1 of
    minibatch s, then phase 2 of minibatch s - 1:

        P1(0) | P1(1) P2(0) | P1(2) P2(1) | ... | P2(last)

    One minibatch is the plain order: every phase-1 tile, then every phase-2 tile."""

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
