"""The MXFP8 layer oracle (mok.reference.mxfp8_forward / mxfp8_backward) on CPU: within the
original's MXFP8 tolerance of the BF16 layer, and exactly the BF16 layer's GEMMs where every
operand is already MXFP8-representable."""

from __future__ import annotations

import pytest
import torch

from mok import reference as R
from mok.testing import context_values, make_inputs

T, H, I, E, K = 256, 256, 256, 4, 2
ROUTED = ("routed_gate", "routed_up", "routed_down")
SHARED = ("shared_gate", "shared_up", "shared_down")


def _weights(inputs):
    """(forward tuples, backward tuples) of the routed weights, quantised once."""
    fwd = [R.mxfp8_quantize(inputs[n]) for n in ROUTED]
    bwd = [
        (*R.mxfp8_quantize(inputs[n]), *R.mxfp8_quantize(inputs[n], transpose=True))
        for n in ROUTED[:2]
    ] + [R.mxfp8_quantize(inputs["routed_down"], transpose=True)]
    return fwd, bwd


def _layer(inputs, schedule, limit, mxfp8: bool):
    shared = [inputs[n] for n in SHARED]
    x, w = inputs["x"], inputs["router_weights"]
    if not mxfp8:
        routed = [inputs[n] for n in ROUTED]
        out, ctx = R.forward(schedule, x, w, *shared, *routed, swiglu_limit=limit)
        grads = R.backward(schedule, ctx, inputs["grad_output"], x, w, *shared, *routed,
                           swiglu_limit=limit)  # fmt: skip
        return out, ctx, grads
    fwd, bwd = _weights(inputs)
    out, ctx = R.mxfp8_forward(schedule, x, w, *shared, *fwd, swiglu_limit=limit)
    grads = R.mxfp8_backward(schedule, ctx, inputs["grad_output"], x, w, *shared, *bwd,
                             swiglu_limit=limit)  # fmt: skip
    return out, ctx, grads


def _functional_setup(seed):
    """(inputs, config, workspace, schedule, shared weights, (forward, backward) MXFP8 tuples)."""
    from mok import functional as F

    inputs = make_inputs(T, H, I, E, K, shared=True, seed=seed)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=E)
    return inputs, config, ws, schedule, [inputs[n] for n in SHARED], _weights(inputs)


def _schedule(inputs):
    return R.make_schedule(inputs["top_experts"], num_local_experts=E, capacity=T * K + E * 128)


# Limit 3 clamps ~0.3% of gate/up elements here. At 2 (4.5% clamped) the quantised gate flips
# enough clamp masks that dW_gate's cosine falls to ~0.987 (docs/NOTES.md, section 12).
@pytest.mark.parametrize("shared,limit", [(False, None), (True, 3.0)])
def test_mxfp8_layer_is_within_the_original_tolerance_of_bf16(shared, limit):
    inputs = make_inputs(T, H, I, E, K, shared=shared, seed=21)
    schedule = _schedule(inputs)
    out_q, _, grads_q = _layer(inputs, schedule, limit, mxfp8=True)
    out_b, _, grads_b = _layer(inputs, schedule, limit, mxfp8=False)
    diff = (out_q.float() - out_b.float()).abs()
    assert diff.max() <= 1.0
    assert diff.sum() / out_b.float().abs().sum() <= 0.1
    for index, (got, want) in enumerate(zip(grads_q, grads_b, strict=True)):
        if want is None:
            assert got is None
            continue
        cosine = torch.nn.functional.cosine_similarity(
            got.double().flatten(), want.double().flatten(), dim=0
        )
        assert cosine >= 0.996, (index, float(cosine))
    assert not torch.equal(out_q, out_b)  # the quantisation is really applied


