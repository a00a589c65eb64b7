"""The router-weight gradient of each routed row, pushed to the rank that owns its token."""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32

from ..common.params import Fp32Pointer, Int32Pointer, Int64Pointer
from ..common.router_grad_rows import push_row


class RouterGradPushArgs(NamedTuple):
    """`RouterGradPush`'s parameters, in order: `push_row`'s."""

    partials_ptr: Fp32Pointer  # fp32 [num_rows, blocks]
    peer_rank_ptr: Int32Pointer  # int32 [num_rows]
    peer_token_idx_ptr: Int32Pointer  # int32 [num_rows]
    num_tokens_ptr: Int32Pointer  # int32 [1]: the schedule's routed rows
    weight_ptr: Fp32Pointer  # this rank's router weights, fp32 [T * k]
    d_router_ptr: Fp32Pointer  # this rank's d_router, fp32 [T * k]
    # int64 [buffers, 128]: the EP group's peer table (common/peers.py), for the peers' router
    # weights and d_router
    peer_table_ptr: Int64Pointer
    ep_rank: Int32
    num_rows: Int32
    blocks: Int32
    status_ptr: Int32Pointer  # the value-status words


@dataclass(frozen=True)
class RouterGradPush:
    """For every routed row r < num_tokens with peer_rank[r] >= 0:

        d_router[p][peer_token_idx[r]] = (sum_{b=0..blocks-1} partials[r, b]) / max(w, tiny)
        w = router_weights[p][peer_token_idx[r]],  p = peer_rank[r]

    `partials` hold <dY_e, y> = w * <dY, y> per 128-column block (the d_hidden epilogue's), so
    the quotient is <dY, y>. The sum runs in increasing b, one thread per row: the same bits on
    every rank and EP size. router_weights[p] and d_router[p] (fp32 [T * k]) are this rank's
    `weight_ptr` / `d_router_ptr` for p == ep_rank and the peer table's router_weight_buffer
    and d_router_weight_buffer rows otherwise. The pushed values are read by their rank after the group's end barrier.

    Kernel parameters: `RouterGradPushArgs`. Launch: grid (ceil(num_rows / threads), 1, 1),
    block (threads, 1, 1).
    """

    threads: int = 128

    def validate(self) -> None:
        if self.threads not in (64, 128, 256):
            raise ValueError(f"threads must be one of 64, 128, 256, got {self.threads}")

    @cute.jit
    def __call__(self, args: RouterGradPushArgs):
        self.kernel(args).launch(
            grid=[(args.num_rows + self.threads - 1) // self.threads, 1, 1],
            block=[self.threads, 1, 1],
        )

    @cute.kernel
    def kernel(self, args: RouterGradPushArgs):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        push_row(bidx * self.threads + tidx, *args)
