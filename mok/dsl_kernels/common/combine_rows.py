"""The two epilogues' fixed-order top-k sum over a thread's rows (kernels/moe_combine_forward.py,
the weighted sum of expert outputs; kernels/moe_combine_backward.py, the plain sum of d_x
slots), and the backward epilogue's block of it (`combine_block`, also backward_finish's).

A thread holds 8 consecutive columns (16-byte loads and stores) of `tokens` consecutive tokens.
Per step of 2 slots (j, j+1) it first issues every load of the step (2 x tokens slot vectors,
their weights and, in step 0, the shared rows) and only then does the arithmetic, so its loads
overlap instead of queueing behind each other.
"""

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .ptx import add_rn, mul_rn
from .row_chunks import VECTOR, chunked_row_views
from .value_checks import flag_unless_positive_finite

# Slots of each token loaded per step: with 4 tokens, 8 independent 16-byte loads per thread
# are in flight at once, and k = 2 (the latency-bound case) is a single step.
SLOTS_PER_STEP = 2


@cute.jit
def combine_rows(tokens: cutlass.Constexpr, chunks: Int32, chunk: Int32, first_token: Int32,
                 num_tokens: Int32, topk: Int32, has_shared: Int32, mOut: cute.Tensor,
                 mShared: cute.Tensor, mSlots: cute.Tensor, weights=None,
                 slots_per_step: cutlass.Constexpr = SLOTS_PER_STEP):  # fmt: skip
    """mOut[:, chunk, t] = bf16(shared + sum_j [w_j *] slot_j) for this thread's tokens, j in
    order, every product and sum rounded on its own (mul.rn, add.rn). `weights`: (mWeight fp32
    [T * k], the value-status word's address a weight <= 0 or non-finite flags), or None for the
    unweighted sum. `slots_per_step`: slots of each token loaded per step (the order of the sum
    is the same for any)."""
    rAcc = cute.make_rmem_tensor((VECTOR, tokens), Float32)

    # Only `chunk < chunks` can diverge, in the last column block.
    if chunk < chunks:
        # Step 0 is peeled (it alone loads the shared rows and initialises acc), so that
        # the loop carries nothing but the accumulators.
        _accumulate_step(tokens, slots_per_step, rAcc, mShared, mSlots, weights, chunk,
                         first_token, num_tokens, topk, has_shared, Int32(0), True)  # fmt: skip
        for j0 in cutlass.range(slots_per_step, topk, slots_per_step, unroll=1):
            _accumulate_step(tokens, slots_per_step, rAcc, mShared, mSlots, weights, chunk,
                             first_token, num_tokens, topk, has_shared, j0, False)  # fmt: skip

        # ---- out = bf16(acc), round to nearest even ----
        for t in cutlass.range_constexpr(tokens):
            token = first_token + t
            if token < num_tokens:
                mOut[None, chunk, token].store(rAcc[None, t].load().to(BFloat16))


@cute.jit
def _accumulate_step(tokens: cutlass.Constexpr, slots_per_step: cutlass.Constexpr,
                     rAcc: cute.Tensor, mShared: cute.Tensor,
                     mSlots: cute.Tensor, weights, chunk: Int32, first_token: Int32,
                     num_tokens: Int32, topk: Int32, has_shared: Int32, j0: Int32,
                     first: cutlass.Constexpr):  # fmt: skip
    """Slots j0 .. j0 + slots_per_step - 1 of the thread's tokens into rAcc (VECTOR, tokens).

    Token and slot predicates are uniform across the CTA (they depend on bidy and topk
    only), so these branches never diverge.
    """
    # Raw bf16 landing buffers, converted only in the math phase (a conversion is a use:
    # it would wait for the load). Local to the step so that nothing but the accumulators
    # is live across steps: registers bound the CTAs per SM, hence the bytes in flight.
    rShared = cute.make_rmem_tensor((VECTOR, tokens), BFloat16)
    rSlots = cute.make_rmem_tensor((VECTOR, slots_per_step, tokens), BFloat16)
    rWeight = None
    if cutlass.const_expr(weights is not None):
        rWeight = cute.make_rmem_tensor((slots_per_step, tokens), Float32)
    rSlot = cute.make_rmem_tensor((VECTOR,), Float32)

    # ---- load: every global load of the step, before any arithmetic ----
    for t in cutlass.range_constexpr(tokens):
        token = first_token + t
        if token < num_tokens:
            if cutlass.const_expr(first):
                if has_shared != 0:
                    rShared[None, t].store(mShared[None, chunk, token].load())
            for s in cutlass.range_constexpr(slots_per_step):
                if j0 + s < topk:
                    row = token * topk + j0 + s
                    if cutlass.const_expr(weights is not None):
                        rWeight[s, t] = weights[0][row]
                    rSlots[None, s, t].store(mSlots[None, chunk, row].load())

    # ---- math: acc = shared (or +0.0) in step 0, then acc = acc + [w_j *] slot_j ----
    for t in cutlass.range_constexpr(tokens):
        if first_token + t < num_tokens:
            if cutlass.const_expr(first):
                rAcc[None, t].fill(0.0)
                if has_shared != 0:
                    rAcc[None, t].store(rShared[None, t].load().to(Float32))
            for s in cutlass.range_constexpr(slots_per_step):
                if j0 + s < topk:
                    if cutlass.const_expr(weights is not None):
                        flag_unless_positive_finite(rWeight[s, t], weights[1], Int32(1))
                    rSlot.store(rSlots[None, s, t].load().to(Float32))
                    for i in cutlass.range_constexpr(VECTOR):
                        if cutlass.const_expr(weights is not None):
                            rAcc[i, t] = add_rn(rAcc[i, t], mul_rn(rWeight[s, t], rSlot[i]))
                        else:
                            rAcc[i, t] = add_rn(rAcc[i, t], rSlot[i])


@cute.jit
def combine_block(threads: cutlass.Constexpr, tokens: cutlass.Constexpr, tidx: Int32,
                  bidx: Int32, bidy: Int32, d_x_ptr: cute.Pointer, d_x_shared_ptr: cute.Pointer,
                  slots_ptr: cute.Pointer, num_tokens: Int32, hidden_size: Int32, topk: Int32,
                  has_shared: Int32):  # fmt: skip
    """`MoeCombineBackward`'s work for thread `tidx` of CTA (bidx, bidy) of its grid."""
    chunks, (mDx, mShared, mSlots) = chunked_row_views(
        hidden_size,
        (d_x_ptr, num_tokens),
        (d_x_shared_ptr, num_tokens),
        (slots_ptr, num_tokens * topk),
    )
    chunk = bidx * threads + tidx
    first_token = bidy * tokens
    combine_rows(tokens, chunks, chunk, first_token, num_tokens, topk, has_shared, mDx,
                 mShared, mSlots)  # fmt: skip
