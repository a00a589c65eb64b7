"""The hook for mok rows: ``MOK_IMPLS`` maps a row name to a builder of an ``Impl``.

There is one mok row per pass: on a GPU, ``mok`` runs the forward megakernel and the backward
megakernel, the only GPU implementation of each pass. ``--mxfp8`` adds ``MXFP8_IMPLS``: the
``mok-mxfp8`` row, the megakernels' MXFP8 variants (CUDA only).

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
MXFP8 = "mok-mxfp8"
# E4M3 keeps 3 mantissa bits: quantising x, the weights and the hidden rows puts the output
# ~6.4e-2 off the fp32 layer (mok.reference's MXFP8 layer at the --quick shapes); 0.1 is the
# original's relative L1 tolerance of MXFP8 against BF16 (tests/gpu/test_mxfp8_forward_gpu.py).
MXFP8_MAX_REL_ERR = 0.1
MXFP8_DEVICES = ("cuda",)  # where the mok-mxfp8 row runs (a CPU's is mok.reference's layer)
_REASONS: dict[str, str] = {}

GRAD_ORDER = ("x", "router_weights", "gate", "up", "down", *SHARED_NAMES)


def unavailable_reason(name: str) -> str:
    return _REASONS.get(name, NOT_AVAILABLE)


def describe_failure(error: Exception) -> str:
    """Status text of an implementation that raised during its check."""
    if type(error).__name__ == "MoKKernelUnavailableError":
        return f"{NOT_AVAILABLE}: {error}"
    return f"error: {type(error).__name__}: {error}"


def _mok_layer(name: str, inputs: MoeInputs, group, settings: dict | None = None,
               ring: bool = False) -> tuple | None:  # fmt: skip
    """(mok.functional, config, workspace) for these inputs, or ``None`` (why: in _REASONS).
    ``settings``: MoKConfig fields other than the defaults (benchmarks/ep_sweep.py); ``ring``:
    keep their macrobatch_size even below the routed rows (the macrobatch rows)."""
    settings = settings or {}
    try:
        import mok.functional as functional

        config = functional.MoKConfig(**settings)
        # The GPU path holds every routed row at once: a macrobatch of at least T * k rows.
        rows = inputs.num_tokens * inputs.shape.topk
        if config.macrobatch_size < rows and not ring:
            step = config.minibatch_size
            config = functional.MoKConfig(
                **{**settings, "macrobatch_size": -(-rows // step) * step}
            )
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
        _REASONS[name] = f"{NOT_AVAILABLE}: {type(error).__name__}: {error}"
        return None
    return functional, config, workspace


def _shared_weights(inputs: MoeInputs) -> tuple:
    return inputs.shared if inputs.shared is not None else (None, None, None)


def _mok_forward(layer: tuple, inputs: MoeInputs, routed: tuple) -> Callable:
    """An Impl's forward: schedule + ``mok.functional.forward`` (routed: gate, up, down)."""
    functional, config, workspace = layer

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
            *_shared_weights(inputs),
            *routed,
            swiglu_limit=inputs.shape.swiglu_limit,
        )
        return out, (schedule, context)

    return forward


def _mok_backward(layer: tuple, inputs: MoeInputs, routed: tuple) -> Callable:
    """An Impl's backward: ``mok.functional.backward`` from the forward's (schedule, context)."""
    functional, config, workspace = layer
    weights = (*_shared_weights(inputs), *routed)

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
            swiglu_limit=inputs.shape.swiglu_limit,
        )
        # backward returns (d_x, d_rw, d_routed gate/up/down, d_shared gate/up/down)
        return {n: g for n, g in zip(GRAD_ORDER, grads, strict=True) if g is not None}

    return backward


def _context_bytes(state) -> int:
    """Bytes of the forward context a mok forward returned (its state's second half)."""
    fields = state[1].tensors()  # an MXFP8 context's routed fields are (data, scales) pairs
    return sum(t.nbytes for f in fields if f is not None
               for t in (f if isinstance(f, tuple) else (f,)))  # fmt: skip


def _build_mok_bf16(inputs: MoeInputs, group, settings: dict | None = None) -> Impl | None:
    """mok's bf16 layer: schedule + forward timed together, backward from the saved context
    (``settings``: MoKConfig fields other than the defaults)."""
    layer = _mok_layer("mok", inputs, group, settings)
    if layer is None:
        return None
    if inputs.x.device.type == "cpu":
        return _bf16_impl("mok_cpu_path", "mok CPU path (PyTorch reference)", layer, inputs)
    return _bf16_impl("mok", "mok (bf16: forward megakernel, backward megakernel)", layer, inputs)


