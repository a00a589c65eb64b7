"""The dynamic ticket: each CTA takes its next task from one global int32 counter (`atom.add`),
so a slow CTA takes fewer tasks instead of finishing last.

Tickets are taken in increasing order and a task waits only for tasks of smaller numbers, each
already taken by a running CTA: the waits cannot deadlock. Which CTA runs a task never changes
what it computes, so results stay bitwise deterministic.

Inside a CTA the producer warp takes the tickets and publishes each in shared-memory slot
`seq % TASK_SLOTS` before the arrive on the task's first full barrier (release); the
consumers read it after waiting on that barrier (acquire), the crew after the consumers'
hand-off (named barriers). NO_TASK (-1) ends each role's walk. The producer runs at most two
tasks ahead of the consumers (3 ring stages, >= 2 K tiles a task), which run at most two
ahead of the crew (two hand-off blocks): 8 slots never overrun.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import atom_add_relaxed_gpu_s32
from .epilogue_warps import BUFFER_BYTES

TASK_SLOTS = 8
SLOT_BYTES = 4 * TASK_SLOTS
NO_TASK = -1


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
def crew_task(crew, tickets: Tickets, seq: Int32) -> Int32:
    """The crew: wait for the consumers' next hand-off (or their `hand_off_nothing`) and
    return its task."""
    crew.wait_for_handoff()
    return tickets.slots[seq % TASK_SLOTS]
