"""The door to mok's CUDA path: the one module of `mok.launchers` that mok's other modules
import (lazily, for CUDA tensors only; importing it loads torch, cuda-python through
`mok.runtime`, and the launchers, never the DSL). Nothing else crosses it: the launchers'
submodules import each other and the layers below them (`mok.runtime`, `mok.config`,
`mok.errors`, `mok.types`, `mok.validation`, `mok.workspace`), never this door.

Which kernels serve an op:
    KERNELS_BY_OP, available(op, device), missing_variants(op, device),
    require(op, device): MoKKernelUnavailableError unless every kernel of `op` is shipped for
    this device's arch; nothing falls back to another path silently.
The layer ops (`mok.ops`, each by its op name):
    build_schedule, forward, recompute_forward_context, backward, mxfp8_quantize,
    fwd_epilogue, bwd_epilogue
Errors found on the device (`mok.functional.check_errors`, `mok.ops`):
    check_errors, raise_value_errors, value_error_check, status_ptr
A layer step's launch plans (`mok.layer_plan`):
    schedule_op_plan, forward_op_plan, backward_op_plan, Carve, current_stream, weight_key
MXFP8 (`mok.mxfp8_context`): mxfp8_quantize, mxfp8_dequantize
The original's raw ops (`mok.original`) and the virtual EP group (`mok.virtual_ep`):
    prepare_comm, group_barrier, all_gather_top_experts, build_schedule_gpu, check_gpu_layer,
    megakernel_peer_table, launch_routed_forward, shared_forward, launch_routed_backward,
    push_router_grads, shared_backward, mxfp8_weights, mxfp8_weight_gradients
A pass's settings: one `mok.types.PassConfig` for forward, backward, their plans and
    launch_routed_*; keywords for routed_forward and routed_backward (tests, tools).
"""

from __future__ import annotations

import torch

from mok.runtime.module import arch_env_token

from ..errors import MoKKernelUnavailableError
from .backward_megakernel import launch_routed_backward, push_router_grads, routed_backward
from .backward_op import backward, mxfp8_weight_gradients
from .backward_op import backward_op as backward_op_plan
from .checks import check_gpu_layer
from .comm import all_gather_top_experts, check_errors, group_barrier
from .comm import prepare as prepare_comm
from .epilogues import bwd_epilogue, fwd_epilogue
from .forward_megakernel import launch_routed_forward, routed_forward
from .forward_op import forward, recompute_forward_context
from .forward_op import forward_op as forward_op_plan
from .mxfp8 import backward_weights as mxfp8_weights
from .mxfp8 import mxfp8_dequantize, mxfp8_quantize
from .peer_table import peer_table as megakernel_peer_table
from .plans import Carve, current_stream, weight_key
from .schedule_kernels import build_schedule_gpu
from .schedule_op import build_schedule
from .schedule_op import schedule_op as schedule_op_plan
from .shared_expert import shared_backward, shared_forward
from .status import raise_value_errors, status_ptr, value_error_check

__all__ = [
    "KERNELS_BY_OP",
    "Carve",
    "all_gather_top_experts",
    "available",
    "backward",
    "backward_op_plan",
    "build_schedule",
    "build_schedule_gpu",
    "bwd_epilogue",
    "check_device_supported",
    "check_errors",
    "check_gpu_layer",
    "current_stream",
    "forward",
    "forward_op_plan",
    "fwd_epilogue",
    "group_barrier",
    "launch_routed_backward",
    "launch_routed_forward",
    "megakernel_peer_table",
    "missing_variants",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "mxfp8_weight_gradients",
    "mxfp8_weights",
    "prepare_comm",
    "push_router_grads",
    "raise_value_errors",
    "recompute_forward_context",
    "require",
    "routed_backward",
    "routed_forward",
    "schedule_op_plan",
    "shared_backward",
    "shared_forward",
    "status_ptr",
    "value_error_check",
    "weight_key",
]

