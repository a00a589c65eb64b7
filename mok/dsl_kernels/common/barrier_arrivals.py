"""The EP barrier's arrival protocol, shared by the comm kernels that arrive on
`barrier_buffer` (ep_barrier, all_gather_top_experts): per-source arrival counters in peers'
symmetric memory, and the arrival epoch in this rank's `barrier_epoch_buffer` (the protocol is
described in mok/dsl_kernels/kernels/ep_barrier.py).
"""

import cutlass.cute as cute
from cutlass import Int32, Int64

from .bounded_wait import (
    NO_TASK,
    OWN_MEMORY,
    atom_add_acq_rel_gpu_s32,
    bounded_wait_reached,
    ld_acquire_sys_s32,
    ld_global_b64,
    red_add_release_sys_s32,
    st_relaxed_sys_b32,
)
from .params import aligned_pointer

# Words of `barrier_epoch_buffer` (int32 [2], this rank's own memory; kernels/ep_barrier.py).
EPOCH_WORD = 0  # arrivals every barrier slot has received before the running comm call
READERS_WORD = 1  # CTAs of the running comm launch that are done with the epoch
ARRIVALS_PER_BARRIER = 1  # per slot and call
# The field annotation of `barrier_epoch_buffer`'s address (8-byte aligned).
EpochPointer = aligned_pointer(Int32, 8)


@cute.jit
def peer_address(peer_table: Int64, peer: Int32) -> Int64:
    """Entry `peer` of a device table of int64 base addresses (one per rank)."""
    return ld_global_b64(peer_table + Int64(peer) * 8)


@cute.jit
def read_arrival_epoch(epoch_buffer: Int64) -> Int32:
    """The arrivals every barrier slot has received before this launch (module doc).

    Acquire, so that this read stays before the `retire_arrival_epoch` that follows it. Not the
    non-coherent path: the previous launch wrote the word.
    """
    return ld_acquire_sys_s32(epoch_buffer + 4 * EPOCH_WORD)


@cute.jit
def retire_arrival_epoch(
    epoch_buffer: Int64, epoch: Int32, arrivals_per_slot: Int32, num_ctas: Int32
):
    """One thread per CTA, once every thread of its CTA is done reading the epoch: count the
    CTA; the last of the launch's `num_ctas` CTAs advances the epoch to `epoch +
    arrivals_per_slot` (wrapping) and resets the count for the next launch.

    acq_rel: the earlier CTAs' reads happen before the last CTA's store, which therefore
    no CTA of this launch can read; the next launch (stream order) sees both stores.
    """
    readers_before = atom_add_acq_rel_gpu_s32(epoch_buffer + 4 * READERS_WORD, Int32(1))
    if readers_before == num_ctas - 1:
        st_relaxed_sys_b32(epoch_buffer + 4 * READERS_WORD, Int32(0))
        st_relaxed_sys_b32(epoch_buffer + 4 * EPOCH_WORD, epoch + arrivals_per_slot)


@cute.jit
def arrive_at_peer(peer_barrier_table: Int64, peer: Int32, rank: Int32):
    """Add 1 (release, system scope) to slot `rank` of rank `peer`'s barrier counters."""
    red_add_release_sys_s32(peer_address(peer_barrier_table, peer) + Int64(rank) * 4, Int32(1))


@cute.jit
def wait_for_source(
    own_barrier: Int64,
    source: Int32,
    target: Int32,
    timeout_ns: Int64,
    record_address: Int64,
    rank: Int32,
    phase: Int32,
):
    """Bounded wait until this rank's slot `source` has reached `target`.

    On timeout the record names `phase`, counter_index = `source` (the rank that did not
    arrive), peer_rank -1 (the slot is in this rank's own memory).
    """
    bounded_wait_reached(
        own_barrier + Int64(source) * 4,
        target,
        timeout_ns,
        record_address,
        rank,
        phase,
        source,
        Int32(OWN_MEMORY),
        Int32(NO_TASK),
    )
