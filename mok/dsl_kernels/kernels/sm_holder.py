"""A kernel that holds whole SMs until the host lets go: the test of the megakernels' forward
progress with fewer resident CTAs than their grid (a data-parallel NCCL kernel on another stream
holds SMs the same way in training)."""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import (
    BACKOFF_MIN_NS,
    global_timer_ns,
    ld_acquire_sys_s32,
    nanosleep,
    red_add_release_sys_s32,
    wrapping_difference,
)
from ..common.params import Int32Pointer

THREADS = 32  # one warp; only thread 0 works
# More than half of an SM's shared memory (228 KiB on H100/H200/B200, 1 KiB more reserved per
# CTA): at most one holder CTA per SM, and no CTA that needs more than the 35 KiB left (a
# megakernel's ~215 KiB) beside it. Within the 227 KiB per-CTA opt-in.
HOLD_SMEM_BYTES = 192 * 1024
# Words of `counts` (each incremented once per CTA, at system scope).
COUNT_STARTED = 0
COUNT_RELEASED = 1
COUNT_TIMED_OUT = 2
# Loop state of thread 0.
_HOLDING = 0
# Back-off cap between polls: the flag is in host memory, read over PCIe by every CTA, and how
# soon a holder lets go does not matter (the bounded waits elsewhere cap at 1 us).
POLL_MAX_NS = 1 << 16


class SmHolderArgs(NamedTuple):
    """`SmHolder`'s parameters, in order."""

    flag_ptr: Int32Pointer  # int32, mapped host memory the host sets
    counts_ptr: Int32Pointer  # int32 [3], mapped host memory, zeroed
    expected: Int32
    timeout_ns: Int64


@dataclass(frozen=True)
class SmHolder:
    """Each CTA takes one whole SM (HOLD_SMEM_BYTES of dynamic shared memory) and keeps it until
    int32 `*flag_ptr` has reached `expected`, or `timeout_ns` has passed.

    Kernel parameters: `SmHolderArgs`. Thread 0 of every CTA adds 1 to counts[COUNT_STARTED] when it starts (the host
    waits for all of them before launching what must run beside them), then polls the flag
    (`ld.acquire.sys`, `nanosleep` back-off up to POLL_MAX_NS) and adds 1 to
    counts[COUNT_RELEASED], or to counts[COUNT_TIMED_OUT] when it gave up, and returns. Giving
    up never traps: a holder that outlived its limit is a failed test, not a dead context.

    Constraints: both pointers 4-byte aligned; launch grid (n, 1, 1) with n <= SM count so that
    every CTA is resident at once, block (32, 1, 1), cluster (1, 1, 1).
    """

    @cute.jit
    def __call__(self, args: SmHolderArgs):
        # The grid is the launcher's; the shared memory, a constant, goes into the manifest.
        self.kernel(args).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], smem=HOLD_SMEM_BYTES)

    @cute.kernel
    def kernel(self, args: SmHolderArgs):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            counts = args.counts_ptr.toint()
            flag = args.flag_ptr.toint()
            red_add_release_sys_s32(counts + 4 * COUNT_STARTED, Int32(1))
            start = global_timer_ns()
            backoff = Int32(BACKOFF_MIN_NS)
            outcome = Int32(_HOLDING)
            while outcome == Int32(_HOLDING):
                if wrapping_difference(ld_acquire_sys_s32(flag), args.expected) >= Int32(0):
                    outcome = Int32(COUNT_RELEASED)
                elif global_timer_ns() - start > args.timeout_ns:
                    outcome = Int32(COUNT_TIMED_OUT)
                else:
                    nanosleep(backoff)
                    backoff = cutlass.min(backoff * 2, Int32(POLL_MAX_NS))
            red_add_release_sys_s32(counts + Int64(4) * Int64(outcome), Int32(1))