def test_mxfp8_gemms_equal_bf16_ones_on_mxfp8_exact_operands():
    inputs = make_inputs(T, H, I, E, K, seed=22)
    for name in ("x", *ROUTED):  # values MXFP8 represents exactly: quantising is the identity
        inputs[name] = R.mxfp8_round_trip(inputs[name])
    assert torch.equal(R.mxfp8_round_trip(inputs["x"]), inputs["x"])
    schedule = _schedule(inputs)
    _, ctx_q, _ = _layer(inputs, schedule, None, mxfp8=True)
    _, ctx_b, _ = _layer(inputs, schedule, None, mxfp8=False)
    rows = int(schedule.num_tokens)
    assert torch.equal(ctx_q.gate_routed[:rows], ctx_b.gate_routed[:rows])
    assert torch.equal(ctx_q.up_routed[:rows], ctx_b.up_routed[:rows])
    assert torch.equal(ctx_q.hidden_routed[:rows], ctx_b.hidden_routed[:rows])


def test_functional_runs_the_mxfp8_layer_on_cpu():
    from mok import functional as F
    from mok.errors import MoKInputError

    inputs, config, ws, schedule, shared, (fwd, bwd) = _functional_setup(23)
    x, w, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    out, ctx = F.forward(config, ws, schedule, x, w, *shared, *fwd, swiglu_limit=3.0)
    grads = F.backward(config, ws, schedule, ctx, dy, x, w, *shared, *bwd, swiglu_limit=3.0)
    r_schedule = _schedule(inputs)
    want_out, want_ctx = R.mxfp8_forward(r_schedule, x, w, *shared, *fwd, swiglu_limit=3.0)
    want = R.mxfp8_backward(r_schedule, want_ctx, dy, x, w, *shared, *bwd, swiglu_limit=3.0)
    assert torch.equal(out, want_out)
    assert torch.equal(grads[0], want[0]) and torch.equal(grads[1], want[1])
    for got, ref in zip(grads[2:], want[2:], strict=True):
        assert torch.equal(got, ref.to(torch.bfloat16))
    # A wrong tuple is a clear error naming the weight.
    bad = (fwd[0][0], fwd[0][1][:1])
    with pytest.raises(ValueError, match="routed_gate_weights scales must have shape"):
        F.forward(config, ws, schedule, x, w, *shared, bad, *fwd[1:])
    with pytest.raises(ValueError, match=r"must be an MXFP8 tuple of 4 tensors"):
        F.backward(config, ws, schedule, ctx, dy, x, w, *shared, *fwd)
    with pytest.raises(MoKInputError, match="all MXFP8 tuples or all bf16 tensors"):
        F.forward(config, ws, schedule, x, w, *shared, fwd[0], inputs["routed_up"], fwd[2])


def test_mxfp8_forward_compiles_fullgraph():
    from mok import functional as F

    inputs = make_inputs(T, H, I, E, K, seed=24)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    fwd, _ = _weights(inputs)

    def step(x, w, ids):
        schedule = F.build_schedule(ws, config, ids, num_local_experts=E)
        return F.forward(config, ws, schedule, x, w, None, None, None, *fwd)[0]

    args = (inputs["x"], inputs["router_weights"], inputs["top_experts"])
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.equal(compiled(*args), step(*args))


def test_mxfp8_recompute_rebuilds_the_forward_context_bitwise():
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=25)
    schedule = _schedule(inputs)
    shared = [inputs[n] for n in SHARED]
    fwd, _ = _weights(inputs)
    _, ctx = R.mxfp8_forward(schedule, inputs["x"], inputs["router_weights"], *shared, *fwd,
                             swiglu_limit=3.0)  # fmt: skip
    again = R.mxfp8_recompute_forward_context(schedule, inputs["x"], *shared[:2], *fwd[:2],
                                              topk=K, swiglu_limit=3.0)  # fmt: skip
    for a, b in zip(again.tensors(), ctx.tensors(), strict=True):
        assert torch.equal(a, b)


def test_functional_mxfp8_recompute_equals_the_forward_context():
    from mok import functional as F

    inputs, config, ws, schedule, shared, (fwd, _) = _functional_setup(26)
    _, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *shared, *fwd)
    again = F.recompute_forward_context(config, ws, schedule, inputs["x"], *shared[:2], *fwd[:2])
    rows = int(schedule.num_tokens)  # rows past num_tokens are not part of the contract
    for a, b in zip(context_values(again, rows), context_values(ctx, rows), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
