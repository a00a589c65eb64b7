"""Argument checks of the original's raw ops (`mok.original.ops`).

The original passes workspace buffers and their addresses on every rank (`<buffer>_ptrs`)
where mok's layer ops take a workspace handle: an op finds its workspace from one pointer
list (or, for the all-gather, from its buffer's address) and checks every other argument
against that workspace. Each error names the argument, the expected and the actual value.
Only metadata is read (pointer lists are plain ints), so the checks run on fake tensors too.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ..config import FEATURE_ALIGNMENT, MAX_TOPK, ROUTED_ROW_ALIGNMENT
from ..errors import MoKInputError
from ..types import PassConfig
from ..validation import (
    HIDDEN_ALIGNMENT,
    check_int,
    check_macrobatch,
    check_swiglu_limit,
    check_tensor,
)
from ..workspace import MoKWorkspace, live_workspaces

Tensor = torch.Tensor
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


# ----------------------------------------------------------------------------------------------
# the workspace
# ----------------------------------------------------------------------------------------------


def _check_pointer_list(arg: str, pointers) -> None:
    if not isinstance(pointers, list) or any(
        isinstance(p, bool) or not isinstance(p, int) or p <= 0 for p in pointers
    ):
        raise MoKInputError(f"{arg} must be a list of positive ints (addresses), got {pointers!r}")


def workspace_of(arg: str, buffer: str, pointers, local: Tensor | None = None) -> MoKWorkspace:
    """The live workspace whose `buffer` has the addresses `pointers` (its `<buffer>_ptrs`).

    The ranks of a virtual EP group (mok.virtual_ep) share one process and the same pointer
    lists, as may workspaces made by the original's constructor over made-up addresses:
    `local`, the rank's own `buffer` argument, tells them apart by identity or address (a fake
    tensor that is no workspace's buffer has none and takes the newest: the ranks' workspaces
    are alike in every shape).
    """
    _check_pointer_list(arg, pointers)
    found = [ws for ws in live_workspaces() if ws.peer_ptrs.get(buffer) == pointers]
    if len(found) > 1 and any(ws.buffers.get(buffer) is local for ws in found):
        found = [ws for ws in found if ws.buffers.get(buffer) is local]
    elif len(found) > 1 and isinstance(local, Tensor) and not is_fake(local):
        found = [ws for ws in found if ws.buffers[buffer].data_ptr() == local.data_ptr()]
        if not found:
            raise ValueError(
                f"{arg} names the workspaces of a virtual EP group's ranks, and the {buffer} "
                f"argument is none of theirs (at {local.data_ptr():#x}): pass the rank's own "
                f"workspace.{buffer}"
            )
    if not found:
        raise ValueError(
            f"{arg} must be the {buffer}_ptrs of a live MoKWorkspace, got {pointers}: no "
            f"workspace has these addresses (destroyed, evicted from get_workspace's cache, or "
            f"never made)"
        )
    return _runnable(found[-1], local)


def _runnable(ws: MoKWorkspace, local) -> MoKWorkspace:
    """`ws`, unless a real call (not fake tensors) would run an EP group's workspace made by
    the original's constructor: mok reaches peers through buffers it allocated itself."""
    if ws.caller_buffers and ws.ep_size > 1 and isinstance(local, Tensor) and not is_fake(local):
        raise ValueError(
            f"a MoKWorkspace made from the original's fields runs only with ep_size 1 (it "
            f"serves tracing with fake tensors at any ep_size), got ep_size {ws.ep_size}: get an "
            f"EP group's workspace from mok.functional.get_workspace"
        )
    return ws


def workspace_holding(arg: str, buffer: str, tensor: Tensor) -> MoKWorkspace:
    """The live workspace whose `buffer` is `tensor` (same address on this rank)."""
    if not isinstance(tensor, Tensor):
        raise MoKInputError(f"{arg} must be a torch.Tensor, got {type(tensor).__name__}")
    for ws in reversed(live_workspaces()):
        if ws.buffers.get(buffer) is tensor:
            return _runnable(ws, tensor)
    address = tensor.data_ptr()
    for ws in live_workspaces():
        own = ws.buffers.get(buffer)
        if own is not None and own.data_ptr() == address:
            return _runnable(ws, tensor)
    raise ValueError(
        f"{arg} must be a live MoKWorkspace's {buffer} (workspace.{buffer}), got a tensor at "
        f"{address:#x} that no workspace holds (torch.compile's aot_eager backend passes a copy "
        f"of a mutated argument: compile with the eager or inductor backend)"
    )


