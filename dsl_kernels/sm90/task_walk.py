"""The megakernels' task walk: a CTA's tasks of one phase (one grouped GEMM's tile list), for
the TMA producer and for the consumer warpgroups.

A megakernel runs phases in dependency order (forward: gate/up, then down; backward: d_hidden,
then d_x). Task numbers run on across phases: CTA c takes its tasks of the whole list in the
order of a TaskWalk (expert_tiles.py: with communication CTAs, the compute CTAs alone take the
first `lead` tasks), so it enters a phase at the first task past the previous phase's end,
minus that phase's size. Inside a phase, tiles are numbered as in expert_tiles.py (expert by
expert, m fastest).

Before loading a task's operands the producer waits, bounded, until the counter of the task's
row tile reaches `needed` (written by an earlier phase of some CTA, released with
`red.release.gpu`), then fences the async proxy: its TMA loads read what the other CTAs'
generic-proxy stores wrote.
"""

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import OWN_MEMORY, bounded_wait_reached, ld_acquire_gpu_s32
from .expert_tiles import TaskWalk, TileList, locate_first_tile, locate_tile, next_task
from .gemm_phases import TILE_M


class RowTileWait(NamedTuple):
    """What a phase's tasks wait for: the int32 counters from byte address `counters`, one per
    row tile, each reaching `needed`; on a timeout the error record gets `phase` and the task
    number (its index in the phase plus `task_offset`: its number in the whole list)."""

    counters: Int64
    needed: Int32
    phase: int
    task_offset: Int32
    record: Int64
    timeout_ns: Int64


def phase_walk(walk: TaskWalk, base) -> TaskWalk:
    """`walk` for the phase whose first task is number `base` of the whole list."""
    return walk._replace(base=base)


@cute.jit
def produce_tasks(state, tiles: TileList, task: Int32, walk: TaskWalk, wait: RowTileWait,
                  load_task, load_args):  # fmt: skip
    """Producer warp: for each of this CTA's tasks of `tiles` from `task` (in `walk`'s order,
    numbered inside the phase), the bounded wait for its row tile, then
    `state = load_task(state, expert, col_tile, row_tile, *load_args)`. Returns (state, the
    CTA's first task past this phase)."""
    expert, tile_base, row_base, row_tiles = locate_first_tile(tiles, task)
    while expert < tiles.num_experts:
        local = task - tile_base
        row_tile = row_base // TILE_M + local % row_tiles
        bounded_wait_reached(
            wait.counters + Int64(4) * Int64(row_tile), wait.needed, wait.timeout_ns,
            wait.record, Int32(0), Int32(wait.phase), row_tile, Int32(OWN_MEMORY),
            task + wait.task_offset, ld_acquire_gpu_s32,
        )  # fmt: skip
        cute.arch.fence_proxy("async.global")
        state = load_task(state, expert, local // row_tiles, row_tile, *load_args)
        task = next_task(task, walk)
        expert, tile_base, row_base, row_tiles = locate_tile(
            tiles, task, (expert, tile_base, row_base, row_tiles)
        )
    return state, task


@cute.jit
def consume_tasks(states, tiles: TileList, task: Int32, walk: TaskWalk, run_task, run_args):
    """Consumer warpgroups: `states = run_task(states, first_row, col_tile, *run_args)` for
    each of this CTA's tasks of `tiles` from `task`, in the producer's order. Returns (states,
    the CTA's first task past this phase)."""
    expert, tile_base, row_base, row_tiles = locate_first_tile(tiles, task)
    while expert < tiles.num_experts:
        local = task - tile_base
        states = run_task(states, row_base + (local % row_tiles) * TILE_M, local // row_tiles,
                          *run_args)  # fmt: skip
        task = next_task(task, walk)
        expert, tile_base, row_base, row_tiles = locate_tile(
            tiles, task, (expert, tile_base, row_base, row_tiles)
        )
    return states, task
