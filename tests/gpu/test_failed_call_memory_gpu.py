"""A call that fails leaves none of mok's device memory behind (one GPU).

A layer's forward and backward, BF16 and MXFP8, first run once so that the workspace and every
launch plan exist; then the device memory PyTorch holds is the baseline. Each failure below is
followed by `gc.collect()` and must bring `torch.cuda.memory_allocated()` back to that baseline
(plus the few bytes of counters a new plan owns):

- a bad argument refused by the checks (a wrong dtype);
- an allocation that fails after the call's plan was made and cached (an out-of-memory error
  injected where the call allocates its outputs), for new weight tensors, so a new plan: an
  MXFP8 plan dequantises the weights to bind itself, and a plan that kept them would hold
  3 * E * I * H bf16 values for as long as it stays cached.
"""

from __future__ import annotations

import gc

import pytest
import torch

import mok.functional as F
from mok import ops
from mok.launchers import forward_megakernel, plans
from mok.testing import make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
T, H, I, E, K = 1024, 1024, 512, 16, 4
ROUTED = ("routed_gate", "routed_up", "routed_down")
PLAN_BYTES = 1 << 20  # a new plan's own counters and schedule scratch


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _weights(inputs, mxfp8: bool):
    """(forward weights, backward weights) of the routed experts."""
    if not mxfp8:
        routed = [inputs[n].clone() for n in ROUTED]
        return routed, routed
    gate, up, down = (ops.mxfp8_quantize(inputs[n], True, True) for n in ROUTED)
    return [gate[:2], up[:2], down[:2]], [tuple(gate), tuple(up), down[2:]]


def _step(config, ws, inputs, fwd, bwd):
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=E)
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"],
                         None, None, None, *fwd)  # fmt: skip
    grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], None, None, None, *bwd)  # fmt: skip
    torch.cuda.synchronize()
    F.check_errors(ws)
    return out, grads


@pytest.mark.parametrize("mxfp8", [False, True], ids=["bf16", "mxfp8"])
def test_a_failed_call_leaves_no_device_memory_behind(monkeypatch, mxfp8):
    inputs = make_inputs(T, H, I, E, K, seed=3, device=CUDA)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    fwd, bwd = _weights(inputs, mxfp8)
    _step(config, ws, inputs, fwd, bwd)
    fresh_fwd, fresh_bwd = _weights(inputs, mxfp8)  # new addresses: new plans
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=E)
    fp64_weights = inputs["router_weights"].double()
    base = _allocated()

    # Refused by the checks: nothing allocated stays.
    with pytest.raises((TypeError, ValueError), match="router_weights"):
        F.forward(config, ws, schedule, inputs["x"], fp64_weights, None, None, None, *fresh_fwd)
    assert _allocated() <= base, "a refused call left device memory behind"

    # Out of memory once the forward's plan is made: the plan stays cached, holding only its
    # counters.
    outputs = forward_megakernel._ForwardPlan._outputs
    calls = []

    def out_of_memory_on_the_call(self):
        calls.append(None)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected: the call's context")
        return outputs(self)

    monkeypatch.setattr(forward_megakernel._ForwardPlan, "_outputs", out_of_memory_on_the_call)
    try:
        F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], None, None, None,
                  *fresh_fwd)  # fmt: skip
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("the injected failure did not happen")
    monkeypatch.undo()
    assert len(calls) == 2
    held = _allocated() - base
    assert held <= PLAN_BYTES, f"a failed forward left {held} bytes behind"

    # The same weights then run, and give the bits of the first weights' step.
    want_out, want_grads = _step(config, ws, inputs, fwd, bwd)
    got_out, got_grads = _step(config, ws, inputs, fresh_fwd, fresh_bwd)
    assert torch.equal(got_out, want_out)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    del got_out, got_grads, want_out, want_grads
    plans.clear_plans()
