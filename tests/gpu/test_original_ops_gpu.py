"""The original's raw op set (mok/original/ops.py) on the GPU: composed as the original's
functional API composes them (tests/original_composition.py), bitwise equal to mok.functional
on CUDA, for a group of one, under torch.compile, and for a virtual EP group of two; the
MXFP8 forward, recompute and backward ops equal to mok.functional's MXFP8 layer bitwise (the
context the GPU quantisation of that forward's)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from original_composition import (
    assert_all_equal,
    context_in_mok_order,
    raw_backward,
    raw_forward,
    raw_recompute,
    raw_schedule,
)

from mok import functional as F
from mok import ops
from mok.testing import make_inputs, poison_cuda_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
T, H, I, E, K = 512, 256, 256, 8, 2
CONFIG = F.MoKConfig()
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workspace():
    return F.get_workspace(CONFIG, None, device=CUDA, num_local_tokens=T, hidden_size=H, topk=K,
                           num_local_experts=E)  # fmt: skip


def _functional(ws, inputs, limit):
    """(schedule, out, context, 8 gradients, recomputed context) through mok.functional."""
    weights = [inputs[n] for n in WEIGHTS]
    x, w = inputs["x"], inputs["router_weights"]
    schedule = F.build_schedule(ws, CONFIG, inputs["top_experts"], num_local_experts=E)
    out, ctx = F.forward(CONFIG, ws, schedule, x, w, *weights, swiglu_limit=limit)
    grads = F.backward(CONFIG, ws, schedule, ctx, inputs["grad_output"], x, w, *weights,
                       swiglu_limit=limit)  # fmt: skip
    again = F.recompute_forward_context(CONFIG, ws, schedule, x, weights[0], weights[1],
                                        weights[3], weights[4], swiglu_limit=limit)  # fmt: skip
    return schedule, out, ctx, grads, again


def _raw(ws, inputs, limit):
    """(schedule tensors, out, forward outputs, 8 gradients, recomputed) through the raw ops."""
    weights = [inputs[n] for n in WEIGHTS]
    x, w = inputs["x"], inputs["router_weights"]
    sched = raw_schedule(CONFIG, ws, inputs["top_experts"], E)
    out, fwd = raw_forward(CONFIG, ws, sched, x, w, weights, limit)
    again = raw_recompute(CONFIG, ws, sched, weights, limit)
    grads = raw_backward(CONFIG, ws, sched, fwd, inputs["grad_output"], x, w, weights, limit)
    return sched, out, fwd, grads, again


def _routed_rows(tensors, rows):
    # Routed rows at or past schedule.num_tokens are not part of the contract (unwritten).
    return [t[:rows] if i < 4 else t for i, t in enumerate(tensors)]


@pytest.mark.parametrize("shared,limit", [(True, None), (False, None), (True, 7.0)])
def test_raw_composition_equals_functional_on_cuda_bitwise(shared, limit):
    inputs = make_inputs(T, H, I, E, K, shared=shared, seed=31, device=CUDA)
    ws = _workspace()
    poison_cuda_allocator()
    schedule, out, ctx, grads, again = _functional(ws, inputs, limit)
    poison_cuda_allocator()
    sched, raw_out, fwd, raw_grads, raw_again = _raw(ws, inputs, limit)
    F.check_errors(ws)
    assert_all_equal(sched, (schedule.peer_rank, schedule.peer_token_idx, schedule.num_tokens,
                             schedule.tokens_per_expert))  # fmt: skip
    rows = int(schedule.num_tokens)
    assert torch.equal(raw_out, out)
    assert not raw_out.isnan().any()
    assert_all_equal(_routed_rows(context_in_mok_order(fwd), rows),
                     _routed_rows(ctx.tensors(), rows))  # fmt: skip
    assert_all_equal(_routed_rows(context_in_mok_order(raw_again), rows),
                     _routed_rows(again.tensors(), rows))  # fmt: skip
    assert_all_equal(raw_grads, grads)
    for grad in raw_grads:
        assert grad is None or not grad.float().isnan().any()


def test_raw_composition_under_torch_compile_on_cuda():
    pytest.importorskip("triton")
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=32, device=CUDA)
    ws = _workspace()
    weights = [inputs[n] for n in WEIGHTS]

    def step(x, w, ids, dy, *weights):
        sched = raw_schedule(CONFIG, ws, ids, E)
        out, fwd = raw_forward(CONFIG, ws, sched, x, w, weights)
        return out, raw_backward(CONFIG, ws, sched, fwd, dy, x, w, weights)

    args = (inputs["x"], inputs["router_weights"], inputs["top_experts"], inputs["grad_output"],
            *weights)  # fmt: skip
    _, out, _, grads, _ = _functional(ws, inputs, None)
    torch._dynamo.reset()
    got_out, got_grads = torch.compile(step, fullgraph=True)(*args)
    F.check_errors(ws)
    assert torch.equal(got_out, out)
    assert_all_equal(got_grads, grads)


def test_mxfp8_raw_ops_equal_functional_on_cuda():
    from mok.mxfp8_context import dequantised_context, flat  # noqa: PLC0415

    inputs = make_inputs(T, H, I, E, K, shared=True, seed=33, device=CUDA)
    ws = _workspace()
    schedule = F.build_schedule(ws, CONFIG, inputs["top_experts"], num_local_experts=E)
    sched = (schedule.peer_rank, schedule.peer_token_idx, schedule.num_tokens,
             schedule.tokens_per_expert)  # fmt: skip
    # Quantised on the CPU reference path: this test is about the ops' CUDA branch.
    q = {n: [t.to(CUDA) for t in ops.mxfp8_quantize(inputs[n].cpu(), True, True)]
         for n in WEIGHTS[3:]}  # fmt: skip
    (g, gsc, gt, gtsc), (u, usc, ut, utsc), (d, dsc, dt, dtsc) = (q[n] for n in WEIGHTS[3:])
    sg, su, sd = (inputs[n] for n in WEIGHTS[:3])
    x, w, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    want_out, want_ctx = F.forward(CONFIG, ws, schedule, x, w, sg, su, sd, (g, gsc), (u, usc),
                                   (d, dsc))  # fmt: skip
    want_grads = F.backward(CONFIG, ws, schedule, want_ctx, dy, x, w, sg, su, sd,
                            (g, gsc, gt, gtsc), (u, usc, ut, utsc), (dt, dtsc))  # fmt: skip
    want = flat(want_ctx, x)  # mok.functional's MXFP8 context: the original's pairs
    settings = (ws.topk, None, 0, CONFIG.macrobatch_size, CONFIG.minibatch_size)
    forward_args = [ws.x_buffer, ws.x_buffer_ptrs, ws.combine_buffer, ws.combine_buffer_ptrs, sg,
                    g, gsc, su, u, usc, sd, d, dsc, *sched, *settings]  # fmt: skip
    ws.x_buffer.copy_(x)
    ws.router_weight_buffer.copy_(w)
    poison_cuda_allocator()
    outs = ops.dispatch_mlp_swiglu_combine_fwd_mxfp8(*forward_args)
    out = ops.fwd_epilogue(outs[11], ws.combine_buffer, w)
    F.check_errors(ws)
    assert torch.equal(out, want_out)
    # Routed rows past the schedule's are never written (whole 32-row blocks of their own):
    # compared through the dequantised values of the routed rows.
    rows = int(schedule.num_tokens)
    assert_all_equal(_routed_rows(dequantised_context(outs[:11]).tensors(), rows),
                     _routed_rows(dequantised_context(want).tensors(), rows))  # fmt: skip
    recomputed = ops.recompute_forward_context_mxfp8(ws.x_buffer, ws.x_buffer_ptrs, sg, g, gsc,
                                                     su, u, usc, *sched, *settings)  # fmt: skip
    assert_all_equal(_routed_rows(dequantised_context(recomputed).tensors(), rows),
                     _routed_rows(dequantised_context(outs[:11]).tensors(), rows))  # fmt: skip
    # The backward from the quantised context: mok.functional's MXFP8 backward's bits.
    ws.d_y_buffer.copy_(dy)
    poison_cuda_allocator()
    bwd = ops.dispatch_mlp_swiglu_combine_bwd_mxfp8(
        ws.d_y_buffer, ws.d_y_buffer_ptrs, ws.d_x_routed_buffer, ws.d_x_routed_buffer_ptrs,
        ws.router_weight_buffer, ws.router_weight_buffer_ptrs, ws.d_router_weight_buffer,
        ws.d_router_weight_buffer_ptrs, sg, gt, gtsc, su, ut, utsc, sd, dt, dtsc, *outs[:11],
        ws.x_buffer, ws.x_buffer_ptrs, g, gsc, u, usc, *sched, *settings,
    )  # fmt: skip
    F.check_errors(ws)
    d_x = ops.bwd_epilogue(bwd[0], ws.d_x_routed_buffer, K)
    got = (d_x, ws.d_router_weight_buffer.clone(), bwd[13], bwd[15], bwd[17], bwd[12], bwd[14],
           bwd[16])  # fmt: skip
    assert_all_equal(got, want_grads)
    bad = list(forward_args)
    bad[6] = gsc[:1]  # w_routed_gate_sc of the wrong shape: the checks come first
    with pytest.raises(ValueError, match="w_routed_gate_sc must have shape"):
        ops.dispatch_mlp_swiglu_combine_fwd_mxfp8(*bad)


def test_raw_composition_on_a_virtual_ep_group_equals_functional():
    # In a subprocess: a wait that gave up traps and ends the CUDA context.
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        import torch
        from original_composition import (assert_all_equal, raw_backward, raw_forward,
                                          raw_schedule)
        from mok import functional as F
        from mok.testing import make_inputs, rank_inputs, run_layer_step
        from mok.virtual_ep import VirtualEPGroup

        config = F.MoKConfig(schedule_capacity_multiplier=1.0)
        group = VirtualEPGroup(2)
        inputs = make_inputs(1024, 256, 256, 8, 2, shared=True, seed=34, device="cuda")
        spaces = group.workspaces(config, num_local_tokens=512, hidden_size=256, topk=2,
                                  num_local_experts=4)
        shards = [rank_inputs(inputs, rank, 2) for rank in range(2)]
        names = {WEIGHTS!r}

        def raw_step(rank):
            ws, s = spaces[rank], shards[rank]
            weights = [s[n] for n in names]
            sched = raw_schedule(config, ws, s["top_experts"], 4)
            out, fwd = raw_forward(config, ws, sched, s["x"], s["router_weights"], weights)
            return out, raw_backward(config, ws, sched, fwd, s["grad_output"], s["x"],
                                     s["router_weights"], weights)

        want = group.run(lambda rank: run_layer_step(config, spaces[rank], shards[rank], 4))
        group.join()
        got = group.run(raw_step)
        group.join()
        for ws in spaces:
            F.check_errors(ws)
        for (out, _, grads), (raw_out, raw_grads) in zip(want, got):
            assert torch.equal(raw_out, out)
            assert_all_equal(raw_grads, grads)
        print("VIRTUAL EP RAW OPS OK")
        """
    )
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="8")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert "VIRTUAL EP RAW OPS OK" in done.stdout, (done.stdout + done.stderr)[-3000:]
