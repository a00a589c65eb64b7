"""SM90 backward expert GEMMs on one GPU (mok/launchers/expert_gemm_bwd.py).

Against `mok.reference` on random data, segment by segment, each error relative to the fp64
truth within 2x the error of a PyTorch baseline (`mok.testing.within_bf16_bound`):
- d_gate, d_up: fp64 d_hidden = dY_e @ W_down[e] through the SwiGLU backward in fp64; the
  baselines are `reference.swiglu_backward` of PyTorch's bf16 GEMM and of the reference's fp32
  GEMM (`_mlp_backward`'s d_hidden). Where a clamp is active the kernel must give exact zeros.
- d_x: fp64 product of the kernel's own d_gate/d_up with W_gate/W_up; baselines PyTorch's bf16
  GEMMs and the reference's fp32 ones. And end to end, the kernel's d_x vs the fp64 chain,
  baseline `reference._mlp_backward`'s d_x.
- dW_down, dW_gate, dW_up (`weight_gradient`, fp32): vs the fp64 per-expert A^T B, baselines
  PyTorch's bf16 GEMM and `_mlp_backward`'s fp32 products; experts without rows must come
  back as exact zeros (the output is NaN-poisoned, so an unwritten tile fails).
Segment sizes are adversarial (empty experts, all rows on one expert, a single 128-row
segment, more CTAs than tiles, capacity past the last segment); clamp on and off. Outputs are
poisoned with NaN first: every row of a segment must be written, rows past the last segment
must not be. Three runs must be bitwise identical. A timing line (not asserted) per model
shape prints TFLOP/s.

`MOK_TEST_MANIFEST=/tmp/bwd_build` runs against a manifest built elsewhere (tests only).
"""

from __future__ import annotations

import os

import pytest
import torch
from grouped_gemm_cases import check_bound, poisoned, segments

from mok import reference
from mok.launchers import expert_gemm_bwd
from mok.testing import rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MANIFEST = os.environ.get("MOK_TEST_MANIFEST")

# (name, hidden_size, intermediate_size, segment sizes, extra capacity rows); H and I are
# multiples of 256 (both are an N extent of one of the two kernels).
CASES = [
    ("mixed", 1024, 512, [0, 640, 128, 0, 1024, 256], 256),
    ("one_expert_all_rows", 512, 256, [0, 0, 2048, 0], 0),
    ("single_128_row_expert", 768, 256, [128], 128),
    ("many_small_and_empty", 256, 256, [128 if e % 3 else 0 for e in range(40)], 0),
    ("all_empty", 512, 256, [0, 0, 0], 384),
]


def _inputs(hidden_size, intermediate_size, sizes, extra, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_experts = len(sizes)
    capacity = sum(sizes) + extra

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).cuda()

    return {
        "dy": randn(capacity, hidden_size),
        # The forward context: gate/up spread over [-3, 3] so a limit of 1.0 clamps many.
        "gate": randn(capacity, intermediate_size, scale=1.5),
        "up": randn(capacity, intermediate_size, scale=1.5),
        "gate_w": randn(num_experts, intermediate_size, hidden_size, scale=hidden_size**-0.5),
        "up_w": randn(num_experts, intermediate_size, hidden_size, scale=hidden_size**-0.5),
        "down_w": randn(num_experts, hidden_size, intermediate_size, scale=intermediate_size**-0.5),
        "tokens_per_expert": torch.tensor(sizes, dtype=torch.int32).cuda(),
    }


