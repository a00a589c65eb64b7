"""mok.reference against an independent oracle: an fp64 per-expert loop differentiated by autograd.

Every float result must be within 2x the error PyTorch itself makes computing the same layer in
bf16 (DESIGN §5). Shapes are small (H, I = 128/256, T <= 256) so the file runs in seconds on
CI's 2 cores; the math does not depend on size.
"""

from __future__ import annotations

import pytest
import torch

from mok import reference as R
from mok.config import ROUTED_ROW_ALIGNMENT
from mok.testing import WEIGHT_NAMES, make_inputs, within_bf16_bound

GRAD_NAMES = ("x", "router_weights", "routed_gate", "routed_up", "routed_down",
              "shared_gate", "shared_up", "shared_down")  # fmt: skip


def run_reference(inputs, num_experts, swiglu_limit=None):
    topk = inputs["top_experts"].shape[1]
    capacity = 2 * inputs["x"].shape[0] * topk + num_experts * ROUTED_ROW_ALIGNMENT
    schedule = R.make_schedule(inputs["top_experts"], num_local_experts=num_experts,
                               capacity=capacity)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]
    out, ctx = R.forward(schedule, inputs["x"], inputs["router_weights"], *weights,
                         swiglu_limit=swiglu_limit)  # fmt: skip
    grads = R.backward(schedule, ctx, inputs["grad_output"], inputs["x"], inputs["router_weights"],
                       *weights, swiglu_limit=swiglu_limit)  # fmt: skip
    return schedule, out, ctx, grads


CASES = [
    # (T, H, I, E, k, shared, limit, routing)
    (128, 128, 128, 4, 1, False, None, "random"),
    (96, 128, 256, 6, 3, True, None, "random"),
    (64, 256, 128, 8, 8, True, None, "first_experts"),  # k = E: every expert gets every token
    (128, 128, 128, 8, 2, False, 0.5, "random"),  # clamp active on many elements
    (128, 128, 128, 8, 2, True, None, "one_expert"),
    (128, 128, 128, 8, 2, False, None, "empty_experts"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}E{c[3]}k{c[4]}-{c[7]}"
                         f"{'-shared' if c[5] else ''}{'-clamp' if c[6] else ''}")  # fmt: skip
def test_reference_matches_naive_autograd(case):
    t, h, i, e, k, shared, limit, routing = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, routing=routing, seed=hash(case) % 1000)
    _, out, _, grads = run_reference(inputs, e, limit)
    truth_out, truth = R.naive_moe_with_grads(inputs, inputs["grad_output"], swiglu_limit=limit)
    bf16_out, bf16 = R.naive_moe_with_grads(inputs, inputs["grad_output"], swiglu_limit=limit,
                                            dtype=torch.bfloat16)  # fmt: skip
    ok, err, base = within_bf16_bound(out, truth_out, bf16_out)
    assert ok, f"out: error {err:.3e} > 2x bf16 torch {base:.3e}"
    for name, got in zip(GRAD_NAMES, grads, strict=True):
        if got is None:
            assert not shared and name.startswith("shared")
            continue
        ok, err, base = within_bf16_bound(got, truth[name], bf16[name])
        assert ok, f"d_{name}: error {err:.3e} > 2x bf16 torch {base:.3e}"


def test_clamp_changes_result_and_masks_gradient():
    inputs = make_inputs(64, 128, 128, 4, 2, seed=3)
    _, out_free, _, grads_free = run_reference(inputs, 4, None)
    _, out_clamped, ctx, grads_clamped = run_reference(inputs, 4, 0.25)
    assert not torch.equal(out_free, out_clamped)
    # Where the gate clamp is active the gate gradient is exactly 0 for that element.
    active = ctx.gate_routed.float() > 0.25
    assert active.any()
    d_hidden = torch.randn(ctx.gate_routed.shape)
    d_gate, d_up = R.swiglu_backward(d_hidden, ctx.gate_routed, ctx.up_routed, 0.25)
    assert (d_gate[active] == 0).all()
    assert (d_up[ctx.up_routed.float().abs() > 0.25] == 0).all()


def test_empty_experts_get_exact_zero_weight_gradients():
    inputs = make_inputs(128, 128, 128, 8, 2, routing="empty_experts", seed=5)
    schedule, _, _, grads = run_reference(inputs, 8)
    empty = schedule.tokens_per_expert == 0
    assert empty.sum() == 4
    for grad in grads[2:5]:
        assert torch.count_nonzero(grad[empty]) == 0
        assert torch.count_nonzero(grad[~empty]) > 0


def test_recompute_equals_saved_context_bitwise():
    inputs = make_inputs(96, 128, 256, 6, 3, shared=True, seed=11)
    schedule, _, ctx, _ = run_reference(inputs, 6, 0.75)
    again = R.recompute_forward_context(
        schedule, inputs["x"], inputs["shared_gate"], inputs["shared_up"], inputs["routed_gate"],
        inputs["routed_up"], topk=3, swiglu_limit=0.75,
    )  # fmt: skip
    for a, b in zip(ctx.tensors(), again.tensors(), strict=True):
        assert torch.equal(a, b)


def test_padding_rows_are_zero_in_context():
    inputs = make_inputs(100, 128, 128, 4, 2, seed=2)
    schedule, _, ctx, _ = run_reference(inputs, 4)
    pad = schedule.peer_rank < 0
    assert pad.any()
    for t in ctx.tensors()[:4]:
        assert torch.count_nonzero(t[pad]) == 0


def test_epilogues_fixed_order_sums():
    gen = torch.Generator().manual_seed(0)
    t, k, h = 16, 4, 64
    slots = torch.randn(t * k, h, generator=gen).to(torch.bfloat16)
    w = torch.rand(t, k, generator=gen)
    shared = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    acc = shared.float()
    for j in range(k):
        acc = acc + w[:, j : j + 1] * slots.view(t, k, h)[:, j].float()
    assert torch.equal(R.fwd_epilogue(shared, slots, w), acc.to(torch.bfloat16))
    expected = slots.view(t, k, h).float().sum(1)  # same order: sum over j is left to right
    got = R.bwd_epilogue(None, slots, k)
    assert (got.float() - expected).abs().max() <= expected.abs().max() * 2**-7
