"""mok's public functional API (SEMANTICS §3), with the original Mixture-of-Kittens names.

    config = MoKConfig()
    ws = get_workspace(config, group, device=x.device, num_local_tokens=T, hidden_size=H, topk=k)
    schedule = build_schedule(ws, config, top_experts, num_local_experts=E)
    out, ctx = forward(config, ws, schedule, x, router_weights, sg, su, sd, rg, ru, rd)
    grads = backward(config, ws, schedule, ctx, grad_output, x, router_weights, sg, ..., rd)

Paths: CPU tensors run the PyTorch reference (`mok.reference`, exact same math, EP through
torch.distributed/gloo) — the CPU path. CUDA tensors on a supported GPU run the shipped kernels;
where a kernel has not landed yet the call raises MoKKernelUnavailableError. Any other device
raises ValueError. There is no silent fallback between paths.

Every function checks its inputs and raises ValueError/TypeError naming the argument, the
expected and the actual value.
"""

from __future__ import annotations

import weakref

import torch

from . import errors, mxfp8_context, ops
from .config import FEATURE_ALIGNMENT, MoKConfig
from .errors import MoKInputError, MoKKernelUnavailableError
from .mxfp8_weights import check_mxfp8_weights, is_mxfp8
from .types import MoKForwardContext, MoKSchedule
from .validation import (
    CheckedCalls,
    check_chunk_divides_routes,
    check_int,
    check_swiglu_limit,
    check_tensor,
    check_type,
    context_rows,
    tensor_key,
)
from .workspace import (
    MoKWorkspace,
    clear_workspace_cache,
    create_workspace,
    get_workspace,
    validate_workspace_args,
)

__all__ = [
    "check_errors",
    "create_workspace",
    "MoKInputError",
    "validate_inputs",
    "validate_workspace_args",
    "MoKConfig",
    "MoKForwardContext",
    "MoKKernelUnavailableError",
    "MoKSchedule",
    "MoKWorkspace",
    "backward",
    "build_schedule",
    "clear_workspace_cache",
    "forward",
    "get_workspace",
    "recompute_forward_context",
    *errors.RUNTIME_ERRORS,
]


def __getattr__(name: str):
    # The runtime's errors (MoKWaitTimeoutError, ...) load on first use, as in mok.errors.
    if name in errors.RUNTIME_ERRORS:
        return getattr(errors, name)
    raise AttributeError(f"module 'mok.functional' has no attribute {name!r}")


_MXFP8_NOT_YET = "{name} was given as an MXFP8 tuple where bf16 weights are expected"


def _check_common(config, workspace, schedule=None) -> None:
    check_type("config", config, MoKConfig)
    # Checked here, not when made (the original's MoKConfig takes any values): once per config
    # object and call shape, as the memo of checked calls skips this on a hit.
    config.validate()
    check_type("workspace", workspace, MoKWorkspace)
    workspace.require_alive()
    if schedule is not None:
        check_type("schedule", schedule, MoKSchedule)
        cap = workspace.schedule_capacity
        check_tensor("schedule.peer_rank", schedule.peer_rank, dtype=torch.int32, shape=[cap],
                     device=workspace.device)  # fmt: skip
        check_tensor("schedule.peer_token_idx", schedule.peer_token_idx, dtype=torch.int32,
                     shape=[cap], device=workspace.device)  # fmt: skip
        check_tensor("schedule.num_tokens", schedule.num_tokens, dtype=torch.int32, shape=[1],
                     device=workspace.device)  # fmt: skip


