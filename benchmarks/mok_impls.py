"""The hook for mok rows: ``MOK_IMPLS`` maps a row name to a builder of an ``Impl``.

There is one mok row per pass: on a GPU, ``mok`` runs the forward megakernel and the backward
megakernel, the only GPU implementation of each pass.

A builder returns ``None`` when it cannot run here (``mok.functional`` not importable, no
workspace for this device); ``unavailable_reason(name)`` then says why. A GPU whose kernel has
not landed raises ``MoKKernelUnavailableError`` at the first call: ``describe_failure`` turns
that into the row's status. Either way the harness prints the reason, never a number.
Calls follow SEMANTICS.md §3. On a CPU mok runs its PyTorch reference path (not a kernel):
that row is named ``mok_cpu_path`` so that it cannot be read as a kernel time.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.impls import SHARED_NAMES, Impl
from benchmarks.inputs import MoeInputs

NOT_AVAILABLE = "kernel not available (issue 4)"
_REASONS: dict[str, str] = {}

GRAD_ORDER = ("x", "router_weights", "gate", "up", "down", *SHARED_NAMES)


def unavailable_reason(name: str) -> str:
    return _REASONS.get(name, NOT_AVAILABLE)


def describe_failure(error: Exception) -> str:
    """Status text of an implementation that raised during its check."""
    if type(error).__name__ == "MoKKernelUnavailableError":
        return f"{NOT_AVAILABLE}: {error}"
    return f"error: {type(error).__name__}: {error}"


def _build_mok_bf16(inputs: MoeInputs, group) -> Impl | None:
    """mok's bf16 layer: schedule + forward timed together, backward from the saved context."""
    try:
        import mok.functional as functional

        config = functional.MoKConfig()
        # The GPU path holds every routed row at once: a macrobatch of at least T * k rows.
        rows = inputs.num_tokens * inputs.shape.topk
        if config.macrobatch_size < rows:
            step = config.minibatch_size
            config = functional.MoKConfig(macrobatch_size=-(-rows // step) * step)
        workspace = functional.get_workspace(
            config,
            group,
            device=inputs.x.device,
            num_local_tokens=inputs.num_tokens,
            hidden_size=inputs.shape.hidden_size,
            topk=inputs.shape.topk,
            num_local_experts=inputs.shape.experts_per_rank,
        )
    except Exception as error:  # not importable, device not supported, ...: no number
        _REASONS["mok"] = f"{NOT_AVAILABLE}: {type(error).__name__}: {error}"
        return None

    shared = inputs.shared if inputs.shared is not None else (None, None, None)
    weights = (*shared, inputs.gate, inputs.up, inputs.down)
    limit = inputs.shape.swiglu_limit

    def forward():
        schedule = functional.build_schedule(
            workspace, config, inputs.top_experts, num_local_experts=inputs.shape.experts_per_rank
        )
        out, context = functional.forward(
            config,
            workspace,
            schedule,
            inputs.x,
            inputs.router_weights,
            *weights,
            swiglu_limit=limit,
        )
        return out, (schedule, context)

    def backward(state, grad_output):
        schedule, context = state
        grads = functional.backward(
            config,
            workspace,
            schedule,
            context,
            grad_output,
            inputs.x,
            inputs.router_weights,
            *weights,
            swiglu_limit=limit,
        )
        # backward returns (d_x, d_rw, d_routed gate/up/down, d_shared gate/up/down)
        return {n: g for n, g in zip(GRAD_ORDER, grads, strict=True) if g is not None}

    if inputs.x.device.type == "cpu":
        return Impl("mok_cpu_path", "mok CPU path (PyTorch reference)", False, forward, backward)
    label = "mok (bf16: forward megakernel, backward megakernel)"
    return Impl("mok", label, False, forward, backward)


MOK_IMPLS: dict[str, Callable[[MoeInputs, object], Impl | None]] = {
    "mok": _build_mok_bf16,
}