# op -> the manifest variants it launches; an empty tuple means no kernel has landed yet, with
# the issue that brings it.
KERNELS_BY_OP: dict[str, tuple[tuple[str, ...], str]] = {
    "build_schedule": (
        ("all_gather_top_experts", "schedule", "schedule_ids64"),
        "the routing all-gather and schedule kernels (schedule_ids64 for a group of one)",
    ),
    # forward_op.py: the routed experts run in the forward megakernel
    # (moe_forward); the shared expert runs the gate/up and plain down GEMMs; an EP group's
    # barriers frame each pass (ep_barrier). A macrobatch below the routed rows runs the
    # megakernel once per macrobatch (macrobatch.py: macrobatch_schedule).
    "forward": (
        (
            "expert_gemm_gate_up_swiglu",
            "expert_gemm_down",
            "moe_forward",
            "moe_combine_forward",
            "ep_barrier",
            "macrobatch_schedule",
        ),
        "the SM90 expert GEMMs",
    ),
    "recompute_forward_context": (
        ("gather_rows", "expert_gemm_gate_up_swiglu", "ep_barrier"),
        "the SM90 expert GEMMs",
    ),
    # backward_op.py: the routed experts run in the backward megakernel
    # (moe_backward, which for a group of one without a shared expert also sums d_x and
    # pushes the router gradients; otherwise backward_finish, in a group of one, or
    # router_grad_push and moe_combine_backward do); the shared expert runs the separate
    # backward GEMMs. A macrobatch below
    # the routed rows replays macrobatches (gather_rows, gate/up) and sums the weight gradients
    # macrobatch by macrobatch (macrobatch.py).
    "backward": (
        (
            "moe_backward",
            "router_grad_push",
            "backward_finish",
            "expert_gemm_bwd_d_hidden_swiglu",
            "expert_gemm_bwd_d_x",
            "expert_gemm_bwd_weights_bf16",
            "expert_gemm_bwd_weights_accumulate",
            "moe_combine_backward",
            "ep_barrier",
            "macrobatch_schedule",
            "gather_rows",
            "expert_gemm_gate_up_swiglu",
            "expert_gemm_bwd_weights_window_bf16",
            "expert_gemm_bwd_weights_window_accumulate",
        ),
        "the SM90 backward expert GEMMs",
    ),
    "mxfp8_quantize": (
        ("mxfp8_quantize_rowwise", "mxfp8_quantize_transposed"),
        "the MXFP8 quantiser kernels",
    ),
    "fwd_epilogue": (("moe_combine_forward",), "the forward epilogue kernel"),
    "bwd_epilogue": (("moe_combine_backward",), "the backward epilogue kernel"),
}


def check_device_supported(device: torch.device) -> str:
    """The cubin arch for this CUDA device; MoKUnsupportedDeviceError for other GPUs."""
    from mok.runtime import select_arch  # noqa: PLC0415 - the door's import stays light

    return select_arch(device)


def missing_variants(op_name: str, device: torch.device) -> tuple[str, list[str]]:
    """(arch, the variants `op_name` needs that the installed manifest lacks)."""
    from mok.runtime import MoKManifestError, load_manifest  # noqa: PLC0415

    arch = check_device_supported(device)
    variants, _ = KERNELS_BY_OP[op_name]
    try:
        shipped = {v.name for v in load_manifest().variants_for(arch)}
    except MoKManifestError:
        shipped = set()
    return arch, [v for v in variants if v not in shipped]


def available(op_name: str, device: torch.device) -> bool:
    """Whether `op_name` runs kernels on this device (False, never an error, for any reason)."""
    try:
        arch, missing = missing_variants(op_name, device)
    except Exception:  # noqa: BLE001 - availability is a yes/no question
        return False
    return bool(KERNELS_BY_OP[op_name][0]) and not missing


_REQUIRED: dict[tuple, bool] = {}


def require(op_name: str, device: torch.device) -> None:
    """Nothing when `op_name` runs kernels on `device`, else MoKKernelUnavailableError.

    A success is cached per (op, device, MOK_ARCH): this runs on every op call, so the hit is
    one dict lookup (MOK_ARCH read through `arch_env_token`, cheaper than os.environ.get).
    """
    key = (op_name, device.index, arch_env_token())
    if key not in _REQUIRED:
        _require(op_name, device)
        _REQUIRED[key] = True


def _require(op_name: str, device: torch.device):
    arch, missing = missing_variants(op_name, device)
    variants, lands_with = KERNELS_BY_OP[op_name]
    if not variants or missing:
        what = f"variants {missing} are missing from the manifest" if variants else "none is built"
        raise MoKKernelUnavailableError(
            f"mok.ops.{op_name} on {device} ({arch}): no CUDA kernel is shipped for it yet "
            f"({what}; it comes with {lands_with}). CPU tensors run the PyTorch reference path."
        )