def _check_weights(workspace, schedule, weights: dict, *, need_down: bool = True) -> int:
    """Check the six weights (down ones only if need_down); returns the intermediate size I."""
    hidden = workspace.hidden_size
    num_experts = schedule.num_local_experts
    for name in ("routed_gate_weights", "routed_up_weights", "routed_down_weights"):
        if isinstance(weights.get(name), tuple):
            raise MoKInputError(_MXFP8_NOT_YET.format(name=name))
    gate = weights["routed_gate_weights"]
    check_type("routed_gate_weights", gate, torch.Tensor)
    if gate.dim() != 3:
        raise ValueError(f"routed_gate_weights must have shape [E, I, H], got {list(gate.shape)}")
    inter = gate.shape[1]
    if inter == 0 or inter % FEATURE_ALIGNMENT:
        raise ValueError(
            f"intermediate size (routed_gate_weights.shape[1]) must be a positive multiple of "
            f"{FEATURE_ALIGNMENT}, got {inter}"
        )
    shapes = {
        "routed_gate_weights": [num_experts, inter, hidden],
        "routed_up_weights": [num_experts, inter, hidden],
        "routed_down_weights": [num_experts, hidden, inter],
        "shared_gate_weights": [inter, hidden],
        "shared_up_weights": [inter, hidden],
        "shared_down_weights": [hidden, inter],
    }
    shared_names = [n for n in shapes if n.startswith("shared") and n in weights]
    given = [n for n in shared_names if weights[n] is not None]
    if given and len(given) != len(shared_names):
        missing = [n for n in shared_names if weights[n] is None]
        raise ValueError(
            f"shared expert weights must be all given or all None; got {given} but {missing} "
            f"is None"
        )
    for name, shape in shapes.items():
        if name not in weights or weights[name] is None:
            continue
        if not need_down and name.endswith("down_weights"):
            continue
        check_tensor(name, weights[name], dtype=torch.bfloat16, shape=shape,
                     device=workspace.device, expert_strided=name in _EXPERT_STRIDED)  # fmt: skip
    return inter


# Routed gate and up weights (and their main_grads) may be the halves of one fused [E, 2 I, H]
# tensor, as frameworks hold them: the kernels take their experts' row stride (SEMANTICS §1).
_EXPERT_STRIDED = ("routed_gate_weights", "routed_up_weights")


def _check_activations(workspace, x, router_weights=None, grad_output=None) -> None:
    t, h, k = workspace.num_local_tokens, workspace.hidden_size, workspace.topk
    check_tensor("x", x, dtype=torch.bfloat16, shape=[t, h], device=workspace.device)
    if router_weights is not None:
        check_tensor("router_weights", router_weights, dtype=torch.float32, shape=[t, k],
                     device=workspace.device)  # fmt: skip
    if grad_output is not None:
        check_tensor("grad_output", grad_output, dtype=torch.bfloat16, shape=[t, h],
                     device=workspace.device)  # fmt: skip


def validate_inputs(
    config: MoKConfig,
    workspace: MoKWorkspace,
    schedule: MoKSchedule,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    grad_output: torch.Tensor | None = None,
) -> None:
    """Raise a clear error unless config, workspace, schedule, x (bf16 [T, H]), router_weights
    (fp32 [T, k]) and grad_output (bf16 [T, H], when given) fit together: the checks forward
    and backward run before their weights'. A wrong type or dtype raises MoKInputError, both a
    ValueError and a TypeError."""
    _check_common(config, workspace, schedule)
    _check_activations(workspace, x, router_weights, grad_output)


def _schedule_args(schedule: MoKSchedule):
    return (schedule.peer_rank, schedule.peer_token_idx, schedule.num_tokens,
            schedule.tokens_per_expert)  # fmt: skip


def build_schedule(
    workspace: MoKWorkspace,
    config: MoKConfig,
    top_experts: torch.Tensor,
    *,
    num_local_experts: int,
) -> MoKSchedule:
    """All-gather the routing over the EP group and build this rank's receive schedule.

    top_experts: int64 [T, k], global expert ids in [0, num_local_experts * EP size). A token
    may name one expert more than once: each (t, j) is its own routed row, so that expert's
    output is added once per occurrence, weighted by that j's router weight.
    The schedule belongs to this routing: forward refuses it once top_experts changes in place.
    Raises ValueError on ids out of range or when routed rows exceed the schedule capacity.
    """
    key = _call_key("build_schedule", config, workspace, None, (top_experts,), num_local_experts)
    if key in _CHECKED:
        workspace.require_alive()
    else:
        _check_common(config, workspace)
        check_int("num_local_experts", num_local_experts, minimum=1)
        check_tensor("top_experts", top_experts, dtype=torch.int64,
                     shape=[workspace.num_local_tokens, workspace.topk],
                     device=workspace.device)  # fmt: skip
        check_chunk_divides_routes(config.all_gather_top_experts_chunk_bytes,
                                   workspace.num_local_tokens, workspace.topk)  # fmt: skip
        _CHECKED.add(key, config)
    outs = ops.call(
        "build_schedule",
        workspace.handle,
        top_experts,
        num_local_experts,
        workspace.schedule_capacity,
        config.all_gather_top_experts_chunk_bytes,
    )
    schedule = MoKSchedule(*outs)
    if not torch.compiler.is_compiling():
        # Where it came from (no dataclass field, no GPU work): forward refuses it with another
        # workspace, or after its routing changed in place.
        made = (workspace.handle, workspace.num_local_tokens, weakref.ref(top_experts),
                top_experts._version)  # fmt: skip
        object.__setattr__(schedule, _SCHEDULE_ROUTING, made)
    return schedule


