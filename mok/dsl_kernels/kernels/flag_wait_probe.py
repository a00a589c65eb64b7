"""A one-thread kernel that waits on a flag with the bounded wait: the test of the timeout path."""

from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.args import global_pointer
from ..common.bounded_wait import NO_TASK, OWN_MEMORY, bounded_wait_reached, st_relaxed_sys_b32

THREADS = 32  # one warp; only thread 0 works


@dataclass(frozen=True)
class FlagWaitProbe:
    """Wait until int32 `*flag_ptr` has reached `expected`, then store 1 to `*done_ptr`.

    Kernel parameters (in this order): `flag_ptr` (int32, this GPU's or a peer's memory),
    `done_ptr` (int32), `expected` (int32), `error_record_ptr` (the 16-word record of
    mok/runtime/error_record.py, pinned mapped host memory), `rank` (int32, written to the record),
    `phase` (int32 WaitPhase id, written to the record), `timeout_ns` (int64).

    The wait is `bounded_wait_reached` (common/bounded_wait.py): when the flag has not
    reached `expected` within `timeout_ns`, the record gets (rank, phase, counter 0, the flag's
    last value, expected, peer -1, CTA 0, task -1), the kernel traps and `done` stays as it was.

    Constraints: both pointers 4-byte aligned; launch grid (1, 1, 1), block (32, 1, 1), no
    dynamic smem, cluster (1, 1, 1).
    """

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(Int32, 4),
            global_pointer(Int32, 4),
            Int32(0),
            global_pointer(Int32, 64),
            Int32(0),
            Int32(0),
            Int64(0),
        )

    @cute.jit
    def __call__(
        self,
        flag_ptr: cute.Pointer,
        done_ptr: cute.Pointer,
        expected: Int32,
        error_record_ptr: cute.Pointer,
        rank: Int32,
        phase: Int32,
        timeout_ns: Int64,
    ):
        self.kernel(flag_ptr, done_ptr, expected, error_record_ptr, rank, phase, timeout_ns).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1]
        )

    @cute.kernel
    def kernel(
        self,
        flag_ptr: cute.Pointer,
        done_ptr: cute.Pointer,
        expected: Int32,
        error_record_ptr: cute.Pointer,
        rank: Int32,
        phase: Int32,
        timeout_ns: Int64,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            bounded_wait_reached(
                flag_ptr.toint(),
                expected,
                timeout_ns,
                error_record_ptr.toint(),
                rank,
                phase,
                Int32(0),
                Int32(OWN_MEMORY),
                Int32(NO_TASK),
            )
            # Relaxed at system scope: the host-side test may poll it through mapped memory.
            st_relaxed_sys_b32(done_ptr.toint(), Int32(1))
