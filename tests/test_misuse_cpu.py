"""Misuse a new user runs into, caught with errors that say what happened (CPU path; the checks
are host-side and the same on the GPU path)."""

from __future__ import annotations

import inspect

import pytest
import torch

import mok.ops
from mok import functional as F
from mok.nn import MoKExperts
from mok.testing import make_inputs

T, H, I, E, K = 32, 128, 128, 4, 2


@pytest.fixture
def layer():
    inp = make_inputs(T, H, I, E, K)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    return config, ws, inp


def _forward(config, ws, schedule, inp):
    return F.forward(config, ws, schedule, inp["x"], inp["router_weights"], None, None, None,
                     inp["routed_gate"], inp["routed_up"], inp["routed_down"])  # fmt: skip


def test_schedule_refused_after_its_routing_changed_in_place(layer):
    config, ws, inp = layer
    top_experts = inp["top_experts"].clone()
    schedule = F.build_schedule(ws, config, top_experts, num_local_experts=E)
    _forward(config, ws, schedule, inp)  # its own routing: fine
    top_experts.copy_(top_experts.flip(0))  # next step's routing written into the same tensor
    with pytest.raises(ValueError, match=r"the top_experts tensor it was built from has changed "
                       r"in place since build_schedule.*call build_schedule again"):  # fmt: skip
        _forward(config, ws, schedule, inp)
    # Built again from the new routing, it runs.
    _forward(config, ws, F.build_schedule(ws, config, top_experts, num_local_experts=E), inp)


def test_schedule_refused_with_another_workspace(layer):
    config, ws, inp = layer
    schedule = F.build_schedule(ws, config, inp["top_experts"], num_local_experts=E)
    other = F.get_workspace(config, None, device="cpu", num_local_tokens=2 * T, hidden_size=H,
                            topk=K, num_local_experts=E)  # fmt: skip
    x2 = torch.cat([inp["x"]] * 2)
    w2 = torch.cat([inp["router_weights"]] * 2)
    with pytest.raises(ValueError, match=rf"another workspace \(handle \d+, {T} tokens\), not "
                       rf"for this one \(handle \d+, {2 * T} tokens\)"):  # fmt: skip
        F.forward(config, other, schedule, x2, w2, None, None, None, inp["routed_gate"],
                  inp["routed_up"], inp["routed_down"])  # fmt: skip


def test_a_workspace_of_another_type_is_a_type_error_on_every_pass(layer):
    # The schedule's origin check must not read the workspace before its type is checked
    # (the original raises TypeError here, and so must mok, not AttributeError).
    config, ws, inp = layer
    schedule = F.build_schedule(ws, config, inp["top_experts"], num_local_experts=E)
    out, ctx = _forward(config, ws, schedule, inp)
    weights = (None, None, None, inp["routed_gate"], inp["routed_up"], inp["routed_down"])
    calls = (
        lambda w: _forward(config, w, schedule, inp),
        lambda w: F.backward(config, w, schedule, ctx, torch.randn_like(out), inp["x"],
                             inp["router_weights"], *weights),
        lambda w: F.recompute_forward_context(config, w, schedule, inp["x"], None, None,
                                              inp["routed_gate"], inp["routed_up"]),
    )  # fmt: skip
    for call in calls:
        with pytest.raises(TypeError, match="workspace must be a MoKWorkspace, got object"):
            call(object())


def test_module_refuses_topk_above_num_experts():
    with pytest.raises(ValueError, match=r"topk must be <= num_experts \(8\).*got topk=10"):
        MoKExperts(num_experts=8, hidden_size=128, intermediate_size=128, topk=10)


def test_duplicate_ids_count_once_per_occurrence(layer):
    """A token naming one expert twice gets that expert's output once per (t, j), each with its
    own weight: the same as the two weights summed on one occurrence (SEMANTICS, routing)."""
    config, ws, inp = layer
    top_experts = inp["top_experts"].clone()
    top_experts[:, 1] = top_experts[:, 0]  # every token names its first expert twice
    schedule = F.build_schedule(ws, config, top_experts, num_local_experts=E)
    out, _ = _forward(config, ws, schedule, inp)
    w = inp["router_weights"].double()
    x = inp["x"].double()
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        e = int(top_experts[t, 0])
        gate = x[t] @ inp["routed_gate"][e].double().T
        up = x[t] @ inp["routed_up"][e].double().T
        y = (torch.nn.functional.silu(gate) * up) @ inp["routed_down"][e].double().T
        want[t] = (w[t, 0] + w[t, 1]) * y
    err = (out.double() - want).norm() / want.norm()
    assert err < 2e-2, err


def test_mxfp8_quantize_documents_itself():
    op = mok.ops.mxfp8_quantize
    assert "Quantise a bf16 matrix" in op.__doc__
    params = inspect.signature(op).parameters
    assert list(params) == ["x_bf16", "return_normal", "return_transposed"]
    assert params["return_normal"].default is True
    assert params["return_transposed"].default is False
    x = torch.randn(128, 256).to(torch.bfloat16)
    normal = op(x)
    transposed = op(x, return_normal=False, return_transposed=True)
    assert normal[2] is None and transposed[0] is None
    assert torch.equal(normal[0].view(torch.uint8), op(x, True, False)[0].view(torch.uint8))
    assert transposed[2].shape == (256, 128)
    # every custom op shows its own docstring, not torch's
    assert "CustomOpDef" not in mok.ops.fwd_epilogue.__doc__