def check_pointers(ws: MoKWorkspace, arg: str, buffer: str, pointers, named_by: str) -> None:
    """`pointers` must be the workspace's `<buffer>_ptrs` (the workspace `named_by` names)."""
    _check_pointer_list(arg, pointers)
    expected = ws.peer_ptrs[buffer]
    if pointers != expected:
        raise ValueError(
            f"{arg} must be workspace.{buffer}_ptrs of the workspace {named_by} names, "
            f"{expected}, got {pointers}"
        )


def check_buffer(ws: MoKWorkspace, arg: str, buffer: str, tensor: Tensor) -> None:
    """`tensor` must be shaped like the workspace's `buffer` (dtype, shape, device, contiguous).

    Its address is not required to be the buffer's: torch.compile passes copies of mutated
    arguments to some backends. Peers reach this rank's buffers through the pointer tables.
    """
    own = ws.buffers[buffer]
    check_tensor(arg, tensor, dtype=own.dtype, shape=list(own.shape), device=ws.device)


def check_rank(ws: MoKWorkspace, rank) -> None:
    check_int("rank", rank)
    if rank != ws.ep_rank:
        raise ValueError(f"rank must be the workspace's EP rank {ws.ep_rank}, got {rank}")


# ----------------------------------------------------------------------------------------------
# launch settings and the schedule
# ----------------------------------------------------------------------------------------------


def check_sizes(activation_name: str, activation, routed_gate, topk, num_comm_sms,
                minibatch_size, macrobatch_size) -> None:  # fmt: skip
    """A dispatch op's checks that need no workspace, run before the workspace lookup in the
    original's order, so a call over made-up pointer lists gets the original's error: the
    hidden_size of the activation, the routed weights' intermediate_size, topk, then the
    launch sizes. On CUDA (fake tensors included) hidden_size must also suit the sm_90a
    GEMMs, as the kernel path requires later."""
    check_tensor(activation_name, activation, dtype=BF16, shape=[None, None])
    hidden = activation.shape[1]
    alignment = HIDDEN_ALIGNMENT if activation.is_cuda else FEATURE_ALIGNMENT
    if hidden == 0 or hidden % alignment:
        where = " on the GPU (the sm_90a GEMMs)" if activation.is_cuda else ""
        raise ValueError(
            f"hidden_size ({activation_name}.shape[1]) must be a positive multiple of "
            f"{alignment}{where}, got {hidden}"
        )
    routed_sizes("w_routed_gate", routed_gate)
    check_int("topk", topk, minimum=1)
    check_int("num_comm_sms", num_comm_sms, minimum=0, multiple_of=2)
    check_int("minibatch_size", minibatch_size, minimum=256, multiple_of=256)
    check_int("macrobatch_size", macrobatch_size, minimum=minibatch_size,
              multiple_of=minibatch_size)  # fmt: skip


def check_launch(
    ws: MoKWorkspace, op: str, topk, swiglu_limit, num_comm_sms, macrobatch_size, minibatch_size
) -> PassConfig:
    """topk, swiglu_limit and the MoKConfig fields the op takes; returns the op's settings on
    `ws`, with every routed row held at once (macrobatch_size None: the op's outputs are the
    whole context)."""
    check_int("topk", topk)
    if topk != ws.topk:
        raise ValueError(f"topk must be the workspace's topk {ws.topk}, got {topk}")
    limit = check_swiglu_limit(swiglu_limit)
    check_int("num_comm_sms", num_comm_sms, minimum=0, multiple_of=2)
    check_int("minibatch_size", minibatch_size, minimum=256, multiple_of=256)
    check_int("macrobatch_size", macrobatch_size, minimum=minibatch_size,
              multiple_of=minibatch_size)  # fmt: skip
    check_macrobatch(macrobatch_size, ws.num_local_tokens, ws.topk, op)
    return PassConfig.of_workspace(ws, swiglu_limit=limit, num_comm_ctas=num_comm_sms,
                                   minibatch_size=minibatch_size, macrobatch_size=None)  # fmt: skip


