"""The CUDA path of mok's ops: which shipped kernels serve an op, and their launches.

Imported only for CUDA tensors. Every op either runs the kernels named in `KERNELS_BY_OP` (all
present in the installed manifest for this device's arch) or raises MoKKernelUnavailableError
saying what is missing; nothing falls back to another path silently.
"""

from __future__ import annotations

import torch

from mok.runtime.module import arch_env_token

from .errors import MoKKernelUnavailableError

# op -> the manifest variants it launches; an empty tuple means no kernel has landed yet, with
# the issue that brings it.
KERNELS_BY_OP: dict[str, tuple[tuple[str, ...], str]] = {
    "build_schedule": (
        ("all_gather_top_experts", "schedule", "schedule_ids64"),
        "the routing all-gather and schedule kernels (schedule_ids64 for a group of one)",
    ),
    # mok/launchers/forward_op.py: the routed experts run in the forward megakernel
    # (moe_forward); the shared expert runs the gate/up and plain down GEMMs; an EP group's
    # barriers frame each pass (ep_barrier). A macrobatch below the routed rows runs the
    # megakernel once per macrobatch (launchers/macrobatch.py: macrobatch_schedule).
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
    ),  # fmt: skip
    "recompute_forward_context": (
        ("gather_rows", "expert_gemm_gate_up_swiglu", "ep_barrier"),
        "the SM90 expert GEMMs",
    ),
    # mok/launchers/backward_op.py: the routed experts run in the backward megakernel
    # (moe_backward, which for a group of one without a shared expert also sums d_x and
    # pushes the router gradients; otherwise backward_finish, in a group of one, or
    # router_grad_push and moe_combine_backward do); the shared expert runs the separate
    # backward GEMMs. A macrobatch below
    # the routed rows replays macrobatches (gather_rows, gate/up) and sums the weight gradients
    # macrobatch by macrobatch (launchers/macrobatch.py).
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
    ),  # fmt: skip
    "mxfp8_quantize": (
        ("mxfp8_quantize_rowwise", "mxfp8_quantize_transposed"),
        "the MXFP8 quantiser kernels",
    ),
    "fwd_epilogue": (("moe_combine_forward",), "the forward epilogue kernel"),
    "bwd_epilogue": (("moe_combine_backward",), "the backward epilogue kernel"),
}


def check_device_supported(device: torch.device) -> str:
    """The cubin arch for this CUDA device; MoKUnsupportedDeviceError for other GPUs."""
    from mok.runtime import select_arch  # noqa: PLC0415

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


_REQUIRED: dict[tuple, object] = {}


def require(op_name: str, device: torch.device):
    """The launcher namespace for `op_name` on `device`, or MoKKernelUnavailableError.

    A success is cached per (op, device, MOK_ARCH): this runs on every op call, so the hit is
    one dict lookup (MOK_ARCH read through `arch_env_token`, cheaper than os.environ.get).
    """
    key = (op_name, device.index, arch_env_token())
    launchers = _REQUIRED.get(key)
    if launchers is None:
        _REQUIRED[key] = launchers = _require(op_name, device)
    return launchers


def _require(op_name: str, device: torch.device):
    arch, missing = missing_variants(op_name, device)
    variants, lands_with = KERNELS_BY_OP[op_name]
    if not variants or missing:
        what = f"variants {missing} are missing from the manifest" if variants else "none is built"
        raise MoKKernelUnavailableError(
            f"mok.ops.{op_name} on {device} ({arch}): no CUDA kernel is shipped for it yet "
            f"({what}; it comes with {lands_with}). CPU tensors run the PyTorch reference path."
        )
    from . import launchers  # noqa: PLC0415

    return launchers
