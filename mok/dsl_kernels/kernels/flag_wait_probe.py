"""A one-thread kernel that waits on a flag with the bounded wait: the test of the timeout path."""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.bounded_wait import NO_TASK, OWN_MEMORY, bounded_wait_reached, st_relaxed_sys_b32
from ..common.params import ErrorRecordPointer, Int32Pointer

THREADS = 32  # one warp; only thread 0 works


class FlagWaitArgs(NamedTuple):
    """`FlagWaitProbe`'s parameters, in order."""

    flag_ptr: Int32Pointer  # int32, this GPU's or a peer's memory
    done_ptr: Int32Pointer  # int32
    expected: Int32
    # the 16-word record of mok/runtime/error_record.py, pinned mapped host memory
    error_record_ptr: ErrorRecordPointer
    rank: Int32  # written to the record
    phase: Int32  # WaitPhase id, written to the record
    timeout_ns: Int64


@dataclass(frozen=True)
class FlagWaitProbe:
    """Wait until int32 `*flag_ptr` has reached `expected`, then store 1 to `*done_ptr`.

    Kernel parameters: `FlagWaitArgs`.

    The wait is `bounded_wait_reached` (common/bounded_wait.py): when the flag has not
    reached `expected` within `timeout_ns`, the record gets (rank, phase, counter 0, the flag's
    last value, expected, peer -1, CTA 0, task -1), the kernel traps and `done` stays as it was.

    Constraints: both pointers 4-byte aligned; launch grid (1, 1, 1), block (32, 1, 1), no
    dynamic smem, cluster (1, 1, 1).
    """

    @cute.jit
    def __call__(self, args: FlagWaitArgs):
        self.kernel(args).launch(grid=[1, 1, 1], block=[THREADS, 1, 1])

    @cute.kernel
    def kernel(self, args: FlagWaitArgs):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            bounded_wait_reached(
                args.flag_ptr.toint(),
                args.expected,
                args.timeout_ns,
                args.error_record_ptr.toint(),
                args.rank,
                args.phase,
                Int32(0),
                Int32(OWN_MEMORY),
                Int32(NO_TASK),
            )
            # Relaxed at system scope: the host-side test may poll it through mapped memory.
            st_relaxed_sys_b32(args.done_ptr.toint(), Int32(1))
