"""The router-weight gradient of each routed row, pushed to the rank that owns its token."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .params import fp32_pointer, int32_pointer, int64_pointer, placeholders
from .peers import peer_table, rank_address
from .value_checks import STATUS_BAD_WEIGHT_BACKWARD, flag_unless_positive_finite

# The smallest normal fp32: a router weight must be > 0 (a bad one sets the value-status word
# 1 + its rank and still divides in bounds), so this only keeps 0 / 0 out of the arithmetic.
FP32_TINY = 1.1754943508222875e-38


# `__call__`'s parameters, in order.
PARAMS = (
    ("partials_ptr", fp32_pointer),
    ("peer_rank_ptr", int32_pointer),
    ("peer_token_idx_ptr", int32_pointer),
    ("num_tokens_ptr", int32_pointer),
    ("weight_ptr", fp32_pointer),
    ("d_router_ptr", fp32_pointer),
    ("weight_ptrs", int64_pointer),
    ("d_router_ptrs", int64_pointer),
    ("ep_rank", Int32(0)),
    ("num_rows", Int32(0)),
    ("blocks", Int32(1)),
    ("status_ptr", int32_pointer),
)


@dataclass(frozen=True)
class RouterGradPush:
    """For every routed row r < num_tokens with peer_rank[r] >= 0:

        d_router[p][peer_token_idx[r]] = (sum_{b=0..blocks-1} partials[r, b]) / max(w, tiny)
        w = router_weights[p][peer_token_idx[r]],  p = peer_rank[r]

    `partials` hold <dY_e, y> = w * <dY, y> per 128-column block (the d_hidden epilogue's), so
    the quotient is <dY, y>. The sum runs in increasing b, one thread per row: the same bits on
    every rank and EP size. router_weights[p] and d_router[p] (fp32 [T * k]) are this rank's
    `weight_ptr` / `d_router_ptr` for p == ep_rank and the peer tables' addresses (int64 [P])
    otherwise. The pushed values are read by their rank after the group's end barrier.

    Kernel parameters, in order: `partials_ptr` fp32 [num_rows, blocks], `peer_rank_ptr`,
    `peer_token_idx_ptr` int32 [num_rows], `num_tokens_ptr` int32 [1], `weight_ptr`,
    `d_router_ptr`, `weight_ptrs`, `d_router_ptrs`, `ep_rank`, `num_rows`, `blocks`,
    `status_ptr` (the value-status words). Launch:
    grid (ceil(num_rows / threads), 1, 1), block (threads, 1, 1).
    """

    threads: int = 128

    def validate(self) -> None:
        if self.threads not in (64, 128, 256):
            raise ValueError(f"threads must be one of 64, 128, 256, got {self.threads}")

    def compile_arguments(self) -> tuple:
        return placeholders(PARAMS)

    @cute.jit
    def __call__(
        self,
        partials_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_tokens_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        d_router_ptr: cute.Pointer,
        weight_ptrs: cute.Pointer,
        d_router_ptrs: cute.Pointer,
        ep_rank: Int32,
        num_rows: Int32,
        blocks: Int32,
        status_ptr: cute.Pointer,
    ):
        self.kernel(
            partials_ptr, peer_rank_ptr, peer_token_idx_ptr, num_tokens_ptr, weight_ptr,
            d_router_ptr, weight_ptrs, d_router_ptrs, ep_rank, num_rows, blocks, status_ptr,
        ).launch(grid=[(num_rows + self.threads - 1) // self.threads, 1, 1],
                 block=[self.threads, 1, 1])  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        partials_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_tokens_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        d_router_ptr: cute.Pointer,
        weight_ptrs: cute.Pointer,
        d_router_ptrs: cute.Pointer,
        ep_rank: Int32,
        num_rows: Int32,
        blocks: Int32,
        status_ptr: cute.Pointer,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        push_row(
            bidx * self.threads + tidx, partials_ptr, peer_rank_ptr, peer_token_idx_ptr,
            num_tokens_ptr, weight_ptr, d_router_ptr, weight_ptrs, d_router_ptrs, ep_rank,
            num_rows, blocks, status_ptr,
        )  # fmt: skip


@cute.jit
def push_row(
    row: Int32,
    partials_ptr: cute.Pointer,
    peer_rank_ptr: cute.Pointer,
    peer_token_idx_ptr: cute.Pointer,
    num_tokens_ptr: cute.Pointer,
    weight_ptr: cute.Pointer,
    d_router_ptr: cute.Pointer,
    weight_ptrs: cute.Pointer,
    d_router_ptrs: cute.Pointer,
    ep_rank: Int32,
    num_rows: Int32,
    blocks: Int32,
    status_ptr: cute.Pointer,
):
    """`RouterGradPush`'s work for routed row `row` (nothing past the schedule's rows)."""
    rows = cutlass.min(num_rows, cute.make_tensor(num_tokens_ptr, cute.make_layout(1))[0])
    rank = cute.make_tensor(peer_rank_ptr, cute.make_layout(num_rows))
    slot = cute.make_tensor(peer_token_idx_ptr, cute.make_layout(num_rows))
    partials = cute.make_tensor(partials_ptr, cute.make_layout((num_rows, blocks),
                                                               stride=(blocks, 1)))  # fmt: skip
    weight_table = peer_table(weight_ptrs)
    d_router_table = peer_table(d_router_ptrs)
    if row < rows:
        peer = rank[row]
        if peer >= 0:
            total = Float32(0.0)
            for b in cutlass.range(blocks, unroll=1):
                total = total + partials[row, b]
            offset = Int64(slot[row]) * Int64(4)
            w_base = rank_address(weight_ptr, weight_table, ep_rank, peer)
            d_base = rank_address(d_router_ptr, d_router_table, ep_rank, peer)
            w_ptr = cute.make_ptr(Float32, w_base + offset, cute.AddressSpace.gmem,
                                  assumed_align=4)  # fmt: skip
            w = cute.make_tensor(w_ptr, cute.make_layout(1))[0]
            flag_unless_positive_finite(
                w, status_ptr.toint() + Int64(STATUS_BAD_WEIGHT_BACKWARD * 4), peer + 1
            )
            d_ptr = cute.make_ptr(Float32, d_base + offset, cute.AddressSpace.gmem,
                                  assumed_align=4)  # fmt: skip
            cute.make_tensor(d_ptr, cute.make_layout(1))[0] = total / cutlass.max(
                w, Float32(FP32_TINY)
            )
