"""The two-phase megakernels' tasks in pipelined minibatches (`MoKConfig.minibatch_size`): step s
runs phase 1 of minibatch s, then phase 2 of minibatch s - 1, whose rows finished a step earlier.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .expert_tiles import TileList, window_cursor
from .tiles import TILE_M


class Minibatches(NamedTuple):
    """Minibatch b is row tiles b * row_tiles .. (the last may be shorter); `cols_1` / `cols_2`
    tiles per row tile in phase 1 / 2. Steps: P1(0) | P1(1) P2(0) | ... | P2(last)."""

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
    """First task of `step`: phase 1 of earlier minibatches, phase 2 of those before step - 1."""
    return (batches.cols_1 * _rows_before(batches, step)
            + batches.cols_2 * _rows_before(batches, step - 1))  # fmt: skip


@cute.jit
def step_of(batches: Minibatches, task: Int32):
    """((base, end, first_row, end_row) of phase 1, the same of phase 2) of the step holding
    `task` (>= 0): tasks base .. end - 1, rows first_row .. end_row - 1."""
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
    """step_of plus each part's window (expert_tiles.window_cursor; `segments` carried from the
    previous call): (segments, (base, end, first, end_row) of phase 1, the same of phase 2)."""
    parts = step_of(batches, task)
    new_segments = []
    windows = []
    for phase in cutlass.range_constexpr(2):
        base, end, first_row, end_row = parts[phase]
        segment, first = window_cursor(tiles, segments[phase], first_row, end_row)
        new_segments.append(segment)
        windows.append((base, end, first, end_row))
    return tuple(new_segments), windows[0], windows[1]
