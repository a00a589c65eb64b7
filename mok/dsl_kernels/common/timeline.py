"""Phase timestamps for a diagnostic build of a megakernel (its config `timeline=True`).

Built only on request (`python -m mok.dsl_kernels.build --arch sm_90a --set moe_forward:timeline=1
--out DIR`; the shipped cubins have `timeline=False` and none of this code), loaded with
MOK_KERNEL_DIR=DIR and read by tools/phase_timeline.py. Each CTA writes STAMPS int64 words past
the launch's int32 counters (from the first 8-byte boundary after them; the launcher sizes the
counters for it when the kernel's config says `timeline`): `%globaltimer` nanoseconds at its
phase boundaries, or counts, at fixed slots (the kernel's TIMELINE_SLOTS names them).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .bounded_wait import global_timer_ns

STAMPS = 16  # int64 words per CTA (mok.launchers.megakernel_walk.TIMELINE_STAMPS)


@cute.jit
def timeline_address(counters: Int64, counter_words: Int32, cta: Int32, slot: int) -> Int64:
    """Where CTA `cta` writes `slot`: past `counter_words` int32 counters at `counters`."""
    first = counters + Int64((counter_words + 1) // 2) * Int64(8)
    return first + (Int64(cta) * Int64(STAMPS) + Int64(slot)) * Int64(8)


@cute.jit
def put(counters: Int64, counter_words: Int32, cta: Int32, slot: int, value: Int64):
    """Store `value` at `slot` of CTA `cta`'s words (one thread calls it)."""
    ptr = cute.make_ptr(Int64, timeline_address(counters, counter_words, cta, slot),
                        cute.AddressSpace.gmem, assumed_align=8)  # fmt: skip
    cute.make_tensor(ptr, cute.make_layout(1))[0] = value


@cute.jit
def stamp(counters: Int64, counter_words: Int32, cta: Int32, slot: int):
    """`%globaltimer` now at `slot` of CTA `cta`'s words (one thread calls it)."""
    put(counters, counter_words, cta, slot, global_timer_ns())


@cute.jit
def mark_time(enabled: cutlass.Constexpr, tidx, counters: Int64, capacity_tiles,
              tail: cutlass.Constexpr, cta, thread: cutlass.Constexpr,
              slot: cutlass.Constexpr):  # fmt: skip
    """A megakernel's stamp at `slot` by thread `thread`, its counters being two int32 arrays
    of `capacity_tiles` and `tail` words; nothing at all unless `enabled` (its config's
    `timeline`). The first six arguments are the kernel's for every mark."""
    if cutlass.const_expr(enabled):
        if tidx == thread:
            stamp(counters, 2 * capacity_tiles + tail, cta, slot)


@cute.jit
def mark_value(enabled: cutlass.Constexpr, tidx, counters: Int64, capacity_tiles,
               tail: cutlass.Constexpr, cta, thread: cutlass.Constexpr, slot: cutlass.Constexpr,
               value):  # fmt: skip
    """`mark_time`, storing `value` instead of the time."""
    if cutlass.const_expr(enabled):
        if tidx == thread:
            put(counters, 2 * capacity_tiles + tail, cta, slot, Int64(value))
