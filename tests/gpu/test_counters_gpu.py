"""The launch counters zero themselves (mok/dsl_kernels/common/retire.py, the schedule count pass):
after every launch of a forward + backward step each plan's counters read zero, with no memset
between launches; and a plan first launched inside a CUDA graph capture (its zeroing captured,
never run) gives the same bits eagerly before any replay, and then replayed."""

from __future__ import annotations

import pytest
import torch
from bitwise import assert_bitwise

from mok import functional as F
from mok.launchers.plans import Counters, plans_of_thread
from mok.testing import make_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
T, H, I, E, K = 512, 256, 256, 8, 2


def _counters_in(obj, depth: int = 2) -> list[Counters]:
    """The Counters a plan holds, itself or in the plans it holds (attributes, `depth` deep)."""
    if isinstance(obj, Counters):
        return [obj]
    if depth == 0 or not hasattr(obj, "__dict__"):
        return []
    return [c for value in vars(obj).values() for c in _counters_in(value, depth - 1)]


def _step(inputs, config, ws):
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=E)
    weights = [inputs[n] for n in ("shared_gate", "shared_up", "shared_down", "routed_gate",
                                   "routed_up", "routed_down")]  # fmt: skip
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)
    grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], *weights)  # fmt: skip
    return (out, *grads)


def _setup(seed: int):
    inputs = make_inputs(T, H, I, E, K, shared=False, seed=seed, device=CUDA)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    return inputs, config, ws


def test_every_launch_leaves_its_counters_zero():
    inputs, config, ws = _setup(1)
    first = _step(inputs, config, ws)
    for _ in range(3):
        torch.cuda.synchronize()
        counters = [c for p in plans_of_thread().values() for c in _counters_in(p)]
        # The schedule's arrival word, the forward's and the backward's megakernel counters.
        assert len(counters) >= 3
        for c in counters:
            assert c.tensor.count_nonzero().item() == 0, c.tensor
        assert_bitwise(_step(inputs, config, ws), first, "again")


def test_a_plan_first_launched_in_a_capture_runs_eagerly_then_replays():
    inputs, config, ws = _setup(2)
    eager = _step(inputs, config, ws)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()  # no plan for it yet: the capture makes them
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = _step(inputs, config, ws)
    with torch.cuda.stream(stream):  # the captured plans, eagerly, before any replay
        before_replay = _step(inputs, config, ws)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert_bitwise(before_replay, eager, "eager on the capture's plans")
    for c in captured:
        if c is not None and c.is_floating_point():
            c.fill_(float("nan"))
    for replay in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(captured, eager, f"replay {replay}")
