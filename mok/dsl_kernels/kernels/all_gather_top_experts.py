"""All-gather of the routing ids across the EP group: unicast NVLink stores + a fused barrier.

Every rank writes its routing ids (int64 [T, k] on the torch side, narrowed here to int32) into
slot [rank] of every peer's `all_gather_top_experts_buffer` (int32 [P, T, k], symmetric memory),
including its own, then arrives on the peer's barrier slot; the kernel ends on rank r only once
all P slots of r's buffer are complete. NVLink multicast is never used.

Why the kernel reads int64 and narrows itself: no extra torch op (and no temporary) per call.
It checks each id against [0, num_experts) on the int64 value, before narrowing to the low 32
bits: an id outside sets the value-status words (common/value_checks.py) and is gathered
narrowed; the schedule treats an id outside this rank's experts as not routed here, so
nothing is written out of bounds.

Barrier counters: the same per-source slots as kernels/ep_barrier.py (`barrier_buffer` [P]
of each rank; slot s counts arrivals from rank s; monotone). The targets come from the arrival
epoch of kernels/ep_barrier.py (`epoch`: arrivals every slot received before this call, a word
in this rank's own memory that every CTA reads when it starts; the launch's last CTA advances it
by 2 * ctas_per_peer when it ends), never from a launch argument, so a CUDA-graph replay waits
for fresh targets. Per call, each rank makes 2 * ctas_per_peer arrivals at each peer:

1. Entry (1 per CTA): CTA (c, p) of rank r adds 1 to slot r of rank p, meaning "rank r has
   started this call", so every earlier kernel of rank r's stream, including any reader of
   the previous ids in r's buffer, has finished. It then waits until its own slot p has reached
   `epoch + 1`: rank p has started too, so overwriting slot [r] of p's buffer cannot race with
   p still reading the previous call's ids.
2. Data (1 per CTA): after its stores to rank p, CTA (c, p) adds 1 (release, after a bar.sync
   and a system fence, so it covers every thread's stores) to slot r of rank p.
3. Completion: CTA (0, p) of rank r waits until its own slot p has reached
   `epoch + 2 * ctas_per_peer`: every CTA of rank p that writes into r's buffer has stored and
   published. With one such CTA per peer, the kernel ends only when all P slots are complete
   (a later kernel on r's stream sees them). A fast peer's arrivals of the next call only push
   the slot past the target (ep_barrier.py's module doc says why that is all they can do), and
   they come after all of that peer's arrivals of this call (its next kernel starts after this
   one ends), so a reached target still means all of this call's data has landed.
4. Retire: thread 0 of each CTA, after the publish bar.sync (every thread of the CTA has read
   the epoch by then) and its waits, counts the CTA; the last of the grid advances the epoch.

Deadlock freedom: the only waits are (a) entry: for one CTA of rank p's grid to have started
(it arrives before it waits on anything), and (b) completion, in CTA (0, p) only: for rank p's
CTAs that write to this rank to finish their stores (they wait on nothing but (a)). Neither needs
a CTA that is itself blocked behind a completion wait, so the kernels of all ranks progress as
long as their CTAs get scheduled; the host keeps the grid small (ctas_per_peer * P <= 64 CTAs,
co-resident on any GPU mok runs on) so that no wait depends on a CTA still queued behind
waiting ones.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.barrier_arrivals import (
    EpochPointer,
    arrive_at_peer,
    peer_address,
    read_arrival_epoch,
    retire_arrival_epoch,
    wait_for_source,
)
from ..common.bounded_wait import (
    fence_acq_rel_sys,
    st_global_b32,
    st_global_v4_b32,
)
from ..common.params import (
    ErrorRecordPointer,
    Int64Pointer,
    aligned_pointer,
)
from ..common.peers import ALL_GATHER_TOP_EXPERTS_BUFFER, BARRIER_BUFFER, peer_row_address
from ..common.value_checks import STATUS_BAD_EXPERT_ID, load_checked_id

THREADS = 128
VECTOR = 4  # int32 ids per 16-byte store
StatusPointer = aligned_pointer(Int32, 16)


class AllGatherArgs(NamedTuple):
    """`AllGatherTopExperts`'s parameters, in order (P = world_size)."""

    ids_ptr: Int64Pointer  # int64 [num_ids], contiguous: this rank's routing ids (T * k)
    # int64 [buffers, 128]: the EP group's peer table (common/peers.py); its rows give each
    # rank's `all_gather_top_experts_buffer` (int32 [P, num_ids]) and `barrier_buffer` (int32 [P])
    peer_table_ptr: Int64Pointer
    rank: Int32
    world_size: Int32
    num_ids: Int32
    chunk_ids: Int32  # ids per chunk: chunk_bytes / 4, a multiple of 4
    # CTAs writing to one peer; each takes chunks c, c + ctas_per_peer, ...
    ctas_per_peer: Int32
    # int32 [2]: this rank's `barrier_epoch_buffer`, the arrival epoch of kernels/ep_barrier.py;
    # targets are derived from it, wrap-safe
    barrier_epoch_ptr: EpochPointer
    error_record_ptr: ErrorRecordPointer  # mok/runtime/error_record.py
    entry_phase: Int32  # WaitPhase id of the entry wait
    gather_phase: Int32  # WaitPhase id of the completion wait
    timeout_ns: Int64  # per wait
    num_experts: Int32  # E * P: ids must lie in [0, num_experts)
    status_ptr: StatusPointer  # the value-status words


