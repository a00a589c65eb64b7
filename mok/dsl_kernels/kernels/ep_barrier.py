"""A device barrier across the EP group, over per-source arrival counters in symmetric memory.

Counters: every rank's workspace `barrier_buffer` is int32 [P], one slot per *source* rank:
slot s of rank r counts the arrivals rank s has made at rank r, ever (monotone, never reset;
see common/bounded_wait.py for why). To arrive, rank r adds 1 with `red.release.sys` to slot r
of every peer's buffer (itself included), through the addresses of `barrier_buffer` on every
rank (its row of the EP group's peer table, common/peers.py). To wait, rank r polls its own P
slots with the bounded acquire wait until each has reached `target = base + arrivals of this
call`.

Arrival epoch (what makes the launches CUDA-graph replayable): `base`, the number of arrivals
every slot has received from the comm calls before this one, lives on the device, in word 0
(EPOCH_WORD) of this rank's own `barrier_epoch_buffer` (int32 [2], not shared with peers; word 1,
READERS_WORD, counts the CTAs of the running launch that have read word 0). Every comm kernel
that arrives on `barrier_buffer` reads the epoch when it starts (`read_arrival_epoch`) and
advances it by its per-slot arrivals when it ends (`retire_arrival_epoch`): each CTA adds 1 to
the reader count with an acq_rel atomic once all of its readers are done, and the CTA that
brings the count to the grid size (the last) stores `base + arrivals` and resets the count to 0.
No launch argument carries a target, so a replayed graph waits for fresh ones. Every rank makes
the same sequence of comm calls with the same per-slot arrivals, so every rank's epoch and every
slot of every rank agree after each call: the invariant "epoch == each slot's arrivals before
this call" holds by induction from the zeroed buffers.

Why the epoch is race-free:
- Within a launch: every CTA reads the epoch before its count increment (program order, or a
  bar.sync for a CTA whose other threads read it), and the last CTA's store follows every
  increment (acq_rel chain on one word), so no CTA of the launch reads the new value. The last
  CTA alone writes both words; nobody else writes them during the launch.
- Between launches: comm kernels of one workspace run in stream order (one stream, or graph
  edges; no programmatic dependent launch), so the next launch starts after the last CTA's
  stores and reads the new epoch and a zero count. Only this rank's own kernels touch the
  words, so a fast peer cannot disturb them.
- A fast peer and the slots: slot s of rank r exceeds `base` only once rank s has entered this
  call, and rank s cannot arrive for the call after next before rank r has arrived for the next
  one, which r does only after finishing this call. So while r waits in call n, slot s holds
  `base_n + a` with 0 <= a <= arrivals of call n + arrivals of call n+1: an early arrival of
  call n+1 only pushes the slot past the target, which the wrap-safe `>=` accepts, and it is
  never lost (no reset). Counters and targets stay far less than 2^31 apart, so wrapping
  around 2^32 is harmless.

Why one slot per source rather than one shared counter: the slot that falls short names the
rank that did not arrive (the error record's counter_index is the late rank), and no two ranks
ever add to the same word, so arrivals do not contend.

Ordering: the release add orders everything the arriving rank did before (its earlier kernels
on the stream included) before the peer's acquire that sees it, so after the barrier each rank
may read what every peer wrote before it, and may overwrite what every peer read before it.

P = 1 degenerates to one release add to the own slot and one wait that succeeds at once.
NVLink multicast is never used: arrivals are unicast atomics to each peer.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.barrier_arrivals import (
    ARRIVALS_PER_BARRIER,
    EpochPointer,
    arrive_at_peer,
    peer_address,
    read_arrival_epoch,
    retire_arrival_epoch,
    wait_for_source,
)
from ..common.params import ErrorRecordPointer, Int64Pointer
from ..common.peers import BARRIER_BUFFER, peer_row_address

THREADS = 128  # thread t arrives at peers t, t+128, ... and waits on slots t, t+128, ...


class EpBarrierArgs(NamedTuple):
    """`EpBarrier`'s parameters, in order."""

    # int64 [buffers, 128]: the EP group's peer table (common/peers.py); its barrier_buffer row
    # holds that buffer's address on each rank, as this rank maps it, entry `rank` its own
    peer_table_ptr: Int64Pointer
    rank: Int32
    world_size: Int32
    # int32 [2]: this rank's `barrier_epoch_buffer`, the arrival epoch of the module doc
    barrier_epoch_ptr: EpochPointer
    error_record_ptr: ErrorRecordPointer  # mok/runtime/error_record.py
    phase: Int32  # WaitPhase id for the record
    timeout_ns: Int64  # per wait


@dataclass(frozen=True)
class EpBarrier:
    """Every rank of the EP group arrives, then waits until every rank has arrived.

    Kernel parameters: `EpBarrierArgs`.

    Reads the epoch, adds 1 to slot `rank` of every peer (red.release.sys), waits (bounded,
    ld.acquire.sys) until each of its own slots has reached `epoch + 1` (wrap-safe), then
    advances the epoch by 1. On timeout the error record names this rank, `phase`, the late
    source rank (counter_index), what its slot read and the target; the kernel traps.

    Constraints: 1 <= world_size; 0 <= rank < world_size; the table and every barrier_buffer
    8- and 4-byte aligned; comm launches of one workspace stream-ordered (module doc); launch
    grid (1, 1, 1), block (128, 1, 1), no dynamic smem, cluster (1, 1, 1).
    """

    @cute.jit
    def __call__(self, args: EpBarrierArgs):
        self.kernel(args).launch(grid=[1, 1, 1], block=[THREADS, 1, 1])

    @cute.kernel
    def kernel(self, args: EpBarrierArgs):
        tidx, _, _ = cute.arch.thread_idx()
        peer_table = peer_row_address(args.peer_table_ptr, BARRIER_BUFFER)
        epoch_buffer = args.barrier_epoch_ptr.toint()
        record = args.error_record_ptr.toint()

        # ---- target: from the device epoch, never a launch argument (graph replays) ----
        epoch = read_arrival_epoch(epoch_buffer)
        target = epoch + ARRIVALS_PER_BARRIER

        # ---- arrive: +1 on slot `rank` of every peer (release: our earlier work is visible) ----
        for peer in cutlass.range(tidx, args.world_size, THREADS, unroll=1):
            arrive_at_peer(peer_table, peer, args.rank)

        # ---- wait: each own slot has reached the target (acquire: theirs is visible to us) ----
        own_barrier = peer_address(peer_table, args.rank)
        for source in cutlass.range(tidx, args.world_size, THREADS, unroll=1):
            wait_for_source(
                own_barrier, source, target, args.timeout_ns, record, args.rank, args.phase
            )
        # The waiters' acquires extend to the whole CTA (and, at kernel end, to later kernels);
        # every thread has read the epoch before thread 0 advances it.
        cute.arch.barrier()

        # ---- retire: the next comm call waits for one arrival more ----
        if tidx == 0:
            retire_arrival_epoch(epoch_buffer, epoch, Int32(ARRIVALS_PER_BARRIER), Int32(1))
