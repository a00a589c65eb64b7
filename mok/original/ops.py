"""The original Mixture-of-Kittens' raw ops, as torch.library custom ops `mok::<name>` with the
original's argument lists, outputs and mutated arguments, and fake implementations (exposed as
`mok.ops.<name>`). mok's own `mok.functional` runs the layer ops of mok/layer_ops.py; these let code
written against the original's raw ops run unchanged. Composed as the original's functional
API composes them, they give mok.functional's results bitwise:

    ws.x_buffer.copy_(x); ws.router_weight_buffer.copy_(router_weights)
    barrier_all(ws.barrier_buffer, ws.barrier_buffer_ptrs, ws.barrier_buffer_multicast_ptr,
                ws.barrier_target)
    (x_routed, gate_shared, gate_routed, up_shared, up_routed, hidden_shared, hidden_routed,
     y_shared, y_routed) = dispatch_mlp_swiglu_combine_fwd_bf16(
        ws.x_buffer, ws.x_buffer_ptrs, ws.combine_buffer, ws.combine_buffer_ptrs, <weights>,
        *schedule, ws.topk, swiglu_limit, config.fwd_num_comm_sms, config.macrobatch_size,
        config.minibatch_size)
    barrier_all(...)
    out = fwd_epilogue(y_shared, ws.combine_buffer, ws.router_weight_buffer)

How they differ from the original's (README, "Differences from the original"):
- The workspace is found from a pointer list (`x_ptrs`, `d_y_buffer_ptrs`,
  `barrier_buffer_ptrs`) or, for the all-gather, from its buffer, after the dispatch ops'
  checks that need none (hidden and intermediate sizes, topk, num_comm_sms, the batch sizes,
  as the original checks them first); every other pointer list and
  buffer is checked against it (shape, dtype, device; torch.compile may pass a copy of a
  mutated buffer, so its address is not required to be the workspace's).
- Routed context rows number the schedule capacity C (every routed row is held at once),
  not macrobatch_size.
- Outputs that are the original kernels' scratch and that its functional API never reads
  (y_routed; the activation gradients d_x_routed, d_gate_*, d_up_*, d_hidden_*, d_y_*) are
  empty [0] tensors of their dtype.
- Shared weights may be None (a routed-only layer): the shared outputs are then empty [0];
  pass None to fwd_epilogue and topk to bwd_epilogue.
- barrier_buffer is mok's int32 [P] (one arrival counter per peer) and target its int32 [1]
  arrival epoch (`workspace.barrier_target`): each barrier adds 1 to every slot and to the
  target, where the original's adds P to its one counter and target (equal for a group of
  one); the multicast pointers are 0 (never used).
- The MXFP8 ops run on CPU (mok.reference's MXFP8 layer, its context in the original's
  quantised layout) and on CUDA (the megakernels' MXFP8 variants, as mok.functional's MXFP8
  layer runs them; the context quantised by the GPU quantiser and dequantised exactly).
- `mok::recompute_forward_context_mxfp8` is also the name of mok's MXFP8 layer recompute (a
  workspace-handle op, its default overload): the original's op is its overload `original`,
  and `mok.ops.recompute_forward_context_mxfp8` (the overload packet) runs either, by
  argument types.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import layer_ops, mxfp8_context, reference
from ..types import MoKForwardContext, MoKSchedule
from ..validation import (
    check_chunk_divides_routes,
    check_expert_id_values,
    check_int,
    check_tensor,
)
from . import checks, slot_passes

__all__ = [
    "all_gather_top_experts",
    "barrier_all",
    "dispatch_mlp_swiglu_combine_bwd_bf16",
    "dispatch_mlp_swiglu_combine_bwd_mxfp8",
    "dispatch_mlp_swiglu_combine_fwd_bf16",
    "dispatch_mlp_swiglu_combine_fwd_mxfp8",
    "recompute_forward_context_bf16",
    "recompute_forward_context_mxfp8",
    "schedule",
]

Tensor = torch.Tensor
BF16, FP8, U8 = torch.bfloat16, torch.float8_e4m3fn, torch.uint8


def _empty(like: Tensor, dtype: torch.dtype = BF16) -> Tensor:
    """A distinct empty [0] tensor: an output mok does not make (custom-op outputs may not
    alias each other)."""
    return like.new_empty(0, dtype=dtype)


def _shared_rows(like: Tensor, rows: int, cols: int, present: bool) -> Tensor:
    return like.new_empty(rows, cols, dtype=BF16) if present else _empty(like)


# ----------------------------------------------------------------------------------------------
# routing: all-gather, barrier, schedule
# ----------------------------------------------------------------------------------------------


def _check_all_gather(top_experts, buffer, multicast_ptr, chunk_bytes) -> None:
    """The all-gather's checks that need no workspace (the original runs them first)."""
    check_tensor("top_experts", top_experts, dtype=torch.int32, shape=[None, None])
    check_tensor("all_gather_top_experts_buffer", buffer, dtype=torch.int32,
                 shape=[None, *top_experts.shape], device=top_experts.device)  # fmt: skip
    check_int("chunk_bytes", chunk_bytes, minimum=16, multiple_of=16)
    check_chunk_divides_routes(chunk_bytes, *top_experts.shape)
    check_int("all_gather_top_experts_buffer_multicast_ptr", multicast_ptr)


def _check_all_gather_workspace(ws, top_experts, multicast_ptr, rank) -> None:
    """The all-gather's checks against the workspace that holds its buffer."""
    check_tensor("top_experts", top_experts, dtype=torch.int32,
                 shape=[ws.num_local_tokens, ws.topk], device=ws.device)  # fmt: skip
    checks.check_rank(ws, rank)
    if multicast_ptr != ws.all_gather_top_experts_buffer_multicast_ptr:
        raise ValueError(
            f"all_gather_top_experts_buffer_multicast_ptr must be the workspace's "
            f"({ws.all_gather_top_experts_buffer_multicast_ptr}: mok never multicasts), got "
            f"{multicast_ptr}"
        )


