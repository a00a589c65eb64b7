"""Each macrobatch's schedule sizes, on the device: the sub-schedule a megakernel launch over one
macrobatch walks (MoKConfig.macrobatch_size below the routed rows, mok/launchers/macrobatch.py)."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..common.params import int32_pointer, placeholders
from ..common.schedule_warp import MAX_LOCAL_EXPERTS

THREADS = MAX_LOCAL_EXPERTS  # one thread per local expert
SCAN_STEPS = 10  # log2(THREADS): the Hillis-Steele scan's steps

# `__call__`'s parameters, in order.
PARAMS = (
    ("num_tokens_ptr", int32_pointer),
    ("tokens_per_expert_ptr", int32_pointer),
    ("window_tokens_ptr", int32_pointer),
    ("window_tokens_per_expert_ptr", int32_pointer),
    ("num_experts", Int32(1)),
    ("num_windows", Int32(1)),
    ("window_rows", Int32(128)),
    ("capacity", Int32(128)),
)


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

    Kernel parameters, in order: `num_tokens_ptr` int32 [1], `tokens_per_expert_ptr` int32 [E],
    `window_tokens_ptr` int32 [M], `window_tokens_per_expert_ptr` int32 [M, E], `num_experts`
    (1..1024), `num_windows` (M = ceil(C / W)), `window_rows`, `capacity`.
    Constraints (the launcher checks them): C < 2^30; pointers 4-byte aligned, contiguous.
    Launch: grid (1, 1, 1), block (1024, 1, 1), 4 KiB static shared memory, cluster (1, 1, 1).
    """

    def compile_arguments(self) -> tuple:
        return placeholders(PARAMS)

    @cute.jit
    def __call__(
        self,
        num_tokens_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        window_tokens_ptr: cute.Pointer,
        window_tokens_per_expert_ptr: cute.Pointer,
        num_experts: Int32,
        num_windows: Int32,
        window_rows: Int32,
        capacity: Int32,
    ):
        self.kernel(
            num_tokens_ptr, tokens_per_expert_ptr, window_tokens_ptr,
            window_tokens_per_expert_ptr, num_experts, num_windows, window_rows, capacity,
        ).launch(grid=[1, 1, 1], block=[THREADS, 1, 1])  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        num_tokens_ptr: cute.Pointer,
        tokens_per_expert_ptr: cute.Pointer,
        window_tokens_ptr: cute.Pointer,
        window_tokens_per_expert_ptr: cute.Pointer,
        num_experts: Int32,
        num_windows: Int32,
        window_rows: Int32,
        capacity: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        counts = cute.make_tensor(tokens_per_expert_ptr, cute.make_layout(num_experts))
        window_tokens = cute.make_tensor(window_tokens_ptr, cute.make_layout(num_windows))
        clipped = cute.make_tensor(
            window_tokens_per_expert_ptr,
            cute.make_layout((num_windows, num_experts), stride=(num_experts, 1)),
        )
        sums = cute.make_tensor(
            cute.arch.alloc_smem(Int32, THREADS, alignment=16), cute.make_layout(THREADS)
        )

        # ---- inclusive prefix of the counts (threads past the last expert add 0) ----
        count = Int32(0)
        if tidx < num_experts:
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
        routed_rows = cute.make_tensor(num_tokens_ptr, cute.make_layout(1))[0]
        for m in cutlass.range(num_windows, unroll=1):
            first = m * window_rows
            end = cutlass.min(first + window_rows, capacity)
            if tidx < num_experts:
                inside = cutlass.min(segment_end, end) - cutlass.max(segment_start, first)
                clipped[m, tidx] = cutlass.max(inside, Int32(0))
            if tidx == 0:
                window_tokens[m] = cutlass.max(cutlass.min(routed_rows, end) - first, Int32(0))
