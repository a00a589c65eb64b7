"""`MoKExperts`' resolved steps (mok/layer_plan.py) on the CPU: the CPU path never resolves one
(it is the reference path, checked on every call), and copies of a module start without any."""

from __future__ import annotations

import copy
import pickle

import torch

from mok.layer_plan import LayerSteps
from mok.nn import MoKExperts
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
