"""A routed row's router-weight gradient: the fixed-order sum of its partials over the
backward's blocks, divided by its weight and stored into its token's (token, j) slot on the
token's rank (the router_grad_push kernel, backward_finish and the backward megakernel's last
phase).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .peers import D_ROUTER_WEIGHT_BUFFER, ROUTER_WEIGHT_BUFFER, peer_table, rank_address
from .value_checks import STATUS_BAD_WEIGHT_BACKWARD, flag_unless_positive_finite

# The smallest normal fp32: a router weight must be > 0 (a bad one sets the value-status word
# 1 + its rank and still divides in bounds), so this only keeps 0 / 0 out of the arithmetic.
FP32_TINY = 1.1754943508222875e-38


@cute.jit
def push_row(
    row: Int32,
    partials_ptr: cute.Pointer,
    peer_rank_ptr: cute.Pointer,
    peer_token_idx_ptr: cute.Pointer,
    num_tokens_ptr: cute.Pointer,
    weight_ptr: cute.Pointer,
    d_router_ptr: cute.Pointer,
    peer_table_ptr: cute.Pointer,
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
    weight_table = peer_table(peer_table_ptr, ROUTER_WEIGHT_BUFFER)
    d_router_table = peer_table(peer_table_ptr, D_ROUTER_WEIGHT_BUFFER)
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