def _run(inp, limit):
    capacity, inter = inp["gate"].shape
    hidden_size = inp["dy"].shape[1]
    d_gate, d_up = poisoned(capacity, inter), poisoned(capacity, inter)
    partials = torch.full((capacity, inter // 128), float("nan"), device="cuda")
    expert_gemm_bwd.d_hidden_swiglu(
        inp["dy"],
        inp["down_w"],
        inp["gate"],
        inp["up"],
        inp["tokens_per_expert"],
        swiglu_limit=limit,
        d_gate=d_gate,
        d_up=d_up,
        router_partials=partials,
        manifest=MANIFEST,
    )
    d_x = poisoned(capacity, hidden_size)
    expert_gemm_bwd.d_x(
        d_gate,
        d_up,
        inp["gate_w"],
        inp["up_w"],
        inp["tokens_per_expert"],
        out=d_x,
        manifest=MANIFEST,
    )
    torch.cuda.synchronize()
    return d_gate, d_up, d_x, partials


def _swiglu_backward64(d_hidden, gate, up, limit):
    """`reference.swiglu_backward` in fp64, unrounded: the truth."""
    g, u = gate.double(), up.double()
    if limit is not None:
        g, u = torch.clamp(g, max=limit), torch.clamp(u, -limit, limit)
    sig = 1.0 / (1.0 + torch.exp(-g))
    d_up = d_hidden * (g * sig)
    d_gate = d_hidden * u * (sig * (1.0 + g * (1.0 - sig)))
    if limit is not None:
        d_gate = torch.where(gate.double() > limit, 0.0, d_gate)
        d_up = torch.where(up.double().abs() > limit, 0.0, d_up)
    return d_gate, d_up


@pytest.mark.parametrize("limit", [None, 1.0])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, limit):
    _, hidden_size, inter, sizes, extra = case
    inp = _inputs(hidden_size, inter, sizes, extra)
    runs = [_run(inp, limit) for _ in range(3)]
    d_gate, d_up, d_x, partials = runs[0]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
            assert torch.equal(a.view(bits), b.view(bits)), "not bitwise stable"

    bounds, total = segments(sizes)
    # Rows past the last segment are not the kernel's: still poisoned.
    for out in (d_gate, d_up, d_x):
        assert torch.isnan(out[total:].float()).all()
    for e, (start, end) in enumerate(bounds):
        if start == end:
            continue
        r = slice(start, end)
        dy, gate, up = inp["dy"][r], inp["gate"][r], inp["up"][r]
        gate_w, up_w, down_w = inp["gate_w"][e], inp["up_w"][e], inp["down_w"][e]

        # ---- d_hidden + SwiGLU backward ----
        dh64 = dy.double() @ down_w.double()
        dg64, du64 = _swiglu_backward64(dh64, gate, up, limit)
        for label, dh in (
            ("bf16 GEMM", (dy @ down_w).float()),
            ("fp32 GEMM", dy.float() @ down_w.float()),
        ):
            dg_ref, du_ref = reference.swiglu_backward(dh, gate, up, limit)
            check_bound(f"d_gate[{e}] vs {label}", d_gate[r], dg64, dg_ref)
            check_bound(f"d_up[{e}] vs {label}", d_up[r], du64, du_ref)
        # ---- router-weight partials: sum_b partials = <d_hidden, hidden> per row ----
        hidden_ref = reference.swiglu(gate, up, limit)
        check_bound(
            f"router partials[{e}]",
            partials[r].sum(dim=1),
            (dh64 * hidden_ref.double()).sum(dim=1),
            ((dy @ down_w) * hidden_ref).float().sum(dim=1),
        )
        if limit is not None:
            assert (d_gate[r][gate.float() > limit] == 0).all()
            assert (d_up[r][up.float().abs() > limit] == 0).all()

        # ---- d_x from the kernel's own d_gate, d_up ----
        dg, du = d_gate[r], d_up[r]
        dx64 = dg.double() @ gate_w.double() + du.double() @ up_w.double()
        check_bound(f"d_x[{e}] vs bf16 GEMM", d_x[r], dx64, dg @ gate_w + du @ up_w)
        dx32 = (dg.float() @ gate_w.float() + du.float() @ up_w.float()).to(torch.bfloat16)
        check_bound(f"d_x[{e}] vs fp32 GEMM", d_x[r], dx64, dx32)

        # ---- end to end vs the reference's expert backward ----
        chain64 = dg64 @ gate_w.double() + du64 @ up_w.double()
        # x and hidden only feed the weight gradients, which are not compared here.
        unused_x = torch.zeros_like(dy)
        unused_hidden = torch.zeros_like(gate)
        d_x_ref = reference._mlp_backward(
            dy, unused_x, gate, up, unused_hidden, gate_w, up_w, down_w, limit
        )[0].to(torch.bfloat16)
        check_bound(f"d_x[{e}] end to end", d_x[r], chain64, d_x_ref)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_weight_gradients(case):
    _, hidden_size, inter, sizes, extra = case
    inp = _inputs(hidden_size, inter, sizes, extra)
    gen = torch.Generator().manual_seed(1)
    capacity = inp["dy"].shape[0]
    x = torch.randn(capacity, hidden_size, generator=gen).to(torch.bfloat16).cuda()
    hidden = torch.randn(capacity, inter, generator=gen).to(torch.bfloat16).cuda()
    d_gate = torch.randn(capacity, inter, generator=gen).to(torch.bfloat16).cuda()
    tpe = inp["tokens_per_expert"]
    num_experts = len(sizes)
    # (label, A, B): dW_down = dY^T hidden [E, H, I]; dW_gate/dW_up = d^T x [E, I, H].
    for label, a, b in (("dW_down", inp["dy"], hidden), ("dW_gate", d_gate, x)):
        runs = []
        for _ in range(3):
            out = torch.full((num_experts, a.shape[1], b.shape[1]), float("nan"), device="cuda")
            expert_gemm_bwd.weight_gradient(a, b, tpe, out=out, manifest=MANIFEST)
            torch.cuda.synchronize()
            runs.append(out)
        for other in runs[1:]:
            assert torch.equal(runs[0].view(torch.int32), other.view(torch.int32)), label
        out = runs[0]
        bounds, _ = segments(sizes)
        for e, (start, end) in enumerate(bounds):
            if start == end:
                assert torch.equal(out[e], torch.zeros_like(out[e])), f"{label}[{e}] not zero"
                continue
            a_e, b_e = a[start:end], b[start:end]
            truth = a_e.double().t() @ b_e.double()
            check_bound(f"{label}[{e}] vs bf16 GEMM", out[e], truth, a_e.t() @ b_e)
            # fp32 output against an fp32 GEMM in another summation order: an fp32-level
            # bound, not the bf16 one (the bf16 bound above is the contract).
            fp32_err = rel_error(out[e], truth)
            assert fp32_err <= 2e-5, f"{label}[{e}]: fp32 error {fp32_err:.3e} > 2e-5"
        # bf16 output: the fp32 result rounded, bitwise; accumulate: start + fp32 result.
        bf16 = torch.full(out.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        expert_gemm_bwd.weight_gradient(a, b, tpe, output="bf16", out=bf16, manifest=MANIFEST)
        start = torch.randn(out.shape, generator=gen).cuda()
        accumulated = start.clone()
        expert_gemm_bwd.weight_gradient(
            a, b, tpe, output="accumulate", out=accumulated, manifest=MANIFEST
        )
        torch.cuda.synchronize()
        assert torch.equal(bf16, out.to(torch.bfloat16)), f"{label}: bf16 output"
        assert torch.equal(accumulated, start + out), f"{label}: accumulated output"


# (name, num_experts, hidden_size, intermediate_size, tokens, topk): evenly routed.
TIMING_SHAPES = [
    ("qwen3-30b-a3b", 128, 2048, 768, 16384, 8),
    ("mixtral-8x7b", 8, 4096, 14336, 16384, 2),
]


@pytest.mark.parametrize("shape", TIMING_SHAPES, ids=[s[0] for s in TIMING_SHAPES])
def test_timing(shape):
    name, num_experts, hidden_size, inter, tokens, topk = shape
    rows = tokens * topk
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*s, scale=1.0):
        return (torch.randn(*s, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    dy, gate, up = randn(rows, hidden_size), randn(rows, inter), randn(rows, inter)
    gate_w = randn(num_experts, inter, hidden_size, scale=0.02)
    up_w = randn(num_experts, inter, hidden_size, scale=0.02)
    down_w = randn(num_experts, hidden_size, inter, scale=0.02)
    tpe = torch.full((num_experts,), rows // num_experts, dtype=torch.int32, device="cuda")
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    d_x = torch.empty_like(dy)

    def d_hidden():
        expert_gemm_bwd.d_hidden_swiglu(
            dy, down_w, gate, up, tpe, d_gate=d_gate, d_up=d_up, manifest=MANIFEST
        )

    def dx():
        expert_gemm_bwd.d_x(d_gate, d_up, gate_w, up_w, tpe, out=d_x, manifest=MANIFEST)

    for label, fn, flops in (
        ("d_hidden+swiglu", d_hidden, 2 * rows * hidden_size * inter),
        ("d_x", dx, 2 * rows * 2 * inter * hidden_size),
    ):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 10
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / iters
        print(f"\n{name:<14} {label:<16} {ms:8.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s")
    assert torch.isfinite(d_x[:128].float()).all()