@dataclass(frozen=True)
class AllGatherTopExperts:
    """gathered[p][rank, i] = int32(ids[i]) for every peer p, i < num_ids; then a barrier.

    Kernel parameters: `AllGatherArgs`.

    Stores: 16-byte `st.global.v4.b32` when num_ids % 4 == 0 (every slot then starts 16-byte
    aligned), else 4-byte stores. On timeout the record names this rank, the phase, the
    source rank whose slot fell short (counter_index) and the targets; the kernel traps.

    Constraints: 1 <= world_size <= 65535, 0 <= rank < world_size, num_ids >= 1,
    world_size * num_ids < 2^31, chunk_ids > 0 and % 4 == 0, 1 <= ctas_per_peer; ids 8-byte
    aligned; each gather buffer 16-byte aligned; comm launches of one workspace stream-ordered
    (ep_barrier.py). Launch grid (ctas_per_peer, world_size, 1),
    block (128, 1, 1), no dynamic smem, cluster (1, 1, 1).
    """

    @cute.jit
    def __call__(self, args: AllGatherArgs):
        self.kernel(args).launch(
            grid=[args.ctas_per_peer, args.world_size, 1], block=[THREADS, 1, 1]
        )

    @cute.kernel
    def kernel(self, args: AllGatherArgs):
        tidx, _, _ = cute.arch.thread_idx()
        cta_in_peer, peer, _ = cute.arch.block_idx()
        barrier_table = peer_row_address(args.peer_table_ptr, BARRIER_BUFFER)
        record = args.error_record_ptr.toint()
        own_barrier = peer_address(barrier_table, args.rank)

        # ---- targets: from the device epoch, never a launch argument (graph replays) ----
        # Every thread reads it (one cached word); the publish bar.sync orders all these reads
        # before thread 0 retires the CTA.
        epoch_buffer = args.barrier_epoch_ptr.toint()
        epoch = read_arrival_epoch(epoch_buffer)
        # Per call each CTA arrives twice at its peer: once on entry, once after its stores.
        arrivals_per_slot = 2 * args.ctas_per_peer

        # ---- entry: announce this call to `peer`, wait until `peer` has started it too ----
        if tidx == 0:
            arrive_at_peer(barrier_table, peer, args.rank)
            wait_for_source(
                own_barrier, peer, epoch + 1, args.timeout_ns, record, args.rank, args.entry_phase
            )
        cute.arch.barrier()

        # ---- copy: chunks cta_in_peer, cta_in_peer + ctas_per_peer, ... into slot [rank] ----
        source = args.ids_ptr.toint()
        limit = Int64(args.num_experts)
        bad_id = args.status_ptr.toint() + Int64(STATUS_BAD_EXPERT_ID * 4)
        destination = (
            peer_address(peer_row_address(args.peer_table_ptr, ALL_GATHER_TOP_EXPERTS_BUFFER), peer)
            + Int64(args.rank) * Int64(args.num_ids) * 4
        )
        num_chunks = (args.num_ids + args.chunk_ids - 1) // args.chunk_ids
        if args.num_ids % VECTOR == 0:
            for chunk in cutlass.range(cta_in_peer, num_chunks, args.ctas_per_peer, unroll=1):
                end = cutlass.min((chunk + 1) * args.chunk_ids, args.num_ids)
                for i in cutlass.range(
                    chunk * args.chunk_ids + tidx * VECTOR, end, THREADS * VECTOR
                ):
                    load = source + Int64(i) * 8
                    st_global_v4_b32(
                        destination + Int64(i) * 4,
                        load_checked_id(load, limit, bad_id),
                        load_checked_id(load + 8, limit, bad_id),
                        load_checked_id(load + 16, limit, bad_id),
                        load_checked_id(load + 24, limit, bad_id),
                    )
        else:
            for chunk in cutlass.range(cta_in_peer, num_chunks, args.ctas_per_peer, unroll=1):
                end = cutlass.min((chunk + 1) * args.chunk_ids, args.num_ids)
                for i in cutlass.range(chunk * args.chunk_ids + tidx, end, THREADS):
                    st_global_b32(
                        destination + Int64(i) * 4,
                        load_checked_id(source + Int64(i) * 8, limit, bad_id),
                    )

        # ---- publish: every thread's stores to `peer`, then one release add on its slot ----
        cute.arch.barrier()
        if tidx == 0:
            # bar.sync ordered the CTA's stores before this thread; the system-scope fence
            # makes the release below cover them for a reader on another GPU.
            fence_acq_rel_sys()
            arrive_at_peer(barrier_table, peer, args.rank)
            # ---- completion: one CTA per source rank waits for all of its CTAs' data ----
            if cta_in_peer == 0:
                wait_for_source(
                    own_barrier,
                    peer,
                    epoch + arrivals_per_slot,
                    args.timeout_ns,
                    record,
                    args.rank,
                    args.gather_phase,
                )
            # ---- retire: the last CTA of the grid advances the epoch for the next call ----
            retire_arrival_epoch(
                epoch_buffer, epoch, arrivals_per_slot, args.ctas_per_peer * args.world_size
            )
