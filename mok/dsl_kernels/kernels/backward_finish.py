"""A group of one's backward after its megakernel, in one launch: the router-weight gradients
(router_grad_push.py) and the d_x epilogue (moe_combine_backward.py), which read disjoint
inputs and write disjoint outputs."""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..common.combine_rows import combine_block
from ..common.params import Fp32Pointer, Int32Pointer
from ..common.router_grad_rows import push_row
from ..common.row_chunks import VECTOR
from .moe_combine_backward import CombineBackwardArgs


class FinishPushArgs(NamedTuple):
    """The push's parameters, in order: `RouterGradPushArgs` of a group of one (no peer table,
    rank 0)."""

    partials_ptr: Fp32Pointer
    peer_rank_ptr: Int32Pointer
    peer_token_idx_ptr: Int32Pointer
    num_rows_ptr: Int32Pointer  # the schedule's routed-row count
    weight_ptr: Fp32Pointer
    d_router_ptr: Fp32Pointer
    num_rows: Int32
    blocks: Int32
    status_ptr: Int32Pointer


@dataclass(frozen=True)
class BackwardFinish:
    """CTAs [0, C) are `MoeCombineBackward`'s grid (C = gx * gy, gx = ceil(hidden_size /
    (8 * threads)), gy = ceil(num_tokens / tokens_per_cta); CTA b is its (b % gx, b // gx));
    CTAs [C, C + ceil(num_rows / threads)) are `RouterGradPush`'s of a group of one (no peer
    table, rank 0). Each does exactly what its kernel does, so the outputs are those kernels'
    bits.

    Kernel parameters: the epilogue's (`CombineBackwardArgs`), then the push's
    (`FinishPushArgs`). Constraints: both kernels'; gy <= 65535 (as the epilogue's grid.y).
    Launch: grid (C + ceil(num_rows / threads), 1, 1), block (threads, 1, 1).
    """

    threads: int = 128
    tokens_per_cta: int = 4

    def validate(self) -> None:
        if self.threads not in (64, 128, 256):
            raise ValueError(f"threads must be one of 64, 128, 256, got {self.threads}")
        if self.tokens_per_cta not in (1, 2, 4, 8):
            raise ValueError(f"tokens_per_cta must be one of 1, 2, 4, 8, got {self.tokens_per_cta}")

    @cute.jit
    def __call__(self, combine: CombineBackwardArgs, push: FinishPushArgs):
        columns = VECTOR * self.threads
        combine_ctas = ((combine.hidden_size + columns - 1) // columns) * (
            (combine.num_tokens + self.tokens_per_cta - 1) // self.tokens_per_cta
        )
        self.kernel(combine, push).launch(
            grid=[combine_ctas + (push.num_rows + self.threads - 1) // self.threads, 1, 1],
            block=[self.threads, 1, 1],
        )

    @cute.kernel
    def kernel(self, combine: CombineBackwardArgs, push: FinishPushArgs):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        columns = VECTOR * self.threads
        grid_x = (combine.hidden_size + columns - 1) // columns
        combine_ctas = grid_x * (
            (combine.num_tokens + self.tokens_per_cta - 1) // self.tokens_per_cta
        )
        if bidx < combine_ctas:
            combine_block(
                self.threads, self.tokens_per_cta, tidx, bidx % grid_x, bidx // grid_x, *combine
            )
        else:
            # A group of one: its own router weights and d_router (a null table, rank 0).
            no_table = cute.make_ptr(
                cutlass.Int64, cutlass.Int64(0), cute.AddressSpace.gmem, assumed_align=8
            )
            row = (bidx - combine_ctas) * self.threads + tidx
            push_row(row, *push[:6], no_table, Int32(0), *push[6:])