_SCHEDULE_ROUTING = "_mok_routing"


def _check_schedule_origin(schedule, workspace, *, routing: bool) -> None:
    """Raise if `build_schedule` made `schedule` for another workspace, or (`routing`) if the
    top_experts it was built from changed in place since. A schedule made by hand, or while
    torch.compile traced, carries no origin and is checked by its shapes only."""
    made = getattr(schedule, "__dict__", {}).get(_SCHEDULE_ROUTING)
    if made is None or not isinstance(workspace, MoKWorkspace):
        return  # a workspace of another type: _check_common raises TypeError naming it
    handle, num_tokens, routing_ref, version = made
    if handle != workspace.handle:
        raise ValueError(
            f"schedule was built by build_schedule for another workspace (handle {handle}, "
            f"{num_tokens} tokens), not for this one (handle {workspace.handle}, "
            f"{workspace.num_local_tokens} tokens): build the schedule with the workspace "
            f"you pass here"
        )
    top_experts = routing_ref() if routing else None
    if top_experts is not None and top_experts._version != version:
        raise ValueError(
            "schedule: the top_experts tensor it was built from has changed in place since "
            "build_schedule, so the schedule no longer describes that routing; a schedule "
            "belongs to one step's routing: call build_schedule again"
        )


def forward(
    config: MoKConfig,
    workspace: MoKWorkspace,
    schedule: MoKSchedule,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: torch.Tensor,
    routed_up_weights: torch.Tensor,
    routed_down_weights: torch.Tensor,
    swiglu_limit: float | None = None,
) -> tuple[torch.Tensor, MoKForwardContext]:
    """out[t] = shared(x_t) + sum_j w[t, j] * expert_{top_experts[t, j]}(x_t)  (SEMANTICS §1).

    Shapes: x bf16 [T, H]; router_weights fp32 [T, k] (> 0); shared gate/up bf16 [I, H] and down
    [H, I], or all three None; routed gate/up bf16 [E, I, H], down [E, H, I]. H and I are
    multiples of 128. Returns (out bf16 [T, H], the context backward needs).

    `schedule` belongs to one step's routing: build it from the top_experts whose weights are
    `router_weights`, every step. A schedule from another workspace, or whose top_experts
    changed in place since it was built, is refused (ValueError); mok cannot tell a schedule
    of an older routing held in another tensor from the current one, and would silently use
    it.
    """
    if schedule.__class__ is MoKSchedule:
        _check_schedule_origin(schedule, workspace, routing=True)
    key = _call_key(
        "forward", config, workspace, schedule,
        (x, router_weights, shared_gate_weights, shared_up_weights, shared_down_weights,
         routed_gate_weights, routed_up_weights, routed_down_weights), swiglu_limit,
    )  # fmt: skip
    if key in _CHECKED:
        workspace.require_alive()
        limit = None if swiglu_limit is None else float(swiglu_limit)
    else:
        _check_common(config, workspace, schedule)
        _check_activations(workspace, x, router_weights)
        weights = dict(
            shared_gate_weights=shared_gate_weights, shared_up_weights=shared_up_weights,
            shared_down_weights=shared_down_weights, routed_gate_weights=routed_gate_weights,
            routed_up_weights=routed_up_weights, routed_down_weights=routed_down_weights,
        )  # fmt: skip
        limit = check_swiglu_limit(swiglu_limit)
        if is_mxfp8(weights):
            check_mxfp8_weights(workspace, schedule.num_local_experts, weights, backward=False)
            out, *ctx = ops.forward_mxfp8(
                workspace.handle, *_schedule_args(schedule), x, router_weights,
                shared_gate_weights, shared_up_weights, shared_down_weights,
                *routed_gate_weights, *routed_up_weights, *routed_down_weights, limit,
                config.fwd_num_comm_sms, config.minibatch_size, config.macrobatch_size,
                config.macrobatch_replay,
            )  # fmt: skip
            return out, _mxfp8_context(ctx, x, schedule, shared_gate_weights is not None)
        _check_weights(workspace, schedule, weights)
        _CHECKED.add(key, config)
    out, *ctx = ops.call(
        "forward",
        workspace.handle, *_schedule_args(schedule), x, router_weights,
        shared_gate_weights, shared_up_weights, shared_down_weights,
        routed_gate_weights, routed_up_weights, routed_down_weights,
        limit, config.fwd_num_comm_sms, config.minibatch_size, config.macrobatch_size,
        config.macrobatch_replay,
    )  # fmt: skip
    return out, _context(ctx, schedule, has_shared=shared_gate_weights is not None)