def check_schedule(
    ws: MoKWorkspace, num_experts: int, peer_rank, peer_token_idx, num_tokens, tokens_per_expert
) -> None:
    capacity, device = ws.schedule_capacity, ws.device
    i32 = torch.int32
    check_tensor("schedule_peer_rank", peer_rank, dtype=i32, shape=[capacity], device=device)
    check_tensor("schedule_peer_token_idx", peer_token_idx, dtype=i32, shape=[capacity],
                 device=device)  # fmt: skip
    check_tensor("num_tokens", num_tokens, dtype=i32, shape=[1], device=device)
    check_tensor("tokens_per_expert", tokens_per_expert, dtype=i32, shape=[num_experts],
                 device=device)  # fmt: skip


def check_routing_ids(topk_all, num_local_experts, schedule_capacity, rank) -> None:
    """`schedule`'s arguments: the all-gathered ids and the schedule's size."""
    check_tensor("topk_all", topk_all, dtype=torch.int32, shape=[None, None, None])
    ep_size, num_tokens, topk = topk_all.shape
    if ep_size < 1 or num_tokens < 1 or not 1 <= topk <= MAX_TOPK:
        raise ValueError(
            f"topk_all must be [ep_size, num_local_tokens, topk] with ep_size, num_local_tokens "
            f">= 1 and topk in [1, {MAX_TOPK}], got {list(topk_all.shape)}"
        )
    check_int("num_local_experts", num_local_experts, minimum=1)
    check_int("schedule_capacity", schedule_capacity, minimum=ROUTED_ROW_ALIGNMENT,
              multiple_of=ROUTED_ROW_ALIGNMENT)  # fmt: skip
    if schedule_capacity < num_tokens * topk:
        # As the original: the schedule holds at least one rank's own routed rows.
        raise ValueError(
            f"schedule_capacity must be >= num_local_tokens * topk = {num_tokens} * {topk} = "
            f"{num_tokens * topk}, got {schedule_capacity}"
        )
    check_int("rank", rank, minimum=0)
    if rank >= ep_size:
        raise ValueError(f"rank must be in [0, {ep_size}) (topk_all.shape[0]), got {rank}")


# ----------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------


def routed_sizes(name: str, routed_gate) -> tuple[int, int]:
    """(E, I) from the routed gate weights, data of shape [E, I, H]."""
    if not isinstance(routed_gate, Tensor):
        raise MoKInputError(f"{name} must be a torch.Tensor, got {type(routed_gate).__name__}")
    if routed_gate.dim() != 3 or routed_gate.shape[0] < 1:
        raise ValueError(
            f"{name} must have shape [num_local_experts, intermediate_size, hidden_size], got "
            f"{list(routed_gate.shape)}"
        )
    num_experts, inter = routed_gate.shape[0], routed_gate.shape[1]
    if inter == 0 or inter % FEATURE_ALIGNMENT:
        raise ValueError(
            f"intermediate_size ({name}.shape[1]) must be a positive multiple of "
            f"{FEATURE_ALIGNMENT}, got {inter}"
        )
    return num_experts, inter


def check_shared_weights(ws: MoKWorkspace, inter: int, weights: dict) -> bool:
    """The bf16 shared expert (`w_shared_*`, all given or all None); returns whether given."""
    hidden = ws.hidden_size
    shapes = {"w_shared_gate": [inter, hidden], "w_shared_up": [inter, hidden],
              "w_shared_down": [hidden, inter]}  # fmt: skip
    given = [name for name in shapes if weights.get(name) is not None]
    if given and len(given) != len([name for name in shapes if name in weights]):
        missing = [name for name in shapes if name in weights and name not in given]
        raise ValueError(
            f"shared expert weights must be all given or all None; got {given} but {missing} "
            f"is None"
        )
    for name in given:
        check_tensor(name, weights[name], dtype=BF16, shape=shapes[name], device=ws.device)
    return bool(given)