@torch.library.custom_op(
    "mok::all_gather_top_experts", mutates_args=("all_gather_top_experts_buffer",)
)
def all_gather_top_experts(
    top_experts: Tensor,
    all_gather_top_experts_buffer: Tensor,
    all_gather_top_experts_buffer_multicast_ptr: int,
    rank: int,
    chunk_bytes: int,
) -> None:
    """Gather every EP rank's routing ids into the workspace's all-gather buffer.

    Inputs:
        top_experts:                   int32 [T, k]  this rank's global expert ids
        all_gather_top_experts_buffer: int32 [P, T, k]  workspace.all_gather_top_experts_buffer
            (the workspace is found by this tensor's address)
        all_gather_top_experts_buffer_multicast_ptr: int  the workspace's (0: never used)
        rank:        int  the workspace's EP rank
        chunk_bytes: int  positive multiple of 16 (MoKConfig.all_gather_top_experts_chunk_bytes)
    Outputs: none; row p of the buffer becomes rank p's ids (collective over the EP group).
    """
    buffer = all_gather_top_experts_buffer
    # The checks that need no workspace first, as the original's order: a wrong dtype of the
    # buffer is its TypeError, not a failed lookup of a copy no workspace holds.
    multicast_ptr = all_gather_top_experts_buffer_multicast_ptr
    _check_all_gather(top_experts, buffer, multicast_ptr, chunk_bytes)
    ws = checks.workspace_holding("all_gather_top_experts_buffer", "all_gather_top_experts_buffer",
                                  buffer)  # fmt: skip
    _check_all_gather_workspace(ws, top_experts, multicast_ptr, rank)
    if ws.ep_size == 1:
        buffer[0].copy_(top_experts)
    elif not top_experts.is_cuda:
        buffer.copy_(reference.all_gather_top_experts(top_experts, ws.group))
    else:
        from ..config import MoKConfig  # noqa: PLC0415

        gpu = slot_passes.cuda_launchers("build_schedule", ws)
        config = MoKConfig(all_gather_top_experts_chunk_bytes=chunk_bytes)
        gpu.all_gather_top_experts(ws, config, top_experts.long(),
                                    timeout_ns=ws.wait_timeout_ns)  # fmt: skip


@all_gather_top_experts.register_fake
def _(top_experts, all_gather_top_experts_buffer, all_gather_top_experts_buffer_multicast_ptr,
      rank, chunk_bytes):  # fmt: skip
    _check_all_gather(top_experts, all_gather_top_experts_buffer,
                      all_gather_top_experts_buffer_multicast_ptr, chunk_bytes)  # fmt: skip


def _check_barrier(barrier_buffer, barrier_buffer_ptrs, barrier_buffer_multicast_ptr, target):
    ws = checks.workspace_of("barrier_buffer_ptrs", "barrier_buffer", barrier_buffer_ptrs,
                             barrier_buffer)  # fmt: skip
    checks.check_buffer(ws, "barrier_buffer", "barrier_buffer", barrier_buffer)
    check_tensor("target", target, dtype=torch.int32, shape=[1], device=ws.device)
    check_int("barrier_buffer_multicast_ptr", barrier_buffer_multicast_ptr)
    if barrier_buffer_multicast_ptr != ws.barrier_buffer_multicast_ptr:
        raise ValueError(
            f"barrier_buffer_multicast_ptr must be the workspace's "
            f"({ws.barrier_buffer_multicast_ptr}: mok never multicasts), got "
            f"{barrier_buffer_multicast_ptr}"
        )
    return ws


@torch.library.custom_op("mok::barrier_all", mutates_args=("barrier_buffer", "target"))
def barrier_all(
    barrier_buffer: Tensor,
    barrier_buffer_ptrs: list[int],
    barrier_buffer_multicast_ptr: int,
    target: Tensor,
) -> None:
    """The EP group's barrier: when it ends, every rank has finished what it queued before.

    Inputs:
        barrier_buffer:      int32 [P]  workspace.barrier_buffer (an arrival counter per peer)
        barrier_buffer_ptrs: list[int] [P]  workspace.barrier_buffer_ptrs (names the workspace)
        barrier_buffer_multicast_ptr: int  the workspace's (0: never used)
        target:              int32 [1]  workspace.barrier_target (the device arrival epoch)
    Outputs: none; every slot of barrier_buffer and target grow by 1 (arrivals each rank made
    here: after n barriers from a new workspace both hold n, as the original's do for a group
    of one). CUDA, EP group: the device barrier on the current stream (no host sync; a wait
    past the workspace's timeout raises MoKWaitTimeoutError from check_errors, reported as
    the PEER_BARRIER_START phase), which counts them. CPU: torch.distributed.barrier, then
    the counts. A group of one: only the counts (two small stream-ordered adds on CUDA).
    """
    ws = _check_barrier(barrier_buffer, barrier_buffer_ptrs, barrier_buffer_multicast_ptr, target)
    if ws.ep_size == 1 or not barrier_buffer.is_cuda:
        if ws.ep_size > 1:
            dist.barrier(group=ws.group)
        # What the device barrier does to them: one arrival from every rank, the epoch after it.
        barrier_buffer.add_(1)
        target.add_(1)
        return
    from .. import launchers  # noqa: PLC0415 - the CUDA path's door, for CUDA tensors only

    launchers.group_barrier(ws, "PEER_BARRIER_START")


@barrier_all.register_fake
def _(barrier_buffer, barrier_buffer_ptrs, barrier_buffer_multicast_ptr, target):
    _check_barrier(barrier_buffer, barrier_buffer_ptrs, barrier_buffer_multicast_ptr, target)


