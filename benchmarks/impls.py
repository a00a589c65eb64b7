"""What the harness runs: one ``Impl`` per implementation, built for one shape's inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.baselines import torchtitan_moe
from benchmarks.inputs import MoeInputs
from benchmarks.reference import MAX_REL_ERR

SHARED_NAMES = ("shared_gate", "shared_up", "shared_down")


@dataclass
class Impl:
    """One implementation bound to one call's inputs.

    ``forward()`` returns (out [T, H] bf16, state); ``backward(state, grad_output)`` returns the
    gradients by name (x, router_weights, gate, up, down, shared_*). The forward is a training
    forward: it keeps what the backward needs.

    ``backward`` is ``None`` for a forward-only implementation: ``no_backward`` says why, as the
    status of its other passes. ``max_rel_err``: the error above which its check fails.
    ``state_bytes(state)``, where given: bytes of what the forward keeps for the backward.
    ``vs_mok``: its timed rows carry ``ratio_vs_mok_bf16``, the bf16 mok row's time over its.
    """

    name: str
    label: str
    is_baseline: bool
    forward: Callable[[], tuple[torch.Tensor, object]]
    backward: Callable[[object, torch.Tensor], dict[str, torch.Tensor]] | None
    no_backward: str | None = None
    max_rel_err: float = MAX_REL_ERR
    state_bytes: Callable[[object], int] | None = None
    vs_mok: bool = False


def baseline_impl(
    inputs: MoeInputs, *, align: int, use_grouped_mm: bool, detail: str, group=None
) -> Impl:
    """The torchtitan-style layer with autograd, over leaves that share the inputs' storage."""
    leaves = {
        "x": inputs.x,
        "router_weights": inputs.router_weights,
        "gate": inputs.gate,
        "up": inputs.up,
        "down": inputs.down,
    }
    if inputs.shared is not None:
        leaves.update(zip(SHARED_NAMES, inputs.shared, strict=True))
    leaves = {name: t.detach().requires_grad_(True) for name, t in leaves.items()}
    shared = tuple(leaves[n] for n in SHARED_NAMES) if inputs.shared is not None else None

    def forward():
        out = torchtitan_moe(
            leaves["x"],
            inputs.top_experts,
            leaves["router_weights"],
            leaves["gate"],
            leaves["up"],
            leaves["down"],
            shared,
            swiglu_limit=inputs.shape.swiglu_limit,
            align=align,
            use_grouped_mm=use_grouped_mm,
            group=group,
        )
        return out, out

    def backward(out, grad_output):
        out.backward(grad_output)
        grads = {name: t.grad for name, t in leaves.items()}
        for t in leaves.values():
            t.grad = None  # fresh gradients each call, as mok returns new tensors
        return grads

    ep = "" if group is None else " + NCCL all_to_all_single"
    if use_grouped_mm:
        name, label = "torch_grouped_mm", f"torchtitan-style torch._grouped_mm, align {align}{ep}"
    else:
        name, label = "torch_loop", f"per-expert matmul loop{ep} ({detail})"
    if group is not None:
        name += "_a2a"
    return Impl(name, label, True, forward, backward)
