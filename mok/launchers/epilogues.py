"""Forward and backward epilogues: the fixed-order sums over each token's k slots.

Kernels `moe_combine_forward` / `moe_combine_backward` (mok/dsl_kernels/kernels): one CTA of
`threads` threads per (block of `tokens_per_cta` tokens, 8 * threads columns), 16-byte loads,
fp32 sums in j order with separate multiply and add roundings (bit-exact with
`mok.reference.fwd_epilogue` / `bwd_epilogue`). The forward one also checks every router
weight (> 0 and finite) into the value-status words (launchers/status.py). Both numbers come from the manifest's config
of the loaded variant, so the grid always matches the cubin.
"""

from __future__ import annotations

import torch

from .checks import check_host
from .plans import current_stream, plan, tensor_key
from .status import status_ptr

# bf16 columns per thread (one 16-byte vector).
COLUMNS_PER_THREAD = 8
# grid.y carries the token-block index and may not exceed this.
MAX_GRID_Y = 65535
HIDDEN_ALIGNMENT = 64


def epilogue_launches(kernel, num_tokens: int, hidden: int):
    """(grid, first token, token count) of each launch: grid (ceil(hidden / (8 * threads)),
    ceil(count / tokens_per_cta), 1), the manifest's `launch.grid` formula, in chunks of at
    most 65535 token blocks (grid.y limit; 262140 tokens per launch with 4 tokens per CTA)."""
    config = kernel.variant.config
    try:
        threads, tokens_per_cta = int(config["threads"]), int(config["tokens_per_cta"])
    except KeyError as error:
        raise RuntimeError(
            f"kernel {kernel.variant.name!r}: manifest config {dict(config)} lacks {error}; "
            "rebuild the cubins (python -m mok.dsl_kernels.build)"
        ) from None
    grid_x = -(-hidden // (COLUMNS_PER_THREAD * threads))
    max_tokens = MAX_GRID_Y * tokens_per_cta
    for start in range(0, num_tokens, max_tokens):
        count = min(max_tokens, num_tokens - start)
        yield (grid_x, -(-count // tokens_per_cta), 1), start, count


def fwd_epilogue(
    y_shared: torch.Tensor | None, slots: torch.Tensor, router_weights: torch.Tensor
) -> torch.Tensor:
    """out[t] = y_shared[t] + sum_j w[t, j] * slots[t * k + j] (bf16 [T, H])."""
    key = ("fwd_epilogue", tensor_key(y_shared), tensor_key(slots), tensor_key(router_weights),
           current_stream(slots.get_device()))  # fmt: skip
    return plan(key, lambda: fwd_epilogue_plan(y_shared, slots, router_weights.shape))(
        y_shared, slots, router_weights
    )


def fwd_epilogue_plan(y_shared, slots, weights_shape):
    """`fwd_epilogue`'s plan for these shapes (checked now): plan(y_shared, slots, weights)."""
    return _EpiloguePlan(True, y_shared, slots, weights_shape)


def check_epilogue(forward: bool, shared, slots, weights_shape_or_topk) -> tuple:
    """(num_tokens, hidden, topk) of an epilogue's tensors, checked: the forward one's
    router-weights shape [T, k], or the backward one's topk."""
    num_slots, hidden = slots.shape if slots.dim() == 2 else (None, None)
    if forward:
        num_tokens, topk = weights_shape_or_topk
    else:
        topk = weights_shape_or_topk
        if topk < 1 or num_slots is None or num_slots % topk:
            raise ValueError(f"slots rows ({num_slots}) must be a multiple of topk ({topk})")
        num_tokens = num_slots // topk
    if hidden is None or hidden % HIDDEN_ALIGNMENT:
        raise ValueError(f"hidden size must be a multiple of {HIDDEN_ALIGNMENT}, got {hidden}")
    check_host("slots", slots, torch.bfloat16, (num_tokens * topk, hidden))
    if shared is not None:
        name = "y_shared" if forward else "d_x_shared"
        check_host(name, shared, torch.bfloat16, (num_tokens, hidden))
    return num_tokens, hidden, topk


def bwd_epilogue_plan(d_x_shared, slots, topk: int):
    """`bwd_epilogue`'s plan for these shapes (checked now): plan(d_x_shared, slots)."""
    return _EpiloguePlan(False, d_x_shared, slots, topk)


def bwd_epilogue(d_x_shared: torch.Tensor | None, slots: torch.Tensor, topk: int) -> torch.Tensor:
    """d_x[t] = d_x_shared[t] + sum_j slots[t * k + j] (bf16 [T, H])."""
    key = ("bwd_epilogue", tensor_key(d_x_shared), tensor_key(slots), topk,
           current_stream(slots.get_device()))  # fmt: skip
    return plan(key, lambda: bwd_epilogue_plan(d_x_shared, slots, topk))(d_x_shared, slots)


class _EpiloguePlan:
    """One (shapes, shared or not) of an epilogue: checked and bound on its first call. Launch
    i covers tokens [start_i, start_i + count_i): its addresses are the call's plus offsets."""

    def __init__(self, forward: bool, shared, slots, weights_shape_or_topk):
        from mok.runtime import get_kernel  # noqa: PLC0415

        num_tokens, hidden, topk = check_epilogue(forward, shared, slots, weights_shape_or_topk)
        self.forward, self.shape, self.topk = forward, (num_tokens, hidden), topk
        self.device = slots.device
        self.device_index = slots.get_device()
        kernel = get_kernel("moe_combine_forward" if forward else "moe_combine_backward",
                            device=slots.device)  # fmt: skip
        has_shared = int(shared is not None)
        self.launches = []
        for grid, start, count in epilogue_launches(kernel, num_tokens, hidden):
            args = {
                "num_tokens": count,
                "hidden_size": hidden,
                "topk": topk,
                "has_shared": has_shared,
            }
            if forward:
                args.update(out_ptr=slots, shared_ptr=shared, weight_ptr=slots, slots_ptr=slots,
                            status_ptr=status_ptr(slots.device))  # fmt: skip
                dynamic = ("out_ptr", "shared_ptr", "weight_ptr", "slots_ptr")
            else:
                args.update(d_x_ptr=slots, d_x_shared_ptr=shared, slots_ptr=slots)
                dynamic = ("d_x_ptr", "d_x_shared_ptr", "slots_ptr")
            self.launches.append((kernel.bind(grid, args, dynamic), start))

    def __call__(self, shared, slots, router_weights=None, checked=False):
        """`checked`: the caller's plan checked router_weights' metadata (its key holds it)."""
        num_tokens, hidden = self.shape
        if self.forward and not checked:
            # A view of the weights needs only 4-byte alignment (scalar loads).
            check_host("router_weights", router_weights, torch.float32, (num_tokens, self.topk))
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=self.device)
        out_at, slots_at = out.data_ptr(), slots.data_ptr()
        shared_at = 0 if shared is None else shared.data_ptr()
        weights_at = 0 if router_weights is None else router_weights.data_ptr()
        row_bytes, k = 2 * hidden, self.topk
        stream = current_stream(self.device_index)
        for bound, start in self.launches:
            at = (out_at + start * row_bytes, shared_at and shared_at + start * row_bytes)
            if self.forward:
                bound.launch(*at, weights_at + start * k * 4, slots_at + start * k * row_bytes,
                             stream=stream)  # fmt: skip
            else:
                bound.launch(*at, slots_at + start * k * row_bytes, stream=stream)
        return out
