"""The GPU backward (EP group of one) through mok.functional: the backward megakernel for the
routed experts, the separate backward GEMMs for the shared expert.

All 8 outputs (and the forward's) against the fp64 autograd oracle within 2x the error of
PyTorch's own bf16 layer; bitwise identical across 3 runs with outputs poisoned before each;
exact zeros for experts with no tokens; fp32 main_grad accumulation equal to the returned
gradients; the clamp on and off; adversarial routing; a whole training step in a CUDA graph.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from graph_replay import check_replays
from separate_kernels import megakernel_and_kernels_backward

from mok import functional as F
from mok.testing import make_inputs, oracle_errors, poison_cuda_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")

CASES = [
    # (T, H, I, E, k, shared, limit, routing); the sm_90a backward needs I % 256 == 0
    (512, 256, 256, 8, 2, True, None, "random"),
    (512, 256, 256, 8, 2, False, 0.5, "random"),
    (300, 256, 256, 4, 1, False, None, "random"),  # k = 1, T not a multiple of 128
    (256, 256, 256, 8, 2, True, None, "one_expert"),
    (256, 256, 256, 8, 2, False, None, "empty_experts"),
    (64, 512, 256, 4, 4, True, 1.0, "first_experts"),  # k = E, clamp
    (2048, 2048, 768, 32, 8, False, None, "random"),  # Qwen3-30B-A3B widths, fewer experts
]


def setup(inputs, num_experts):
    t, h = inputs["x"].shape
    k = inputs["top_experts"].shape[1]
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=num_experts)  # fmt: skip
    return config, ws


def run_step(inputs, num_experts, limit, main_grads=None):
    """(out, *8 backward outputs) of one schedule + forward + backward, outputs poisoned."""
    config, ws = setup(inputs, num_experts)
    weights = [inputs[n] for n in WEIGHTS]
    poison_cuda_allocator()
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=num_experts)
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights,
                         swiglu_limit=limit)  # fmt: skip
    grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], *weights, swiglu_limit=limit,
                       main_grads=main_grads)  # fmt: skip
    torch.cuda.synchronize()
    F.check_errors(ws)
    return (out, *grads)


def case_id(c):
    return (f"T{c[0]}H{c[1]}I{c[2]}E{c[3]}k{c[4]}-{c[7]}{'-shared' if c[5] else ''}"
            f"{'-clamp' if c[6] else ''}")  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_backward_matches_fp64_oracle_and_is_deterministic(case):
    t, h, i, e, k, shared, limit, routing = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, routing=routing, seed=t + i + k,
                         device=CUDA)  # fmt: skip
    results = run_step(inputs, e, limit)
    failures = [
        f"{name}: error {err:.3e} > 2x PyTorch bf16 error {base:.3e}"
        for name, ok, err, base in oracle_errors(results, inputs, swiglu_limit=limit)
        if not ok
    ]
    assert not failures, "; ".join(failures)
    if routing == "empty_experts":
        for d_w in results[3:6]:  # experts E/2.. never chosen: exact zeros
            assert torch.count_nonzero(d_w[e // 2 :]) == 0
    for _ in range(2):
        again = run_step(inputs, e, limit)
        for name, a, b in zip(("out", "d_x", "d_rw", "dg", "du", "dd", "dsg", "dsu", "dsd"),
                              again, results, strict=True):  # fmt: skip
            assert (a is None and b is None) or torch.equal(a, b), f"{name} differs between runs"


@pytest.mark.parametrize("case", CASES[:2] + CASES[5:], ids=case_id)
def test_megakernel_gives_the_separate_kernels_bits(case):
    """Same tiles, same K order, same epilogue math: the backward megakernel's routed outputs
    equal the standalone GEMM kernels composed with torch gathers, bit for bit."""
    t, h, i, e, k, shared, limit, routing = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, routing=routing, seed=t + i + k,
                         device=CUDA)  # fmt: skip
    got, expected = megakernel_and_kernels_backward(inputs, e, limit)
    for name, a, b in zip(("dy_e", "d_gate", "d_up", "partials", "slots", "dg", "du", "dd"),
                          got, expected, strict=True):  # fmt: skip
        assert torch.equal(a, b), f"{name} differs"


@pytest.mark.parametrize("case", CASES[:3] + CASES[5:], ids=case_id)
def test_backward_finish_gives_the_push_and_epilogue_bits(case):
    """A group of one's backward_finish (push + d_x epilogue in one launch) against the two
    kernels on the same routed backward: d_router and d_x bitwise, outputs poisoned; a bad
    router weight is reported by both."""
    from mok.launchers.backward_finish import finish_plan  # noqa: PLC0415
    from mok.launchers.backward_megakernel import push_router_grads, routed_backward
    from mok.launchers.epilogues import bwd_epilogue
    from mok.launchers.plans import schedule_addresses

    t, h, i, e, k, shared, limit, routing = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, routing=routing, seed=t + i + k,
                         device=CUDA)  # fmt: skip
    config, ws = setup(inputs, e)
    weights = [inputs[n] for n in WEIGHTS]
    x, w, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
    _, ctx = F.forward(config, ws, schedule, x, w, *weights, swiglu_limit=limit)
    _, _, _, partials, slots, _ = routed_backward(
        dy, w, schedule, ctx.x_routed, ctx.gate_routed, ctx.up_routed, ctx.hidden_routed,
        *weights[3:], swiglu_limit=limit,
    )  # fmt: skip
    d_x_shared = torch.randn(t, h, device=CUDA).to(torch.bfloat16) if shared else None
    for bad in (False, True):
        weights_in = w.clone()
        if bad:
            weights_in[t // 2, 0] = -1.0
        poison_cuda_allocator()
        want_router = torch.full_like(w, float("nan"))
        push_router_grads(partials, schedule, weights_in, want_router)
        want_d_x = bwd_epilogue(d_x_shared, slots, k)
        torch.cuda.synchronize()
        with pytest.raises(ValueError) if bad else contextlib.nullcontext():
            F.check_errors(ws)
        got_router = torch.full_like(w, float("nan"))
        plan = finish_plan(d_x_shared, slots, k, partials, schedule, weights_in, got_router)
        got_d_x = plan(d_x_shared, slots, partials.data_ptr(), schedule_addresses(schedule),
                       weights_in, got_router)  # fmt: skip
        torch.cuda.synchronize()
        with pytest.raises(ValueError) if bad else contextlib.nullcontext():
            F.check_errors(ws)
        assert torch.equal(got_d_x, want_d_x)
        assert torch.equal(got_router.nan_to_num(7.0), want_router.nan_to_num(7.0))


@pytest.mark.parametrize("t,h,i,e,k", [(300, 256, 256, 4, 1), (260, 2304, 256, 4, 3),
                                       (2048, 2048, 768, 32, 8)])  # fmt: skip
def test_in_kernel_finish_gives_the_push_and_epilogue_bits(t, h, i, e, k):
    """A group of one without a shared expert runs the d_x sum and the router-weight push as
    the backward megakernel's last phase (phases/combine_phase.py): d_x and d_router must be the
    separate kernels' on the same routed backward, bit for bit (H = 2304: a partial column
    block; T % 4 != 0: a partial token block); a bad router weight is reported."""
    from mok.launchers.backward_megakernel import push_router_grads, routed_backward
    from mok.launchers.epilogues import bwd_epilogue

    inputs = make_inputs(t, h, i, e, k, seed=t + h + 1, device=CUDA)
    config, ws = setup(inputs, e)
    weights = [inputs[n] for n in WEIGHTS]
    x, w, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
    _, ctx = F.forward(config, ws, schedule, x, w, *weights)
    poison_cuda_allocator()
    d_x, d_router, *_ = F.backward(config, ws, schedule, ctx, dy, x, w, *weights)
    _, _, _, partials, slots, _ = routed_backward(
        dy, w, schedule, ctx.x_routed, ctx.gate_routed, ctx.up_routed, ctx.hidden_routed,
        *weights[3:],
    )  # fmt: skip
    want_router = torch.full_like(w, float("nan"))
    push_router_grads(partials, schedule, w, want_router)
    want_d_x = bwd_epilogue(None, slots, k)
    torch.cuda.synchronize()
    F.check_errors(ws)
    assert torch.equal(d_x, want_d_x)
    assert torch.equal(d_router, want_router)
    bad = w.clone()
    bad[t // 2, 0] = float("inf")
    with pytest.raises(ValueError, match="router_weights must be finite and > 0"):
        F.backward(config, ws, schedule, ctx, dy, x, bad, *weights)
        torch.cuda.synchronize()
        F.check_errors(ws)


def test_main_grads_accumulate_the_returned_gradients():
    t, h, i, e, k = 512, 256, 256, 8, 2
    inputs = make_inputs(t, h, i, e, k, shared=True, seed=11, device=CUDA)
    returned = run_step(inputs, e, None)[3:]
    main_grads = tuple(torch.zeros(inputs[n].shape, dtype=torch.float32, device=CUDA)
                       for n in ("routed_gate", "routed_up", "routed_down", "shared_gate",
                                 "shared_up", "shared_down"))  # fmt: skip
    for _ in range(2):
        accumulated = run_step(inputs, e, None, main_grads=main_grads)[3:]
    for got, main_grad, grad in zip(accumulated, main_grads, returned, strict=True):
        assert got is main_grad
        # 0 + g + g = 2g exactly in fp32, and bf16(2g) == 2 bf16(g).
        assert torch.equal(main_grad.to(torch.bfloat16), grad * 2)


def test_bad_intermediate_size_names_the_alignment():
    t, h, i, e, k = 256, 256, 128, 4, 2
    inputs = make_inputs(t, h, i, e, k, seed=3, device=CUDA)
    with pytest.raises(
        ValueError, match=r"intermediate_size must be a multiple of 256 .*, got 128"
    ):
        run_step(inputs, e, None)


def test_training_step_in_a_cuda_graph():
    t, h, i, e, k = 512, 256, 256, 8, 2
    inputs = make_inputs(t, h, i, e, k, shared=True, seed=5, device=CUDA)
    config, ws = setup(inputs, e)
    weights = [inputs[n] for n in WEIGHTS]
    ids = inputs["top_experts"].clone()

    def step():
        schedule = F.build_schedule(ws, config, ids, num_local_experts=e)
        out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"],
                             *weights)  # fmt: skip
        grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                           inputs["router_weights"], *weights)  # fmt: skip
        return (out, *grads)

    check_replays(step, ids, e, range(200, 203), lambda: F.check_errors(ws))
