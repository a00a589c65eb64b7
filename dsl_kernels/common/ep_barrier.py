"""A device barrier across the EP group, over per-source arrival counters in symmetric memory.

Counters: every rank's workspace `barrier_buffer` is int32 [P], one slot per *source* rank:
slot s of rank r counts the arrivals rank s has made at rank r, ever (monotone, never reset;
see common/bounded_wait.py for why). To arrive, rank r adds 1 with `red.release.sys` to slot r
of every peer's buffer (itself included), through the peer base addresses of `barrier_buffer`
(a device table of P int64, `peer_barrier_ptrs`). To wait, rank r polls its own P slots with
the bounded acquire wait until each has reached `target`. The host keeps, per workspace, the
running total of arrivals each slot has received (the same on every rank, because every rank
makes the same sequence of collective calls) and passes `target = total before this call +
arrivals of this call` (1 for a plain barrier).

Why one slot per source rather than one shared counter: the slot that falls short names the
rank that did not arrive (the error record's counter_index is the late rank), and no two ranks
ever add to the same word, so arrivals do not contend.

Why the monotone target is safe without a reset: slot s of rank r exceeds the total of earlier
calls only once rank s has entered this call, and rank s cannot arrive for the next call before
it has finished waiting in this one, which needs rank r's arrival for this call. So ranks are
at most one barrier apart and no arrival is ever counted for the wrong call.

Ordering: the release add orders everything the arriving rank did before (its earlier kernels
on the stream included) before the peer's acquire that sees it, so after the barrier each rank
may read what every peer wrote before it, and may overwrite what every peer read before it.

P = 1 degenerates to one release add to the own slot and one wait that succeeds at once.
NVLink multicast is never used: arrivals are unicast atomics to each peer.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .args import global_pointer
from .bounded_wait import (
    NO_TASK,
    OWN_MEMORY,
    bounded_wait_reached,
    ld_global_b64,
    red_add_release_sys_s32,
)

THREADS = 128  # thread t arrives at peers t, t+128, ... and waits on slots t, t+128, ...


@cute.jit
def peer_address(peer_table: Int64, peer: Int32) -> Int64:
    """Entry `peer` of a device table of int64 base addresses (one per rank)."""
    return ld_global_b64(peer_table + Int64(peer) * 8)


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


@dataclass(frozen=True)
class EpBarrier:
    """Every rank of the EP group arrives, then waits until every rank has arrived.

    Kernel parameters (in this order): `peer_barrier_ptrs` (int64 [world_size]: the address
    of `barrier_buffer` of each rank, as this rank maps it; entry `rank` is its own), `rank`,
    `world_size` (int32), `target` (int32: the value every own slot must reach, i.e. the
    host's running arrival total per slot after this call; wrap-safe), `error_record_ptr`
    (runtime/error_record.py), `phase` (int32 WaitPhase id for the record), `timeout_ns`
    (int64, per wait).

    Each rank adds 1 to slot `rank` of every peer (red.release.sys), then waits (bounded,
    ld.acquire.sys) until each of its own slots has reached `target`. On timeout the error
    record names this rank, `phase`, the late source rank (counter_index), what its slot read
    and `target`; the kernel traps.

    Constraints: 1 <= world_size; 0 <= rank < world_size; the table and every barrier_buffer
    8- and 4-byte aligned; launch grid (1, 1, 1), block (128, 1, 1), no dynamic smem,
    cluster (1, 1, 1).
    """

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(Int64, 8),
            Int32(0),
            Int32(0),
            Int32(0),
            global_pointer(Int32, 64),
            Int32(0),
            Int64(0),
        )

    @cute.jit
    def __call__(
        self,
        peer_barrier_ptrs: cute.Pointer,
        rank: Int32,
        world_size: Int32,
        target: Int32,
        error_record_ptr: cute.Pointer,
        phase: Int32,
        timeout_ns: Int64,
    ):
        self.kernel(
            peer_barrier_ptrs, rank, world_size, target, error_record_ptr, phase, timeout_ns
        ).launch(grid=[1, 1, 1], block=[THREADS, 1, 1])

    @cute.kernel
    def kernel(
        self,
        peer_barrier_ptrs: cute.Pointer,
        rank: Int32,
        world_size: Int32,
        target: Int32,
        error_record_ptr: cute.Pointer,
        phase: Int32,
        timeout_ns: Int64,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        peer_table = peer_barrier_ptrs.toint()
        record = error_record_ptr.toint()

        # ---- arrive: +1 on slot `rank` of every peer (release: our earlier work is visible) ----
        for peer in cutlass.range(tidx, world_size, THREADS, unroll=1):
            arrive_at_peer(peer_table, peer, rank)

        # ---- wait: each own slot has reached the target (acquire: theirs is visible to us) ----
        own_barrier = peer_address(peer_table, rank)
        for source in cutlass.range(tidx, world_size, THREADS, unroll=1):
            wait_for_source(own_barrier, source, target, timeout_ns, record, rank, phase)
        # The waiters' acquires extend to the whole CTA (and, at kernel end, to later kernels).
        cute.arch.barrier()
