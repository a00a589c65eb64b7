"""The layer's passes up to the per-(token, j) slots: the bodies of the original's raw ops
`dispatch_mlp_swiglu_combine_{fwd,bwd}_{bf16,mxfp8}` (mok/original/ops.py).

    forward:  each routed row's unweighted expert output lands in its token's slot
              t * k + j of `slots` (the combine buffer, on the token's rank); the shared
              expert's y_shared is returned apart. out = fwd_epilogue(y_shared, slots, w).
    backward: each routed row's d_x lands in its token's slot of `slots` (the d_x_routed
              buffer) and its router-weight gradient in `d_router`, on the token's rank;
              d_x_shared is returned apart. d_x = bwd_epilogue(d_x_shared, slots).

No barrier runs inside: an EP group frames each pass with barrier_all, as the original's
functional API does. CPU tensors run `mok.reference`'s `*_to_slots` (the functions the
reference layer is made of); CUDA tensors run the launchers `mok.ops`' layer ops run, so the
raw ops and the layer ops compute the same bits. MXFP8 runs on CPU only.
"""

from __future__ import annotations

import torch

from .. import reference
from ..mxfp8_context import dequantised_context, quantised_context
from ..types import MoKForwardContext, MoKSchedule, PassConfig
from ..validation import check_router_weight_values

Tensor = torch.Tensor


def _present(t: Tensor) -> Tensor | None:
    return t if t.numel() else None


def _filled(ctx: MoKForwardContext, like: Tensor) -> tuple[Tensor, ...]:
    """The 7 context tensors, a distinct empty [0] for each absent shared one."""
    return tuple(t if t is not None else like.new_empty(0) for t in ctx.tensors())


def cuda_launchers(layer_op: str, ws):
    """The CUDA launchers of `layer_op`'s kernels, after raising the bad input values a kernel
    found (for a group of one only: a rank raising between collective launches would strand
    its peers; EP groups get them from mok.functional.check_errors)."""
    from .. import launchers  # noqa: PLC0415 - the CUDA path's door, for CUDA tensors only

    launchers.require(layer_op, ws.device)
    if ws.ep_size == 1:
        launchers.raise_value_errors(ws.device)
    return launchers


# ----------------------------------------------------------------------------------------------
# BF16
# ----------------------------------------------------------------------------------------------


def forward_to_slots(ws, op: str, schedule: MoKSchedule, x: Tensor, slots: Tensor,
                     shared: tuple, routed: tuple, pass_config: PassConfig):  # fmt: skip
    """(the 7 context tensors, y_shared or None); `slots` [T*k, H] filled. `shared` and
    `routed` are the (gate, up, down) weights (shared ones None for a routed-only layer);
    `pass_config` the op's settings (original/checks.py, `check_launch`)."""
    limit = pass_config.swiglu_limit
    if not x.is_cuda:
        ctx, got, y_shared = reference.forward_to_slots(
            schedule, x, *shared, *routed, topk=ws.topk, group=ws.group, swiglu_limit=limit
        )
        slots.copy_(got)
        return _filled(ctx, x), y_shared
    gpu = cuda_launchers("forward", ws)
    gpu.check_gpu_layer(ws, op)
    table = gpu.megakernel_peer_table(ws)
    peers = None if table is None else (ws.ep_rank, table)
    routed_ctx, _ = gpu.launch_routed_forward(
        x, schedule, ws.topk, routed, pass_config, peers=peers, slots=slots
    )
    # Distinct empty tensors: custom-op outputs may not alias each other.
    shared_ctx, y_shared = tuple(x.new_empty(0) for _ in range(3)), None
    if shared[0] is not None:
        *shared_ctx, y_shared = gpu.shared_forward(x, *shared, limit)
    return (*routed_ctx, *shared_ctx), y_shared


def backward_to_slots(
    ws, op: str, schedule: MoKSchedule, ctx: tuple, d_y: Tensor, router_weights: Tensor,
    x: Tensor, slots: Tensor, d_router: Tensor, shared: tuple, routed: tuple,
    pass_config: PassConfig,
):  # fmt: skip
    """(d_x_shared or None, the 6 bf16 weight gradients routed gate, up, down, shared gate, up,
    down (None without a shared expert)); `slots` [T*k, H] and `d_router` [T, k] filled.
    `ctx`: the forward's 7 context tensors (shared ones empty [0] without a shared expert)."""
    if not x.is_cuda:
        check_router_weight_values(router_weights)
        d_x_shared, got, got_router, *grads = reference.backward_to_slots(
            schedule, MoKForwardContext(*(_present(t) for t in ctx)), d_y, x, router_weights,
            *shared, *routed, group=ws.group, swiglu_limit=pass_config.swiglu_limit,
        )  # fmt: skip
        slots.copy_(got)
        d_router.copy_(got_router)
        return d_x_shared, tuple(None if g is None else g.to(torch.bfloat16) for g in grads)
    return _cuda_backward_to_slots(ws, op, schedule, ctx, d_y, router_weights, x, slots,
                                   d_router, shared, routed, pass_config)  # fmt: skip


