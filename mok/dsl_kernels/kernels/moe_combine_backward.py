"""Backward epilogue of the MoE layer: the fixed-order top-k sum of d_x rows."""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32

from ..common.combine_rows import combine_block
from ..common.params import Bf16Pointer
from ..common.row_chunks import VECTOR


class CombineBackwardArgs(NamedTuple):
    """`MoeCombineBackward`'s parameters, in order: `combine_block`'s."""

    d_x_ptr: Bf16Pointer  # bf16 [num_tokens, hidden_size]
    d_x_shared_ptr: Bf16Pointer  # bf16 [num_tokens, hidden_size], may be null if not has_shared
    slots_ptr: Bf16Pointer  # bf16 [num_tokens * topk, hidden_size]
    num_tokens: Int32
    hidden_size: Int32
    topk: Int32
    has_shared: Int32  # 0 = no shared expert


@dataclass(frozen=True)
class MoeCombineBackward:
    """d_x[t, :] = bf16(d_x_shared[t, :] + sum_{j=0..k-1} slots[t*k + j, :]).

    Kernel parameters: `CombineBackwardArgs`.

    Exact arithmetic (a PyTorch reference reproduces it bit for bit), per element, in fp32:
        acc = float(d_x_shared[t, h]) if has_shared else +0.0
        for j in 0..topk-1:  acc = acc + float(slots[t*k + j, h])      (add.rn.f32)
        d_x[t, h] = bf16(acc)   (round to nearest even)
    i.e. torch: `acc = acc + slots[:, j, :].float()` in fp32 for j in order, then `.bfloat16()`.

    Constraints (the caller checks them; the kernel does not):
    - hidden_size % 64 == 0, hidden_size > 0; 1 <= topk <= 32 (any topk >= 1 is correct: it
      is a loop bound); num_tokens >= 0 (0: launch nothing); any num_tokens (the last CTA
      predicates the tokens past the end).
    - all pointers 16-byte aligned and contiguous.
    - ceil(num_tokens / tokens_per_cta) <= 65535 (grid.y limit); offsets are 64-bit: no limit
      on the tensor sizes.
    - launch: grid (ceil(hidden_size / (8 * threads)), ceil(num_tokens / tokens_per_cta), 1),
      block (threads, 1, 1), no dynamic smem, cluster (1, 1, 1).

    Work split: thread = 8 consecutive columns (16-byte loads and stores) of `tokens_per_cta`
    consecutive tokens. Per step of 2 slots (j, j+1), a thread first issues every load of the
    step (2 x tokens_per_cta slot vectors and, in step 0, the d_x_shared rows) and only then
    does the arithmetic, so its loads overlap instead of queueing behind each other.
    """

    threads: int = 128
    tokens_per_cta: int = 4

    def validate(self) -> None:
        if self.threads not in (64, 128, 256, 512):
            raise ValueError(f"threads must be one of 64, 128, 256, 512, got {self.threads}")
        if self.tokens_per_cta not in (1, 2, 4, 8):
            raise ValueError(f"tokens_per_cta must be one of 1, 2, 4, 8, got {self.tokens_per_cta}")

    @cute.jit
    def __call__(self, args: CombineBackwardArgs):
        columns_per_cta = VECTOR * self.threads
        self.kernel(args).launch(
            grid=[
                (args.hidden_size + columns_per_cta - 1) // columns_per_cta,
                (args.num_tokens + self.tokens_per_cta - 1) // self.tokens_per_cta,
                1,
            ],
            block=[self.threads, 1, 1],
        )

    @cute.kernel
    def kernel(self, args: CombineBackwardArgs):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        combine_block(self.threads, self.tokens_per_cta, tidx, bidx, bidy, *args)
