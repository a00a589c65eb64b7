"""The GPU MXFP8 forward (the forward megakernel's MXFP8 variant, EP group of one) through
mok.functional, with weights quantised by mok.reference (independent of the GPU quantiser).

Against mok.reference.mxfp8_forward (the oracle: products of the dequantised MXFP8 operands,
fp32 sums): the output within bf16 rounding of the oracle's (only the fp32 summation order
differs); the context, the original's MXFP8 pairs (x and hidden quantised along the routed
rows, gate and up along I), dequantised: x bitwise the round trip of the oracle's x rows,
gate / up / hidden within 2^-6 of the round trips of the oracle's (bf16 rounding of the fp32
sums, now and then moved one E4M3 step); against the BF16 layer
within the original's tolerance (max abs 1.0, relative L1 0.1); bitwise identical across runs,
outputs poisoned before each; adversarial routing, clamp on and off, a shared expert; on
virtual EP groups of 2 and 4 ranks bitwise the EP group of one (each rank's weights its experts'
slice, quantised there).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok import functional as F
from mok import ops
from mok import reference as R
from mok.testing import context_values, make_inputs, poison_cuda_allocator, rank_inputs
from mok.virtual_ep import VirtualEPGroup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = torch.device("cuda")
SHARED = ("shared_gate", "shared_up", "shared_down")
ROUTED = ("routed_gate", "routed_up", "routed_down")

CASES = [
    # (T, H, I, E, k, shared, limit, routing)
    (512, 256, 256, 8, 2, True, None, "random"),
    (512, 256, 256, 8, 2, False, 3.0, "random"),
    (300, 256, 128, 4, 1, False, None, "random"),  # k = 1, T not a multiple of 128
    (256, 256, 256, 8, 2, True, None, "one_expert"),
    (256, 256, 256, 8, 2, False, None, "empty_experts"),
    (64, 512, 256, 4, 4, True, None, "first_experts"),  # k = E
    (2048, 2048, 768, 32, 8, False, None, "random"),  # Qwen3-30B-A3B widths, fewer experts
]


def quantised(cpu):
    """(fp8, scales) of each routed weight along its K, by mok.reference."""
    return {n: R.mxfp8_quantize(cpu[n]) for n in ROUTED}


def run_forward(inputs, mx, num_experts, limit):
    t, h = inputs["x"].shape
    k = inputs["top_experts"].shape[1]
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=num_experts)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=num_experts)
    routed = [tuple(p.to(CUDA) for p in mx[n]) for n in ROUTED]
    poison_cuda_allocator()
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"],
                         *(inputs[n] for n in SHARED), *routed, swiglu_limit=limit)  # fmt: skip
    torch.cuda.synchronize()
    return ws, schedule, out, ctx


def close(got, want, what, rel=2**-7):
    got, want = got.cpu().float(), want.float()
    assert torch.isfinite(got).all(), what
    err = (got - want).norm()
    assert err <= rel * want.norm() + 1e-6, f"{what}: |err| {err:.3e} vs |want| {want.norm():.3e}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}H{c[1]}I{c[2]}E{c[3]}k{c[4]}-{c[7]}"
                         f"{'-shared' if c[5] else ''}{'-clamp' if c[6] else ''}")  # fmt: skip
def test_mxfp8_forward_matches_oracle_and_is_deterministic(case):
    t, h, i, e, k, shared, limit, routing = case
    inputs = make_inputs(t, h, i, e, k, shared=shared, routing=routing, seed=t + i + 7,
                         device=CUDA)  # fmt: skip
    cpu = {n: (v.cpu() if v is not None else None) for n, v in inputs.items()}
    mx = quantised(cpu)
    ws, schedule, out, ctx = run_forward(inputs, mx, e, limit)
    ref_sched = R.make_schedule(cpu["top_experts"], num_local_experts=e,
                                capacity=ws.schedule_capacity)  # fmt: skip
    want, want_ctx = R.mxfp8_forward(ref_sched, cpu["x"], cpu["router_weights"],
                                     *(cpu[n] for n in SHARED), *(mx[n] for n in ROUTED),
                                     swiglu_limit=limit)  # fmt: skip
    rows = int(schedule.num_tokens)
    got_ctx = context_values(ctx, rows)
    by_token = dict(along_rows=True)
    assert torch.equal(got_ctx[0].cpu(), R.mxfp8_round_trip(want_ctx.x_routed[:rows], **by_token))
    for name, got, along_rows in (("gate_routed", got_ctx[1], False),
                                  ("up_routed", got_ctx[2], False),
                                  ("hidden_routed", got_ctx[3], True)):  # fmt: skip
        want_rows = R.mxfp8_round_trip(getattr(want_ctx, name)[:rows], along_rows=along_rows)
        close(got, want_rows, name, rel=2**-6)
    close(out, want, "out")
    # The original's tolerance against the BF16 layer.
    bf16_out, _ = R.forward(ref_sched, cpu["x"], cpu["router_weights"],
                            *(cpu[n] for n in SHARED + ROUTED), swiglu_limit=limit)  # fmt: skip
    diff = (out.cpu().float() - bf16_out.float()).abs()
    assert diff.max() <= 1.0, f"max abs {diff.max():.3e} against BF16"
    assert diff.sum() <= 0.1 * bf16_out.float().abs().sum(), "relative L1 against BF16"
    for _ in range(2):
        _, _, again, again_ctx = run_forward(inputs, mx, e, limit)
        assert torch.equal(again, out)
        for a, b in zip(context_values(again_ctx, rows), got_ctx, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_mxfp8_forward_rejects_a_wrong_tuple_on_cuda():
    t, h, i, e, k = 256, 256, 128, 4, 2
    inputs = make_inputs(t, h, i, e, k, seed=3, device=CUDA)
    cpu = {n: v.cpu() for n, v in inputs.items() if v is not None}
    mx = {n: tuple(p.to(CUDA) for p in pair) for n, pair in quantised(cpu).items()}
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h, topk=k,
                         num_local_experts=e)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
    bad = (mx["routed_gate"][0], mx["routed_gate"][1][:1])
    with pytest.raises(ValueError, match="routed_gate"):
        F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], None, None, None,
                  bad, mx["routed_up"], mx["routed_down"])  # fmt: skip


def test_mxfp8_forward_on_virtual_ep_groups_equals_a_group_of_one():
    t, h, i, e, k = 512, 256, 256, 8, 2
    inputs = make_inputs(t, h, i, e, k, shared=True, routing="one_expert", seed=21, device=CUDA)
    # Capacity for the adversarial routing: one rank may receive every routed row of the group.
    config = dataclasses.replace(F.MoKConfig(), schedule_capacity_multiplier=1.0)
    outs = {}
    for size in (1, 2, 4):
        group = VirtualEPGroup(size)
        spaces = group.workspaces(config, num_local_tokens=t // size, hidden_size=h, topk=k,
                                  num_local_experts=e // size)  # fmt: skip
        shards = [rank_inputs(inputs, rank, size) for rank in range(size)]
        routed = [[tuple(ops.mxfp8_quantize(shard[n], True, False)[:2]) for n in ROUTED]
                  for shard in shards]  # fmt: skip

        def step(rank, shards=shards, spaces=spaces, routed=routed, size=size):
            shard, ws = shards[rank], spaces[rank]
            schedule = F.build_schedule(ws, config, shard["top_experts"],
                                        num_local_experts=e // size)  # fmt: skip
            return F.forward(config, ws, schedule, shard["x"], shard["router_weights"],
                             *(shard[n] for n in SHARED), *routed[rank])[0]  # fmt: skip

        poison_cuda_allocator()
        results = group.run(step)
        group.join()
        for ws in spaces:
            F.check_errors(ws)
        outs[size] = torch.cat(results)
    assert torch.isfinite(outs[1].float()).all()
    assert torch.equal(outs[2], outs[1])
    assert torch.equal(outs[4], outs[1])


def test_mxfp8_forward_bits_do_not_depend_on_comm_ctas_or_minibatches():
    t, h, i, e, k = 1024, 256, 256, 8, 2
    inputs = make_inputs(t, h, i, e, k, shared=False, seed=22, device=CUDA)
    cpu = {n: (v.cpu() if v is not None else None) for n, v in inputs.items()}
    routed = [tuple(p.to(CUDA) for p in pair) for pair in quantised(cpu).values()]
    outs = []
    for config in (F.MoKConfig(), dataclasses.replace(F.MoKConfig(), fwd_num_comm_sms=2),
                   dataclasses.replace(F.MoKConfig(), minibatch_size=256)):  # fmt: skip
        ws = F.get_workspace(config, None, device=CUDA, num_local_tokens=t, hidden_size=h,
                             topk=k, num_local_experts=e)  # fmt: skip
        schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
        poison_cuda_allocator()
        out, _ = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], None,
                           None, None, *routed)  # fmt: skip
        F.check_errors(ws)
        outs.append(out)
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
