"""A group of one's backward after its megakernel, in one launch: the router-weight gradients
(router_grad_push.py) and the d_x epilogue (moe_combine_backward.py), which read disjoint
inputs and write disjoint outputs."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..common.combine_rows import combine_block
from ..common.params import bf16_pointer, fp32_pointer, int32_pointer, placeholders
from ..common.router_grad_rows import push_row
from ..common.row_chunks import VECTOR

# `__call__`'s parameters, in order.
PARAMS = (
    ("d_x_ptr", bf16_pointer),
    ("d_x_shared_ptr", bf16_pointer),
    ("slots_ptr", bf16_pointer),
    ("num_tokens", Int32(0)),
    ("hidden_size", Int32(0)),
    ("topk", Int32(0)),
    ("has_shared", Int32(0)),
    ("partials_ptr", fp32_pointer),
    ("peer_rank_ptr", int32_pointer),
    ("peer_token_idx_ptr", int32_pointer),
    ("num_rows_ptr", int32_pointer),
    ("weight_ptr", fp32_pointer),
    ("d_router_ptr", fp32_pointer),
    ("num_rows", Int32(0)),
    ("blocks", Int32(1)),
    ("status_ptr", int32_pointer),
)


@dataclass(frozen=True)
class BackwardFinish:
    """CTAs [0, C) are `MoeCombineBackward`'s grid (C = gx * gy, gx = ceil(hidden_size /
    (8 * threads)), gy = ceil(num_tokens / tokens_per_cta); CTA b is its (b % gx, b // gx));
    CTAs [C, C + ceil(num_rows / threads)) are `RouterGradPush`'s of a group of one (no peer
    tables, rank 0). Each does exactly what its kernel does, so the outputs are those kernels'
    bits.

    Kernel parameters, in order: the epilogue's (`d_x_ptr`, `d_x_shared_ptr` (null when
    has_shared == 0), `slots_ptr`, `num_tokens`, `hidden_size`, `topk`, `has_shared`), then the
    push's (`partials_ptr`, `peer_rank_ptr`, `peer_token_idx_ptr`, `num_rows_ptr` (the
    schedule's routed-row count), `weight_ptr`, `d_router_ptr`, `num_rows`, `blocks`,
    `status_ptr`). Constraints: both kernels'; gy <= 65535 (as the epilogue's grid.y).
    Launch: grid (C + ceil(num_rows / threads), 1, 1), block (threads, 1, 1).
    """

    threads: int = 128
    tokens_per_cta: int = 4

    def validate(self) -> None:
        if self.threads not in (64, 128, 256):
            raise ValueError(f"threads must be one of 64, 128, 256, got {self.threads}")
        if self.tokens_per_cta not in (1, 2, 4, 8):
            raise ValueError(f"tokens_per_cta must be one of 1, 2, 4, 8, got {self.tokens_per_cta}")

    def compile_arguments(self) -> tuple:
        return placeholders(PARAMS)

    @cute.jit
    def __call__(
        self,
        d_x_ptr: cute.Pointer,
        d_x_shared_ptr: cute.Pointer,
        slots_ptr: cute.Pointer,
        num_tokens: Int32,
        hidden_size: Int32,
        topk: Int32,
        has_shared: Int32,
        partials_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_rows_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        d_router_ptr: cute.Pointer,
        num_rows: Int32,
        blocks: Int32,
        status_ptr: cute.Pointer,
    ):
        columns = VECTOR * self.threads
        combine_ctas = ((hidden_size + columns - 1) // columns) * (
            (num_tokens + self.tokens_per_cta - 1) // self.tokens_per_cta
        )
        self.kernel(
            d_x_ptr, d_x_shared_ptr, slots_ptr, num_tokens, hidden_size, topk, has_shared,
            partials_ptr, peer_rank_ptr, peer_token_idx_ptr, num_rows_ptr, weight_ptr,
            d_router_ptr, num_rows, blocks, status_ptr,
        ).launch(grid=[combine_ctas + (num_rows + self.threads - 1) // self.threads, 1, 1],
                 block=[self.threads, 1, 1])  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        d_x_ptr: cute.Pointer,
        d_x_shared_ptr: cute.Pointer,
        slots_ptr: cute.Pointer,
        num_tokens: Int32,
        hidden_size: Int32,
        topk: Int32,
        has_shared: Int32,
        partials_ptr: cute.Pointer,
        peer_rank_ptr: cute.Pointer,
        peer_token_idx_ptr: cute.Pointer,
        num_rows_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        d_router_ptr: cute.Pointer,
        num_rows: Int32,
        blocks: Int32,
        status_ptr: cute.Pointer,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        columns = VECTOR * self.threads
        grid_x = (hidden_size + columns - 1) // columns
        combine_ctas = grid_x * ((num_tokens + self.tokens_per_cta - 1) // self.tokens_per_cta)
        if bidx < combine_ctas:
            combine_block(self.threads, self.tokens_per_cta, tidx, bidx % grid_x, bidx // grid_x,
                          d_x_ptr, d_x_shared_ptr, slots_ptr, num_tokens, hidden_size, topk,
                          has_shared)  # fmt: skip
        else:
            # A group of one: its own router weights and d_router (null tables, rank 0).
            no_table = cute.make_ptr(cutlass.Int64, cutlass.Int64(0), cute.AddressSpace.gmem,
                                    assumed_align=8)  # fmt: skip
            push_row(
                (bidx - combine_ctas) * self.threads + tidx, partials_ptr, peer_rank_ptr,
                peer_token_idx_ptr, num_rows_ptr, weight_ptr, d_router_ptr, no_table, no_table,
                Int32(0), num_rows, blocks, status_ptr,
            )  # fmt: skip
