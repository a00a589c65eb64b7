"""Bounded waits on int32 counters in global memory, and the memory operations they are made of.

Every cross-CTA or cross-GPU dependency in mok is an int32 counter in global memory (this GPU's
or a peer's, reached through a raw 64-bit address). The producer adds to it with a *release*
atomic after writing its data; the consumer polls it with an *acquire* load until it has reached
the value it needs, then reads the data. Both sides use system scope (`.sys`): the counters and
the data they guard cross NVLink, and the error record lives in pinned host memory.
NVLink multicast (multimem / NVLS) is never used: every remote access is a unicast load, store
or atomic to one peer address.

Counters are monotone. A counter is never reset between uses; each use waits for a larger
target (`arrivals before this call + arrivals of this call`). A reset would race: a fast peer
may already have arrived for the next use when the slow owner resets, and its arrival would be
erased. With monotone counters the only state is the running total, which every rank knows
without talking to the others because every rank makes the same sequence of calls. The kernels
read that total from a word in device memory when they start (kernels/ep_barrier.py, "Arrival
epoch"), never from a launch argument, so a CUDA-graph replay waits for fresh targets.
Comparisons are wrap-safe: "reached" means `int32(value - target) >= 0` (two's complement),
which equals `value >= target` as long as the counter and the target are less than 2^31 apart,
so a counter may wrap around 2^32 without breaking a wait.

`bounded_wait_reached` is the one wait every kernel uses. It polls with `ld.acquire.sys`,
sleeps between polls with an exponential `nanosleep` back-off (32 ns doubling to 1 us: a
short wait costs little latency, a long one does not flood NVLink with polls), and reads
`%globaltimer` (nanoseconds) to give up after `timeout_ns`, a kernel argument the host sets
(never an environment read here). On giving up it writes the host-visible error record
(mok/runtime/error_record.py: CAS claim at system scope, fields, `fence.sc.sys`, flag = 2) and
executes `trap`, which aborts the kernel; the host then raises MoKWaitTimeoutError naming the
rank, phase and counter values. A timed-out wait never returns.

Addresses are Int64 (a `cute.Pointer`'s `.toint()`, or a value loaded from a peer-pointer
table). All helpers here are inline PTX with side effects and a memory clobber, so the compiler
neither removes nor reorders them against other memory operations.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# Error-record layout (mok/runtime/error_record.py): int32 words at the record's address.
RECORD_WORDS = 16
FLAG_CLEAR = 0
FLAG_CLAIMED = 1
FLAG_VALID = 2
WORD_RANK = 1
WORD_PHASE = 2
WORD_COUNTER_INDEX = 3
WORD_OBSERVED = 4
WORD_EXPECTED = 5
WORD_PEER_RANK = 6
WORD_CTA = 7
WORD_TASK = 8
FIRST_RESERVED_WORD = 9
# peer_rank value meaning "the counter is in this rank's own memory".
OWN_MEMORY = -1
# task value meaning "not inside a task of the task list".
NO_TASK = -1

# Back-off between polls: start short (a counter that is about to flip costs ~32 ns extra),
# double up to 1 us (a stalled peer is polled ~1e6 times a second, not ~1e8).
BACKOFF_MIN_NS = 32
BACKOFF_MAX_NS = 1024


def side_effect_asm(result_type, operands, asm: str, constraints: str, loc, ip):
    """An inline-PTX statement LLVM keeps where it is."""
    # has_side_effects + "~{memory}": never hoisted out of a polling loop, never reordered
    # against other memory operations, never removed when the result is unused.
    return llvm.inline_asm(
        result_type,
        operands,
        asm,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _i32(value, loc, ip):
    return Int32(value).ir_value(loc=loc, ip=ip)


def _i64(value, loc, ip):
    return Int64(value).ir_value(loc=loc, ip=ip)


# ---------------------------------------------------------------------------------------------
# Memory operations (system scope)
# ---------------------------------------------------------------------------------------------
@dsl_user_op
def ld_acquire_sys_s32(address: Int64, *, loc=None, ip=None) -> Int32:
    """`ld.acquire.sys.global.b32`: reads after it see what the releasing writer wrote before."""
    return Int32(
        side_effect_asm(
            T.i32(),
            [_i64(address, loc, ip)],
            "ld.acquire.sys.global.b32 $0, [$1];",
            "=r,l,~{memory}",
            loc,
            ip,
        )
    )


@dsl_user_op
def red_add_release_sys_s32(address: Int64, value: Int32, *, loc=None, ip=None) -> None:
    """`red.release.sys.global.add.s32`: writes before it are visible to whoever acquires it."""
    side_effect_asm(
        None,
        [_i64(address, loc, ip), _i32(value, loc, ip)],
        "red.release.sys.global.add.s32 [$0], $1;",
        "l,r,~{memory}",
        loc,
        ip,
    )


@dsl_user_op
def ld_acquire_gpu_s32(address: Int64, *, loc=None, ip=None) -> Int32:
    """`ld.acquire.gpu.global.b32`: `ld_acquire_sys_s32` for a counter only this GPU's CTAs
    write (a megakernel's local dependency): no system-scope coherence to wait for."""
    return Int32(
        side_effect_asm(
            T.i32(),
            [_i64(address, loc, ip)],
            "ld.acquire.gpu.global.b32 $0, [$1];",
            "=r,l,~{memory}",
            loc,
            ip,
        )
    )


@dsl_user_op
def red_add_release_gpu_s32(address: Int64, value: Int32, *, loc=None, ip=None) -> None:
    """`red.release.gpu.global.add.s32`: the GPU-scope release matching `ld_acquire_gpu_s32`."""
    side_effect_asm(
        None,
        [_i64(address, loc, ip), _i32(value, loc, ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r,~{memory}",
        loc,
        ip,
    )


@dsl_user_op
def atom_add_relaxed_gpu_s32(address: Int64, value: Int32, *, loc=None, ip=None) -> Int32:
    """`atom.relaxed.gpu.global.add.s32`, returning the old value: a ticket counter (the order
    of the values is all it gives; what a ticket guards is published elsewhere)."""
    return Int32(
        side_effect_asm(
            T.i32(),
            [_i64(address, loc, ip), _i32(value, loc, ip)],
            "atom.relaxed.gpu.global.add.s32 $0, [$1], $2;",
            "=r,l,r,~{memory}",
            loc,
            ip,
        )
    )


@dsl_user_op
def atom_add_release_sys_s32(address: Int64, value: Int32, *, loc=None, ip=None) -> Int32:
    """`atom.release.sys.global.add.s32`: as `red_add_release_sys_s32`, returning the old value."""
    return Int32(
        side_effect_asm(
            T.i32(),
            [_i64(address, loc, ip), _i32(value, loc, ip)],
            "atom.release.sys.global.add.s32 $0, [$1], $2;",
            "=r,l,r,~{memory}",
            loc,
            ip,
        )
    )


@dsl_user_op
def atom_add_acq_rel_gpu_s32(address: Int64, value: Int32, *, loc=None, ip=None) -> Int32:
    """`atom.acq_rel.gpu.global.add.s32`: old value; orders this thread's earlier accesses
    before, and its later ones after, those of every thread on this GPU that adds to the same
    word (a count of CTAs that have finished a step; GPU scope: only this GPU's CTAs count)."""
    return Int32(
        side_effect_asm(
            T.i32(),
            [_i64(address, loc, ip), _i32(value, loc, ip)],
            "atom.acq_rel.gpu.global.add.s32 $0, [$1], $2;",
            "=r,l,r,~{memory}",
            loc,
            ip,
        )
    )


@dsl_user_op
def atom_cas_relaxed_sys_b32(
    address: Int64, compare: Int32, value: Int32, *, loc=None, ip=None
) -> Int32:
    """`atom.relaxed.sys.global.cas.b32`: old value; stores `value` if old == `compare`."""
    return Int32(
        side_effect_asm(
            T.i32(),
            [_i64(address, loc, ip), _i32(compare, loc, ip), _i32(value, loc, ip)],
            "atom.relaxed.sys.global.cas.b32 $0, [$1], $2, $3;",
            "=r,l,r,r,~{memory}",
            loc,
            ip,
        )
    )


@dsl_user_op
def st_relaxed_sys_b32(address: Int64, value: Int32, *, loc=None, ip=None) -> None:
    """`st.relaxed.sys.global.b32`: a store other GPUs and the host may observe."""
    side_effect_asm(
        None,
        [_i64(address, loc, ip), _i32(value, loc, ip)],
        "st.relaxed.sys.global.b32 [$0], $1;",
        "l,r,~{memory}",
        loc,
        ip,
    )


@dsl_user_op
def st_global_v4_b32(
    address: Int64, x: Int32, y: Int32, z: Int32, w: Int32, *, loc=None, ip=None
) -> None:
    """`st.global.v4.b32`: one 16-byte store (address 16-byte aligned); weak, so publish it
    with a release (fence + red.release) before anyone reads it."""
    side_effect_asm(
        None,
        [
            _i64(address, loc, ip),
            _i32(x, loc, ip),
            _i32(y, loc, ip),
            _i32(z, loc, ip),
            _i32(w, loc, ip),
        ],
        "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r,~{memory}",
        loc,
        ip,
    )


@dsl_user_op
def st_global_b32(address: Int64, value: Int32, *, loc=None, ip=None) -> None:
    """`st.global.b32`: one weak 4-byte store (published like `st_global_v4_b32`)."""
    side_effect_asm(
        None,
        [_i64(address, loc, ip), _i32(value, loc, ip)],
        "st.global.b32 [$0], $1;",
        "l,r,~{memory}",
        loc,
        ip,
    )


@dsl_user_op
def ld_global_b64(address: Int64, *, loc=None, ip=None) -> Int64:
    """`ld.global.nc.b64`: one 64-bit word (an entry of a peer-pointer table)."""
    return Int64(
        side_effect_asm(
            T.i64(),
            [_i64(address, loc, ip)],
            "ld.global.nc.b64 $0, [$1];",
            "=l,l,~{memory}",
            loc,
            ip,
        )
    )


@dsl_user_op
def fence_sc_sys(*, loc=None, ip=None) -> None:
    """`fence.sc.sys` (__threadfence_system): orders every earlier access before every later one."""
    side_effect_asm(None, [], "fence.sc.sys;", "~{memory}", loc, ip)


@dsl_user_op
def fence_acq_rel_sys(*, loc=None, ip=None) -> None:
    """`fence.acq_rel.sys`: makes a following relaxed/release op cumulative over the CTA's writes
    that a preceding bar.sync ordered before this thread."""
    side_effect_asm(None, [], "fence.acq_rel.sys;", "~{memory}", loc, ip)


@dsl_user_op
def wrapping_difference(value: Int32, target: Int32, *, loc=None, ip=None) -> Int32:
    """`value - target` in two's complement (`sub.s32` wraps): >= 0 means "reached"."""
    return Int32(
        side_effect_asm(
            T.i32(),
            [_i32(value, loc, ip), _i32(target, loc, ip)],
            "sub.s32 $0, $1, $2;",
            "=r,r,r",
            loc,
            ip,
        )
    )


@dsl_user_op
def global_timer_ns(*, loc=None, ip=None) -> Int64:
    """`%globaltimer`: a 64-bit nanosecond clock shared by the whole GPU."""
    return Int64(side_effect_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l,~{memory}", loc, ip))


@dsl_user_op
def nanosleep(duration_ns: Int32, *, loc=None, ip=None) -> None:
    """`nanosleep.u32`: suspend this warp for about `duration_ns` (0 .. 1 ms)."""
    side_effect_asm(None, [_i32(duration_ns, loc, ip)], "nanosleep.u32 $0;", "r,~{memory}", loc, ip)


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """`trap`: abort the kernel (the CUDA context becomes unusable; the error record survives)."""
    side_effect_asm(None, [], "trap;", "~{memory}", loc, ip)


# ---------------------------------------------------------------------------------------------
# Error record + bounded wait
# ---------------------------------------------------------------------------------------------
@cute.jit
def linear_cta_index() -> Int32:
    """blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)."""
    bidx, bidy, bidz = cute.arch.block_idx()
    gdimx, gdimy, _ = cute.arch.grid_dim()
    return Int32(bidx + gdimx * (bidy + gdimy * bidz))


@cute.jit
def record_timeout_and_trap(
    record_address: Int64,
    rank: Int32,
    phase: Int32,
    counter_index: Int32,
    observed: Int32,
    expected: Int32,
    peer_rank: Int32,
    task: Int32,
):
    """Write the error record (first writer only) and trap. Never returns.

    Protocol of mok/runtime/error_record.py: claim the record with a system-scope CAS 0 -> 1 (one
    writer wins; a later timeout anywhere only traps), store the fields, `fence.sc.sys` so the
    host never sees flag 2 before the fields, store flag 2, fence again so the flag has left
    the SM before `trap` tears the context down. A null record address only traps.
    """
    if record_address != Int64(0):
        previous = atom_cas_relaxed_sys_b32(record_address, Int32(FLAG_CLEAR), Int32(FLAG_CLAIMED))
        if previous == Int32(FLAG_CLEAR):
            st_relaxed_sys_b32(record_address + 4 * WORD_RANK, rank)
            st_relaxed_sys_b32(record_address + 4 * WORD_PHASE, phase)
            st_relaxed_sys_b32(record_address + 4 * WORD_COUNTER_INDEX, counter_index)
            st_relaxed_sys_b32(record_address + 4 * WORD_OBSERVED, observed)
            st_relaxed_sys_b32(record_address + 4 * WORD_EXPECTED, expected)
            st_relaxed_sys_b32(record_address + 4 * WORD_PEER_RANK, peer_rank)
            st_relaxed_sys_b32(record_address + 4 * WORD_CTA, linear_cta_index())
            st_relaxed_sys_b32(record_address + 4 * WORD_TASK, task)
            for word in cutlass.range_constexpr(FIRST_RESERVED_WORD, RECORD_WORDS):
                st_relaxed_sys_b32(record_address + 4 * word, Int32(0))
            fence_sc_sys()
            st_relaxed_sys_b32(record_address, Int32(FLAG_VALID))
            fence_sc_sys()
    trap()


@cute.jit
def bounded_wait_reached(
    counter_address: Int64,
    target: Int32,
    timeout_ns: Int64,
    record_address: Int64,
    rank: Int32,
    phase: Int32,
    counter_index: Int32,
    peer_rank: Int32,
    task: Int32,
    acquire=ld_acquire_sys_s32,
) -> Int32:
    """Spin (one thread) until the int32 counter at `counter_address` has reached `target`.

    `acquire` (trace time): the polling load, `ld_acquire_sys_s32` by default (counters that
    cross NVLink), `ld_acquire_gpu_s32` for a counter written only by this GPU.

    "Reached" is `int32(value - target) >= 0` (monotone counters, wrap-safe: module doc).
    Each poll is `ld.acquire.sys`, so once this returns, the calling thread sees every write
    the arriving producers made before their release; make it visible to the rest of the CTA
    with a bar.sync. Between polls: `nanosleep` with exponential back-off (32 ns .. 1 us).
    After `timeout_ns` nanoseconds of `%globaltimer` without reaching the target, writes the
    error record at `record_address` with (rank, phase, counter_index, last value read,
    target, peer_rank, this CTA, task) and traps. Returns the value read last.

    `rank`: EP rank of the waiting GPU. `phase`: a WaitPhase id (mok.runtime.WaitPhase).
    `counter_index`: which counter of the phase (e.g. the source rank of a barrier slot).
    `peer_rank`: rank whose memory holds the counter, -1 for this rank's own memory.
    `task`: the task-list index, -1 outside the task list.
    """
    observed = acquire(counter_address)
    if wrapping_difference(observed, target) < Int32(0):
        start = global_timer_ns()
        backoff = Int32(BACKOFF_MIN_NS)
        while wrapping_difference(observed, target) < Int32(0):
            nanosleep(backoff)
            backoff = cutlass.min(backoff * 2, Int32(BACKOFF_MAX_NS))
            if global_timer_ns() - start > timeout_ns:
                record_timeout_and_trap(
                    record_address, rank, phase, counter_index, observed, target, peer_rank, task
                )
            observed = acquire(counter_address)
    return observed