# Argument sets whose checks passed (the BF16 layer calls; see validation.CheckedCalls).
_CHECKED = CheckedCalls()


def _call_key(op, config, workspace, schedule, tensors, *values) -> tuple | None:
    """The key of a call's checks: its config and workspace, the `tensor_key` of the
    schedule's and every given tensor, and the plain values (None: not memoisable, and always
    while torch.compile traces: the checks then run on the fake tensors, and the memo would be a
    side effect in the graph)."""
    if torch.compiler.is_compiling():
        return None
    if config.__class__ is not MoKConfig or workspace.__class__ is not MoKWorkspace:
        return None
    sched = ()
    if schedule is not None:
        if schedule.__class__ is not MoKSchedule:
            return None
        sched = (tensor_key(schedule.peer_rank), tensor_key(schedule.peer_token_idx),
                 tensor_key(schedule.num_tokens), tensor_key(schedule.tokens_per_expert))  # fmt: skip
    # The workspace by handle: a memo must not hold it (the cache evicts unreferenced ones), and
    # a handle names one shape for life (an evicted workspace's handle is remade alike).
    return (op, id(config), workspace.handle, *sched, *(tensor_key(t) for t in tensors),
            *((v.__class__, v) for v in values))  # fmt: skip


def _context(tensors, schedule: MoKSchedule, *, has_shared: bool) -> MoKForwardContext:
    routed, shared = tensors[:4], tensors[4:]
    ctx = MoKForwardContext(*routed, *(shared if has_shared else (None, None, None)))
    # The schedule it was made with (no dataclass field): backward refuses another's context.
    object.__setattr__(ctx, _CONTEXT_SCHEDULE, schedule.peer_rank)
    return ctx


_CONTEXT_SCHEDULE = "_mok_schedule_peer_rank"


def _mxfp8_context(tensors, like, schedule: MoKSchedule, has_shared: bool) -> MoKForwardContext:
    """The original's MXFP8 context (mok/mxfp8_context.py) of the layer op's bf16 one: the
    routed fields (data, scales) pairs, about half the bytes."""
    bf16 = MoKForwardContext(*tensors[:4], *(t if t.numel() else None for t in tensors[4:]))
    pairs = mxfp8_context.as_pairs(mxfp8_context.quantised_context(bf16, like))
    return _context(pairs, schedule, has_shared=has_shared)


def recompute_forward_context(
    config: MoKConfig,
    workspace: MoKWorkspace,
    schedule: MoKSchedule,
    x: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    routed_gate_weights: torch.Tensor,
    routed_up_weights: torch.Tensor,
    swiglu_limit: float | None = None,
) -> MoKForwardContext:
    """Rebuild forward's context bitwise, for activation checkpointing (no down GEMM).
    `schedule`: the one forward ran with."""
    if schedule.__class__ is MoKSchedule:
        _check_schedule_origin(schedule, workspace, routing=False)
    _check_common(config, workspace, schedule)
    _check_activations(workspace, x)
    weights = dict(
        shared_gate_weights=shared_gate_weights, shared_up_weights=shared_up_weights,
        routed_gate_weights=routed_gate_weights, routed_up_weights=routed_up_weights,
    )  # fmt: skip
    limit = check_swiglu_limit(swiglu_limit)
    if is_mxfp8(weights):
        check_mxfp8_weights(workspace, schedule.num_local_experts, weights, backward=False)
        ctx = ops.recompute_forward_context_mxfp8(
            workspace.handle, *_schedule_args(schedule), x, shared_gate_weights,
            shared_up_weights, *routed_gate_weights, *routed_up_weights, limit,
        )  # fmt: skip
        return _mxfp8_context(ctx, x, schedule, shared_gate_weights is not None)
    _check_weights(workspace, schedule, weights, need_down=False)
    ctx = ops.call(
        "recompute_forward_context",
        workspace.handle, *_schedule_args(schedule), x, shared_gate_weights, shared_up_weights,
        routed_gate_weights, routed_up_weights, limit,
    )  # fmt: skip
    return _context(ctx, schedule, has_shared=shared_gate_weights is not None)


