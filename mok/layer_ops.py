"""mok's own layer ops as torch.library custom ops (`mok::...`), with fake implementations.
`mok.ops` is the public namespace of these and of the original's raw ops (mok/original/ops.py,
which build on these).

Each op takes tensors, ints, floats and strings only: the workspace enters as its integer
handle and the EP group as its name. CPU tensors run the PyTorch reference (`mok.reference`);
CUDA tensors run the shipped kernels (`mok.launchers`, the CUDA path's door), or raise
MoKKernelUnavailableError where the kernel has not landed. The fake implementations give output shapes from input shapes alone,
so `torch.compile(fullgraph=True)` traces a whole MoE step with no graph break. `mok.functional`
runs the layer ops through `call`, which skips the dispatcher in eager mode.

Optional tensor outputs (the shared expert's) are returned as empty [0] tensors when absent.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from . import reference
from .config import check_macrobatch_replay
from .errors import MoKInputError
from .types import MoKForwardContext, MoKSchedule, PassConfig
from .validation import (
    check_expert_id_values,
    check_macrobatch,
    check_router_weight_values,
    check_tensor,
    forward_context_rows,
    fused_gate_up,
)
from .workspace import workspace_from_handle

Tensor = torch.Tensor


# The Python implementation of each custom op `call` runs outside torch.compile.
_IMPLEMENTATIONS: dict[str, Callable] = {}
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def _op(name: str, mutates_args: tuple[str, ...] = ()):
    """Register the decorated function as custom op mok::`name` and keep it for `call`."""

    def register(fn: Callable):
        _IMPLEMENTATIONS[name] = fn
        return torch.library.custom_op(f"mok::{name}", mutates_args=mutates_args)(fn)

    return register


def implementation(name: str) -> Callable:
    """The Python implementation of mok::`name` (what `call` runs in eager mode)."""
    return _IMPLEMENTATIONS[name]


def call(name: str, *args):
    """Run mok::`name` on `args`.

    While torch.compile traces, or when a tensor subclass or a dispatch mode is involved, this
    goes through torch's dispatcher (the op and its fake implementation). Otherwise it calls the
    op's Python implementation directly, under no_grad: the dispatcher's per-call host cost
    buys nothing in eager mode, where these ops have no autograd formula and their outputs
    never alias their inputs.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return getattr(torch.ops.mok, name)(*args)
    for arg in args:
        if isinstance(arg, Tensor) and arg.__class__ not in _PLAIN_TENSORS:
            return getattr(torch.ops.mok, name)(*args)
    if torch.is_grad_enabled():
        with torch.no_grad():
            return _IMPLEMENTATIONS[name](*args)
    return _IMPLEMENTATIONS[name](*args)


def _gpu(op_name: str, device: torch.device, ep_size: int = 1):
    """The CUDA launchers, after raising any bad input value a kernel found (launchers/status.py:
    the kernels check the values they load, so CUDA inputs cost no check here).

    Only for a group of one: a rank of an EP group that raised here, between the collective
    launches of a step, would leave its peers waiting in a barrier until they time out. EP
    groups get the error from `mok.functional.check_errors`, which every rank calls."""
    from . import launchers  # noqa: PLC0415 - the CUDA path's door, loaded for CUDA tensors

    launchers.require(op_name, device)
    if ep_size == 1:
        launchers.raise_value_errors(device)
    return launchers


def _check_macrobatch(macrobatch_size: int, minibatch_size: int, router_weights: Tensor,
                      op: str) -> int | None:  # fmt: skip
    """The GPU path's macrobatch rule on the CPU path too (the rule lives in mok.validation):
    the reference's `macrobatch_size` (None: every routed row at once)."""
    num_tokens, topk = router_weights.shape
    ring = check_macrobatch(macrobatch_size, num_tokens, topk, op, minibatch_size)
    return macrobatch_size if ring else None


def _none_if_empty(t: Tensor | None) -> Tensor | None:
    return None if t is None or t.numel() == 0 else t


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _fake_context(peer_rank, x, routed_gate_weights, has_shared: bool,
                  capacity: int | None = None, activation_rows: int | None = None,
                  ) -> tuple[Tensor, ...]:  # fmt: skip
    """Empty tensors shaped like the 7 forward-context outputs (fake implementations); routed
    rows `capacity` (None: the schedule's), gate/up/hidden's `activation_rows` (None: as
    x_routed's)."""
    capacity = peer_rank.shape[0] if capacity is None else capacity
    activation_rows = capacity if activation_rows is None else activation_rows
    num_tokens, hidden = x.shape
    inter = routed_gate_weights.shape[1]
    routed = [x.new_empty(capacity, hidden)] + [
        x.new_empty(activation_rows, inter) for _ in range(3)
    ]
    shared = [x.new_empty(num_tokens, inter) if has_shared else _empty(x) for _ in range(3)]
    return (*routed, *shared)


