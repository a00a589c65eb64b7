"""The GPU forward op (`mok.ops.forward`) and the recomputed forward context.

    EP > 1: x into this rank's symmetric x buffer, then the group's start barrier
    routed experts: the forward megakernel (forward_megakernel.py): rows pulled from their
                    token's rank, gate/up + SwiGLU, down rows pushed to their (token, j) slot
                    on their token's rank, in one launch
    EP > 1: the group's end barrier (every rank's pushes into this rank's slots are done)
    shared expert:  expert_gemm's gate/up and down on one 'expert' of T rows (padded to 128)
    out = y_shared + sum_j w[t, j] * slots[t * k + j]  (fixed j order)   moe_combine_forward
A group of one without a shared expert sums the slots in the megakernel's last phase (the same
bits): one launch for the whole op.

The recomputed context pulls the rows with the gather kernel and runs the same gate/up tiles
as separate kernels (MXFP8: on x's round trip along H and the dequantised weights). All launches go on the current stream with no host sync; every step is
deterministic (no atomics on values, no split-K, each output element written by one thread in
a fixed order), so results are bitwise identical run to run and across EP sizes.
"""

from __future__ import annotations

import weakref

import torch

from ..validation import check_macrobatch
from . import dispatch, expert_gemm, macrobatch, mxfp8
from .checks import check_gpu_layer, check_host
from .comm import group_barrier, publish_x
from .epilogues import fwd_epilogue_plan
from .forward_megakernel import forward_plan
from .peer_table import peer_table
from .plans import current_stream, plan, tensor_key, weight_key
from .shared_expert import shared_forward


def forward(ws, schedule, x, router_weights, shared, routed, pass_config):
    """The forward op: `shared` and `routed` the (gate, up, down) weights (shared ones None
    without a shared expert), `pass_config` its settings (mok.types.PassConfig)."""
    if pass_config.macrobatch_size < x.shape[0] * router_weights.shape[1]:  # ring reuse
        return macrobatch.forward(ws, schedule, x, router_weights, shared, routed, pass_config)
    op = forward_op(ws, schedule, x, router_weights, shared, routed, pass_config)
    return op(schedule, x, router_weights, shared, routed)


def forward_op(ws, schedule, x, router_weights, shared, routed, pass_config, schedule_ids=None):
    """The plan of `forward` (without ring reuse) for these arguments, checked when made:
    op(schedule, x, router_weights, shared weights, routed weights) -> forward's outputs.
    `schedule_ids` (a layer step's int64 [T, k] routing): where the op sums in the megakernel
    (`combine`), the megakernel also writes the schedule (`schedules`; `combined` takes the
    routing's address)."""
    key = (
        "forward", ws.handle, tensor_key(x), tensor_key(router_weights),
        tensor_key(schedule.peer_rank), tensor_key(schedule.peer_token_idx),
        tensor_key(schedule.num_tokens), tensor_key(schedule.tokens_per_expert),
        *map(weight_key, shared), *map(weight_key, routed), pass_config,
        current_stream(x.get_device()),
        None if schedule_ids is None else ("schedule_ids", tensor_key(schedule_ids)),
    )  # fmt: skip
    ws.require_alive()  # a plan holds the workspace's buffers

    def make():
        has_shared = shared[0] is not None
        return _ForwardOp(
            ws, schedule, x, router_weights, routed, pass_config, has_shared, schedule_ids
        )

    # Not one made for an evicted workspace whose handle this one took over.
    return plan(key, make, current=lambda op: op.ws() is ws)


