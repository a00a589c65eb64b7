"""`MoKExperts`' resolved steps (mok/layer_plan.py) on the CPU: the CPU path never resolves one
(it is the reference path, checked on every call), copies of a module start without any, and
the C apply a resolved step calls `MoKFunction` through wires autograd as `Function.apply`."""

from __future__ import annotations

import copy
import pickle

import torch

from mok import functional
from mok.layer_plan import LayerSteps
from mok.nn import MoKExperts, MoKFunction, _step_apply
from mok.testing import make_inputs


def test_cpu_calls_take_the_full_path_and_resolve_no_step():
    module = MoKExperts(4, 128, 128, 2)
    inputs = make_inputs(64, 128, 128, 4, 2, seed=0)
    x, w, top = inputs["x"], inputs["router_weights"], inputs["top_experts"]
    assert module._steps.key(module, x, w, top, module.weights()) is None
    first = module(x, w, top)
    assert torch.equal(module(x, w, top), first)
    assert module._steps._steps == {}


def test_copies_and_pickles_start_without_steps():
    steps = LayerSteps()
    steps._steps[("key",)] = object()
    assert copy.deepcopy(steps)._steps == {}
    assert pickle.loads(pickle.dumps(steps))._steps == {}
    module = MoKExperts(4, 128, 128, 2)
    module._steps._steps[("key",)] = object()
    assert copy.deepcopy(module)._steps._steps == {}


def test_step_apply_gives_function_apply_outputs_and_gradients():
    """`_step_apply` (torch's C apply, as a resolved step calls it) against the Python
    `Function.apply`, here on the full path (no step): the same output and gradients, bitwise,
    for x, the router weights and each weight."""
    torch.manual_seed(0)
    module = MoKExperts(4, 128, 128, 2)
    inputs = make_inputs(64, 128, 128, 4, 2, seed=1)
    ws = module.workspace(64, torch.device("cpu"))
    schedule = functional.build_schedule(ws, module.config, inputs["top_experts"],
                                         num_local_experts=4)  # fmt: skip
    grad = torch.randn(64, 128, dtype=torch.bfloat16)
    results = []
    for apply in (MoKFunction.apply, _step_apply):
        module.zero_grad(set_to_none=True)
        x = inputs["x"].clone().requires_grad_(True)
        w = inputs["router_weights"].clone().requires_grad_(True)
        out = apply(module.config, ws, schedule, None, False, False, None, x, w,
                    *module.weights())  # fmt: skip
        assert type(out.grad_fn).__name__ == "MoKFunctionBackward"
        out.backward(grad)
        results.append((out, x.grad, w.grad, *(p.grad for p in module.parameters())))
    for a, b in zip(*results, strict=True):
        assert a is not None and torch.equal(a, b)


class _Double(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_weights_are_the_modules_attributes():
    """`MoKExperts.weights()` (read from `_parameters` where it can, every step) gives the
    attributes: with and without a shared expert, and for a parametrized weight."""
    for shared in (False, True):
        module = MoKExperts(4, 128, 128, 2, shared_expert=shared)
        names = ("shared_gate_weight", "shared_up_weight", "shared_down_weight", "gate_weight",
                 "up_weight", "down_weight")  # fmt: skip
        assert all(w is getattr(module, n) for w, n in zip(module.weights(), names, strict=True))
    module = MoKExperts(4, 128, 128, 2)
    torch.nn.utils.parametrize.register_parametrization(module, "up_weight", _Double())
    original = module.parametrizations.up_weight.original
    assert torch.equal(module.weights()[4], 2 * original)
