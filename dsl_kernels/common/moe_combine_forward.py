"""Forward epilogue of the MoE layer: the fixed-order weighted top-k sum of expert outputs."""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from .args import global_pointer
from .ptx import add_rn, mul_rn
from .row_chunks import VECTOR, chunked_row_views
from .value_checks import STATUS_BAD_WEIGHT_FORWARD, flag_unless_positive_finite

# Slots of each token loaded per step: with 4 tokens, 8 independent 16-byte loads per thread
# are in flight at once, and k = 2 (the latency-bound case) is a single step.
SLOTS_PER_STEP = 2


@dataclass(frozen=True)
class MoeCombineForward:
    """out[t, :] = bf16(shared[t, :] + sum_{j=0..k-1} weight[t, j] * slots[t*k + j, :]).

    Kernel parameters (in this order): `out_ptr` (bf16 [num_tokens, hidden_size]),
    `shared_ptr` (bf16 [num_tokens, hidden_size], may be null when has_shared == 0),
    `weight_ptr` (fp32 [num_tokens, topk]), `slots_ptr` (bf16 [num_tokens * topk, hidden_size]),
    `num_tokens`, `hidden_size`, `topk`, `has_shared` (int32; 0 = no shared expert),
    `status_ptr` (the value-status words: a weight <= 0 or non-finite sets its word).

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

    def compile_arguments(self) -> tuple:
        """Placeholders for `__call__`, in order (see common/args.py)."""
        return (
            global_pointer(BFloat16, 16),
            global_pointer(BFloat16, 16),
            global_pointer(Float32, 4),
            global_pointer(BFloat16, 16),
            Int32(0),
            Int32(0),
            Int32(0),
            Int32(0),
            global_pointer(Int32, 16),
        )

    @cute.jit
    def __call__(
        self,
        out_ptr: cute.Pointer,
        shared_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        slots_ptr: cute.Pointer,
        num_tokens: Int32,
        hidden_size: Int32,
        topk: Int32,
        has_shared: Int32,
        status_ptr: cute.Pointer,
    ):
        columns_per_cta = VECTOR * self.threads
        self.kernel(
            out_ptr,
            shared_ptr,
            weight_ptr,
            slots_ptr,
            num_tokens,
            hidden_size,
            topk,
            has_shared,
            status_ptr,
        ).launch(
            grid=[
                (hidden_size + columns_per_cta - 1) // columns_per_cta,
                (num_tokens + self.tokens_per_cta - 1) // self.tokens_per_cta,
                1,
            ],
            block=[self.threads, 1, 1],
        )

    @cute.kernel
    def kernel(
        self,
        out_ptr: cute.Pointer,
        shared_ptr: cute.Pointer,
        weight_ptr: cute.Pointer,
        slots_ptr: cute.Pointer,
        num_tokens: Int32,
        hidden_size: Int32,
        topk: Int32,
        has_shared: Int32,
        status_ptr: cute.Pointer,
    ):
        tokens = self.tokens_per_cta
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, _ = cute.arch.block_idx()
        chunks, (mOut, mShared, mSlots) = chunked_row_views(
            hidden_size,
            (out_ptr, num_tokens),
            (shared_ptr, num_tokens),
            (slots_ptr, num_tokens * topk),
        )
        mWeight = cute.make_tensor(weight_ptr, cute.make_layout(num_tokens * topk))
        bad_weight = status_ptr.toint() + Int64(STATUS_BAD_WEIGHT_FORWARD * 4)

        chunk = bidx * self.threads + tidx
        first_token = bidy * tokens
        rAcc = cute.make_rmem_tensor((VECTOR, tokens), Float32)

        # Only `chunk < chunks` can diverge, in the last column block.
        if chunk < chunks:
            # Step 0 is peeled (it alone loads the shared rows and initialises acc), so that
            # the loop carries nothing but the accumulators.
            self.accumulate_step(
                rAcc,
                mShared,
                mSlots,
                mWeight,
                chunk,
                first_token,
                num_tokens,
                topk,
                has_shared,
                bad_weight,
                Int32(0),
                True,
            )
            for j0 in cutlass.range(SLOTS_PER_STEP, topk, SLOTS_PER_STEP, unroll=1):
                self.accumulate_step(
                    rAcc,
                    mShared,
                    mSlots,
                    mWeight,
                    chunk,
                    first_token,
                    num_tokens,
                    topk,
                    has_shared,
                    bad_weight,
                    j0,
                    False,
                )

            # ---- out = bf16(acc), round to nearest even ----
            for t in cutlass.range_constexpr(tokens):
                token = first_token + t
                if token < num_tokens:
                    mOut[None, chunk, token].store(rAcc[None, t].load().to(BFloat16))

    @cute.jit
    def accumulate_step(
        self,
        rAcc: cute.Tensor,
        mShared: cute.Tensor,
        mSlots: cute.Tensor,
        mWeight: cute.Tensor,
        chunk: Int32,
        first_token: Int32,
        num_tokens: Int32,
        topk: Int32,
        has_shared: Int32,
        bad_weight: Int64,
        j0: Int32,
        first: cutlass.Constexpr,
    ):
        """Slots j0 .. j0 + SLOTS_PER_STEP - 1 of the thread's tokens into rAcc (VECTOR, tokens).

        Token and slot predicates are uniform across the CTA (they depend on bidy and topk
        only), so these branches never diverge.
        """
        tokens = self.tokens_per_cta
        # Raw bf16 landing buffers, converted only in the math phase (a conversion is a use:
        # it would wait for the load). Local to the step so that nothing but the accumulators
        # is live across steps: registers bound the CTAs per SM, hence the bytes in flight.
        rShared = cute.make_rmem_tensor((VECTOR, tokens), BFloat16)
        rSlots = cute.make_rmem_tensor((VECTOR, SLOTS_PER_STEP, tokens), BFloat16)
        rWeight = cute.make_rmem_tensor((SLOTS_PER_STEP, tokens), Float32)
        rSlot = cute.make_rmem_tensor((VECTOR,), Float32)

        # ---- load: every global load of the step, before any arithmetic ----
        for t in cutlass.range_constexpr(tokens):
            token = first_token + t
            if token < num_tokens:
                if cutlass.const_expr(first):
                    if has_shared != 0:
                        rShared[None, t].store(mShared[None, chunk, token].load())
                for s in cutlass.range_constexpr(SLOTS_PER_STEP):
                    if j0 + s < topk:
                        row = token * topk + j0 + s
                        rWeight[s, t] = mWeight[row]
                        rSlots[None, s, t].store(mSlots[None, chunk, row].load())

        # ---- math: acc = shared (or +0.0) in step 0, then acc = acc + w_j * slot_j ----
        for t in cutlass.range_constexpr(tokens):
            if first_token + t < num_tokens:
                if cutlass.const_expr(first):
                    rAcc[None, t].fill(0.0)
                    if has_shared != 0:
                        rAcc[None, t].store(rShared[None, t].load().to(Float32))
                for s in cutlass.range_constexpr(SLOTS_PER_STEP):
                    if j0 + s < topk:
                        flag_unless_positive_finite(rWeight[s, t], bad_weight, Int32(1))
                        rSlot.store(rSlots[None, s, t].load().to(Float32))
                        for i in cutlass.range_constexpr(VECTOR):
                            rAcc[i, t] = add_rn(rAcc[i, t], mul_rn(rWeight[s, t], rSlot[i]))
