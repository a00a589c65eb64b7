"""Dynamic tickets: each CTA takes its next task from one global int32 counter (`atom.add`).
Tasks wait only on smaller tickets, already taken by running CTAs: no deadlock. The producer
publishes each in slot `seq % TASK_SLOTS` before its first full-barrier arrive (release); 8 slots
never overrun (producer <= 2 tasks ahead of the consumers, they <= 2 ahead of the crew).
The megakernels' dispatch takes row tiles by a ticket of its own (dispatch_phase.py), through
slot 0 before the roles split; the CTA meets after it, before the producer's first ticket.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import atom_add_relaxed_gpu_s32

TASK_SLOTS = 8
# The task numbers, then as many words of what the producer found about each task's rows
# (`task_flags`).
SLOT_BYTES = 2 * 4 * TASK_SLOTS
NO_TASK = -1
# A task flag: rows 64..127 of its 128-row tile are all padding (the second consumer
# warpgroup's half; gemm_engine.mma_k_tiles `skip`).
PADDED_HALF = 1


def task_slots(storage, offset_bytes: int) -> cute.Tensor:
    """TASK_SLOTS int32 slots at `offset_bytes` of `storage.staging`: the engine's shared
    memory, past what its crew hand-off uses (sm90: epilogue_warps.BUFFER_BYTES)."""
    return cute.make_tensor(
        cute.recast_ptr(storage.staging.data_ptr() + offset_bytes, dtype=Int32),
        cute.make_layout(TASK_SLOTS),
    )


def task_flags(storage, offset_bytes: int) -> cute.Tensor:
    """TASK_SLOTS int32 flags after `task_slots`' words: flag seq % TASK_SLOTS belongs to the
    task in that slot, written by the producer (every lane) before the task's first stage, so
    the consumers read it after that stage's full barrier, as they read the task."""
    return cute.make_tensor(
        cute.recast_ptr(storage.staging.data_ptr() + offset_bytes + 4 * TASK_SLOTS, dtype=Int32),
        cute.make_layout(TASK_SLOTS),
    )


class Tickets(NamedTuple):
    """Ticket counter (address of a zeroed int32), task slots (shared), number of tasks."""

    counter: Int64
    slots: cute.Tensor
    total: Int32


@cute.jit
def take_ticket(tickets: Tickets, seq: Int32) -> Int32:
    """Producer warp: the CTA's seq-th task or NO_TASK. Every lane writes the slot, so the lane
    that arrives on the full barrier has written it itself."""
    task = Int32(0)
    if cute.arch.lane_idx() == 0:
        task = atom_add_relaxed_gpu_s32(tickets.counter, Int32(1))
    task = cute.arch.shuffle_sync(task, 0)
    task = cutlass.select_(task < tickets.total, task, Int32(NO_TASK))
    tickets.slots[seq % TASK_SLOTS] = task
    return task


@cute.jit
def signal_no_task(ring, state):
    """Producer, on NO_TASK: arrive on the next free stage's full barrier with no load (the
    consumers wake and read NO_TASK). Never released: `producer_tail` finds every stage free."""
    ring.sync_object_empty.wait(state.index, state.phase)
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive(ring.producer_get_barrier(state))


@cute.jit
def consumer_task(ring, read_state, tickets: Tickets, seq: Int32) -> Int32:
    """Consumers: the seq-th task (or NO_TASK), published with the task's first stage."""
    ring.consumer_wait(read_state)
    return tickets.slots[seq % TASK_SLOTS]


@cute.jit
def crew_task(crew, tickets: Tickets, seq: Int32) -> Int32:
    """Crew: wait for the next hand-off (or `hand_off_nothing`) and return its task."""
    crew.wait_for_handoff()
    return tickets.slots[seq % TASK_SLOTS]