def check_bf16_weights(ws: MoKWorkspace, weights: dict) -> tuple[int, int, bool]:
    """The bf16 weights given (`w_routed_*` and `w_shared_*`, down ones optional); returns
    (E, I, whether a shared expert is given)."""
    num_experts, inter = routed_sizes("w_routed_gate", weights["w_routed_gate"])
    hidden = ws.hidden_size
    shapes = {"w_routed_gate": [num_experts, inter, hidden],
              "w_routed_up": [num_experts, inter, hidden],
              "w_routed_down": [num_experts, hidden, inter]}  # fmt: skip
    for name, shape in shapes.items():
        if name in weights:
            check_tensor(name, weights[name], dtype=BF16, shape=shape, device=ws.device)
    return num_experts, inter, check_shared_weights(ws, inter, weights)


def scale_shape(rows: int, cols: int) -> list[int]:
    """The swizzled UE8M0 scale tensor of `rows` x `cols` values quantised along the columns."""
    return [rows // 128, cols // 128, 32, 16]


def check_mxfp8_pair(ws: MoKWorkspace, name: str, data, scales, shape: list[int]) -> None:
    """An (fp8, scale) pair from mok.ops.mxfp8_quantize: data `shape`, scales along its last
    dim (leading dims fold into the rows)."""
    check_tensor(name, data, dtype=FP8, shape=shape, device=ws.device)
    rows = 1
    for dim in shape[:-1]:
        rows *= dim
    check_tensor(f"{name}_sc", scales, dtype=torch.uint8, shape=scale_shape(rows, shape[-1]),
                 device=ws.device)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# the forward context
# ----------------------------------------------------------------------------------------------


def check_shared_context(ws: MoKWorkspace, inter: int, has_shared: bool, tensors: dict) -> None:
    """gate/up/hidden_shared: bf16 [T, I] with a shared expert, empty [0] without one."""
    for name, tensor in tensors.items():
        if has_shared:
            check_tensor(name, tensor, dtype=BF16, shape=[ws.num_local_tokens, inter],
                         device=ws.device)  # fmt: skip
        else:
            check_tensor(name, tensor, dtype=BF16, shape=[0], device=ws.device)


def check_bf16_context(ws: MoKWorkspace, inter: int, has_shared: bool, ctx: dict) -> None:
    """The forward op's bf16 context: routed rows [C, H] / [C, I], shared [T, I] or [0]."""
    capacity, hidden, device = ws.schedule_capacity, ws.hidden_size, ws.device
    check_tensor("x_routed", ctx["x_routed"], dtype=BF16, shape=[capacity, hidden], device=device)
    for name in ("gate_routed", "up_routed", "hidden_routed"):
        check_tensor(name, ctx[name], dtype=BF16, shape=[capacity, inter], device=device)
    shared = {n: ctx[n] for n in ("gate_shared", "up_shared", "hidden_shared")}
    check_shared_context(ws, inter, has_shared, shared)


def check_mxfp8_context(ws: MoKWorkspace, inter: int, has_shared: bool, ctx: dict) -> None:
    """The MXFP8 forward op's context: x and hidden quantised along the routed rows
    (transposed, [H, C] / [I, C]), gate and up along I ([C, I]); shared bf16 [T, I] or [0]."""
    capacity, hidden = ws.schedule_capacity, ws.hidden_size
    pairs = {
        "x_fp8_t_routed": ("x_sc_t_routed", [hidden, capacity]),
        "gate_fp8_routed": ("gate_sc_routed", [capacity, inter]),
        "up_fp8_routed": ("up_sc_routed", [capacity, inter]),
        "hidden_fp8_t_routed": ("hidden_sc_t_routed", [inter, capacity]),
    }
    for name, (scale_name, shape) in pairs.items():
        check_tensor(name, ctx[name], dtype=FP8, shape=shape, device=ws.device)
        check_tensor(scale_name, ctx[scale_name], dtype=torch.uint8,
                     shape=scale_shape(*shape), device=ws.device)  # fmt: skip
    shared = {n: ctx[n] for n in ("gate_shared", "up_shared", "hidden_shared")}
    check_shared_context(ws, inter, has_shared, shared)
