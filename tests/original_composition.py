"""A layer step written with the original's raw ops (mok/original/ops.py), composed as the
original's `mok.functional` composes them: the buffers filled, a barrier before and after each
pass, the epilogues over the workspace's slot buffers. Shared by the CPU and GPU tests."""

from __future__ import annotations

import torch

from mok import ops


def barrier(ws):
    ops.barrier_all(ws.barrier_buffer, ws.barrier_buffer_ptrs, ws.barrier_buffer_multicast_ptr,
                    ws.barrier_target)  # fmt: skip


def launch(config, ws, limit, comm_sms):
    """The raw ops' trailing (topk, swiglu_limit, num_comm_sms, macrobatch_size, minibatch_size)."""
    return (ws.topk, limit, comm_sms, config.macrobatch_size, config.minibatch_size)


def raw_schedule(config, ws, top_experts, num_local_experts):
    """The schedule's 4 tensors: all-gather, barrier, schedule."""
    ops.all_gather_top_experts(top_experts.to(torch.int32), ws.all_gather_top_experts_buffer,
                               ws.all_gather_top_experts_buffer_multicast_ptr, ws.ep_rank,
                               config.all_gather_top_experts_chunk_bytes)  # fmt: skip
    barrier(ws)
    return ops.schedule(ws.all_gather_top_experts_buffer, num_local_experts,
                        ws.schedule_capacity, ws.ep_rank)  # fmt: skip


def raw_forward(config, ws, sched, x, router_weights, weights, limit=None):
    """(out, the forward op's 9 outputs); `weights` in mok.functional's order (shared gate, up,
    down, routed gate, up, down)."""
    sg, su, sd, rg, ru, rd = weights
    ws.x_buffer.copy_(x)
    ws.router_weight_buffer.copy_(router_weights)
    barrier(ws)
    outs = ops.dispatch_mlp_swiglu_combine_fwd_bf16(
        ws.x_buffer, ws.x_buffer_ptrs, ws.combine_buffer, ws.combine_buffer_ptrs, sg, rg, su, ru,
        sd, rd, *sched, *launch(config, ws, limit, config.fwd_num_comm_sms),
    )  # fmt: skip
    barrier(ws)
    y_shared = outs[7] if sg is not None else None
    return ops.fwd_epilogue(y_shared, ws.combine_buffer, ws.router_weight_buffer), outs


def raw_recompute(config, ws, sched, weights, limit=None):
    """The forward op's first 7 outputs again, from workspace.x_buffer."""
    sg, su, _, rg, ru, _ = weights
    return ops.recompute_forward_context_bf16(
        ws.x_buffer, ws.x_buffer_ptrs, sg, rg, su, ru, *sched,
        *launch(config, ws, limit, config.fwd_num_comm_sms),
    )  # fmt: skip


def raw_backward(config, ws, sched, fwd, grad_output, x, router_weights, weights, limit=None):
    """mok.functional.backward's 8 results (d_x, d_router_weights, routed then shared weight
    gradients, the shared ones None without a shared expert) from the forward op's outputs."""
    sg, su, sd, rg, ru, rd = weights
    ws.d_y_buffer.copy_(grad_output)
    ws.x_buffer.copy_(x)
    ws.router_weight_buffer.copy_(router_weights)
    barrier(ws)
    outs = ops.dispatch_mlp_swiglu_combine_bwd_bf16(
        ws.d_y_buffer, ws.d_y_buffer_ptrs, ws.d_x_routed_buffer, ws.d_x_routed_buffer_ptrs,
        ws.router_weight_buffer, ws.router_weight_buffer_ptrs, ws.d_router_weight_buffer,
        ws.d_router_weight_buffer_ptrs, sg, rg, su, ru, sd, rd, *fwd[:7], ws.x_buffer,
        ws.x_buffer_ptrs, *sched, *launch(config, ws, limit, config.bwd_num_comm_sms),
    )  # fmt: skip
    barrier(ws)
    has_shared = sg is not None
    d_x = ops.bwd_epilogue(outs[0] if has_shared else None, ws.d_x_routed_buffer, ws.topk)
    shared = (outs[9], outs[11], outs[13]) if has_shared else (None, None, None)
    return (d_x, ws.d_router_weight_buffer.clone(), outs[10], outs[12], outs[14], *shared)


def context_in_mok_order(fwd):
    """The forward op's context outputs (the original's order, shared ones interleaved) in
    mok.functional's MoKForwardContext order (routed x, gate, up, hidden, then shared)."""
    return [fwd[i] for i in (0, 2, 4, 6, 1, 3, 5)]


def assert_all_equal(got, want):
    """Bitwise equal, entry by entry; a None in `want` matches None or an empty [0] tensor."""
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None:
            assert a is None or a.numel() == 0, index
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), index
