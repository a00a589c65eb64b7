"""The GPU backward op (`mok.ops.backward`).

    EP > 1: dY and w into this rank's symmetric buffers, then the group's start barrier

routed experts: the backward megakernel (backward_megakernel.py), bf16 weight gradients in the
                same launch (fp32 main_grads: the accumulate kernel adds them instead)
d_router[t, j] = sum_b partials[r, b] / w[r]  (fixed-order sums)
shared expert:  expert_gemm_bwd's kernels on one 'expert' of T rows (padded to 128)
d_x = d_x_shared + sum_j slots[t * k + j]  (fixed j order)          moe_combine_backward
A group of one runs the d_router push and the d_x sum in one launch (backward_finish.py); without
a shared expert, as the backward megakernel's last phase (the same bits): one launch for the op.

MXFP8 routed weights (gate, up: (fp8, scale, fp8_t, scale_t); down: (fp8_t, scale_t)), the
layer of mok.reference.mxfp8_backward:
    weights: the transposed copies dequantised to bf16 (exact) in the weights' own layouts
    gate, up: the context's MXFP8 round trips along I (the SwiGLU backward's inputs)
    the backward megakernel's MXFP8 variant: the GEMMs read dY_e's round trip along H and
                d_gate's, d_up's along I; no weight gradients in the launch
    weight gradients: x, hidden, dY_e, d_gate, d_up round-tripped along the tokens (32-row
                blocks), then the weight-gradient kernels
"""

from __future__ import annotations

import weakref

import torch

from ..validation import check_macrobatch, fused_gate_up
from . import macrobatch, mxfp8
from .backward_finish import finish_plan
from .backward_megakernel import backward_plan, router_grad_push_plan
from .checks import check_gpu_layer
from .comm import group_barrier
from .epilogues import bwd_epilogue_plan
from .expert_gemm_bwd import N_ALIGNMENT, weight_gradients
from .peer_table import peer_table
from .plans import (
    current_stream,
    new_tensors,
    plan,
    schedule_addresses,
    tensor_key,
    weight_key,
)
from .shared_expert import shared_backward


def mxfp8_weight_gradients(dy_e, x_rows, d_gate, d_up, hidden, tokens, main_grads,
                           context_exact: bool = False) -> list:  # fmt: skip
    """`weight_gradients` of the MXFP8 layer: every operand's MXFP8 round trip along the
    tokens first (mxfp8.weight_gradient_operands)."""
    operands = mxfp8.weight_gradient_operands(dy_e, d_gate, d_up, x_rows, hidden, context_exact)
    return weight_gradients(*operands, tokens, main_grads)


def backward(ws, schedule, ctx_tensors, grad_output, x, router_weights, shared, routed,
             pass_config, main_grads, context_exact=False):  # fmt: skip
    """The backward op: `shared` and `routed` the (gate, up, down) weights (shared ones None
    without a shared expert), `pass_config` its settings (mok.types.PassConfig). With MXFP8
    routed weights `context_exact` says the routed context holds MXFP8 values already (x,
    hidden along the tokens, gate, up along I: a dequantised quantised context), so their
    round trips, identities, are skipped."""
    if pass_config.macrobatch_size < x.shape[0] * router_weights.shape[1]:  # ring reuse
        return macrobatch.backward(ws, schedule, ctx_tensors, grad_output, x, router_weights,
                                   shared, routed, pass_config, main_grads)  # fmt: skip
    op = backward_op(ws, schedule, ctx_tensors, grad_output, x, router_weights, shared, routed,
                     pass_config, main_grads)  # fmt: skip
    return op(schedule, ctx_tensors, grad_output, x, router_weights, shared, main_grads, routed,
              context_exact)  # fmt: skip


def backward_op(ws, schedule, ctx_tensors, grad_output, x, router_weights, shared, routed,
                pass_config, main_grads):  # fmt: skip
    """The plan of `backward` (without ring reuse) for these arguments, checked when made:
    op(schedule, ctx_tensors, grad_output, x, router_weights, shared weights, main_grads,
    routed weights, context_exact) -> backward's outputs."""
    key = (
        "backward", ws.handle, *(tensor_key(t) for t in ctx_tensors), tensor_key(grad_output),
        tensor_key(x), tensor_key(router_weights), tensor_key(schedule.peer_rank),
        tensor_key(schedule.peer_token_idx), tensor_key(schedule.num_tokens),
        tensor_key(schedule.tokens_per_expert), *map(weight_key, shared),
        *map(weight_key, routed), *map(weight_key, main_grads), pass_config,
        current_stream(x.get_device()),
    )  # fmt: skip
    ws.require_alive()  # a plan holds the workspace's buffers

    def make():
        has_shared = shared[0] is not None
        return _BackwardOp(ws, schedule, ctx_tensors, grad_output, router_weights, routed,
                           pass_config, main_grads, has_shared)  # fmt: skip

    # Not one made for an evicted workspace whose handle this one took over.
    return plan(key, make, current=lambda op: op.ws() is ws)


