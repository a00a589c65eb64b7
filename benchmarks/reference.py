"""A plain fp32 reference of the layer (per-expert loop, autograd for gradients) and the check.

The layer is mok.reference.naive_moe in fp32: written from SEMANTICS.md §1-2 with no schedule
and no bf16 rounding anywhere, sharing no code with mok's reference path or kernels, so every
implementation's error is measured against the exact math, not against another bf16 pipeline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.inputs import MoeInputs
from mok.reference import naive_moe

# Relative Frobenius error above which a result is wrong and is not timed. bf16 rounding of
# operands and outputs gives ~3e-3; 2e-2 leaves room for long sums but not for a bug.
MAX_REL_ERR = 2e-2

GRAD_NAMES = (
    "x",
    "router_weights",
    "gate",
    "up",
    "down",
    "shared_gate",
    "shared_up",
    "shared_down",
)


def swiglu_fp32(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SiLU(gate) * up in fp32, with the optional clamp of SEMANTICS.md §1."""
    gate, up = gate.float(), up.float()
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def moe_reference(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    router_weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    expert_offset: int = 0,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """fp32 output [T, H] of experts ``expert_offset .. expert_offset + len(gate)`` (+ shared).

    Slots routed to other experts contribute nothing, so a rank can compute its own experts'
    share of the group's tokens. Weights may be bf16 (cast per expert) or fp32 leaves. This is
    mok.reference.naive_moe (a per-expert loop with no schedule and no bf16 rounding) in fp32.
    """
    return naive_moe(x, router_weights, top_experts, gate, up, down, shared,
                     swiglu_limit=swiglu_limit, dtype=torch.float32,
                     expert_offset=expert_offset)  # fmt: skip


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float().requires_grad_(True)


def _grads(leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # An expert that got no token has no graph: its exact gradient is zero.
    return {n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in leaves.items()}


def reference_results(inputs: MoeInputs, with_grads: bool) -> dict[str, torch.Tensor]:
    """fp32 ``out`` (and gradients named as GRAD_NAMES) for this rank's part of the call.

    With EP > 1, out, d_x and d_router_weights need every expert but only local tokens, while
    local experts' weight gradients need every rank's tokens: two passes, each restricted.
    """
    limit = inputs.shape.swiglu_limit
    shared = inputs.shared
    token_leaves = {"x": _leaf(inputs.x), "router_weights": _leaf(inputs.router_weights)}
    if shared is not None:
        token_leaves.update(zip(GRAD_NAMES[5:], (_leaf(w) for w in shared), strict=True))
        shared = tuple(token_leaves[name] for name in GRAD_NAMES[5:])
    weight_leaves = {"gate": _leaf(inputs.gate), "up": _leaf(inputs.up), "down": _leaf(inputs.down)}
    grad = torch.enable_grad() if with_grads else torch.no_grad()
    with grad:
        if inputs.world_size == 1:
            out = moe_reference(
                token_leaves["x"],
                inputs.top_experts,
                token_leaves["router_weights"],
                *weight_leaves.values(),
                shared,
                swiglu_limit=limit,
            )
            if with_grads:
                out.backward(inputs.grad_output.float())
        else:
            out = moe_reference(
                token_leaves["x"],
                inputs.top_experts,
                token_leaves["router_weights"],
                inputs.gate_all,
                inputs.up_all,
                inputs.down_all,
                shared,
                swiglu_limit=limit,
            )
            if with_grads:
                out.backward(inputs.grad_output.float())
                partial = moe_reference(
                    inputs.x_all,
                    inputs.top_experts_all,
                    inputs.router_weights_all,
                    *weight_leaves.values(),
                    expert_offset=inputs.expert_offset,
                    swiglu_limit=limit,
                )
                partial.backward(inputs.grad_output_all.float())
    results = {"out": out.detach()}
    if with_grads:
        results.update(_grads(token_leaves))
        results.update(_grads(weight_leaves))
    return results


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp32 (inf on NaN, shape mismatch or zero norm)."""
    if actual is None or actual.shape != expected.shape:
        return float("inf")
    actual, expected = actual.detach(), expected.detach()
    diff = (actual.float() - expected.float()).norm()
    norm = expected.float().norm()
    if not torch.isfinite(diff) or norm == 0:
        return 0.0 if diff == 0 else float("inf")
    return float(diff / norm)


def compare(results: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict:
    """Relative error of every reference entry that ``results`` also has."""
    return {name: rel_err(results[name], ref) for name, ref in reference.items() if name in results}