def _cuda_backward_to_slots(
    ws, op, schedule, ctx, d_y, router_weights, x, slots, d_router, shared, routed, pass_config,
    mxfp8: bool = False,
):  # fmt: skip
    """`backward_to_slots` on CUDA: the backward megakernel (with `mxfp8` its MXFP8 variant,
    composed as launchers/backward_op.py composes it; `routed` the MXFP8 tuples, `ctx` a
    dequantised quantised context, MXFP8 values already)."""
    gpu = cuda_launchers("backward", ws)
    gpu.check_gpu_layer(ws, op)
    table = gpu.megakernel_peer_table(ws)
    peers = None if table is None else (ws.ep_rank, table)
    x_routed, gate, up, hidden, *shared_ctx = ctx
    weights = routed
    if mxfp8:
        weights = gpu.mxfp8_weights(routed)
    dy_e, d_gate, d_up, partials, _, routed_grads = gpu.launch_routed_backward(
        d_y, router_weights, schedule, (x_routed, gate, up, hidden), weights, pass_config,
        weight_grads=not mxfp8, peers=peers, slots=slots, mxfp8=mxfp8,
    )  # fmt: skip
    gpu.push_router_grads(partials, schedule, router_weights, d_router, peers=peers)
    if mxfp8:
        routed_grads = gpu.mxfp8_weight_gradients(
            dy_e,
            x_routed,
            d_gate,
            d_up,
            hidden,
            schedule.tokens_per_expert,
            (None,) * 3,
            context_exact=True,
        )
    d_x_shared, shared_grads = None, (None, None, None)
    if shared[0] is not None:
        d_x_shared, shared_grads = gpu.shared_backward(
            d_y, x, tuple(shared_ctx), shared, pass_config.swiglu_limit, (None, None, None)
        )
    return d_x_shared, (*routed_grads, *shared_grads)


# ----------------------------------------------------------------------------------------------
# MXFP8: the context leaves and enters in the original's quantised layout (mxfp8_context.py)
# ----------------------------------------------------------------------------------------------


def mxfp8_forward_to_slots(ws, op: str, schedule: MoKSchedule, x: Tensor, slots: Tensor,
                           shared: tuple, routed: tuple, pass_config: PassConfig):  # fmt: skip
    """(the 11 tensors of `quantised_context`, y_shared or None); `slots` filled. `routed`:
    (gate, up, down) each (fp8, scale) along K. CUDA: the forward megakernel's MXFP8 variant
    (`forward_to_slots` with the MXFP8 pairs), its bf16 context then quantised."""
    if x.is_cuda:
        ctx, y_shared = forward_to_slots(ws, op, schedule, x, slots, shared, routed, pass_config)
        return quantised_context(MoKForwardContext(*(_present(t) for t in ctx)), x), y_shared
    ctx, got, y_shared = reference.mxfp8_forward_to_slots(
        schedule, x, *shared, *routed, topk=ws.topk, group=ws.group,
        swiglu_limit=pass_config.swiglu_limit,
    )  # fmt: skip
    slots.copy_(got)
    return quantised_context(ctx, x), y_shared


def mxfp8_backward_to_slots(
    ws, op: str, schedule: MoKSchedule, ctx: tuple, d_y: Tensor, router_weights: Tensor,
    x: Tensor, slots: Tensor, d_router: Tensor, shared: tuple, routed: tuple,
    pass_config: PassConfig,
):  # fmt: skip
    """As `backward_to_slots`; `ctx` in `quantised_context`'s order, `routed` the MXFP8 tuples
    of mok.reference.mxfp8_backward (gate and up with their transposed copies, down transposed).
    CUDA: the context dequantised by the GPU kernels, then the backward megakernel's MXFP8
    variant (`backward_to_slots`' composition)."""
    if x.is_cuda:
        return _cuda_backward_to_slots(
            ws, op, schedule, dequantised_context(ctx).tensors(), d_y, router_weights, x, slots,
            d_router, shared, routed, pass_config, mxfp8=True,
        )  # fmt: skip
    check_router_weight_values(router_weights)
    d_x_shared, got, got_router, *grads = reference.mxfp8_backward_to_slots(
        schedule, dequantised_context(ctx), d_y, x, router_weights, *shared, *routed,
        group=ws.group, swiglu_limit=pass_config.swiglu_limit,
    )  # fmt: skip
    slots.copy_(got)
    d_router.copy_(got_router)
    return d_x_shared, tuple(None if g is None else g.to(torch.bfloat16) for g in grads)
