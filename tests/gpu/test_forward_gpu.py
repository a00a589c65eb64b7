"""The GPU forward (the forward megakernel, EP group of one) through mok.functional.

Against an fp64 per-expert loop: the output within 2x the error of PyTorch's own bf16 layer;
the saved context against mok.reference within the same bound; bitwise identical across 3
runs; outputs poisoned before each run; recompute equal to the saved context bitwise; a CUDA
graph of schedule + forward replayed with new routing equal to eager.
"""

from __future__ import annotations

import pytest
import torch
from graph_replay import check_replays

from mok import functional as F
from mok import reference as R
from mok.testing import make_inputs, poison_cuda_allocator, within_bf16_bound

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")

CASES = [
    # (T, H, I, E, k, shared, limit, routing)
    (512, 256, 256, 8, 2, True, None, "random"),
    (512, 256, 256, 8, 2, False, 0.5, "random"),
    (300, 256, 128, 4, 1, False, None, "random"),  # k = 1, T not a multiple of 128
    (256, 256, 256, 8, 2, True, None, "one_expert"),
    (256, 256, 256, 8, 2, False, None, "empty_experts"),
    (64, 512, 256, 4, 4, True, None, "first_experts"),  # k = E
    (2048, 2048, 768, 32, 8, False, None, "random"),  # Qwen3-30B-A3B widths, fewer experts
]


def run_forward(inputs, num_experts, limit):
    t, h = inputs["x"].shape
    k = inputs["top_experts"].shape[1]
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=num_experts)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=num_experts)
    weights = [inputs[n] for n in WEIGHTS]
    poison_cuda_allocator()
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights,
                         swiglu_limit=limit)  # fmt: skip
    torch.cuda.synchronize()
    return config, ws, schedule, out, ctx


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}E{c[3]}k{c[4]}-{c[7]}"
                         f"{'-shared' if c[5] else ''}{'-clamp' if c[6] else ''}")  # fmt: skip
def test_forward_matches_fp64_oracle_and_is_deterministic(case):
    t, h, i, e, k, shared, limit, routing = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, routing=routing, seed=t + i, device=CUDA)
    config, ws, schedule, out, ctx = run_forward(inputs, e, limit)
    assert not torch.isnan(out.float()).any()
    cpu = {n: (v.cpu() if v is not None else None) for n, v in inputs.items()}
    shared_w = tuple(cpu[n] for n in WEIGHTS[:3]) if shared else None
    args = (cpu["x"], cpu["router_weights"], cpu["top_experts"], cpu["routed_gate"],
            cpu["routed_up"], cpu["routed_down"], shared_w)  # fmt: skip
    truth = R.naive_moe(*args, swiglu_limit=limit, dtype=torch.float64)
    bf16 = R.naive_moe(*args, swiglu_limit=limit, dtype=torch.bfloat16)
    ok, err, base = within_bf16_bound(out, truth, bf16)
    assert ok, f"out: error {err:.3e} > 2x PyTorch bf16 error {base:.3e}"
    # The context's real rows against the reference's (same schedule, fp32 GEMMs).
    ref_sched = R.make_schedule(cpu["top_experts"], num_local_experts=e,
                                capacity=ws.schedule_capacity)  # fmt: skip
    _, ref_ctx = R.forward(ref_sched, cpu["x"], cpu["router_weights"],
                           *(cpu[n] for n in WEIGHTS), swiglu_limit=limit)  # fmt: skip
    rows = int(schedule.num_tokens)
    assert torch.equal(ctx.x_routed[:rows].cpu(), ref_ctx.x_routed[:rows])
    for name in ("gate_routed", "up_routed", "hidden_routed"):
        got, want = getattr(ctx, name)[:rows].cpu().float(), getattr(ref_ctx, name)[:rows].float()
        assert (got - want).norm() <= 2**-7 * want.norm() + 1e-6, name
    for _ in range(2):
        again = run_forward(inputs, e, limit)
        assert torch.equal(again[3], out)
        for a, b in zip(again[4].tensors(), ctx.tensors(), strict=True):
            assert (a is None and b is None) or torch.equal(a[:rows], b[:rows])
    re_ctx = F.recompute_forward_context(config, ws, schedule, inputs["x"], inputs["shared_gate"],
                                         inputs["shared_up"], inputs["routed_gate"],
                                         inputs["routed_up"], swiglu_limit=limit)  # fmt: skip
    for a, b in zip(re_ctx.tensors(), ctx.tensors(), strict=True):
        assert (a is None and b is None) or torch.equal(a[:rows], b[:rows])


@pytest.mark.parametrize("t,h,i,e,k", [(300, 256, 128, 4, 1), (260, 2304, 256, 4, 3),
                                       (2048, 2048, 768, 32, 8)])  # fmt: skip
def test_in_kernel_combine_is_bitwise_the_epilogue_kernel(t, h, i, e, k):
    """A group of one without a shared expert sums the slots in the forward megakernel's last
    phase (phases/combine_phase.py): `out` must be the separate megakernel + epilogue kernel's,
    bit for bit (H = 2304: a column block of 256 chunks and a partial one; T % 4 != 0: a
    partial token block)."""
    from mok.launchers.epilogues import fwd_epilogue
    from mok.launchers.forward_megakernel import routed_forward

    inputs = make_inputs(t, h, i, e, k, seed=t + h, device=CUDA)
    _, _, schedule, out, _ = run_forward(inputs, e, None)
    _, slots = routed_forward(inputs["x"], schedule, k, inputs["routed_gate"],
                              inputs["routed_up"], inputs["routed_down"])  # fmt: skip
    poison_cuda_allocator()
    want = fwd_epilogue(None, slots, inputs["router_weights"])
    assert torch.equal(out, want)


def test_schedule_and_forward_in_a_cuda_graph():
    t, h, i, e, k = 512, 256, 256, 8, 2
    inputs = make_inputs(t, h, i, e, k, shared=True, seed=5, device=CUDA)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=e)  # fmt: skip
    weights = [inputs[n] for n in WEIGHTS]
    ids = inputs["top_experts"].clone()

    def step():
        schedule = F.build_schedule(ws, config, ids, num_local_experts=e)
        return F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)[0]

    check_replays(step, ids, e, range(100, 103), lambda: F.check_errors(ws))


def test_bad_values_on_the_gpu_are_reported_without_a_host_sync():
    t, h, i, e, k = 256, 256, 128, 4, 2
    inputs = make_inputs(t, h, i, e, k, seed=9, device=CUDA)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=e)  # fmt: skip
    weights = [inputs[n] for n in WEIGHTS]
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
    bad_weights = inputs["router_weights"].clone()
    bad_weights[3, 1] = 0.0
    # The verdict is raised by the first mok call that finds it landed (possibly this one, as
    # the check's own op starts by looking), or at the latest by check_errors, which syncs.
    with pytest.raises(ValueError, match=r"router_weights must be finite and > 0, got a value"):
        F.forward(config, ws, schedule, inputs["x"], bad_weights, *weights)
        F.check_errors(ws)
    bad_ids = inputs["top_experts"].clone()
    bad_ids[0, 0] = e
    with pytest.raises(ValueError, match=r"top_experts must hold expert ids in \[0, 4\)"):
        F.build_schedule(ws, config, bad_ids, num_local_experts=e)
        F.check_errors(ws)
    F.check_errors(ws)  # reported once, then clear
