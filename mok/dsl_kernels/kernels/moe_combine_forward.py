"""Forward epilogue of the MoE layer: the fixed-order weighted top-k sum of expert outputs."""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32, Int64

from ..common.combine_rows import combine_rows
from ..common.params import Bf16Pointer, Fp32Pointer, aligned_pointer
from ..common.row_chunks import VECTOR, chunked_row_views
from ..common.value_checks import STATUS_BAD_WEIGHT_FORWARD

StatusPointer = aligned_pointer(Int32, 16)


class CombineForwardArgs(NamedTuple):
    """`MoeCombineForward`'s parameters, in order."""

    out_ptr: Bf16Pointer  # bf16 [num_tokens, hidden_size]
    shared_ptr: Bf16Pointer  # bf16 [num_tokens, hidden_size], may be null if not has_shared
    weight_ptr: Fp32Pointer  # fp32 [num_tokens, topk]
    slots_ptr: Bf16Pointer  # bf16 [num_tokens * topk, hidden_size]
    num_tokens: Int32
    hidden_size: Int32
    topk: Int32
    has_shared: Int32  # 0 = no shared expert
    # the value-status words: a weight <= 0 or non-finite sets its word
    status_ptr: StatusPointer


@dataclass(frozen=True)
class MoeCombineForward:
    """out[t, :] = bf16(shared[t, :] + sum_{j=0..k-1} weight[t, j] * slots[t*k + j, :]).

    Kernel parameters: `CombineForwardArgs`.

    Exact arithmetic (a PyTorch reference reproduces it bit for bit), per element, in fp32:
        acc = float(shared[t, h]) if has_shared else +0.0
        for j in 0..topk-1:  acc = acc + (weight[t, j] * float(slots[t*k + j, h]))
        out[t, h] = bf16(acc)   (round to nearest even)
    Each product and each sum is rounded separately (mul.rn.f32 then add.rn.f32, never an fma),
    i.e. torch: `acc = acc + w[:, j, None] * slots[:, j, :].float()` in fp32, then `.bfloat16()`.

    Constraints (the caller checks them; the kernel does not):
    - hidden_size % 64 == 0, hidden_size > 0; 1 <= topk <= 32 (any topk >= 1 is correct: it
      is a loop bound); num_tokens >= 0 (0: launch nothing); any num_tokens (the last CTA
      predicates the tokens past the end).
    - out, shared and slots 16-byte aligned and contiguous; weight 4-byte aligned.
    - ceil(num_tokens / tokens_per_cta) <= 65535 (grid.y limit); offsets are 64-bit: no limit
      on the tensor sizes.
    - launch: grid (ceil(hidden_size / (8 * threads)), ceil(num_tokens / tokens_per_cta), 1),
      block (threads, 1, 1), no dynamic smem, cluster (1, 1, 1).

    Work split: thread = 8 consecutive columns (16-byte loads and stores) of `tokens_per_cta`
    consecutive tokens. Per step of 2 slots (j, j+1), a thread first issues every load of the
    step (2 x tokens_per_cta slot vectors, their weights and, in step 0, the shared rows) and
    only then does the arithmetic, so its loads overlap instead of queueing behind each other.
    """

    threads: int = 128
    tokens_per_cta: int = 4

    def validate(self) -> None:
        if self.threads not in (64, 128, 256, 512):
            raise ValueError(f"threads must be one of 64, 128, 256, 512, got {self.threads}")
        if self.tokens_per_cta not in (1, 2, 4, 8):
            raise ValueError(f"tokens_per_cta must be one of 1, 2, 4, 8, got {self.tokens_per_cta}")

    @cute.jit
    def __call__(self, args: CombineForwardArgs):
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
    def kernel(self, args: CombineForwardArgs):
        tokens = self.tokens_per_cta
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        chunks, (mOut, mShared, mSlots) = chunked_row_views(
            args.hidden_size,
            (args.out_ptr, args.num_tokens),
            (args.shared_ptr, args.num_tokens),
            (args.slots_ptr, args.num_tokens * args.topk),
        )
        mWeight = cute.make_tensor(args.weight_ptr, cute.make_layout(args.num_tokens * args.topk))
        bad_weight = args.status_ptr.toint() + Int64(STATUS_BAD_WEIGHT_FORWARD * 4)

        chunk = bidx * self.threads + tidx
        first_token = bidy * tokens
        combine_rows(
            tokens, chunks, chunk, first_token, args.num_tokens, args.topk, args.has_shared,
            mOut, mShared, mSlots, (mWeight, bad_weight),
        )  # fmt: skip
