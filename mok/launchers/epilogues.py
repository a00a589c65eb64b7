"""Forward and backward epilogues: the fixed-order sums over each token's k slots.

Kernels `moe_combine_forward` / `moe_combine_backward` (dsl_kernels/common): one CTA of
`threads` threads per (block of `tokens_per_cta` tokens, 8 * threads columns), 16-byte loads,
fp32 sums in j order with separate multiply and add roundings (bit-exact with
`mok.reference.fwd_epilogue` / `bwd_epilogue`). The forward one also checks every router
weight (> 0 and finite) into the value-status words (launchers/status.py). Both numbers come from the manifest's config
of the loaded variant, so the grid always matches the cubin.
"""

from __future__ import annotations

import torch

from .checks import check_host
from .status import status_ptr

# bf16 columns per thread (one 16-byte vector).
COLUMNS_PER_THREAD = 8
# grid.y carries the token-block index and may not exceed this.
MAX_GRID_Y = 65535
HIDDEN_ALIGNMENT = 64


def _launches(kernel, num_tokens: int, hidden: int):
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
    from mok.runtime import get_kernel  # noqa: PLC0415

    num_tokens, topk = router_weights.shape
    hidden = slots.shape[1]
    if hidden % HIDDEN_ALIGNMENT:
        raise ValueError(f"hidden size must be a multiple of {HIDDEN_ALIGNMENT}, got {hidden}")
    check_host("slots", slots, torch.bfloat16, (num_tokens * topk, hidden))
    check_host("router_weights", router_weights, torch.float32, (num_tokens, topk))
    if y_shared is not None:
        check_host("y_shared", y_shared, torch.bfloat16, (num_tokens, hidden))
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=slots.device)
    kernel = get_kernel("moe_combine_forward", device=slots.device)
    status = status_ptr(slots.device)
    for grid, start, count in _launches(kernel, num_tokens, hidden):
        kernel.launch(
            grid,
            {
                "out_ptr": out[start:],
                "shared_ptr": None if y_shared is None else y_shared[start:],
                "weight_ptr": router_weights[start:],
                "slots_ptr": slots[start * topk :],
                "num_tokens": count,
                "hidden_size": hidden,
                "topk": topk,
                "has_shared": int(y_shared is not None),
                "status_ptr": status,
            },
        )
    return out


def bwd_epilogue(d_x_shared: torch.Tensor | None, slots: torch.Tensor, topk: int) -> torch.Tensor:
    from mok.runtime import get_kernel  # noqa: PLC0415

    num_slots, hidden = slots.shape
    if hidden % HIDDEN_ALIGNMENT:
        raise ValueError(f"hidden size must be a multiple of {HIDDEN_ALIGNMENT}, got {hidden}")
    if topk < 1 or num_slots % topk:
        raise ValueError(f"slots rows ({num_slots}) must be a multiple of topk ({topk})")
    num_tokens = num_slots // topk
    check_host("slots", slots, torch.bfloat16, (num_slots, hidden))
    if d_x_shared is not None:
        check_host("d_x_shared", d_x_shared, torch.bfloat16, (num_tokens, hidden))
    d_x = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=slots.device)
    kernel = get_kernel("moe_combine_backward", device=slots.device)
    for grid, start, count in _launches(kernel, num_tokens, hidden):
        kernel.launch(
            grid,
            {
                "d_x_ptr": d_x[start:],
                "d_x_shared_ptr": None if d_x_shared is None else d_x_shared[start:],
                "slots_ptr": slots[start * topk :],
                "num_tokens": count,
                "hidden_size": hidden,
                "topk": topk,
                "has_shared": int(d_x_shared is not None),
            },
        )
    return d_x
