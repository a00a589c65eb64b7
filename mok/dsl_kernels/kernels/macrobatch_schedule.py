"""Each macrobatch's schedule sizes, on the device: the sub-schedule a megakernel launch over one
macrobatch walks (MoKConfig.macrobatch_size below the routed rows, mok/launchers/macrobatch.py)."""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..common.params import Int32Pointer
from ..common.schedule_warp import MAX_LOCAL_EXPERTS

THREADS = MAX_LOCAL_EXPERTS  # one thread per local expert
SCAN_STEPS = 10  # log2(THREADS): the Hillis-Steele scan's steps


class MacrobatchScheduleArgs(NamedTuple):
    """`MacrobatchSchedule`'s parameters, in order (M macrobatches, E experts)."""

    num_tokens_ptr: Int32Pointer  # int32 [1]
    tokens_per_expert_ptr: Int32Pointer  # int32 [E]
    window_tokens_ptr: Int32Pointer  # int32 [M]
    window_tokens_per_expert_ptr: Int32Pointer  # int32 [M, E]
    num_experts: Int32  # 1..1024
    num_windows: Int32  # M = ceil(C / W)
    window_rows: Int32  # W
    capacity: Int32  # C


@dataclass(frozen=True)
class MacrobatchSchedule:
    """Macrobatch m holds rows [m * W, min((m + 1) * W, C)) of a schedule (W = `window_rows`, a
    multiple of 128; C = `capacity`). With S_e = sum_{e' < e} n_e the start of expert e's padded
    segment (n_e = tokens_per_expert[e]):

        window_tokens[m]                = clamp(num_tokens - m * W, 0, rows of m)
        window_tokens_per_expert[m, e]  = |[S_e, S_e + n_e) ∩ rows of m|

    which is a schedule of its own over the macrobatch's rows (segments multiples of 128, in
    expert order, summing to window_tokens[m]): mok.reference.macrobatch_schedules.

    Work: one CTA; thread e owns expert e (E <= 1024). The inclusive prefix of the counts is a
    Hillis-Steele scan in shared memory (integer adds in a fixed order: exact), then every
    thread writes its expert's clipped size for each macrobatch (coalesced rows of [M, E]) and
    thread 0 the macrobatch's rows.

    Kernel parameters: `MacrobatchScheduleArgs`.
    Constraints (the launcher checks them): C < 2^30; pointers 4-byte aligned, contiguous.
    Launch: grid (1, 1, 1), block (1024, 1, 1), 4 KiB static shared memory, cluster (1, 1, 1).
    """

    @cute.jit
    def __call__(self, args: MacrobatchScheduleArgs):
        self.kernel(args).launch(grid=[1, 1, 1], block=[THREADS, 1, 1])

    @cute.kernel
    def kernel(self, args: MacrobatchScheduleArgs):
        tidx, _, _ = cute.arch.thread_idx()
        counts = cute.make_tensor(args.tokens_per_expert_ptr, cute.make_layout(args.num_experts))
        window_tokens = cute.make_tensor(args.window_tokens_ptr, cute.make_layout(args.num_windows))
        clipped = cute.make_tensor(
            args.window_tokens_per_expert_ptr,
            cute.make_layout((args.num_windows, args.num_experts), stride=(args.num_experts, 1)),
        )
        sums = cute.make_tensor(
            cute.arch.alloc_smem(Int32, THREADS, alignment=16), cute.make_layout(THREADS)
        )

        # ---- inclusive prefix of the counts (threads past the last expert add 0) ----
        count = Int32(0)
        if tidx < args.num_experts:
            count = counts[tidx]
        sums[tidx] = count
        cute.arch.sync_threads()
        for step in cutlass.range_constexpr(SCAN_STEPS):
            value = sums[tidx]
            if tidx >= (1 << step):
                value = value + sums[tidx - (1 << step)]
            # Every read of this step before any write of it.
            cute.arch.sync_threads()
            sums[tidx] = value
            cute.arch.sync_threads()
        segment_end = sums[tidx]
        segment_start = segment_end - count

        # ---- each macrobatch's share of this expert, and its rows ----
        routed_rows = cute.make_tensor(args.num_tokens_ptr, cute.make_layout(1))[0]
        for m in cutlass.range(args.num_windows, unroll=1):
            first = m * args.window_rows
            end = cutlass.min(first + args.window_rows, args.capacity)
            if tidx < args.num_experts:
                inside = cutlass.min(segment_end, end) - cutlass.max(segment_start, first)
                clipped[m, tidx] = cutlass.max(inside, Int32(0))
            if tidx == 0:
                window_tokens[m] = cutlass.max(cutlass.min(routed_rows, end) - first, Int32(0))