def _fake_rows(macrobatch_size, macrobatch_replay, peer_rank, router_weights) -> tuple:
    """(x_routed's rows, gate/up/hidden's rows) of a forward context (`forward_context_rows`)."""
    return forward_context_rows(
        macrobatch_size, macrobatch_replay, peer_rank.shape[0], *router_weights.shape
    )


def _schedule(peer_rank, peer_token_idx, num_tokens, tokens_per_expert) -> MoKSchedule:
    return MoKSchedule(peer_rank, peer_token_idx, num_tokens, tokens_per_expert)


# ----------------------------------------------------------------------------------------------
# schedule
# ----------------------------------------------------------------------------------------------


@_op("build_schedule")
def build_schedule(
    workspace_handle: int,
    top_experts: Tensor,
    num_local_experts: int,
    capacity: int,
    all_gather_chunk_bytes: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """All-gather routing ids over the EP group and build this rank's receive schedule.

    Inputs:
        workspace_handle:  int           `MoKWorkspace.handle` (its EP group and buffers)
        top_experts:       int64 [T, k]  global expert ids in [0, num_local_experts * P)
        num_local_experts: int           E, experts on this rank
        capacity:          int           C, routed rows (padding included) the schedule holds
        all_gather_chunk_bytes: int      MoKConfig.all_gather_top_experts_chunk_bytes
    Outputs:
        peer_rank int32 [C], peer_token_idx int32 [C], num_tokens int32 [1],
        tokens_per_expert int32 [E]  (SEMANTICS §3; padding rows are -1)
    """
    ws = workspace_from_handle(workspace_handle)
    if top_experts.is_cuda:
        return _gpu("build_schedule", top_experts.device, ws.ep_size).build_schedule(
            ws, top_experts, num_local_experts, capacity, all_gather_chunk_bytes
        )
    check_expert_id_values(top_experts, num_local_experts * ws.ep_size)
    s = reference.make_schedule(
        top_experts, num_local_experts=num_local_experts, capacity=capacity, group=ws.group
    )
    return s.peer_rank, s.peer_token_idx, s.num_tokens, s.tokens_per_expert


@build_schedule.register_fake
def _(workspace_handle, top_experts, num_local_experts, capacity, all_gather_chunk_bytes):
    i32 = dict(dtype=torch.int32, device=top_experts.device)
    return (
        torch.empty(capacity, **i32),
        torch.empty(capacity, **i32),
        torch.empty(1, **i32),
        torch.empty(num_local_experts, **i32),
    )


# ----------------------------------------------------------------------------------------------
# forward and recompute
# ----------------------------------------------------------------------------------------------


@_op("forward")
def forward(
    workspace_handle: int,
    peer_rank: Tensor,
    peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    x: Tensor,
    router_weights: Tensor,
    shared_gate_weights: Tensor | None,
    shared_up_weights: Tensor | None,
    shared_down_weights: Tensor | None,
    routed_gate_weights: Tensor,
    routed_up_weights: Tensor,
    routed_down_weights: Tensor,
    swiglu_limit: float | None,
    fwd_num_comm_sms: int,
    minibatch_size: int,
    macrobatch_size: int,
    macrobatch_replay: str = "gate_up",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The MoE layer forward: dispatch, SwiGLU experts, combine, fixed-order weighted sum.

    Inputs:
        workspace_handle: int  `MoKWorkspace.handle`
        peer_rank, peer_token_idx, num_tokens, tokens_per_expert: the schedule (int32)
        x:              bf16 [T, H]
        router_weights: fp32 [T, k], finite and > 0
        shared_*:       bf16 gate/up [I, H], down [H, I], or None (routed-only)
        routed_*:       bf16 gate/up [E, I, H], down [E, H, I]
        swiglu_limit:   float or None
        fwd_num_comm_sms, minibatch_size, macrobatch_size, macrobatch_replay: MoKConfig
                        fields the kernel uses
    Outputs:
        out bf16 [T, H]; x_routed bf16 [C, H]; gate_routed, up_routed, hidden_routed bf16 [C, I];
        gate_shared, up_shared, hidden_shared bf16 [T, I] (empty [0] without a shared expert).
        With ring reuse (macrobatch_size below T * k) x_routed holds macrobatch 0's rows, and
        gate/up/hidden too (macrobatch_replay "gate_up") or every row ("gather").
    """
    ws = workspace_from_handle(workspace_handle)
    check_macrobatch_replay(macrobatch_replay)
    schedule = _schedule(peer_rank, peer_token_idx, num_tokens, tokens_per_expert)
    shared = (shared_gate_weights, shared_up_weights, shared_down_weights)
    routed = (routed_gate_weights, routed_up_weights, routed_down_weights)
    if x.is_cuda:
        pass_config = PassConfig.of_workspace(
            ws, swiglu_limit=swiglu_limit, num_comm_ctas=fwd_num_comm_sms,
            minibatch_size=minibatch_size, macrobatch_size=macrobatch_size,
            macrobatch_replay=macrobatch_replay,
        )  # fmt: skip
        gpu = _gpu("forward", x.device, ws.ep_size)
        return gpu.forward(ws, schedule, x, router_weights, shared, routed, pass_config)
    check_router_weight_values(router_weights)
    macrobatch = _check_macrobatch(macrobatch_size, minibatch_size, router_weights, "forward")
    ws.buffers["x_buffer"].copy_(x)
    out, ctx = reference.forward(
        schedule, x, router_weights, *shared, *routed, group=ws.group, swiglu_limit=swiglu_limit,
        macrobatch_size=macrobatch, macrobatch_replay=macrobatch_replay,
    )  # fmt: skip
    return (out, *(t if t is not None else _empty(x) for t in ctx.tensors()))


@forward.register_fake
def _(
    workspace_handle, peer_rank, peer_token_idx, num_tokens, tokens_per_expert, x,
    router_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
    routed_gate_weights, routed_up_weights, routed_down_weights, swiglu_limit,
    fwd_num_comm_sms, minibatch_size, macrobatch_size, macrobatch_replay="gate_up",
):  # fmt: skip
    rows = _fake_rows(macrobatch_size, macrobatch_replay, peer_rank, router_weights)
    return (
        torch.empty_like(x),
        *_fake_context(peer_rank, x, routed_gate_weights, shared_gate_weights is not None, *rows),
    )


@_op("recompute_forward_context")
def recompute_forward_context(
    workspace_handle: int,
    peer_rank: Tensor,
    peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    x: Tensor,
    shared_gate_weights: Tensor | None,
    shared_up_weights: Tensor | None,
    routed_gate_weights: Tensor,
    routed_up_weights: Tensor,
    swiglu_limit: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Rebuild the forward context bitwise (activation checkpointing): no down GEMM.

    Inputs: as `mok::forward`, without router weights and down weights.
    Outputs: the 7 context tensors of `mok::forward` (its outputs 1..7).
    """
    ws = workspace_from_handle(workspace_handle)
    schedule = _schedule(peer_rank, peer_token_idx, num_tokens, tokens_per_expert)
    if x.is_cuda:
        return _gpu("recompute_forward_context", x.device, ws.ep_size).recompute_forward_context(
            ws, schedule, x, shared_gate_weights, shared_up_weights, routed_gate_weights,
            routed_up_weights, swiglu_limit,
        )  # fmt: skip
    ctx = reference.recompute_forward_context(
        schedule, x, shared_gate_weights, shared_up_weights, routed_gate_weights,
        routed_up_weights, topk=ws.topk, group=ws.group, swiglu_limit=swiglu_limit,
    )  # fmt: skip
    return tuple(t if t is not None else _empty(x) for t in ctx.tensors())


@recompute_forward_context.register_fake
def _(
    workspace_handle, peer_rank, peer_token_idx, num_tokens, tokens_per_expert, x,
    shared_gate_weights, shared_up_weights, routed_gate_weights, routed_up_weights, swiglu_limit,
):  # fmt: skip
    return _fake_context(peer_rank, x, routed_gate_weights, shared_gate_weights is not None)


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


@_op(
    "backward",
    mutates_args=(
        "main_grad_routed_gate", "main_grad_routed_up", "main_grad_routed_down",
        "main_grad_shared_gate", "main_grad_shared_up", "main_grad_shared_down",
    ),
)  # fmt: skip
def backward(
    workspace_handle: int,
    peer_rank: Tensor,
    peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    x_routed: Tensor,
    gate_routed: Tensor,
    up_routed: Tensor,
    hidden_routed: Tensor,
    gate_shared: Tensor,
    up_shared: Tensor,
    hidden_shared: Tensor,
    grad_output: Tensor,
    x: Tensor,
    router_weights: Tensor,
    shared_gate_weights: Tensor | None,
    shared_up_weights: Tensor | None,
    shared_down_weights: Tensor | None,
    routed_gate_weights: Tensor,
    routed_up_weights: Tensor,
    routed_down_weights: Tensor,
    swiglu_limit: float | None,
    bwd_num_comm_sms: int,
    minibatch_size: int,
    macrobatch_size: int,
    main_grad_routed_gate: Tensor | None,
    main_grad_routed_up: Tensor | None,
    main_grad_routed_down: Tensor | None,
    main_grad_shared_gate: Tensor | None,
    main_grad_shared_up: Tensor | None,
    main_grad_shared_down: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The MoE layer backward (SEMANTICS §2).

    Inputs: the schedule, the 7 forward-context tensors (shared ones empty [0] if absent),
        grad_output bf16 [T, H], the forward's x, router weights and six weights, and optional
        fp32 `main_grad_*` tensors shaped like their weights: a weight's gradient is added into
        its main_grad in place (fp32) instead of being returned.
    Outputs: d_x bf16 [T, H]; d_router_weights fp32 [T, k]; d_routed_gate, d_routed_up bf16
        [E, I, H]; d_routed_down bf16 [E, H, I]; d_shared_gate, d_shared_up bf16 [I, H];
        d_shared_down bf16 [H, I]. A weight gradient that went into a main_grad, or a shared one
        without a shared expert, is empty [0]. With routed gate and up weights the halves of
        one [E, 2 I, H] tensor (validation.fused_gate_up) and neither's gradient into a
        main_grad, d_routed_gate is the fused bf16 [E, 2 I, H] gradient (gate rows first) and
        d_routed_up empty [0] (custom-op outputs may not alias each other).
    """
    ws = workspace_from_handle(workspace_handle)
    schedule = _schedule(peer_rank, peer_token_idx, num_tokens, tokens_per_expert)
    main_grads = (
        main_grad_routed_gate, main_grad_routed_up, main_grad_routed_down,
        main_grad_shared_gate, main_grad_shared_up, main_grad_shared_down,
    )  # fmt: skip
    ctx_tensors = (x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
                   hidden_shared)  # fmt: skip
    shared = (shared_gate_weights, shared_up_weights, shared_down_weights)
    routed = (routed_gate_weights, routed_up_weights, routed_down_weights)
    if x.is_cuda:
        pass_config = PassConfig.of_workspace(
            ws, swiglu_limit=swiglu_limit, num_comm_ctas=bwd_num_comm_sms,
            minibatch_size=minibatch_size, macrobatch_size=macrobatch_size,
        )  # fmt: skip
        return _gpu("backward", x.device, ws.ep_size).backward(
            ws, schedule, ctx_tensors, grad_output, x, router_weights, shared, routed,
            pass_config, main_grads,
        )  # fmt: skip
    check_router_weight_values(router_weights)
    macrobatch = _check_macrobatch(macrobatch_size, minibatch_size, router_weights, "backward")
    ctx = MoKForwardContext(*(_none_if_empty(t) for t in ctx_tensors))
    grads = reference.backward(
        schedule, ctx, grad_output, x, router_weights, *shared, *routed, group=ws.group,
        swiglu_limit=swiglu_limit, macrobatch_size=macrobatch,
    )  # fmt: skip
    d_x, d_router, weight_grads = grads[0], grads[1], list(grads[2:])
    if _fused_grads(routed_gate_weights, routed_up_weights, main_grads):
        weight_grads[:2] = [torch.cat(weight_grads[:2], dim=1), None]
    outs = []
    for grad, main_grad in zip(weight_grads, main_grads, strict=True):
        if grad is None:
            outs.append(_empty(x))
        elif main_grad is not None:
            main_grad.add_(grad)
            outs.append(_empty(x))
        else:
            outs.append(grad.to(torch.bfloat16))
    return (d_x, d_router, *outs)


@backward.register_fake
def _(workspace_handle, peer_rank, peer_token_idx, num_tokens, tokens_per_expert, x_routed,
      gate_routed, up_routed, hidden_routed, gate_shared, up_shared, hidden_shared, grad_output,
      x, router_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
      routed_gate_weights, routed_up_weights, routed_down_weights, swiglu_limit,
      bwd_num_comm_sms, minibatch_size, macrobatch_size, *main_grads):  # fmt: skip
    weights = (routed_gate_weights, routed_up_weights, routed_down_weights,
               shared_gate_weights, shared_up_weights, shared_down_weights)  # fmt: skip
    outs = [
        _empty(x) if w is None or mg is not None else torch.empty_like(w)
        for w, mg in zip(weights, main_grads, strict=True)
    ]
    if _fused_grads(routed_gate_weights, routed_up_weights, main_grads):
        e, i, h = routed_gate_weights.shape
        outs[:2] = [x.new_empty(e, 2 * i, h), _empty(x)]
    return (torch.empty_like(x), torch.empty_like(router_weights), *outs)


def _fused_grads(gate, up, main_grads) -> bool:
    """The backward returns one fused [E, 2 I, H] gate/up gradient (see `backward`)."""
    return main_grads[0] is None and main_grads[1] is None and fused_gate_up(gate, up)


# ----------------------------------------------------------------------------------------------
# MXFP8 layers (the forward on CUDA; the backward and recompute on the reference path only)
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("mok::forward_mxfp8", mutates_args=())
def forward_mxfp8(
    workspace_handle: int,
    peer_rank: Tensor,
    peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    x: Tensor,
    router_weights: Tensor,
    shared_gate_weights: Tensor | None,
    shared_up_weights: Tensor | None,
    shared_down_weights: Tensor | None,
    routed_gate: Tensor,
    routed_gate_scales: Tensor,
    routed_up: Tensor,
    routed_up_scales: Tensor,
    routed_down: Tensor,
    routed_down_scales: Tensor,
    swiglu_limit: float | None,
    fwd_num_comm_sms: int,
    minibatch_size: int,
    macrobatch_size: int,
    macrobatch_replay: str = "gate_up",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`forward` with MXFP8 routed weights ((fp8, scale) along K each, mxfp8_quantize's):
    `mok.reference.mxfp8_forward`. Same outputs as `forward` (the context in bf16; with ring
    reuse, macrobatch 0's rows, as `forward`'s). On CUDA the forward megakernel's MXFP8
    variant."""
    ws = workspace_from_handle(workspace_handle)
    if check_macrobatch_replay(macrobatch_replay) == "gather" and (
        macrobatch_size < router_weights.numel()
    ):
        raise ValueError(
            "macrobatch_replay 'gather' is BF16 only: with MXFP8 routed weights and "
            f"macrobatch_size {macrobatch_size} below the {router_weights.numel()} routed rows, "
            "use 'gate_up'"
        )
    schedule = _schedule(peer_rank, peer_token_idx, num_tokens, tokens_per_expert)
    routed = ((routed_gate, routed_gate_scales), (routed_up, routed_up_scales),
              (routed_down, routed_down_scales))  # fmt: skip
    shared = (shared_gate_weights, shared_up_weights, shared_down_weights)
    if x.is_cuda:
        pass_config = PassConfig.of_workspace(
            ws, swiglu_limit=swiglu_limit, num_comm_ctas=fwd_num_comm_sms,
            minibatch_size=minibatch_size, macrobatch_size=macrobatch_size,
            macrobatch_replay=macrobatch_replay,
        )  # fmt: skip
        gpu = _gpu("forward", x.device, ws.ep_size)
        return gpu.forward(ws, schedule, x, router_weights, shared, routed, pass_config)
    check_router_weight_values(router_weights)
    macrobatch = _check_macrobatch(macrobatch_size, minibatch_size, router_weights, "forward")
    ws.buffers["x_buffer"].copy_(x)
    out, ctx = reference.mxfp8_forward(
        schedule, x, router_weights, *shared, *routed, group=ws.group, swiglu_limit=swiglu_limit,
        macrobatch_size=macrobatch, macrobatch_replay=macrobatch_replay,
    )  # fmt: skip
    return (out, *(t if t is not None else _empty(x) for t in ctx.tensors()))


@forward_mxfp8.register_fake
def _(workspace_handle, peer_rank, peer_token_idx, num_tokens, tokens_per_expert, x,
      router_weights, shared_gate_weights, shared_up_weights, shared_down_weights, routed_gate,
      routed_gate_scales, routed_up, routed_up_scales, routed_down, routed_down_scales,
      swiglu_limit, fwd_num_comm_sms, minibatch_size, macrobatch_size,
      macrobatch_replay="gate_up"):  # fmt: skip
    rows = _fake_rows(macrobatch_size, macrobatch_replay, peer_rank, router_weights)
    return (
        torch.empty_like(x),
        *_fake_context(peer_rank, x, routed_gate, shared_gate_weights is not None, *rows),
    )


@torch.library.custom_op("mok::recompute_forward_context_mxfp8", mutates_args=())
def recompute_forward_context_mxfp8(
    workspace_handle: int,
    peer_rank: Tensor,
    peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    x: Tensor,
    shared_gate_weights: Tensor | None,
    shared_up_weights: Tensor | None,
    routed_gate: Tensor,
    routed_gate_scales: Tensor,
    routed_up: Tensor,
    routed_up_scales: Tensor,
    swiglu_limit: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`recompute_forward_context` with MXFP8 gate and up weights ((fp8, scale) along H):
    `mok.reference.mxfp8_recompute_forward_context`, bitwise `forward_mxfp8`'s context. On CUDA
    the gather, x's round trip along H and the gate/up kernel on the dequantised weights."""
    ws = workspace_from_handle(workspace_handle)
    schedule = _schedule(peer_rank, peer_token_idx, num_tokens, tokens_per_expert)
    if x.is_cuda:
        gpu = _gpu("recompute_forward_context", x.device, ws.ep_size)
        return gpu.recompute_forward_context(
            ws, schedule, x, shared_gate_weights, shared_up_weights,
            (routed_gate, routed_gate_scales), (routed_up, routed_up_scales), swiglu_limit,
        )  # fmt: skip
    ctx = reference.mxfp8_recompute_forward_context(
        schedule, x, shared_gate_weights, shared_up_weights, (routed_gate, routed_gate_scales),
        (routed_up, routed_up_scales), topk=ws.topk, group=ws.group, swiglu_limit=swiglu_limit,
    )  # fmt: skip
    return tuple(t if t is not None else _empty(x) for t in ctx.tensors())


@recompute_forward_context_mxfp8.register_fake
def _(workspace_handle, peer_rank, peer_token_idx, num_tokens, tokens_per_expert, x,
      shared_gate_weights, shared_up_weights, routed_gate, *_):  # fmt: skip
    return _fake_context(peer_rank, x, routed_gate, shared_gate_weights is not None)


@torch.library.custom_op("mok::backward_mxfp8", mutates_args=())
def backward_mxfp8(
    workspace_handle: int,
    peer_rank: Tensor,
    peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    x_routed: Tensor,
    gate_routed: Tensor,
    up_routed: Tensor,
    hidden_routed: Tensor,
    gate_shared: Tensor,
    up_shared: Tensor,
    hidden_shared: Tensor,
    grad_output: Tensor,
    x: Tensor,
    router_weights: Tensor,
    shared_gate_weights: Tensor | None,
    shared_up_weights: Tensor | None,
    shared_down_weights: Tensor | None,
    routed_gate: Tensor,
    routed_gate_scales: Tensor,
    routed_gate_t: Tensor,
    routed_gate_t_scales: Tensor,
    routed_up: Tensor,
    routed_up_scales: Tensor,
    routed_up_t: Tensor,
    routed_up_t_scales: Tensor,
    routed_down_t: Tensor,
    routed_down_t_scales: Tensor,
    swiglu_limit: float | None,
    bwd_num_comm_sms: int,
    minibatch_size: int,
    macrobatch_size: int,
    context_exact: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`backward` with MXFP8 routed weights (gate and up with their transposed copies, down
    transposed): `mok.reference.mxfp8_backward`. Same outputs as `backward` (bf16 weight
    gradients, empty [0] shared ones without a shared expert). On CUDA the backward
    megakernel's MXFP8 variant (launchers/backward_op.py; with ring reuse, launchers/
    macrobatch.py). `context_exact`: the routed context holds MXFP8 values already (a dequantised
    quantised context, mok/mxfp8_context.py), so the round trips that are identities on it
    are skipped; the results are the same either way."""
    ws = workspace_from_handle(workspace_handle)
    schedule = _schedule(peer_rank, peer_token_idx, num_tokens, tokens_per_expert)
    ctx_tensors = (x_routed, gate_routed, up_routed, hidden_routed, gate_shared, up_shared,
                   hidden_shared)  # fmt: skip
    shared = (shared_gate_weights, shared_up_weights, shared_down_weights)
    routed = ((routed_gate, routed_gate_scales, routed_gate_t, routed_gate_t_scales),
              (routed_up, routed_up_scales, routed_up_t, routed_up_t_scales),
              (routed_down_t, routed_down_t_scales))  # fmt: skip
    if x.is_cuda:
        pass_config = PassConfig.of_workspace(
            ws, swiglu_limit=swiglu_limit, num_comm_ctas=bwd_num_comm_sms,
            minibatch_size=minibatch_size, macrobatch_size=macrobatch_size,
        )  # fmt: skip
        return _gpu("backward", x.device, ws.ep_size).backward(
            ws, schedule, ctx_tensors, grad_output, x, router_weights, shared, routed,
            pass_config, (None,) * 6, context_exact,
        )  # fmt: skip
    check_router_weight_values(router_weights)
    macrobatch = _check_macrobatch(macrobatch_size, minibatch_size, router_weights, "backward")
    ctx = MoKForwardContext(*(_none_if_empty(t) for t in ctx_tensors))
    grads = reference.mxfp8_backward(
        schedule, ctx, grad_output, x, router_weights, *shared, *routed, group=ws.group,
        swiglu_limit=swiglu_limit, macrobatch_size=macrobatch,
    )  # fmt: skip
    d_x, d_router, weight_grads = grads[0], grads[1], grads[2:]
    return (d_x, d_router,
            *(_empty(x) if g is None else g.to(torch.bfloat16) for g in weight_grads))  # fmt: skip


@backward_mxfp8.register_fake
def _(workspace_handle, peer_rank, peer_token_idx, num_tokens, tokens_per_expert, x_routed,
      gate_routed, up_routed, hidden_routed, gate_shared, up_shared, hidden_shared, grad_output,
      x, router_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
      routed_gate, *_):  # fmt: skip
    experts, inter, hidden = routed_gate.shape
    bf16 = dict(dtype=torch.bfloat16, device=x.device)
    routed = [x.new_empty(experts, inter, hidden, **bf16) for _ in range(2)]
    routed.append(x.new_empty(experts, hidden, inter, **bf16))
    weights = (shared_gate_weights, shared_up_weights, shared_down_weights)
    shared = [_empty(x) if w is None else torch.empty_like(w) for w in weights]
    return (torch.empty_like(x), torch.empty_like(router_weights), *routed, *shared)


# ----------------------------------------------------------------------------------------------
# MXFP8 quantiser and epilogues
# ----------------------------------------------------------------------------------------------


def _check_mxfp8_input(x: Tensor, return_normal, return_transposed) -> None:
    # The schema's bools: the dispatcher has converted or refused a non-bool already.
    if not (return_normal or return_transposed):
        raise ValueError("return_normal and return_transposed are both False: nothing to return")
    if x.dtype != torch.bfloat16:
        raise MoKInputError(f"x_bf16 must have dtype torch.bfloat16, got {x.dtype}")
    if x.dim() not in (2, 3) or any(d <= 0 for d in x.shape):
        raise ValueError(
            f"x_bf16 must be [M, N] or [E, M, N] with every dim > 0, got {list(x.shape)}"
        )
    if x.shape[-1] % 128 or x.shape[-2] % 128:
        raise ValueError(f"x_bf16's last two dims must be multiples of 128, got {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"x_bf16 must be contiguous, got strides {tuple(x.stride())}")


@torch.library.custom_op(
    "mok::mxfp8_quantize",
    mutates_args=(),
    schema="(Tensor x_bf16, bool return_normal=True, bool return_transposed=False) "
    "-> (Tensor?, Tensor?, Tensor?, Tensor?)",
)
def mxfp8_quantize(
    x_bf16: Tensor, return_normal: bool = True, return_transposed: bool = False
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Quantise a bf16 matrix (or a stack of them) to MXFP8 (SEMANTICS §5): E4M3 values with
    one UE8M0 power-of-two scale per 32 consecutive values, bit-exact with
    `mok.reference.mxfp8_quantize` on CPU and GPU. The original's op, with defaults added.

        x_fp8, x_sc, _, _ = mok.ops.mxfp8_quantize(w)                         # along N
        _, _, w_fp8_t, w_sc_t = mok.ops.mxfp8_quantize(w, return_normal=False,
                                                      return_transposed=True)  # along M

    Inputs:
        x_bf16: bf16 [M, N] or [E, M, N], contiguous; M and N multiples of 128 (E folds into
            the rows of the scale layout)
        return_normal: return the layout quantised along N (the last dim); default True
        return_transposed: return a transposed copy [..., N, M] quantised along M; default
            False. At least one of the two must be True.
    Outputs (None for a layout not asked for):
        x_fp8 float8_e4m3fn like x, x_sc uint8 [E*M/128, N/128, 32, 16] (along N);
        x_fp8_t float8_e4m3fn [..., N, M], x_sc_t uint8 [E*N/128, M/128, 32, 16] (along M)
    Raises ValueError (bad shape, nothing asked for) or MoKInputError (dtype).
    """
    _check_mxfp8_input(x_bf16, return_normal, return_transposed)
    if x_bf16.is_cuda:
        quantize = _gpu("mxfp8_quantize", x_bf16.device).mxfp8_quantize
    else:

        def quantize(x, transpose):
            return reference.mxfp8_quantize(x, transpose=transpose)

    normal = quantize(x_bf16, False) if return_normal else (None, None)
    transposed = quantize(x_bf16, True) if return_transposed else (None, None)
    return (*normal, *transposed)


@mxfp8_quantize.register_fake
def _(x_bf16, return_normal=True, return_transposed=False):
    def layout(transpose):
        shape = tuple(x_bf16.shape)
        if transpose:
            shape = (*shape[:-2], shape[-1], shape[-2])
        rows = x_bf16.numel() // shape[-1]
        data = x_bf16.new_empty(shape, dtype=torch.float8_e4m3fn)
        return data, x_bf16.new_empty((rows // 128, shape[-1] // 128, 32, 16), dtype=torch.uint8)

    normal = layout(False) if return_normal else (None, None)
    transposed = layout(True) if return_transposed else (None, None)
    return (*normal, *transposed)


# The epilogues' top-k range: the original's (one byte of k), checked on every path.
EPILOGUE_MAX_TOPK = 255


def _check_epilogue(op: str, shared: Tensor | None, shared_name: str, slots: Tensor,
                    slots_name: str, topk: int, num_tokens: int | None = None) -> None:  # fmt: skip
    """An epilogue's tensors: topk in [1, 255], slots bf16 [T*k, H], shared bf16 [T, H] (T the
    router weights' rows in the forward, the slots' over k in the backward)."""
    if not 1 <= topk <= EPILOGUE_MAX_TOPK:
        raise ValueError(f"topk must be in [1, {EPILOGUE_MAX_TOPK}] ({op}), got {topk}")
    check_tensor(slots_name, slots, dtype=torch.bfloat16, shape=[None, None])
    hidden = slots.shape[1]
    if num_tokens is None:
        if slots.shape[0] % topk:
            raise ValueError(
                f"{slots_name} rows ({slots.shape[0]}) must be a multiple of topk ({topk})"
            )
        num_tokens = slots.shape[0] // topk
    check_tensor(slots_name, slots, dtype=torch.bfloat16, shape=[num_tokens * topk, hidden])
    if shared is not None:
        check_tensor(shared_name, shared, dtype=torch.bfloat16, shape=[num_tokens, hidden],
                     device=slots.device)  # fmt: skip


def _check_fwd_epilogue(y_shared, combine_buffer, topk_weights) -> None:
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=[None, None],
                 device=combine_buffer.device)  # fmt: skip
    num_tokens, topk = topk_weights.shape
    _check_epilogue("fwd_epilogue", y_shared, "y_shared", combine_buffer, "combine_buffer", topk,
                    num_tokens)  # fmt: skip


@torch.library.custom_op("mok::fwd_epilogue", mutates_args=())
def fwd_epilogue(y_shared: Tensor | None, combine_buffer: Tensor, topk_weights: Tensor) -> Tensor:
    """out[t] = bf16(y_shared[t] + sum_j w[t, j] * combine_buffer[t*k + j]) in fp32, j in order.

    Inputs: y_shared bf16 [T, H] or None; combine_buffer bf16 [T*k, H] (the slots);
    topk_weights fp32 [T, k] (the router weights), k in [1, 255].
    Outputs: out bf16 [T, H]. A shape, dtype or k out of range raises ValueError (a wrong
    dtype MoKInputError, also a TypeError).
    """
    _check_fwd_epilogue(y_shared, combine_buffer, topk_weights)
    if combine_buffer.is_cuda:
        return _gpu("fwd_epilogue", combine_buffer.device).fwd_epilogue(
            y_shared, combine_buffer, topk_weights
        )
    return reference.fwd_epilogue(y_shared, combine_buffer, topk_weights)


@fwd_epilogue.register_fake
def _(y_shared, combine_buffer, topk_weights):
    _check_fwd_epilogue(y_shared, combine_buffer, topk_weights)
    return combine_buffer.new_empty(topk_weights.shape[0], combine_buffer.shape[1])


def _epilogue_topk(d_x_shared: Tensor | None, d_x_routed_buffer: Tensor, topk: int | None) -> int:
    """k of bwd_epilogue: given, or the routed rows over the tokens of d_x_shared."""
    if topk is not None:
        return topk
    if d_x_shared is None:
        raise ValueError("bwd_epilogue needs topk when d_x_shared is None (no shared expert)")
    tokens = d_x_shared.shape[0]
    if tokens == 0 or d_x_routed_buffer.shape[0] % tokens:
        raise ValueError(
            f"d_x_routed_buffer rows ({d_x_routed_buffer.shape[0]}) must be a multiple of the "
            f"tokens of d_x_shared ({tokens})"
        )
    return d_x_routed_buffer.shape[0] // tokens


@torch.library.custom_op("mok::bwd_epilogue", mutates_args=())
def bwd_epilogue(
    d_x_shared: Tensor | None, d_x_routed_buffer: Tensor, topk: int | None = None
) -> Tensor:
    """d_x[t] = bf16(d_x_shared[t] + sum_j d_x_routed_buffer[t*k + j]) in fp32, j in order.

    Inputs: d_x_shared bf16 [T, H] or None; d_x_routed_buffer bf16 [T*k, H] (the slots); topk
    k in [1, 255] (None: inferred from d_x_shared, as the original's two-argument call).
    Outputs: d_x bf16 [T, H]. A shape, dtype or k out of range raises ValueError (a wrong
    dtype MoKInputError, also a TypeError).
    """
    k = _epilogue_topk(d_x_shared, d_x_routed_buffer, topk)
    _check_epilogue("bwd_epilogue", d_x_shared, "d_x_shared", d_x_routed_buffer,
                    "d_x_routed_buffer", k)  # fmt: skip
    if d_x_routed_buffer.is_cuda:
        return _gpu("bwd_epilogue", d_x_routed_buffer.device).bwd_epilogue(
            d_x_shared, d_x_routed_buffer, k
        )
    return reference.bwd_epilogue(d_x_shared, d_x_routed_buffer, k)


@bwd_epilogue.register_fake
def _(d_x_shared, d_x_routed_buffer, topk=None):
    k = _epilogue_topk(d_x_shared, d_x_routed_buffer, topk)
    _check_epilogue("bwd_epilogue", d_x_shared, "d_x_shared", d_x_routed_buffer,
                    "d_x_routed_buffer", k)  # fmt: skip
    return d_x_routed_buffer.new_empty(d_x_routed_buffer.shape[0] // k, d_x_routed_buffer.shape[1])


def document_ops(namespace: dict) -> None:
    """Give each custom op object its function's docstring and signature: a CustomOpDef
    otherwise shows torch's generic docstring and `(*args, **kwargs)` in help() and inspect."""
    for value in list(namespace.values()):
        if isinstance(value, torch._library.custom_ops.CustomOpDef):
            value.__doc__ = value._init_fn.__doc__
            value.__signature__ = inspect.signature(value._init_fn)


document_ops(globals())