@torch.library.custom_op("mok::schedule", mutates_args=())
def schedule(
    topk_all: Tensor, num_local_experts: int, schedule_capacity: int, rank: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """This rank's receive schedule from the all-gathered routing ids.

    Inputs:
        topk_all:          int32 [P, T, k]  the all-gather buffer
        num_local_experts: int  E
        schedule_capacity: int  C, a positive multiple of 128 (workspace.schedule_capacity)
        rank:              int  this rank, in [0, P)
    Outputs (int32, SEMANTICS §3): schedule_peer_rank [C], schedule_peer_token_idx [C],
        num_tokens [1], tokens_per_expert [E]. CPU: ids outside [0, E * P) and a capacity
        overflow raise ValueError here; CUDA: an overflow is raised by the next mok call on the
        device (or check_errors), ids are not range-checked (mok.functional.build_schedule's
        all-gather checks them).
    """
    checks.check_routing_ids(topk_all, num_local_experts, schedule_capacity, rank)
    if not topk_all.is_cuda:
        check_expert_id_values(topk_all, num_local_experts * topk_all.shape[0])
        s = reference.build_schedule(topk_all, ep_rank=rank, num_local_experts=num_local_experts,
                                     capacity=schedule_capacity)  # fmt: skip
        return s.peer_rank, s.peer_token_idx, s.num_tokens, s.tokens_per_expert
    from .. import launchers  # noqa: PLC0415 - the CUDA path's door, for CUDA tensors only

    launchers.require("build_schedule", topk_all.device)
    if topk_all.shape[0] == 1:
        launchers.raise_value_errors(topk_all.device)
    return launchers.build_schedule_gpu(
        topk_all, ep_rank=rank, num_local_experts=num_local_experts, capacity=schedule_capacity,
        status=launchers.status_ptr(topk_all.device),
    )[:4]  # fmt: skip


@schedule.register_fake
def _(topk_all, num_local_experts, schedule_capacity, rank):
    checks.check_routing_ids(topk_all, num_local_experts, schedule_capacity, rank)
    i32 = dict(dtype=torch.int32)
    return (topk_all.new_empty(schedule_capacity, **i32),
            topk_all.new_empty(schedule_capacity, **i32), topk_all.new_empty(1, **i32),
            topk_all.new_empty(num_local_experts, **i32))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# BF16 forward and recompute
# ----------------------------------------------------------------------------------------------


# Each op and its fake check the same arguments: they pass them by name (`locals()` on entry),
# and these pick the groups the checks and the layer passes take.
_SCHEDULE_ARGS = ("schedule_peer_rank", "schedule_peer_token_idx", "num_tokens",
                  "tokens_per_expert")  # fmt: skip
_LAUNCH_ARGS = ("topk", "swiglu_limit", "num_comm_sms", "macrobatch_size", "minibatch_size")


def _schedule_of(args: dict) -> tuple:
    return tuple(args[n] for n in _SCHEDULE_ARGS)


def _launch_of(args: dict) -> tuple:
    return tuple(args[n] for n in _LAUNCH_ARGS)


def _weights_of(args: dict) -> dict:
    """{argument name: weight} of every `w_*` argument given."""
    return {n: v for n, v in args.items() if n.startswith("w_")}


def _forward_workspace(x, x_ptrs, combine_buffer=None, combine_buffer_ptrs=None):
    """The workspace `x_ptrs` names, with x (and the combine buffer) checked against it."""
    ws = checks.workspace_of("x_ptrs", "x_buffer", x_ptrs, x)
    checks.check_buffer(ws, "x", "x_buffer", x)
    if combine_buffer is not None:
        checks.check_pointers(ws, "combine_buffer_ptrs", "combine_buffer", combine_buffer_ptrs,
                              "x_ptrs")  # fmt: skip
        checks.check_buffer(ws, "combine_buffer", "combine_buffer", combine_buffer)
    return ws


def _check_sizes(args: dict, activation_name: str) -> None:
    """The checks that need no workspace (checks.check_sizes), first."""
    checks.check_sizes(activation_name, args[activation_name], args["w_routed_gate"],
                       *(args[n] for n in ("topk", "num_comm_sms", "minibatch_size",
                                           "macrobatch_size")))  # fmt: skip


def _check_fwd_bf16(op, args):
    """(workspace, E, I, has_shared, PassConfig) of a BF16 forward or recompute op's checked
    arguments (`args` by name; the recompute has no combine buffer)."""
    _check_sizes(args, "x")
    ws = _forward_workspace(args["x"], args["x_ptrs"], args.get("combine_buffer"),
                            args.get("combine_buffer_ptrs"))  # fmt: skip
    num_experts, inter, has_shared = checks.check_bf16_weights(ws, _weights_of(args))
    checks.check_schedule(ws, num_experts, *_schedule_of(args))
    pass_config = checks.check_launch(ws, op, *_launch_of(args))
    return ws, num_experts, inter, has_shared, pass_config


@torch.library.custom_op(
    "mok::dispatch_mlp_swiglu_combine_fwd_bf16", mutates_args=("combine_buffer",)
)
def dispatch_mlp_swiglu_combine_fwd_bf16(
    x: Tensor,
    x_ptrs: list[int],
    combine_buffer: Tensor,
    combine_buffer_ptrs: list[int],
    w_shared_gate: Tensor | None,
    w_routed_gate: Tensor,
    w_shared_up: Tensor | None,
    w_routed_up: Tensor,
    w_shared_down: Tensor | None,
    w_routed_down: Tensor,
    schedule_peer_rank: Tensor,
    schedule_peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    topk: int,
    swiglu_limit: float | None,
    num_comm_sms: int,
    macrobatch_size: int,
    minibatch_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The BF16 MoE forward up to the combine: dispatch, SwiGLU experts, each routed row's
    output pushed unweighted into its token's slot of the combine buffer.

    Inputs:
        x:                   bf16 [T, H]  workspace.x_buffer (this rank's tokens)
        x_ptrs:              list[int] [P]  workspace.x_buffer_ptrs (names the workspace)
        combine_buffer:      bf16 [T*k, H]  workspace.combine_buffer (mutated)
        combine_buffer_ptrs: list[int] [P]  workspace.combine_buffer_ptrs
        w_shared_*:          bf16 gate/up [I, H], down [H, I], or all None (routed-only)
        w_routed_*:          bf16 gate/up [E, I, H], down [E, H, I]
        schedule_*, num_tokens, tokens_per_expert: int32 [C], [C], [1], [E] (`schedule`'s)
        topk:                int  the workspace's k
        swiglu_limit:        float > 0 or None
        num_comm_sms, macrobatch_size, minibatch_size: MoKConfig's fwd_num_comm_sms,
            macrobatch_size and minibatch_size (checked as MoKConfig's; a macrobatch below
            T * k gives the same bits, every routed row held at once: this op's outputs are
            the whole context)
    Outputs:
        x_routed bf16 [C, H]; gate_shared [T, I]; gate_routed [C, I]; up_shared [T, I];
        up_routed [C, I]; hidden_shared [T, I]; hidden_routed [C, I]; y_shared [T, H];
        y_routed empty [0] (the shared ones empty [0] without a shared expert). Slot t*k + j
        of the combine buffer on token t's rank gets its j-th expert's output once every rank's
        op has run (barrier_all); out = fwd_epilogue(y_shared, combine_buffer, router weights).
    """
    op, args = "dispatch_mlp_swiglu_combine_fwd_bf16", locals()
    ws, _, _, _, pass_config = _check_fwd_bf16(op, args)
    shared = (w_shared_gate, w_shared_up, w_shared_down)
    routed = (w_routed_gate, w_routed_up, w_routed_down)
    ctx, y_shared = slot_passes.forward_to_slots(
        ws, op, MoKSchedule(*_schedule_of(args)), x, combine_buffer, shared, routed, pass_config
    )
    x_routed, gate, up, hidden, gate_s, up_s, hidden_s = ctx
    y_shared = _empty(x) if y_shared is None else y_shared
    return (x_routed, gate_s, gate, up_s, up, hidden_s, hidden, y_shared, _empty(x))


@dispatch_mlp_swiglu_combine_fwd_bf16.register_fake
def _(x, x_ptrs, combine_buffer, combine_buffer_ptrs, w_shared_gate, w_routed_gate, w_shared_up,
      w_routed_up, w_shared_down, w_routed_down, schedule_peer_rank, schedule_peer_token_idx,
      num_tokens, tokens_per_expert, topk, swiglu_limit, num_comm_sms, macrobatch_size,
      minibatch_size):  # fmt: skip
    ws, _, inter, has_shared, _ = _check_fwd_bf16("dispatch_mlp_swiglu_combine_fwd_bf16",
                                                  locals())  # fmt: skip
    (tokens, hidden), capacity = x.shape, ws.schedule_capacity
    routed = [x.new_empty(capacity, inter) for _ in range(3)]
    shared = [_shared_rows(x, tokens, inter, has_shared) for _ in range(3)]
    return (x.new_empty(capacity, hidden), shared[0], routed[0], shared[1], routed[1], shared[2],
            routed[2], _shared_rows(x, tokens, hidden, has_shared), _empty(x))  # fmt: skip


@torch.library.custom_op("mok::recompute_forward_context_bf16", mutates_args=())
def recompute_forward_context_bf16(
    x: Tensor,
    x_ptrs: list[int],
    w_shared_gate: Tensor | None,
    w_routed_gate: Tensor,
    w_shared_up: Tensor | None,
    w_routed_up: Tensor,
    schedule_peer_rank: Tensor,
    schedule_peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    topk: int,
    swiglu_limit: float | None,
    num_comm_sms: int,
    macrobatch_size: int,
    minibatch_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The BF16 forward context again, bitwise (activation checkpointing): no down GEMM.

    Inputs: as dispatch_mlp_swiglu_combine_fwd_bf16, without the combine buffer and the down
        weights.
    Outputs: its first 7 outputs (x_routed, gate_shared, gate_routed, up_shared, up_routed,
        hidden_shared, hidden_routed). Runs mok's layer op `mok::recompute_forward_context`
        (on CUDA with an EP group, with its own start and end barriers inside).
    """
    args = locals()
    ws, _, _, _, pass_config = _check_fwd_bf16("recompute_forward_context_bf16", args)
    recompute = layer_ops.implementation("recompute_forward_context")
    x_routed, gate, up, hidden, gate_s, up_s, hidden_s = recompute(
        ws.handle, *_schedule_of(args), x, w_shared_gate, w_shared_up, w_routed_gate, w_routed_up,
        pass_config.swiglu_limit,
    )  # fmt: skip
    return (x_routed, gate_s, gate, up_s, up, hidden_s, hidden)


@recompute_forward_context_bf16.register_fake
def _(x, x_ptrs, w_shared_gate, w_routed_gate, w_shared_up, w_routed_up, schedule_peer_rank,
      schedule_peer_token_idx, num_tokens, tokens_per_expert, topk, swiglu_limit, num_comm_sms,
      macrobatch_size, minibatch_size):  # fmt: skip
    ws, _, inter, has_shared, _ = _check_fwd_bf16("recompute_forward_context_bf16", locals())
    capacity, tokens = ws.schedule_capacity, x.shape[0]
    routed = [x.new_empty(capacity, inter) for _ in range(3)]
    shared = [_shared_rows(x, tokens, inter, has_shared) for _ in range(3)]
    return (x.new_empty(capacity, x.shape[1]), shared[0], routed[0], shared[1], routed[1],
            shared[2], routed[2])  # fmt: skip


# ----------------------------------------------------------------------------------------------
# BF16 backward
# ----------------------------------------------------------------------------------------------

# The backward's buffers after d_y_buffer (whose pointers name the workspace): (argument,
# workspace buffer); each comes with its `<argument>_ptrs`.
_BACKWARD_BUFFERS = (
    ("d_x_routed_buffer", "d_x_routed_buffer"),
    ("router_weight_buffer", "router_weight_buffer"),
    ("d_router_weight_buffer", "d_router_weight_buffer"),
    ("x", "x_buffer"),
)


# The BF16 backward's context arguments, in the order the layer pass takes them.
_BF16_CONTEXT_ARGS = ("x_routed", "gate_routed", "up_routed", "hidden_routed", "gate_shared",
                      "up_shared", "hidden_shared")  # fmt: skip


def _backward_workspace(args: dict):
    """The workspace `d_y_buffer_ptrs` names, with every backward buffer checked against it."""
    d_y_buffer = args["d_y_buffer"]
    ws = checks.workspace_of("d_y_buffer_ptrs", "d_y_buffer", args["d_y_buffer_ptrs"],
                             d_y_buffer)  # fmt: skip
    checks.check_buffer(ws, "d_y_buffer", "d_y_buffer", d_y_buffer)
    for arg, name in _BACKWARD_BUFFERS:
        checks.check_pointers(ws, f"{arg}_ptrs", name, args[f"{arg}_ptrs"], "d_y_buffer_ptrs")
        checks.check_buffer(ws, arg, name, args[arg])
    return ws


def _check_bwd_bf16(op, args):
    """(workspace, E, I, has_shared, PassConfig, context by name) of the BF16 backward op's
    checked arguments (`args` by name)."""
    _check_sizes(args, "d_y_buffer")
    ws = _backward_workspace(args)
    num_experts, inter, has_shared = checks.check_bf16_weights(ws, _weights_of(args))
    ctx = {n: args[n] for n in _BF16_CONTEXT_ARGS}
    checks.check_bf16_context(ws, inter, has_shared, ctx)
    checks.check_schedule(ws, num_experts, *_schedule_of(args))
    pass_config = checks.check_launch(ws, op, *_launch_of(args))
    return ws, num_experts, inter, has_shared, pass_config, ctx


def _weight_grad_outputs(like, grads, weights: dict, has_shared: bool) -> tuple[Tensor, ...]:
    """The original's weight-gradient order (shared gate, routed gate, shared up, routed up,
    shared down, routed down) from (routed gate, up, down, shared gate, up, down)."""
    if grads is None:  # fake: shaped like the weights
        grads = [torch.empty_like(weights[f"w_routed_{n}"]) for n in ("gate", "up", "down")]
        grads += [torch.empty_like(weights[f"w_shared_{n}"]) if has_shared else None
                  for n in ("gate", "up", "down")]  # fmt: skip
    routed, shared = grads[:3], [_empty(like) if g is None else g for g in grads[3:]]
    return (shared[0], routed[0], shared[1], routed[1], shared[2], routed[2])


@torch.library.custom_op(
    "mok::dispatch_mlp_swiglu_combine_bwd_bf16",
    mutates_args=("d_x_routed_buffer", "d_router_weight_buffer", "x_routed", "gate_routed",
                  "up_routed", "hidden_routed"),
)  # fmt: skip
def dispatch_mlp_swiglu_combine_bwd_bf16(
    d_y_buffer: Tensor,
    d_y_buffer_ptrs: list[int],
    d_x_routed_buffer: Tensor,
    d_x_routed_buffer_ptrs: list[int],
    router_weight_buffer: Tensor,
    router_weight_buffer_ptrs: list[int],
    d_router_weight_buffer: Tensor,
    d_router_weight_buffer_ptrs: list[int],
    w_shared_gate: Tensor | None,
    w_routed_gate: Tensor,
    w_shared_up: Tensor | None,
    w_routed_up: Tensor,
    w_shared_down: Tensor | None,
    w_routed_down: Tensor,
    x_routed: Tensor,
    gate_shared: Tensor,
    gate_routed: Tensor,
    up_shared: Tensor,
    up_routed: Tensor,
    hidden_shared: Tensor,
    hidden_routed: Tensor,
    x: Tensor,
    x_ptrs: list[int],
    schedule_peer_rank: Tensor,
    schedule_peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    topk: int,
    swiglu_limit: float | None,
    num_comm_sms: int,
    macrobatch_size: int,
    minibatch_size: int,
) -> tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
    Tensor, Tensor, Tensor, Tensor,
]:  # fmt: skip
    """The BF16 MoE backward up to its epilogue (SEMANTICS §2).

    Inputs:
        d_y_buffer:             bf16 [T, H]  workspace.d_y_buffer (grad_output)
        d_y_buffer_ptrs:        list[int] [P]  (names the workspace)
        d_x_routed_buffer:      bf16 [T*k, H]  workspace.d_x_routed_buffer (mutated)
        router_weight_buffer:   fp32 [T, k]  workspace.router_weight_buffer (router weights)
        d_router_weight_buffer: fp32 [T, k]  workspace.d_router_weight_buffer (mutated)
        *_ptrs:                 list[int] [P]  each buffer's workspace.<buffer>_ptrs
        w_shared_*, w_routed_*: as dispatch_mlp_swiglu_combine_fwd_bf16
        x_routed .. hidden_routed: its context outputs (declared mutated, as the original's;
            mok leaves them as they are)
        x:                      bf16 [T, H]  workspace.x_buffer; x_ptrs its pointers
        schedule, topk, swiglu_limit: as the forward; num_comm_sms MoKConfig.bwd_num_comm_sms
    Outputs:
        d_x_shared bf16 [T, H]; d_x_routed, d_gate_shared, d_gate_routed, d_up_shared,
        d_up_routed, d_hidden_shared, d_hidden_routed, d_y_routed: empty [0]; d_w_shared_gate
        [I, H], d_w_routed_gate [E, I, H], d_w_shared_up [I, H], d_w_routed_up [E, I, H],
        d_w_shared_down [H, I], d_w_routed_down [E, H, I], all bf16 (shared ones and d_x_shared
        empty [0] without a shared expert). Once every rank's op has run (barrier_all), slot
        t*k + j of the d_x_routed buffer holds token t's d_x through its j-th expert and the
        d_router_weight buffer the router weights' gradient: d_x = bwd_epilogue(d_x_shared,
        d_x_routed_buffer), d_router_weights = d_router_weight_buffer.clone().
    """
    op, args = "dispatch_mlp_swiglu_combine_bwd_bf16", locals()
    ws, _, _, has_shared, pass_config, ctx = _check_bwd_bf16(op, args)
    shared = (w_shared_gate, w_shared_up, w_shared_down)
    routed = (w_routed_gate, w_routed_up, w_routed_down)
    d_x_shared, grads = slot_passes.backward_to_slots(
        ws, op, MoKSchedule(*_schedule_of(args)), tuple(ctx.values()), d_y_buffer,
        router_weight_buffer, x, d_x_routed_buffer, d_router_weight_buffer, shared, routed,
        pass_config,
    )  # fmt: skip
    d_x_shared = _empty(x) if d_x_shared is None else d_x_shared
    return (d_x_shared, *(_empty(x) for _ in range(8)),
            *_weight_grad_outputs(x, grads, _weights_of(args), has_shared))  # fmt: skip


@dispatch_mlp_swiglu_combine_bwd_bf16.register_fake
def _(d_y_buffer, d_y_buffer_ptrs, d_x_routed_buffer, d_x_routed_buffer_ptrs,
      router_weight_buffer, router_weight_buffer_ptrs, d_router_weight_buffer,
      d_router_weight_buffer_ptrs, w_shared_gate, w_routed_gate, w_shared_up, w_routed_up,
      w_shared_down, w_routed_down, x_routed, gate_shared, gate_routed, up_shared, up_routed,
      hidden_shared, hidden_routed, x, x_ptrs, schedule_peer_rank, schedule_peer_token_idx,
      num_tokens, tokens_per_expert, topk, swiglu_limit, num_comm_sms, macrobatch_size,
      minibatch_size):  # fmt: skip
    args = locals()
    has_shared = _check_bwd_bf16("dispatch_mlp_swiglu_combine_bwd_bf16", args)[3]
    d_x_shared = torch.empty_like(x) if has_shared else _empty(x)
    return (d_x_shared, *(_empty(x) for _ in range(8)),
            *_weight_grad_outputs(x, None, _weights_of(args), has_shared))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# MXFP8 forward and recompute (CPU: mok.reference's MXFP8 layer)
# ----------------------------------------------------------------------------------------------


def _check_mxfp8_forward_weights(ws, weights: dict, *, down: bool) -> tuple[int, int, bool]:
    """(E, I, has_shared) of the forward's MXFP8 routed weights ((fp8, scale) along K each) and
    bf16 shared weights."""
    num_experts, inter = checks.routed_sizes("w_routed_gate", weights["w_routed_gate"])
    hidden = ws.hidden_size
    shapes = {"gate": [num_experts, inter, hidden], "up": [num_experts, inter, hidden]}
    if down:
        shapes["down"] = [num_experts, hidden, inter]
    for name, shape in shapes.items():
        checks.check_mxfp8_pair(ws, f"w_routed_{name}", weights[f"w_routed_{name}"],
                                weights[f"w_routed_{name}_sc"], shape)  # fmt: skip
    shared = {n: weights[n] for n in ("w_shared_gate", "w_shared_up", "w_shared_down")
              if n in weights}  # fmt: skip
    return num_experts, inter, checks.check_shared_weights(ws, inter, shared)


def _check_fwd_mxfp8(op, args):
    """(workspace, I, has_shared, PassConfig) of an MXFP8 forward or recompute op's checked
    arguments (`args` by name; the recompute has no combine buffer and no down weights)."""
    _check_sizes(args, "x")
    combine_buffer = args.get("combine_buffer")
    ws = _forward_workspace(args["x"], args["x_ptrs"], combine_buffer,
                            args.get("combine_buffer_ptrs"))  # fmt: skip
    num_experts, inter, has_shared = _check_mxfp8_forward_weights(
        ws, _weights_of(args), down=combine_buffer is not None
    )
    checks.check_schedule(ws, num_experts, *_schedule_of(args))
    pass_config = checks.check_launch(ws, op, *_launch_of(args))
    return ws, inter, has_shared, pass_config


def _fake_mxfp8_context(x, ws, inter: int, has_shared: bool) -> tuple[Tensor, ...]:
    """The 11 context outputs of the MXFP8 forward (mxfp8_context's flat order)."""
    (tokens, hidden), capacity = x.shape, ws.schedule_capacity

    def pair(rows, cols):
        return (x.new_empty(rows, cols, dtype=FP8),
                x.new_empty(*checks.scale_shape(rows, cols), dtype=U8))  # fmt: skip

    shared = [_shared_rows(x, tokens, inter, has_shared) for _ in range(3)]
    return (*pair(hidden, capacity), shared[0], *pair(capacity, inter), shared[1],
            *pair(capacity, inter), shared[2], *pair(inter, capacity))  # fmt: skip


@torch.library.custom_op(
    "mok::dispatch_mlp_swiglu_combine_fwd_mxfp8", mutates_args=("combine_buffer",)
)
def dispatch_mlp_swiglu_combine_fwd_mxfp8(
    x: Tensor,
    x_ptrs: list[int],
    combine_buffer: Tensor,
    combine_buffer_ptrs: list[int],
    w_shared_gate: Tensor | None,
    w_routed_gate: Tensor,
    w_routed_gate_sc: Tensor,
    w_shared_up: Tensor | None,
    w_routed_up: Tensor,
    w_routed_up_sc: Tensor,
    w_shared_down: Tensor | None,
    w_routed_down: Tensor,
    w_routed_down_sc: Tensor,
    schedule_peer_rank: Tensor,
    schedule_peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    topk: int,
    swiglu_limit: float | None,
    num_comm_sms: int,
    macrobatch_size: int,
    minibatch_size: int,
) -> tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
    Tensor, Tensor,
]:  # fmt: skip
    """dispatch_mlp_swiglu_combine_fwd_bf16 with MXFP8 routed weights (mok.ops.mxfp8_quantize's
    (fp8, scale) along K each: gate/up fp8 [E, I, H] with uint8 [E*I/128, H/128, 32, 16],
    down fp8 [E, H, I] with [E*H/128, I/128, 32, 16]); the shared expert is bf16.

    Outputs (the original's MXFP8 context): x_fp8_t_routed fp8 [H, C], x_sc_t_routed uint8
        [H/128, C/128, 32, 16]; gate_shared bf16 [T, I]; gate_fp8_routed fp8 [C, I],
        gate_sc_routed uint8 [C/128, I/128, 32, 16]; up_shared, up_fp8_routed, up_sc_routed
        likewise; hidden_shared bf16 [T, I]; hidden_fp8_t_routed fp8 [I, C], hidden_sc_t_routed
        uint8 [I/128, C/128, 32, 16]; y_shared bf16 [T, H]; y_routed empty [0]. The combine
        buffer is filled as by the BF16 op. CPU: mok.reference.mxfp8_forward's layer; CUDA: the
        forward megakernel's MXFP8 variant (mok.functional.forward's bits with MXFP8 weights),
        its context quantised by the GPU quantiser (ring reuse is not built for it: every
        routed row is held, as this op returns the whole context).
    """
    op, args = "dispatch_mlp_swiglu_combine_fwd_mxfp8", locals()
    ws, _, _, pass_config = _check_fwd_mxfp8(op, args)
    ctx, y_shared = slot_passes.mxfp8_forward_to_slots(
        ws, op, MoKSchedule(*_schedule_of(args)), x, combine_buffer,
        (w_shared_gate, w_shared_up, w_shared_down),
        ((w_routed_gate, w_routed_gate_sc), (w_routed_up, w_routed_up_sc),
         (w_routed_down, w_routed_down_sc)), pass_config,
    )  # fmt: skip
    return (*ctx, _empty(x) if y_shared is None else y_shared, _empty(x))


@dispatch_mlp_swiglu_combine_fwd_mxfp8.register_fake
def _(x, x_ptrs, combine_buffer, combine_buffer_ptrs, w_shared_gate, w_routed_gate,
      w_routed_gate_sc, w_shared_up, w_routed_up, w_routed_up_sc, w_shared_down, w_routed_down,
      w_routed_down_sc, schedule_peer_rank, schedule_peer_token_idx, num_tokens,
      tokens_per_expert, topk, swiglu_limit, num_comm_sms, macrobatch_size,
      minibatch_size):  # fmt: skip
    ws, inter, has_shared, _ = _check_fwd_mxfp8("dispatch_mlp_swiglu_combine_fwd_mxfp8",
                                                locals())  # fmt: skip
    return (*_fake_mxfp8_context(x, ws, inter, has_shared),
            _shared_rows(x, x.shape[0], x.shape[1], has_shared), _empty(x))  # fmt: skip


def _recompute_forward_context_mxfp8(
    x: Tensor,
    x_ptrs: list[int],
    w_shared_gate: Tensor | None,
    w_routed_gate: Tensor,
    w_routed_gate_sc: Tensor,
    w_shared_up: Tensor | None,
    w_routed_up: Tensor,
    w_routed_up_sc: Tensor,
    schedule_peer_rank: Tensor,
    schedule_peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    topk: int,
    swiglu_limit: float | None,
    num_comm_sms: int,
    macrobatch_size: int,
    minibatch_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The MXFP8 forward context again, bitwise (activation checkpointing): no down GEMM.

    Inputs: as dispatch_mlp_swiglu_combine_fwd_mxfp8, without the combine buffer and the down
        weights. Outputs: its first 11 outputs. Runs mok's MXFP8 layer recompute (the default
        overload of this op; CUDA: the gather, x's round trip and the gate/up kernel on the
        dequantised weights), then quantises the context as the forward op does.
    """
    args = locals()
    ws, _, _, pass_config = _check_fwd_mxfp8("recompute_forward_context_mxfp8", args)
    layer = torch.ops.mok.recompute_forward_context_mxfp8.default(
        ws.handle, *_schedule_of(args), x, w_shared_gate, w_shared_up, w_routed_gate,
        w_routed_gate_sc, w_routed_up, w_routed_up_sc, pass_config.swiglu_limit,
    )  # fmt: skip
    ctx = MoKForwardContext(*layer[:4], *(t if t.numel() else None for t in layer[4:]))
    return mxfp8_context.quantised_context(ctx, x)


def _recompute_forward_context_mxfp8_fake(
    x, x_ptrs, w_shared_gate, w_routed_gate, w_routed_gate_sc, w_shared_up, w_routed_up,
    w_routed_up_sc, schedule_peer_rank, schedule_peer_token_idx, num_tokens, tokens_per_expert,
    topk, swiglu_limit, num_comm_sms, macrobatch_size, minibatch_size,
):  # fmt: skip
    ws, inter, has_shared, _ = _check_fwd_mxfp8("recompute_forward_context_mxfp8", locals())
    return _fake_mxfp8_context(x, ws, inter, has_shared)


# The name is mok's MXFP8 layer recompute too (mok/layer_ops.py, the default overload, which
# mok.functional calls with a workspace handle first): the original's signature is the overload
# `original`, and the packet resolves a call to either by its argument types.
_LIBRARY = torch.library.Library("mok", "FRAGMENT")
_LIBRARY.define(
    "recompute_forward_context_mxfp8.original"
    + torch.library.infer_schema(_recompute_forward_context_mxfp8, mutates_args=())
)
torch.library.impl("mok::recompute_forward_context_mxfp8.original", "CompositeExplicitAutograd",
                   _recompute_forward_context_mxfp8, lib=_LIBRARY)  # fmt: skip
torch.library.register_fake("mok::recompute_forward_context_mxfp8.original",
                            _recompute_forward_context_mxfp8_fake, lib=_LIBRARY)  # fmt: skip
recompute_forward_context_mxfp8 = torch.ops.mok.recompute_forward_context_mxfp8


# ----------------------------------------------------------------------------------------------
# MXFP8 backward (CPU)
# ----------------------------------------------------------------------------------------------


# The MXFP8 backward's context arguments, in the flat order (mok/mxfp8_context.py).
_MXFP8_CONTEXT_ARGS = ("x_fp8_t_routed", "x_sc_t_routed", "gate_shared", "gate_fp8_routed",
                       "gate_sc_routed", "up_shared", "up_fp8_routed", "up_sc_routed",
                       "hidden_shared", "hidden_fp8_t_routed", "hidden_sc_t_routed")  # fmt: skip


def _check_bwd_mxfp8(op, args):
    """(workspace, E, I, has_shared, PassConfig, context by name) of the MXFP8 backward op's
    checked arguments (`args` by name). Backward MXFP8 weights: gate and up (fp8, scale)
    [E, I, H] and their transposed copies [E, H, I] (`_T`), down only transposed [E, I, H]."""
    _check_sizes(args, "d_y_buffer")
    weights = _weights_of(args)
    ws = _backward_workspace(args)
    num_experts, inter = checks.routed_sizes("w_routed_gate", weights["w_routed_gate"])
    hidden = ws.hidden_size
    gate_up, transposed = [num_experts, inter, hidden], [num_experts, hidden, inter]
    for name, shape in (("w_routed_gate", gate_up), ("w_routed_up", gate_up),
                        ("w_routed_gate_T", transposed), ("w_routed_up_T", transposed),
                        ("w_routed_down_T", gate_up)):  # fmt: skip
        checks.check_mxfp8_pair(ws, name, weights[name], weights[f"{name}_sc"], shape)
    shared = {n: weights[n] for n in ("w_shared_gate", "w_shared_up", "w_shared_down")}
    has_shared = checks.check_shared_weights(ws, inter, shared)
    ctx = {n: args[n] for n in _MXFP8_CONTEXT_ARGS}
    checks.check_mxfp8_context(ws, inter, has_shared, ctx)
    checks.check_schedule(ws, num_experts, *_schedule_of(args))
    pass_config = checks.check_launch(ws, op, *_launch_of(args))
    return ws, num_experts, inter, has_shared, pass_config, ctx


def _mxfp8_gradient_outputs(like, d_x_shared, grads, weights, has_shared) -> tuple[Tensor, ...]:
    """The 18 outputs of the MXFP8 backward; `grads` None in the fake (shaped like the bf16
    weights: routed gate/up [E, I, H], down [E, H, I])."""
    if grads is None:
        num_experts, inter, hidden = weights["w_routed_gate"].shape
        gate_up = [like.new_empty(num_experts, inter, hidden) for _ in range(2)]
        grads = [*gate_up, like.new_empty(num_experts, hidden, inter)]
        grads += [torch.empty_like(weights[f"w_shared_{n}"]) if has_shared else None
                  for n in ("gate", "up", "down")]  # fmt: skip
        d_x_shared = torch.empty_like(like) if has_shared else None
    scratch = (BF16, BF16, FP8, U8, BF16, FP8, U8, BF16, BF16, FP8, U8)
    d_x_shared = _empty(like) if d_x_shared is None else d_x_shared
    return (d_x_shared, *(_empty(like, dtype) for dtype in scratch),
            *_weight_grad_outputs(like, grads, weights, has_shared))  # fmt: skip


@torch.library.custom_op(
    "mok::dispatch_mlp_swiglu_combine_bwd_mxfp8",
    mutates_args=("d_x_routed_buffer", "d_router_weight_buffer", "x_fp8_t_routed",
                  "x_sc_t_routed", "gate_fp8_routed", "gate_sc_routed", "up_fp8_routed",
                  "up_sc_routed", "hidden_fp8_t_routed", "hidden_sc_t_routed"),
)  # fmt: skip
def dispatch_mlp_swiglu_combine_bwd_mxfp8(
    d_y_buffer: Tensor,
    d_y_buffer_ptrs: list[int],
    d_x_routed_buffer: Tensor,
    d_x_routed_buffer_ptrs: list[int],
    router_weight_buffer: Tensor,
    router_weight_buffer_ptrs: list[int],
    d_router_weight_buffer: Tensor,
    d_router_weight_buffer_ptrs: list[int],
    w_shared_gate: Tensor | None,
    w_routed_gate_T: Tensor,
    w_routed_gate_T_sc: Tensor,
    w_shared_up: Tensor | None,
    w_routed_up_T: Tensor,
    w_routed_up_T_sc: Tensor,
    w_shared_down: Tensor | None,
    w_routed_down_T: Tensor,
    w_routed_down_T_sc: Tensor,
    x_fp8_t_routed: Tensor,
    x_sc_t_routed: Tensor,
    gate_shared: Tensor,
    gate_fp8_routed: Tensor,
    gate_sc_routed: Tensor,
    up_shared: Tensor,
    up_fp8_routed: Tensor,
    up_sc_routed: Tensor,
    hidden_shared: Tensor,
    hidden_fp8_t_routed: Tensor,
    hidden_sc_t_routed: Tensor,
    x: Tensor,
    x_ptrs: list[int],
    w_routed_gate: Tensor,
    w_routed_gate_sc: Tensor,
    w_routed_up: Tensor,
    w_routed_up_sc: Tensor,
    schedule_peer_rank: Tensor,
    schedule_peer_token_idx: Tensor,
    num_tokens: Tensor,
    tokens_per_expert: Tensor,
    topk: int,
    swiglu_limit: float | None,
    num_comm_sms: int,
    macrobatch_size: int,
    minibatch_size: int,
) -> tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
]:  # fmt: skip
    """dispatch_mlp_swiglu_combine_bwd_bf16 with MXFP8 routed weights and context.

    Inputs: the buffers and their pointers as the BF16 op; w_routed_gate_T, w_routed_up_T fp8
        [E, H, I] and w_routed_down_T fp8 [E, I, H] (mxfp8_quantize's transposed copies) with
        their scales; w_routed_gate, w_routed_up fp8 [E, I, H] with scales; the forward op's
        11 context outputs (declared mutated, as the original's; mok leaves them as they are);
        x, x_ptrs, the schedule and launch settings as the BF16 op.
    Outputs: d_x_shared bf16 [T, H]; 11 empty [0] scratch outputs of the original's dtypes
        (d_x_routed, d_gate_shared, d_gate_fp8_routed, d_gate_sc_routed, d_up_shared,
        d_up_fp8_routed, d_up_sc_routed, d_hidden_shared, d_hidden_routed, d_y_fp8_routed,
        d_y_sc_routed); the six bf16 weight gradients in the BF16 op's order. The buffers are
        filled as by the BF16 op. CPU: mok.reference.mxfp8_backward's layer; CUDA: the context
        dequantised (exact), then the backward megakernel's MXFP8 variant as mok.functional's
        MXFP8 backward runs it.
    """
    op, args = "dispatch_mlp_swiglu_combine_bwd_mxfp8", locals()
    ws, _, _, has_shared, pass_config, ctx = _check_bwd_mxfp8(op, args)
    routed = ((w_routed_gate, w_routed_gate_sc, w_routed_gate_T, w_routed_gate_T_sc),
              (w_routed_up, w_routed_up_sc, w_routed_up_T, w_routed_up_T_sc),
              (w_routed_down_T, w_routed_down_T_sc))  # fmt: skip
    d_x_shared, grads = slot_passes.mxfp8_backward_to_slots(
        ws, op, MoKSchedule(*_schedule_of(args)), tuple(ctx.values()), d_y_buffer,
        router_weight_buffer, x, d_x_routed_buffer, d_router_weight_buffer,
        (w_shared_gate, w_shared_up, w_shared_down), routed, pass_config,
    )  # fmt: skip
    return _mxfp8_gradient_outputs(x, d_x_shared, grads, _weights_of(args), has_shared)


@dispatch_mlp_swiglu_combine_bwd_mxfp8.register_fake
def _(d_y_buffer, d_y_buffer_ptrs, d_x_routed_buffer, d_x_routed_buffer_ptrs,
      router_weight_buffer, router_weight_buffer_ptrs, d_router_weight_buffer,
      d_router_weight_buffer_ptrs, w_shared_gate, w_routed_gate_T, w_routed_gate_T_sc,
      w_shared_up, w_routed_up_T, w_routed_up_T_sc, w_shared_down, w_routed_down_T,
      w_routed_down_T_sc, x_fp8_t_routed, x_sc_t_routed, gate_shared, gate_fp8_routed,
      gate_sc_routed, up_shared, up_fp8_routed, up_sc_routed, hidden_shared,
      hidden_fp8_t_routed, hidden_sc_t_routed, x, x_ptrs, w_routed_gate, w_routed_gate_sc,
      w_routed_up, w_routed_up_sc, schedule_peer_rank, schedule_peer_token_idx, num_tokens,
      tokens_per_expert, topk, swiglu_limit, num_comm_sms, macrobatch_size,
      minibatch_size):  # fmt: skip
    args = locals()
    has_shared = _check_bwd_mxfp8("dispatch_mlp_swiglu_combine_bwd_mxfp8", args)[3]
    return _mxfp8_gradient_outputs(x, None, None, _weights_of(args), has_shared)


layer_ops.document_ops(globals())
