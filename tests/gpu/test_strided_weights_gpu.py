"""Routed gate/up weights as the two halves of one fused [E, 2 I, H] tensor (as Hugging Face and
TorchTitan hold them), read and written in place by the GPU kernels.

Against contiguous separate weights holding the same values, bitwise (torch.equal), with
outputs poisoned before each run: the forward's output and context, every gradient, the
recomputed context, and fp32 main_grad accumulation into fused views of one [E, 2 I, H]
main_grad; on the default path and with ring reuse (macrobatches below the routed rows).
The fused gradients come back as the two halves (views) of one new [E, 2 I, H] tensor.
"""

from __future__ import annotations

import pytest
import torch

from mok import functional as F
from mok.testing import WEIGHT_NAMES, make_inputs, poison_cuda_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")

# (T, H, I, E, k, shared, limit, macrobatch_size): Qwen3-like small shapes (the sm_90a backward
# needs I % 256 == 0); macrobatch 512 < T * k = 2048 routed rows forces ring reuse.
CASES = [
    (512, 512, 256, 8, 4, False, None, None),
    (512, 512, 256, 8, 4, True, 0.5, None),
    (512, 512, 256, 8, 4, False, None, 512),
    (512, 512, 256, 8, 4, True, None, 512),
]


def case_id(c):
    t, h, i, e, k, shared, limit, macro = c
    return (f"T{t}H{h}I{i}E{e}k{k}{'-shared' if shared else ''}{'-clamp' if limit else ''}"
            f"{f'-macro{macro}' if macro else ''}")  # fmt: skip


def fused(inputs: dict) -> dict:
    """The same layer with routed gate and up as the halves of one new [E, 2 I, H] tensor."""
    out = dict(inputs)
    inter = inputs["routed_gate"].shape[1]
    gate_up = torch.cat([inputs["routed_gate"], inputs["routed_up"]], dim=1)
    out["routed_gate"], out["routed_up"] = gate_up[:, :inter], gate_up[:, inter:]
    assert not out["routed_gate"].is_contiguous()
    assert out["routed_up"].data_ptr() == gate_up.data_ptr() + inter * gate_up.shape[2] * 2
    return out


def config_of(macrobatch_size):
    if macrobatch_size is None:
        return F.MoKConfig()
    return F.MoKConfig(minibatch_size=macrobatch_size, macrobatch_size=macrobatch_size)


def run_step(inputs, num_experts, limit, config, main_grads=None):
    """(out, context, recomputed context, 8 backward outputs) of one schedule + forward +
    recompute + backward, with the caching allocator poisoned (NaN) first."""
    t, h = inputs["x"].shape
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h,
                         topk=inputs["top_experts"].shape[1],
                         num_local_experts=num_experts)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]
    poison_cuda_allocator()
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=num_experts)
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights,
                         swiglu_limit=limit)  # fmt: skip
    re_ctx = F.recompute_forward_context(
        config, ws, schedule, inputs["x"], inputs["shared_gate"], inputs["shared_up"],
        inputs["routed_gate"], inputs["routed_up"], swiglu_limit=limit,
    )  # fmt: skip
    grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], *weights, swiglu_limit=limit,
                       main_grads=main_grads)  # fmt: skip
    torch.cuda.synchronize()
    F.check_errors(ws)
    return out, ctx, re_ctx, grads, int(schedule.num_tokens)


def assert_same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype, what
        assert not a.isnan().any(), f"{what}: unwritten (NaN) elements"
        assert torch.equal(a, b), what


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fused_views_are_bitwise_separate_weights(case):
    t, h, i, e, k, shared, limit, macro = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, seed=t + h + k, device=CUDA)
    config = config_of(macro)
    want = run_step(inputs, e, limit, config)
    got = run_step(fused(inputs), e, limit, config)
    assert_same(got[0], want[0], "out")
    assert got[4] == want[4]
    for label, g, w in (("context", got[1], want[1]), ("recomputed context", got[2], want[2])):
        # The routed rows the schedule fills (of macrobatch 0 with ring reuse): the rest of
        # the buffers is never written.
        rows = min(got[4], g.x_routed.shape[0])
        for n, (a, b) in enumerate(zip(g.tensors(), w.tensors(), strict=True)):
            if a is not None and n < 4:
                a, b = a[:rows], b[:rows]
            assert_same(a, b, f"{label} field {n}")
    names = ("d_x", "d_router", "routed_gate", "routed_up", "routed_down", "shared_gate",
             "shared_up", "shared_down")  # fmt: skip
    for name, a, b in zip(names, got[3], want[3], strict=True):
        assert_same(a, b, name)
    d_gate, d_up = got[3][2], got[3][3]
    base = d_gate._base
    assert base is not None and d_up._base is base, "fused gradients must be views of one tensor"
    assert base.shape == (e, 2 * i, h) and base.dtype == torch.bfloat16
    assert d_gate.data_ptr() == base.data_ptr()
    assert d_up.data_ptr() == base.data_ptr() + i * h * 2
    assert torch.equal(base, torch.cat([want[3][2], want[3][3]], dim=1))
    # The contiguous weights' gradients stay two separate contiguous tensors.
    assert want[3][2].is_contiguous() and want[3][3].is_contiguous()
    assert want[3][2].untyped_storage().data_ptr() != want[3][3].untyped_storage().data_ptr()


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=case_id)
def test_fused_main_grads_accumulate_bitwise_in_place(case):
    t, h, i, e, k, shared, limit, macro = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, seed=t + i, device=CUDA)
    config = config_of(macro)
    start = torch.randn(e, 2 * i, h, device=CUDA)
    separate = (start[:, :i].clone(), start[:, i:].clone())
    down = torch.randn(e, h, i, device=CUDA)
    want = run_step(inputs, e, limit, config,
                    main_grads=(*separate, down.clone(), None, None, None))  # fmt: skip
    main = start.clone()
    main_down = down.clone()
    got = run_step(fused(inputs), e, limit, config,
                   main_grads=(main[:, :i], main[:, i:], main_down, None, None, None))  # fmt: skip
    assert torch.equal(main[:, :i], separate[0]) and torch.equal(main[:, i:], separate[1])
    assert torch.equal(main_down, want[3][4])
    assert got[3][2].data_ptr() == main.data_ptr()
    assert got[3][3].data_ptr() == main[:, i:].data_ptr()
    assert_same(got[3][0], want[3][0], "d_x")
    assert_same(got[3][1], want[3][1], "d_router")


