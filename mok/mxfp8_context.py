"""The MXFP8 layer's forward context as the original keeps it (SEMANTICS §5): x and hidden
quantised along the routed rows (the weight gradients' operands), gate and up along I (what the
SwiGLU backward reads), each an (E4M3 data, UE8M0 scales) pair; the shared expert's rows bf16.
About half BF16's bytes per routed row: (H + 3 I) * 33 / 32 against 2 H + 6 I.

mok's MXFP8 backward reads the routed context only through that quantisation, and the MXFP8
round trip of MXFP8 values is the identity, so a quantised context gives exactly the gradients
of the bf16 one (mok.reference.mxfp8_backward_to_slots).

The flat order (the original's raw ops'): (x_fp8_t, x_sc_t, gate_shared, gate_fp8, gate_sc,
up_shared, up_fp8, up_sc, hidden_shared, hidden_fp8_t, hidden_sc_t).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .types import MoKForwardContext
from .validation import check_tensor

TILE = 128  # the GPU quantiser's and dequantiser's tile (rows and columns)


def _on_gpu(t: Tensor) -> bool:
    return t.is_cuda and t.shape[-2] % TILE == 0 and t.shape[-1] % TILE == 0


def _quantised(t: Tensor, transpose: bool = False) -> tuple[Tensor, Tensor]:
    if _on_gpu(t):
        from . import launchers  # noqa: PLC0415 - the CUDA path's door, for CUDA tensors only

        return launchers.mxfp8_quantize(t.contiguous(), transpose)  # bit-exact with the reference
    # contiguous: the reference quantiser returns a 2-D transposed layout as a strided view
    return tuple(q.contiguous() for q in reference.mxfp8_quantize(t, transpose=transpose))


def _values(data: Tensor, scales: Tensor, transpose: bool = False) -> Tensor:
    if _on_gpu(data):
        from . import launchers  # noqa: PLC0415 - the CUDA path's door, for CUDA tensors only

        return launchers.mxfp8_dequantize(data, scales, transposed=transpose)  # bit-exact
    return reference.mxfp8_dequantize(data, scales, transpose=transpose).to(torch.bfloat16)


def quantised_context(ctx: MoKForwardContext, like: Tensor) -> tuple[Tensor, ...]:
    """The flat quantised context (the module docstring's order) of mok's bf16 one; an absent
    shared expert's rows are distinct empty [0] tensors like `like`."""
    x_q = _quantised(ctx.x_routed, transpose=True)
    gate_q, up_q = _quantised(ctx.gate_routed), _quantised(ctx.up_routed)
    hidden_q = _quantised(ctx.hidden_routed, transpose=True)
    gate_s, up_s, hidden_s = (t if t is not None else like.new_empty(0) for t in ctx.tensors()[4:])
    return (*x_q, gate_s, *gate_q, up_s, *up_q, hidden_s, *hidden_q)


def dequantised_context(q: tuple) -> MoKForwardContext:
    """mok's bf16 context from a flat quantised one (exact: MXFP8 values are bf16 values)."""
    x_fp8_t, x_sc_t, gate_s, gate, gate_sc, up_s, up, up_sc, hidden_s, hidden_t, hidden_sc_t = q
    return MoKForwardContext(
        _values(x_fp8_t, x_sc_t, True), _values(gate, gate_sc), _values(up, up_sc),
        _values(hidden_t, hidden_sc_t, True), *(t if t.numel() else None
                                                for t in (gate_s, up_s, hidden_s)),
    )  # fmt: skip


def as_pairs(q: tuple) -> tuple:
    """A flat quantised context as MoKForwardContext's fields, in its order: the routed ones
    (data, scales) pairs, the shared ones bf16 tensors (empty [0] without a shared expert)."""
    x_t, x_sc, gate_s, gate, gate_sc, up_s, up, up_sc, hidden_s, hidden_t, hidden_sc = q
    return ((x_t, x_sc), (gate, gate_sc), (up, up_sc), (hidden_t, hidden_sc), gate_s, up_s,
            hidden_s)  # fmt: skip


def is_quantised(ctx: MoKForwardContext) -> bool:
    return isinstance(ctx.x_routed, tuple)


def flat(ctx: MoKForwardContext, like: Tensor) -> tuple[Tensor, ...]:
    """A quantised MoKForwardContext's tensors in the flat order (absent shared rows empty)."""
    (x_t, x_sc), (gate, gate_sc), (up, up_sc), (hidden_t, hidden_sc) = ctx.tensors()[:4]
    gate_s, up_s, hidden_s = (t if t is not None else like.new_empty(0) for t in ctx.tensors()[4:])
    return (x_t, x_sc, gate_s, gate, gate_sc, up_s, up, up_sc, hidden_s, hidden_t, hidden_sc)


def check_quantised(ctx: MoKForwardContext, capacity: int, hidden: int, inter: int,
                    device) -> None:  # fmt: skip
    """The routed fields of a quantised context: pairs of the shapes the MXFP8 forward returns."""
    fp8 = torch.float8_e4m3fn
    layouts = {  # field -> (data shape, scales shape)
        "x_routed": ([hidden, capacity], [hidden // TILE, capacity // TILE, 32, 16]),
        "gate_routed": ([capacity, inter], [capacity // TILE, inter // TILE, 32, 16]),
        "up_routed": ([capacity, inter], [capacity // TILE, inter // TILE, 32, 16]),
        "hidden_routed": ([inter, capacity], [inter // TILE, capacity // TILE, 32, 16]),
    }
    for name, (data_shape, scales_shape) in layouts.items():
        value = getattr(ctx, name)
        if not (isinstance(value, tuple) and len(value) == 2):
            raise ValueError(
                f"forward_context.{name} must be an MXFP8 pair (data, scales) like the other "
                f"routed fields, got {type(value).__name__}"
            )
        check_tensor(f"forward_context.{name} data", value[0], dtype=fp8, shape=data_shape,
                     device=device)  # fmt: skip
        check_tensor(f"forward_context.{name} scales", value[1], dtype=torch.uint8,
                     shape=scales_shape, device=device)  # fmt: skip
