"""The router-weight gradient of each routed row, pushed to the rank that owns its token."""

from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Int32

from ..common.params import fp32_pointer, int32_pointer, int64_pointer, placeholders
from ..common.router_grad_rows import push_row

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