def _bf16_impl(name: str, label: str, layer: tuple, inputs: MoeInputs, vs_mok=False) -> Impl:
    """A bf16 mok row of `layer` (_mok_layer's): forward, backward from its context."""
    routed = (inputs.gate, inputs.up, inputs.down)
    return Impl(name, label, False, _mok_forward(layer, inputs, routed),
                _mok_backward(layer, inputs, routed), state_bytes=_context_bytes,
                vs_mok=vs_mok)  # fmt: skip


def _build_mok_mxfp8(inputs: MoeInputs, group) -> Impl | None:
    """mok's MXFP8 layer (CUDA only): the routed weights quantised once, here, untimed."""
    if inputs.x.device.type not in MXFP8_DEVICES:
        _REASONS[MXFP8] = (
            f"skipped on {inputs.x.device.type}: its MXFP8 layer is mok.reference's, "
            "far too slow to benchmark"
        )
        return None
    layer = _mok_layer(MXFP8, inputs, group)
    if layer is None:
        return None
    try:
        from mok.ops import mxfp8_quantize

        # Forward: (fp8, scales) along K of each routed weight (gate, up [E, I, H], down
        # [E, H, I]); backward: gate and up also along I, down along H (the original's tuples).
        gate, up = (mxfp8_quantize(w, True, True) for w in (inputs.gate, inputs.up))
        down = mxfp8_quantize(inputs.down, True, True)
        forward_routed = (tuple(gate[:2]), tuple(up[:2]), tuple(down[:2]))
        backward_routed = (tuple(gate), tuple(up), tuple(down[2:]))
    except Exception as error:
        _REASONS[MXFP8] = describe_failure(error)
        return None
    return Impl(
        MXFP8,
        "mok (mxfp8 forward and backward megakernels, weights quantised once)",
        False,
        _mok_forward(layer, inputs, forward_routed),
        _mok_backward(layer, inputs, backward_routed),
        max_rel_err=MXFP8_MAX_REL_ERR,
        state_bytes=_context_bytes,
    )


def macrobatch_name(size: int, replay: str, device_type: str) -> str:
    """The name of the mok row with ring reuse at `size` rows and MoKConfig.macrobatch_replay
    `replay`: ``mok-mb{size}`` (gate/up replayed) or ``mok-mb{size}-gather``; on a CPU
    ``mok_cpu_path-mb{size}...`` (the reference path, as the ``mok_cpu_path`` row)."""
    prefix = "mok_cpu_path" if device_type == "cpu" else "mok"
    return f"{prefix}-mb{size}" + ("-gather" if replay == "gather" else "")


def build_mok_macrobatch(inputs: MoeInputs, group, size: int, replay: str) -> Impl | None:
    """mok's bf16 layer with ring reuse: `size` routed rows held at once (minibatch `size`),
    the later macrobatches replayed as MoKConfig.macrobatch_replay `replay` says; ``None``
    (why: in _REASONS) where `size` holds every routed row (that is the mok row)."""
    name = macrobatch_name(size, replay, inputs.x.device.type)
    rows = inputs.num_tokens * inputs.shape.topk
    if size >= rows:
        _REASONS[name] = f"every routed row at once ({size} >= T * k = {rows}): the mok row"
        return None
    settings = {"minibatch_size": size, "macrobatch_size": size, "macrobatch_replay": replay}
    layer = _mok_layer(name, inputs, group, settings, ring=True)
    if layer is None:
        return None
    where = "CPU path (PyTorch reference)" if inputs.x.device.type == "cpu" else "megakernels"
    label = f"mok (bf16 {where}, macrobatches of {size} rows, {replay} replay)"
    return _bf16_impl(name, label, layer, inputs, vs_mok=True)


MOK_IMPLS: dict[str, Callable[[MoeInputs, object], Impl | None]] = {
    "mok": _build_mok_bf16,
}
# Rows added by --mxfp8.
MXFP8_IMPLS: dict[str, Callable[[MoeInputs, object], Impl | None]] = {
    MXFP8: _build_mok_mxfp8,
}