def test_fused_weights_in_a_later_step_do_not_reuse_the_contiguous_plan():
    """The same addresses' values as separate contiguous weights, then as fused halves of
    another tensor, then contiguous again: each call's plan is its own (the strides are in the
    keys), and all three give the same bits."""
    t, h, i, e, k = 512, 512, 256, 8, 4
    inputs = make_inputs(t, h, i, e, k, seed=11, device=CUDA)
    config = config_of(None)
    first = run_step(inputs, e, None, config)
    second = run_step(fused(inputs), e, None, config)
    third = run_step(inputs, e, None, config)
    for run in (second, third):
        assert_same(run[0], first[0], "out")
        for a, b in zip(run[3], first[3], strict=True):
            assert_same(a, b, "gradient")


@pytest.mark.parametrize("macro", [None, 512], ids=["default", "ring-reuse"])
@pytest.mark.parametrize("accumulate_main_grad", [False, True], ids=["grad", "main_grad"])
def test_moe_fused_is_bitwise_moe_of_separate_weights(macro, accumulate_main_grad):
    """mok.nn.moe_fused reads gate_up's halves in place and its gradient (or fp32 main_grad)
    is written in place: bitwise moe over separate contiguous copies."""
    from mok.nn import moe, moe_fused

    t, h, i, e, k = 512, 512, 256, 8, 4
    inp = make_inputs(t, h, i, e, k, seed=31, device=CUDA)
    config = config_of(macro)
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=e)  # fmt: skip
    schedule = F.build_schedule(ws, config, inp["top_experts"], num_local_experts=e)
    gate_up = torch.cat((inp["routed_gate"], inp["routed_up"]), 1).requires_grad_()
    gate, up = (inp[n].clone().requires_grad_() for n in ("routed_gate", "routed_up"))
    downs = [inp["routed_down"].clone().requires_grad_() for _ in range(2)]
    if accumulate_main_grad:
        start = torch.randn(e, 2 * i, h, device=CUDA)
        gate_up.main_grad = start.clone()
        main_ptr = gate_up.main_grad.data_ptr()
        gate.main_grad, up.main_grad = (s.clone() for s in start.split(i, 1))
        for d in downs:
            d.main_grad = torch.zeros(e, h, i, device=CUDA)
    xs = [inp["x"].clone().requires_grad_() for _ in range(2)]
    kw = dict(accumulate_main_grad=accumulate_main_grad)
    poison_cuda_allocator()
    got = moe_fused(config, ws, schedule, xs[0], inp["router_weights"], gate_up, downs[0], **kw)
    want = moe(config, ws, schedule, xs[1], inp["router_weights"], None, None, None, gate, up,
               downs[1], **kw)  # fmt: skip
    assert_same(got, want, "out")
    got.backward(inp["grad_output"])
    want.backward(inp["grad_output"])
    torch.cuda.synchronize()
    F.check_errors(ws)
    assert_same(xs[0].grad, xs[1].grad, "d_x")
    if accumulate_main_grad:
        assert gate_up.main_grad.data_ptr() == main_ptr
        assert_same(gate_up.main_grad, torch.cat((gate.main_grad, up.main_grad), 1), "main_grad")
        assert_same(downs[0].main_grad, downs[1].main_grad, "down main_grad")
    else:
        assert_same(gate_up.grad, torch.cat((gate.grad, up.grad), 1), "d_gate_up")
        assert_same(downs[0].grad, downs[1].grad, "d_down")
