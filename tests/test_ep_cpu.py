"""EP semantics on CPU: two gloo processes running mok.functional as an EP group of two.

Each rank holds half of the experts and its own tokens; the results must equal one process
running the whole problem (both ranks' tokens, every expert) as an EP group of one, bitwise:
the schedule orders rows by (expert, source rank, slot) either way, so every GEMM sees the same
rows in the same order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ep_worker import run_on_gloo_group

from mok import functional as F
from mok.testing import make_inputs, rel_error

T, H, I, E, K = 64, 128, 128, 8, 2
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")


def run_layer(inputs, group, num_local_experts, expert_slice):
    config = F.MoKConfig()
    num_tokens = inputs["x"].shape[0]
    ws = F.get_workspace(config, group, device="cpu", num_local_tokens=num_tokens, hidden_size=H,
                         topk=K, num_local_experts=num_local_experts)  # fmt: skip
    weights = [inputs[n] if n.startswith("shared") or inputs[n] is None else inputs[n][expert_slice]
               for n in WEIGHTS]  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"],
                                num_local_experts=num_local_experts)  # fmt: skip
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)
    grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], *weights)  # fmt: skip
    return schedule, out, grads


def split_for_rank(inputs, rank):
    rows = slice(rank * T, (rank + 1) * T)
    return {n: (v[rows] if n in ("x", "router_weights", "top_experts", "grad_output") else v)
            for n, v in inputs.items()}  # fmt: skip


def ep_worker(rank, world_size, routing, shared):
    inputs = make_inputs(world_size * T, H, I, E, K, shared=shared, routing=routing, seed=42)
    local = E // world_size
    schedule, out, grads = run_layer(split_for_rank(inputs, rank), dist.group.WORLD, local,
                                     slice(rank * local, (rank + 1) * local))  # fmt: skip
    return {"num_tokens": int(schedule.num_tokens), "out": out, "grads": grads}


@pytest.mark.parametrize("routing,shared", [("random", True), ("empty_experts", False)])
def test_ep2_equals_ep1_bitwise(routing, shared):
    results = run_on_gloo_group(ep_worker, 2, routing, shared)
    inputs = make_inputs(2 * T, H, I, E, K, shared=shared, routing=routing, seed=42)
    _, out, grads = run_layer(inputs, None, E, slice(0, E))
    if routing == "empty_experts":  # experts 4..7 (all of rank 1) receive no token
        assert results[1]["num_tokens"] == 0
    for rank, res in enumerate(results):
        rows, experts = slice(rank * T, (rank + 1) * T), slice(rank * 4, rank * 4 + 4)
        assert torch.equal(res["out"], out[rows])
        d_x, d_router, d_gate, d_up, d_down = res["grads"][:5]
        assert torch.equal(d_x, grads[0][rows])
        assert torch.equal(d_router, grads[1][rows])
        for got, want in zip((d_gate, d_up, d_down), grads[2:5], strict=True):
            assert torch.equal(got, want[experts])
    if shared:
        # Each rank's shared-expert gradients cover its own tokens: they add up to EP=1's, up
        # to the rounding of two bf16 partial sums (a few bf16 ulps, 2^-8 relative each).
        for j in range(5, 8):
            total = results[0]["grads"][j].float() + results[1]["grads"][j].float()
            assert rel_error(total, grads[j]) < 2**-7
