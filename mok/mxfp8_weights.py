"""MXFP8 routed weights as the original passes them, checked: (fp8, scale) tuples from
`mok.ops.mxfp8_quantize`. Forward: gate, up, down each (fp8, scale) along K. Backward: gate and
up (fp8, scale, fp8_t, scale_t), down its transposed copy (fp8_t, scale_t)."""

from __future__ import annotations

import torch

from .config import FEATURE_ALIGNMENT
from .errors import MoKInputError
from .validation import check_tensor

ROUTED = ("routed_gate_weights", "routed_up_weights", "routed_down_weights")


def is_mxfp8(weights: dict) -> bool:
    """True if the routed weights are MXFP8 tuples (all three), False if tensors (all three)."""
    kinds = [isinstance(weights[name], tuple) for name in ROUTED if name in weights]
    if any(kinds) and not all(kinds):
        given = [name for name, kind in zip(ROUTED, kinds, strict=False) if kind]
        raise MoKInputError(
            f"routed weights must be all MXFP8 tuples or all bf16 tensors; {given} are tuples"
        )
    return bool(kinds) and all(kinds)


def _check_pair(name: str, data, scales, shape: tuple[int, ...], device) -> None:
    check_tensor(f"{name} data", data, dtype=torch.float8_e4m3fn, shape=list(shape), device=device)
    rows = 1
    for dim in shape[:-1]:
        rows *= dim
    check_tensor(f"{name} scales", scales, dtype=torch.uint8,
                 shape=[rows // 128, shape[-1] // 128, 32, 16], device=device)  # fmt: skip


def check_mxfp8_weights(workspace, num_experts: int, weights: dict, *, backward: bool) -> int:
    """Check the routed MXFP8 tuples (and the bf16 shared weights); returns I."""
    hidden, device = workspace.hidden_size, workspace.device
    gate = weights["routed_gate_weights"]
    if not gate or not isinstance(gate[0], torch.Tensor) or gate[0].dim() != 3:
        raise ValueError("routed_gate_weights must be an MXFP8 tuple whose data is [E, I, H]")
    inter = gate[0].shape[1]
    if inter == 0 or inter % FEATURE_ALIGNMENT:
        raise ValueError(
            f"intermediate size (routed_gate_weights[0].shape[1]) must be a positive multiple of "
            f"{FEATURE_ALIGNMENT}, got {inter}"
        )
    gate_up, down = (num_experts, inter, hidden), (num_experts, hidden, inter)
    layouts = {  # name -> the data shapes of its tuple, in order
        "routed_gate_weights": (gate_up, down) if backward else (gate_up,),
        "routed_up_weights": (gate_up, down) if backward else (gate_up,),
        "routed_down_weights": (gate_up,) if backward else (down,),
    }
    for name, shapes in layouts.items():
        if name not in weights:
            continue
        value = weights[name]
        if len(value) != 2 * len(shapes):
            raise ValueError(
                f"{name} must be an MXFP8 tuple of {2 * len(shapes)} tensors "
                f"({'(fp8, scale, fp8_t, scale_t)' if len(shapes) == 2 else '(fp8, scale)'} "
                f"from mok.ops.mxfp8_quantize), got {len(value)}"
            )
        for index, shape in enumerate(shapes):
            _check_pair(name, value[2 * index], value[2 * index + 1], shape, device)
    shared = {
        "shared_gate_weights": [inter, hidden],
        "shared_up_weights": [inter, hidden],
        "shared_down_weights": [hidden, inter],
    }
    for name, shape in shared.items():
        if weights.get(name) is not None:
            check_tensor(name, weights[name], dtype=torch.bfloat16, shape=shape, device=device)
    return inter