def backward(
    config: MoKConfig,
    workspace: MoKWorkspace,
    schedule: MoKSchedule,
    forward_context: MoKForwardContext,
    grad_output: torch.Tensor,
    x: torch.Tensor,
    router_weights: torch.Tensor,
    shared_gate_weights: torch.Tensor | None,
    shared_up_weights: torch.Tensor | None,
    shared_down_weights: torch.Tensor | None,
    routed_gate_weights: torch.Tensor,
    routed_up_weights: torch.Tensor,
    routed_down_weights: torch.Tensor,
    swiglu_limit: float | None = None,
    *,
    main_grads: tuple[torch.Tensor | None, ...] | None = None,
    whole_gate_up_grad: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of `forward` (SEMANTICS §2).

    Returns (d_x bf16 [T, H], d_router_weights fp32 [T, k], d_routed_gate, d_routed_up,
    d_routed_down, d_shared_gate, d_shared_up, d_shared_down); the shared ones are None without a
    shared expert. Experts with no tokens get exact zeros.

    main_grads: optional 6-tuple of fp32 tensors (or None entries), in the order routed gate, up,
    down, shared gate, up, down, shaped like their weights: those gradients are accumulated in
    place into them (fp32) and the same tensors are returned in their places.
    `schedule`: the one forward ran with.

    Routed gate and up weights that are the halves of one [E, 2 I, H] tensor
    (validation.fused_gate_up) with no main_grads of theirs get gradients that are the halves of
    one new [E, 2 I, H] tensor; `whole_gate_up_grad` returns that tensor whole in
    d_routed_gate's place and None in d_routed_up's (mok.nn.moe_fused: gate_up's gradient with
    no copy, and no alias test that torch.compile cannot trace).
    """
    if schedule.__class__ is MoKSchedule:
        _check_schedule_origin(schedule, workspace, routing=False)
    has_shared = shared_gate_weights is not None
    context_tensors = (forward_context.tensors()
                       if forward_context.__class__ is MoKForwardContext else None)  # fmt: skip
    key = None
    if context_tensors is not None and (main_grads is None or main_grads.__class__ is tuple):
        key = _call_key(
            "backward", config, workspace, schedule,
            (*context_tensors, grad_output, x, router_weights, shared_gate_weights,
             shared_up_weights, shared_down_weights, routed_gate_weights, routed_up_weights,
             routed_down_weights, *(main_grads or ())), swiglu_limit, main_grads is None,
        )  # fmt: skip
    if key in _CHECKED:
        workspace.require_alive()
        _check_provenance(forward_context, schedule)
        limit = None if swiglu_limit is None else float(swiglu_limit)
        main = main_grads if main_grads is not None else (None,) * 6
        ctx = context_tensors
    else:
        _check_common(config, workspace, schedule)
        _check_activations(workspace, x, router_weights, grad_output)
        check_type("forward_context", forward_context, MoKForwardContext)
        weights = dict(
            routed_gate_weights=routed_gate_weights, routed_up_weights=routed_up_weights,
            routed_down_weights=routed_down_weights, shared_gate_weights=shared_gate_weights,
            shared_up_weights=shared_up_weights, shared_down_weights=shared_down_weights,
        )  # fmt: skip
        limit = check_swiglu_limit(swiglu_limit)
        if is_mxfp8(weights):
            return _backward_mxfp8(config, workspace, schedule, forward_context, grad_output, x,
                                   router_weights, weights, limit, has_shared, main_grads)  # fmt: skip
        inter = _check_weights(workspace, schedule, weights)
        _check_context(
            forward_context, workspace, schedule, inter, has_shared, config.macrobatch_size
        )
        main = _check_main_grads(main_grads, weights)
        _CHECKED.add(key, config)
        ctx = forward_context.tensors()
    empty = x.new_empty(0)
    ctx = [t if t is not None else empty for t in ctx]
    grads = ops.call(
        "backward",
        workspace.handle, *_schedule_args(schedule), *ctx, grad_output, x, router_weights,
        shared_gate_weights, shared_up_weights, shared_down_weights,
        routed_gate_weights, routed_up_weights, routed_down_weights, limit,
        config.bwd_num_comm_sms, config.minibatch_size, config.macrobatch_size, *main,
    )  # fmt: skip
    return backward_outputs(grads, main, has_shared, whole_gate_up_grad)


def backward_outputs(grads, main_grads, has_shared: bool, whole_gate_up: bool = False) -> tuple:
    """The backward op's outputs as `backward` returns them: a gradient that went into its
    main_grad is that main_grad, the shared ones None without a shared expert; a fused routed
    gate/up gradient (the op's [E, 2 I, H] in the gate's place, empty in the up's) as its two
    halves, views of it (`whole_gate_up`: whole in the gate's place, None in the up's)."""
    d_x, d_router, weight_grads = grads[0], grads[1], list(grads[2:])
    gate_up = weight_grads[0]
    if main_grads[1] is None and weight_grads[1].numel() == 0 and gate_up.dim() == 3:
        inter = gate_up.shape[1] // 2
        if whole_gate_up:
            weight_grads[1] = None
        else:
            weight_grads[0], weight_grads[1] = gate_up[:, :inter], gate_up[:, inter:]
    for i, main_grad in enumerate(main_grads):
        if main_grad is not None:
            weight_grads[i] = main_grad
    if not has_shared:
        weight_grads[3:] = [None, None, None]
    return (d_x, d_router, *weight_grads)


def _backward_mxfp8(config, workspace, schedule, forward_context, grad_output, x,
                    router_weights, weights, limit, has_shared, main_grads):  # fmt: skip
    inter = check_mxfp8_weights(workspace, schedule.num_local_experts, weights, backward=True)
    values, exact = forward_context, mxfp8_context.is_quantised(forward_context)
    if exact:  # the original's: (data, scales) pairs, MXFP8 values once dequantised
        _check_provenance(forward_context, schedule)
        x_data = forward_context.x_routed[0]  # [H, rows]: quantised along the routed rows
        cap = _context_capacity(getattr(x_data, "shape", None), 1, config.macrobatch_size,
                                workspace)  # fmt: skip
        mxfp8_context.check_quantised(forward_context, cap, workspace.hidden_size, inter,
                                      workspace.device)  # fmt: skip
        _check_shared_context(forward_context, workspace, inter, has_shared)
        values = mxfp8_context.dequantised_context(mxfp8_context.flat(forward_context, x))
    else:  # a bf16 context (mok's BF16 layout) gives the same gradients
        _check_context(forward_context, workspace, schedule, inter, has_shared,
                       config.macrobatch_size)  # fmt: skip
    if main_grads is not None and any(g is not None for g in main_grads):
        raise ValueError("main_grads with MXFP8 routed weights are not supported yet")
    empty = x.new_empty(0)
    ctx = [t if t is not None else empty for t in values.tensors()]
    grads = ops.backward_mxfp8(
        workspace.handle, *_schedule_args(schedule), *ctx, grad_output, x, router_weights,
        weights["shared_gate_weights"], weights["shared_up_weights"],
        weights["shared_down_weights"], *weights["routed_gate_weights"],
        *weights["routed_up_weights"], *weights["routed_down_weights"], limit,
        config.bwd_num_comm_sms, config.minibatch_size, config.macrobatch_size, exact,
    )  # fmt: skip
    shared_grads = grads[5:] if has_shared else (None, None, None)
    return (*grads[:5], *shared_grads)


def _check_provenance(ctx: MoKForwardContext, schedule) -> None:
    """Host-side provenance (a context's rows are only meaningful in its own schedule's order;
    comparing them with the schedule would need a device sync). A context rebuilt by hand
    carries none and is only shape-checked."""
    made_with = getattr(ctx, _CONTEXT_SCHEDULE, None)
    if made_with is not None and made_with is not schedule.peer_rank:
        raise ValueError(
            "forward_context must come from a forward with this schedule, got one a forward "
            "with another MoKSchedule returned (pass backward the schedule its forward used)"
        )


def _check_context(
    ctx: MoKForwardContext,
    workspace,
    schedule,
    inter: int,
    has_shared: bool,
    macrobatch_size: int | None = None,
) -> None:
    hidden = workspace.hidden_size
    cap = _context_capacity(getattr(ctx.x_routed, "shape", None), 0, macrobatch_size, workspace)
    dev = workspace.device
    _check_provenance(ctx, schedule)
    check_tensor("forward_context.x_routed", ctx.x_routed, dtype=torch.bfloat16,
                 shape=[cap, hidden], device=dev)  # fmt: skip
    # With ring reuse gate, up and hidden hold macrobatch 0's rows as x_routed does, or every
    # row (MoKConfig.macrobatch_replay "gather").
    rows = cap
    if cap != workspace.schedule_capacity and _rows(ctx.gate_routed) == workspace.schedule_capacity:
        rows = workspace.schedule_capacity
    for name in ("gate_routed", "up_routed", "hidden_routed"):
        check_tensor(f"forward_context.{name}", getattr(ctx, name), dtype=torch.bfloat16,
                     shape=[rows, inter], device=dev)  # fmt: skip
    _check_shared_context(ctx, workspace, inter, has_shared)


def _rows(tensor) -> int | None:
    """A tensor's rows, or None (not a tensor, or no dimensions)."""
    shape = getattr(tensor, "shape", None)
    return shape[0] if shape else None


def _context_capacity(shape, dim: int, macrobatch_size: int | None, workspace) -> int:
    """The routed rows a context's x_routed must hold, its rows along `dim` of `shape` (None:
    not a tensor): the schedule capacity, or with ring reuse (`macrobatch_size` below the routed
    rows) macrobatch 0's when it holds other than every row."""
    cap = workspace.schedule_capacity
    rows = tuple(shape)[dim : dim + 1] if shape is not None else (cap,)
    if macrobatch_size is not None and rows != (cap,):
        cap = context_rows(macrobatch_size, cap, workspace.num_local_tokens, workspace.topk)
    return cap


def _check_shared_context(ctx: MoKForwardContext, workspace, inter: int, has_shared: bool):
    """The shared expert's context rows: bf16 [T, I] with one, None without."""
    t, dev = workspace.num_local_tokens, workspace.device
    for name in ("gate_shared", "up_shared", "hidden_shared"):
        value = getattr(ctx, name)
        if has_shared:
            if value is None:
                raise ValueError(
                    f"forward_context.{name} is None but shared expert weights were given "
                    f"(the context must come from a forward with the shared expert)"
                )
            check_tensor(f"forward_context.{name}", value, dtype=torch.bfloat16,
                         shape=[t, inter], device=dev)  # fmt: skip
        elif value is not None:
            raise ValueError(
                f"forward_context.{name} must be None without shared expert weights, got a "
                f"tensor of shape {list(value.shape)} (the context comes from a forward with "
                f"the shared expert: pass backward its shared weights)"
            )


_MAIN_GRAD_NAMES = (
    "routed_gate_weights", "routed_up_weights", "routed_down_weights",
    "shared_gate_weights", "shared_up_weights", "shared_down_weights",
)  # fmt: skip


def _check_main_grads(main_grads, weights: dict) -> tuple[torch.Tensor | None, ...]:
    if main_grads is None:
        return (None,) * 6
    check_type("main_grads", main_grads, tuple)
    if len(main_grads) != 6:
        raise ValueError(f"main_grads must have 6 entries (or be None), got {len(main_grads)}")
    for name, main_grad in zip(_MAIN_GRAD_NAMES, main_grads, strict=True):
        if main_grad is None:
            continue
        weight = weights[name]
        if weight is None:
            raise ValueError(f"main_grads entry for {name} must be None: {name} is None")
        check_tensor(f"main_grads[{name}]", main_grad, dtype=torch.float32,
                     shape=list(weight.shape), device=weight.device,
                     expert_strided=name in _EXPERT_STRIDED)  # fmt: skip
    return tuple(main_grads)


def check_errors(workspace: MoKWorkspace) -> None:
    """Sync the workspace's device and raise what its kernels recorded without a host sync.

    Raises ValueError for a bad input value found on the GPU without a host sync (router
    weights <= 0 or non-finite, expert ids out of range), for a schedule capacity overflow of
    the last `build_schedule`, and
    MoKWaitTimeoutError when a cross-CTA or cross-GPU wait gave up (naming rank and phase).
    On CPU there is nothing deferred: errors were raised by the calls themselves.
    """
    check_type("workspace", workspace, MoKWorkspace)
    if workspace.device.type != "cuda":
        return
    from . import launchers  # noqa: PLC0415 - CUDA only

    # Syncs the device, then raises a recorded timeout (chained to a trapped kernel's error).
    launchers.check_errors(workspace.device)
    launchers.raise_value_errors(workspace.device)
