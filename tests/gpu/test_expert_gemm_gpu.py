"""SM90 grouped expert GEMMs on one GPU (mok/launchers/expert_gemm.py).

Against `mok.reference` (per-expert `_mm` + `swiglu`) on random data, segment by segment:
- gate/up: error vs the fp64 product within 2x PyTorch's own bf16 matmul error;
- hidden: vs fp64 SwiGLU of the fp64 gate/up (PyTorch's bf16 baseline: `reference.swiglu` of
  its bf16 gate/up), and exactly `reference.swiglu(kernel gate, kernel up)` up to 1 bf16 ulp
  (the kernel's exp is ex2.approx-based; torch's is expf);
- down: vs fp64 product of the kernel's hidden with W_down, same bound.
Segment sizes are adversarial (empty experts, all rows on one expert, a single 128-row
segment, more CTAs than tiles, capacity past the last segment); clamp on and off. Outputs are
poisoned with NaN first: every row of a segment must be written, rows past the last segment
must not be. Three runs must be bitwise identical. A timing line (not asserted) per model
shape prints TFLOP/s.

`MOK_TEST_MANIFEST=/tmp/gemm_build` runs against a manifest built elsewhere (tests only).
"""

from __future__ import annotations

import os

import pytest
import torch
from grouped_gemm_cases import check_bound, poisoned, segments

from mok import reference
from mok.launchers import expert_gemm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MANIFEST = os.environ.get("MOK_TEST_MANIFEST")

# (name, hidden_size, intermediate_size, segment sizes, extra capacity rows)
CASES = [
    ("mixed", 1024, 384, [0, 640, 128, 0, 1024, 256], 256),
    ("one_expert_all_rows", 512, 256, [0, 0, 2048, 0], 0),
    ("single_128_row_expert", 768, 128, [128], 128),
    ("many_small_and_empty", 256, 256, [128 if e % 3 else 0 for e in range(40)], 0),
    ("all_empty", 512, 128, [0, 0, 0], 384),
]


def _inputs(hidden_size, intermediate_size, sizes, extra, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_experts = len(sizes)
    total = sum(sizes)
    capacity = total + extra

    def w(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(torch.bfloat16).cuda()

    x = torch.randn(capacity, hidden_size, generator=gen).to(torch.bfloat16).cuda()
    return {
        "x": x,
        "gate_w": w(num_experts, intermediate_size, hidden_size, fan_in=hidden_size),
        "up_w": w(num_experts, intermediate_size, hidden_size, fan_in=hidden_size),
        "down_w": w(num_experts, hidden_size, intermediate_size, fan_in=intermediate_size),
        "tokens_per_expert": torch.tensor(sizes, dtype=torch.int32).cuda(),
    }


def _run(inp, limit):
    capacity, inter = inp["x"].shape[0], inp["gate_w"].shape[1]
    hidden_size = inp["x"].shape[1]
    gate, up, hidden = (poisoned(capacity, inter) for _ in range(3))
    expert_gemm.gate_up_swiglu(
        inp["x"],
        inp["gate_w"],
        inp["up_w"],
        inp["tokens_per_expert"],
        swiglu_limit=limit,
        gate=gate,
        up=up,
        hidden=hidden,
        manifest=MANIFEST,
    )
    y = poisoned(capacity, hidden_size)
    expert_gemm.down(hidden, inp["down_w"], inp["tokens_per_expert"], out=y, manifest=MANIFEST)
    torch.cuda.synchronize()
    return gate, up, hidden, y


@pytest.mark.parametrize("limit", [None, 1.0])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, limit):
    _, hidden_size, inter, sizes, extra = case
    inp = _inputs(hidden_size, inter, sizes, extra)
    runs = [_run(inp, limit) for _ in range(3)]
    gate, up, hidden, y = runs[0]
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "not bitwise stable"

    bounds, total = segments(sizes)
    # Rows past the last segment are not the kernel's: still poisoned.
    for out in (gate, up, hidden, y):
        assert torch.isnan(out[total:].float()).all()
    for e, (start, end) in enumerate(bounds):
        if start == end:
            continue
        x = inp["x"][start:end]
        g64 = x.double() @ inp["gate_w"][e].double().t()
        u64 = x.double() @ inp["up_w"][e].double().t()
        g16 = x @ inp["gate_w"][e].t()  # PyTorch's own bf16 GEMM: the error baseline
        u16 = x @ inp["up_w"][e].t()
        check_bound(f"gate[{e}]", gate[start:end], g64, g16)
        check_bound(f"up[{e}]", up[start:end], u64, u16)
        # The same fp32 SwiGLU from the kernel's own bf16 gate/up: equal up to 1 bf16 ulp.
        expected = reference.swiglu(gate[start:end], up[start:end], limit)
        assert torch.allclose(hidden[start:end].float(), expected.float(), rtol=2**-7, atol=0)
        g_c, u_c = reference._clamped(g64, u64, limit)
        h64 = g_c / (1 + torch.exp(-g_c)) * u_c
        check_bound(f"hidden[{e}]", hidden[start:end], h64, reference.swiglu(g16, u16, limit))
        hid = hidden[start:end]
        y64 = hid.double() @ inp["down_w"][e].double().t()
        check_bound(f"y[{e}]", y[start:end], y64, hid @ inp["down_w"][e].t())
        # And the reference's GEMM (mok.reference._mm, fp32, rounded to bf16 as the kernel
        # stores it) is an equally valid baseline.
        check_bound(
            f"y[{e}] vs _mm",
            y[start:end],
            y64,
            reference._mm(hid, inp["down_w"][e]).to(torch.bfloat16),
        )


# (name, num_experts, hidden_size, intermediate_size, tokens, topk): evenly routed.
TIMING_SHAPES = [
    ("qwen3-30b-a3b", 128, 2048, 768, 16384, 8),
    ("mixtral-8x7b", 8, 4096, 14336, 16384, 2),
]


@pytest.mark.parametrize("shape", TIMING_SHAPES, ids=[s[0] for s in TIMING_SHAPES])
def test_timing(shape):
    name, num_experts, hidden_size, inter, tokens, topk = shape
    rows = tokens * topk
    per_expert = rows // num_experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    gate_w = (torch.randn(num_experts, inter, hidden_size, device="cuda", generator=gen) * 0.02).to(
        torch.bfloat16
    )
    up_w = torch.randn_like(gate_w, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
    down_w = (torch.randn(num_experts, hidden_size, inter, device="cuda", generator=gen) * 0.02).to(
        torch.bfloat16
    )
    tpe = torch.full((num_experts,), per_expert, dtype=torch.int32, device="cuda")
    gate, up, hidden = (
        torch.empty(rows, inter, dtype=torch.bfloat16, device="cuda") for _ in "guh"
    )
    y = torch.empty(rows, hidden_size, dtype=torch.bfloat16, device="cuda")

    def gate_up():
        expert_gemm.gate_up_swiglu(
            x, gate_w, up_w, tpe, gate=gate, up=up, hidden=hidden, manifest=MANIFEST
        )

    def down():
        expert_gemm.down(hidden, down_w, tpe, out=y, manifest=MANIFEST)

    for label, fn, flops in (
        ("gate_up+swiglu", gate_up, 2 * rows * hidden_size * 2 * inter),
        ("down", down, 2 * rows * inter * hidden_size),
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
        print(f"\n{name:<14} {label:<15} {ms:8.3f} ms {flops / ms / 1e9:8.1f} TFLOP/s")
    assert torch.isfinite(y[:128].float()).all()