class _BackwardOp:
    """The backward op for one (workspace, shapes, weights, main_grads, settings): its checks
    and the backward megakernel's plan made on the first call, then only launches."""

    def __init__(self, ws, schedule, ctx_tensors, grad_output, router_weights, routed,
                 pass_config, main_grads, shared_expert):  # fmt: skip
        check_gpu_layer(ws, "backward")
        num_tokens, topk = grad_output.shape[0], router_weights.shape[1]
        check_macrobatch(pass_config.macrobatch_size, num_tokens, topk, "backward")
        self.mxfp8 = isinstance(routed[0], tuple)
        if self.mxfp8:
            # Checked: the tuples (mok.mxfp8_weights); no main_grads (mok.functional).
            # Only for the checks and the binding: every call dequantises its own.
            routed = mxfp8.backward_weights(routed)
        if routed[2].shape[2] % N_ALIGNMENT:
            raise ValueError(
                f"intermediate_size must be a multiple of {N_ALIGNMENT} on the "
                f"sm_90a backward kernel path, got {routed[2].shape[2]}"
            )
        # By weak reference: the workspace cache evicts only workspaces nothing else holds; and no
        # tensor of the caller's (the shared weights come with each call).
        self.ws, self.limit = weakref.ref(ws), pass_config.swiglu_limit
        self.table = table = peer_table(ws)
        # The d_x rows' slots: the workspace's (a group of one too: no allocation per call).
        self.slots = ws.buffers["d_x_routed_buffer"]
        peers = None if table is None else (ws.ep_rank, table)
        # The weight gradients in the megakernel's launch unless they go into fp32 main_grads
        # (or their MXFP8 operands need round trips first).
        self.in_launch = all(g is None for g in main_grads[:3]) and not self.mxfp8
        # Gate and up the halves of one [E, 2 I, H]: so are their bf16 gradients.
        self.fused = (not self.mxfp8 and main_grads[0] is None and main_grads[1] is None
                      and fused_gate_up(routed[0], routed[1]))  # fmt: skip
        # A group of one without a shared expert: d_x and d_router in the megakernel's launch.
        finish = table is None and not shared_expert
        self.routed = backward_plan(
            grad_output, router_weights, schedule, ctx_tensors[:4], routed, pass_config,
            self.in_launch, peers, self.slots, self.mxfp8, finish, self.fused,
        )  # fmt: skip
        self.in_kernel_finish = finish and self.routed.bound is not None
        # The push's checks look at shapes only: partials as the scratch's piece is shaped
        # (allocated alone, not the whole scratch) and d_router as each call makes it.
        partials = new_tensors(self.routed.scratch.pieces[3:], grad_output.device)[0]
        d_router = self._d_router(ws, router_weights)
        self.push = router_grad_push_plan(partials, schedule, router_weights, d_router, peers)
        self.epilogue = None  # bound on the first call, with its tensors
        # A group of one with a shared expert (or no launch): the push and the epilogue in one
        # launch (backward_finish.py).
        self.finish = None
        if table is None and not self.in_kernel_finish:
            shared_d_x = None
            if shared_expert:
                shared_d_x = torch.empty(grad_output.shape, dtype=torch.bfloat16,
                                         device=grad_output.device)  # fmt: skip
            self.finish = finish_plan(shared_d_x, self.slots, ws.topk, partials, schedule,
                                      router_weights, d_router)  # fmt: skip

    def _d_router(self, ws, router_weights):
        if self.table is None:
            return torch.empty(router_weights.shape, dtype=torch.float32,
                               device=router_weights.device)  # fmt: skip
        return ws.buffers["d_router_weight_buffer"]

    def _finish_outputs(self, grad_output, router_weights) -> tuple:
        """(d_x, d_router): what the megakernel's last phase writes (`in_kernel_finish`).
        grad_output (bf16) and router_weights (fp32) are contiguous, checked by the op's key:
        `empty_like` (a third of `torch.empty`'s host time with a shape and dtype)."""
        return torch.empty_like(grad_output), torch.empty_like(router_weights)

    def finished(self, grad_output, router_weights, context) -> tuple:
        """(d_x, d_router, routed d_w gate, up, down) of an op whose megakernel writes them all
        (`in_kernel_finish` and `in_launch`, BF16: a layer step's), the routed context at
        `context`'s addresses (as `__call__` takes it)."""
        d_x, d_router = self._finish_outputs(grad_output, router_weights)
        _, _, d_weights = self.routed.launch(
            grad_output, router_weights, *context, self.slots, None,
            (d_x.data_ptr(), d_router.data_ptr()),
        )  # fmt: skip
        return (d_x, d_router, *d_weights)

    def __call__(self, schedule, ctx_tensors, grad_output, x, router_weights, shared, main_grads,
                 routed, context_exact=False, context=None):  # fmt: skip
        """The op's outputs; without a shared expert its gradients are three distinct empty
        tensors (custom-op outputs may not alias each other).

        `context` (a layer step, mok/layer_plan.py: its outputs reach no custom op): the routed
        context by address, (schedule's four, context's four, a callable making context tensor
        i); `schedule` and ctx_tensors[:4] are then unused, and absent shared gradients are
        None."""
        ws, table = self.ws(), self.table
        x_routed, gate, up, hidden, gate_s, up_s, hidden_s = ctx_tensors
        weights = None
        if self.mxfp8:
            weights = mxfp8.backward_weights(routed)
            if not context_exact:
                gate, up = mxfp8.gate_up_operands(gate, up)
        layer_step = context is not None
        if not layer_step:
            routed_ctx = (x_routed, gate, up, hidden)
            context = (schedule_addresses(schedule), tuple(t.data_ptr() for t in routed_ctx),
                       routed_ctx.__getitem__)  # fmt: skip
        d_x, finish_at = None, (0, 0)
        if self.in_kernel_finish:
            d_x, d_router = self._finish_outputs(grad_output, router_weights)
            finish_at = (d_x.data_ptr(), d_router.data_ptr())
        else:
            d_router = self._d_router(ws, router_weights)
        if table is not None:
            ws.buffers["d_y_buffer"].copy_(grad_output)
            ws.buffers["router_weight_buffer"].copy_(router_weights)
        group_barrier(ws, "PEER_BARRIER_START")
        scratch = self.routed.scratch
        buffer, slots, routed_grads = self.routed.launch(
            grad_output, router_weights, *context, self.slots, weights, finish_at
        )
        partials_at = buffer.data_ptr() + scratch.offsets[3]
        if self.finish is None and d_x is None:  # else with the epilogue, below, or done
            self.push.launch(partials_at, context[0], router_weights, d_router)
        group_barrier(ws, "PEER_BARRIER_END")
        if not self.in_launch:
            dy_e, d_gate, d_up, _ = scratch.views(buffer)
            operands = (dy_e, x_routed, d_gate, d_up, hidden, schedule.tokens_per_expert,
                        main_grads[:3])  # fmt: skip
            if self.mxfp8:
                routed_grads = mxfp8_weight_gradients(*operands, context_exact)
            else:
                routed_grads = weight_gradients(*operands, fused=self.fused)
        if self.fused and not layer_step:  # the op's output: the fused tensor in gate's place
            routed_grads = [routed_grads[0]._base, x.new_empty(0), routed_grads[2]]
        if table is not None:
            d_router = d_router.clone()  # the buffer is the next call's
        d_x_shared, shared_grads = None, [None, None, None]
        if not layer_step:
            shared_grads = [x.new_empty(0), x.new_empty(0), x.new_empty(0)]
        if shared[0] is not None:
            d_x_shared, shared_grads = shared_backward(
                grad_output, x, (gate_s, up_s, hidden_s), shared, self.limit,
                main_grads[3:],
            )  # fmt: skip
        # Else the megakernel's last phase wrote d_x.
        if d_x is None and self.finish is not None:
            d_x = self.finish(d_x_shared, slots, partials_at, context[0], router_weights, d_router)
        elif d_x is None:
            if self.epilogue is None:
                self.epilogue = bwd_epilogue_plan(d_x_shared, slots, ws.topk)
            d_x = self.epilogue(d_x_shared, slots)
        return (d_x, d_router, *routed_grads, *shared_grads)
