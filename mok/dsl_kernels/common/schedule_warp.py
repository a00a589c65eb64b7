"""Warp-level helpers shared by the schedule's count and placement tasks (schedule_count.py,
schedule_place.py) and the constants that tie them together.

The schedule is a stable counting sort of the all-gathered routing entries (flat index
`i = rank * T * k + t * k + j`) by local expert. Every task walks the same chunking:
chunk `c` is entries [c * CHUNK, (c + 1) * CHUNK); inside it warp `w` owns the contiguous
sub-chunk [c * CHUNK + w * WARP_CHUNK, ...), which it reads 32 entries (one per lane, lane
order = entry order) per step. The count pass's per-chunk offsets are only consistent with
the placement if both passes use these constants.

A group of one has a variant of the kernel (`ids64`) that reads the caller's routing, int64
[T, k], in place of the all-gather's int32 copy: the count pass reads each id's low word (the
int64 array seen as int32 with stride 2), the placement loads the whole id, checks it against
[0, E) into the value-status words (as the all-gather does) and narrows it to the same low
word, so both passes key every entry alike.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from .value_checks import load_checked_id

WARP_SIZE = 32
THREADS = 256  # threads of a schedule CTA
WARPS = THREADS // WARP_SIZE
ENTRIES_PER_LANE = 16  # steps of 32 entries a warp takes over its sub-chunk
WARP_CHUNK = WARP_SIZE * ENTRIES_PER_LANE  # 512 entries per warp
CHUNK = WARPS * WARP_CHUNK  # 4096 entries per CTA: 256 CTAs for 8 ranks x 16384 tokens x 8
MAX_LOCAL_EXPERTS = 1024  # static shared-memory tables are sized for this many experts
NOT_MINE = -1  # key of an entry routed to another rank's expert (or past the end)
ROUTED_ROW_ALIGNMENT = 128  # = mok.config.ROUTED_ROW_ALIGNMENT (dsl_kernels may not import mok)


def smem_words(sizes: tuple) -> int:
    """The int32 words `smem_vectors` carves from a base for vectors of `sizes`."""
    return sum(-(-size // 4) * 4 for size in sizes)


def smem_vectors(sizes: tuple, base=None) -> tuple:
    """Int32 shared-memory vectors of `sizes`: static allocations (`base` None), or carved one
    after another from `base` (an Int32 shared-memory pointer, 16-byte aligned; each vector
    16-byte aligned), e.g. from a megakernel's operand ring before its mainloop."""
    vectors, offset = [], 0
    for size in sizes:
        if base is None:
            pointer = cute.arch.alloc_smem(Int32, size, alignment=16)
        else:
            pointer = base + offset
            offset += smem_words((size,))
        vectors.append(cute.make_tensor(pointer, cute.make_layout(size)))
    return tuple(vectors)


def schedule_barrier(named_barrier) -> None:
    """The barrier of a schedule task's THREADS threads: the whole CTA (`named_barrier` None: the
    schedule kernel), or named barrier `named_barrier` over THREADS threads (threads 0 ..
    THREADS - 1 of a larger CTA that runs schedule tasks). A trace-time choice."""
    if named_barrier is None:
        cute.arch.sync_threads()
    else:
        cute.arch.barrier(barrier_id=named_barrier, number_of_threads=THREADS)


@cute.jit
def local_expert_key(
    ids: cute.Tensor, index: Int32, num_entries: Int32, expert_base: Int32, num_experts: Int32
) -> Int32:
    """Local expert (0..E-1) of entry `index`, or NOT_MINE (other rank, or index out of range)."""
    key = Int32(NOT_MINE)
    if index < num_entries:
        local = ids[index] - expert_base
        if local >= 0 and local < num_experts:
            key = local
    return key


@cute.jit
def checked_local_expert_key(
    ids_address: Int64, index: Int32, num_entries: Int32, num_experts: Int32, bad_id: Int64
) -> Int32:
    """`local_expert_key` of int64 ids at `ids_address` (a group of one: expert_base 0); an id
    outside [0, num_experts) stores [1, num_experts] at `bad_id` (value_checks.py) and keys as
    its low 32 bits, the int32 the all-gather would have written."""
    key = Int32(NOT_MINE)
    if index < num_entries:
        local = load_checked_id(ids_address + Int64(index) * 8, Int64(num_experts), bad_id)
        if local >= 0 and local < num_experts:
            key = local
    return key


@cute.jit
def warp_group_of(key: Int32) -> tuple[Uint32, Int32, Int32]:
    """(lanes holding the same key, how many of them sit below this lane, group size).

    `match.any.sync` gives the lanes of this warp whose key equals ours; masking it with
    %lanemask_lt counts the earlier lanes (= earlier entries) of the same expert, which is what
    keeps the placement stable inside one 32-entry step. The lane with rank 0 leads its group.
    """
    peers = cute.arch.match_sync(cutlass.Int32(-1), key, kind="any")
    below = cute.arch.popc(peers & cute.arch.lanemask_lt())
    return peers, Int32(below), Int32(cute.arch.popc(peers))