class _ForwardOp:
    """The forward op for one (workspace, shapes, weights, settings): its checks and the routed
    megakernel's plan made on the first call, then only launches. `combine`: the megakernel
    sums the slots itself (a group of one without a shared expert)."""

    def __init__(
        self, ws, schedule, x, router_weights, routed, pass_config, has_shared, schedule_ids=None
    ):
        check_gpu_layer(ws, "forward")
        num_tokens, topk = x.shape[0], router_weights.shape[1]
        check_macrobatch(pass_config.macrobatch_size, num_tokens, topk, "forward")
        # By weak reference: the workspace cache evicts only workspaces nothing else holds; and no
        # tensor of the caller's (the shared weights come with each call).
        self.ws, self.limit = weakref.ref(ws), pass_config.swiglu_limit
        self.table = table = peer_table(ws)
        # The routed rows' slots: the workspace's (a group of one too: no allocation per call).
        self.slots, peers = ws.buffers["combine_buffer"], None
        self.slots_at = self.slots.data_ptr()
        if table is not None:
            peers = (ws.ep_rank, table)
        combine = table is None and not has_shared
        ids = schedule_ids if combine else None
        self.routed = forward_plan(
            x, schedule, ws.topk, routed, pass_config, peers, self.slots, combine, ids
        )
        # The launch writes the schedule: `combined` takes the routing's address.
        self.schedules = self.routed.schedules
        # No launch (no routed rows): the epilogue kernel sums the slots.
        self.combine = combine and self.routed.bound is not None
        if self.combine:
            check_host("router_weights", router_weights, torch.float32, (x.shape[0], ws.topk))
        self.epilogue = None  # bound on the first call, with its slots and y_shared

    def __call__(self, schedule, x, router_weights, shared, routed, context=None):
        """The op's outputs; without a shared expert its context is three distinct empty
        tensors (custom-op outputs may not alias each other).

        `context` (a layer step, mok/layer_plan.py: its outputs reach no custom op): the
        addresses of the routed context to write, (schedule's four, context's four, a callable
        making context tensor i); `schedule` is then unused, and the outputs are out and the
        shared context (None in its places without a shared expert)."""
        ws = self.ws()
        if self.combine:  # a group of one: no barriers, no shared expert
            if context is not None:
                return self.combined(x, router_weights, routed, context), None, None, None
            out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
            routed_ctx, _ = self.routed(x, schedule, self.slots, routed, (out, router_weights))
            return (out, *routed_ctx, x.new_empty(0), x.new_empty(0), x.new_empty(0))
        publish_x(ws, x, self.table)
        if context is None:
            routed_ctx, slots = self.routed(x, schedule, self.slots, routed)
            shared_ctx = (x.new_empty(0), x.new_empty(0), x.new_empty(0))
        else:
            routed_ctx, slots, shared_ctx = (), self.slots, (None, None, None)
            if self.routed.bound is not None:
                self.routed.launch(x, *context, self.slots_at, routed)
        group_barrier(ws, "PEER_BARRIER_END")
        y_shared = None
        if shared[0] is not None:
            *shared_ctx, y_shared = shared_forward(x, *shared, self.limit)
        # This op's key holds router_weights' tensor_key: the epilogue checks them on the first
        # call only.
        checked = self.epilogue is not None
        if not checked:
            self.epilogue = fwd_epilogue_plan(y_shared, slots, router_weights.shape)
        out = self.epilogue(y_shared, slots, router_weights, checked=checked)
        return (out, *routed_ctx, *shared_ctx)

    def combined(self, x, router_weights, routed, context, ids_at=0) -> torch.Tensor:
        """`out` of an op made with `combine` (the megakernel sums the slots), its routed
        context written at `context`'s addresses (as `__call__` takes it); `ids_at`: the
        routing's address, for an op that `schedules` (the launch writes the schedule there
        too)."""
        out = torch.empty_like(x)  # x is bf16 and contiguous (checked by the op's key)
        self.routed.launch(x, *context, self.slots_at, routed,
                           (out.data_ptr(), router_weights.data_ptr()), ids_at)  # fmt: skip
        return out

    def layout(self) -> list:
        """(dtype, shape) of the routed context (x_routed, gate, up, hidden), for a `Carve`."""
        return self.routed.layout()


def recompute_forward_context(
    ws, schedule, x, shared_gate, shared_up, routed_gate, routed_up, swiglu_limit
):
    check_gpu_layer(ws, "recompute_forward_context")
    table = peer_table(ws)
    publish_x(ws, x, table)
    peers = None if table is None else (ws.ep_rank, table)
    x_routed = dispatch.gather_rows(x, schedule.peer_rank, schedule.peer_token_idx,
                                    schedule.num_tokens, ws.topk, peers=peers)  # fmt: skip
    group_barrier(ws, "PEER_BARRIER_END")
    a_rows = x_routed
    if isinstance(routed_gate, tuple):  # MXFP8 (fp8, scale) along H: the forward's operands
        a_rows = mxfp8.mxfp8_round_trip(x_routed, along_rows=False)
        routed_gate, routed_up = (mxfp8.mxfp8_dequantize(*w) for w in (routed_gate, routed_up))
    gate, up, hidden = expert_gemm.gate_up_swiglu(
        a_rows, routed_gate, routed_up, schedule.tokens_per_expert, swiglu_limit=swiglu_limit
    )
    shared_ctx = tuple(x.new_empty(0) for _ in range(3))
    if shared_gate is not None:
        shared_ctx = shared_forward(x, shared_gate, shared_up, None, swiglu_limit)[:3]
    return (x_routed, gate, up, hidden, *shared_ctx)
