"""The megakernels' communication CTAs and dynamic ticket (tickets.py) on the GPU: whatever the
number of communication CTAs, every output is bit-equal to every CTA dispatching first, run
after run (which CTA takes which task changes, the bits do not); and the communication CTAs
stamp their dispatch, the others start at once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok import functional as F
from mok.launchers import set_backward_path
from mok.launchers.moe_forward import CLOCK_SLOTS, set_comm_ctas, set_phase_clock
from mok.testing import make_inputs, run_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def step(inputs, e, config):
    out, ctx, grads, schedule = run_layer(inputs, e, config)
    # The context's routed rows (rows past schedule.num_tokens are not written).
    rows, capacity = int(schedule.num_tokens.item()), schedule.peer_rank.shape[0]
    context = [getattr(ctx, f.name) for f in dataclasses.fields(ctx)]
    context = [c if c is None or c.shape[0] != capacity else c[:rows] for c in context]
    return (out, *context, *grads)


@pytest.mark.parametrize("experts,topk", [(8, 2), (32, 8)])
def test_any_comm_count_gives_the_same_bits(experts, topk):
    inputs = make_inputs(2048, 512, 512, experts, topk, seed=5, device=torch.device("cuda"))
    previous_path = set_backward_path("megakernel")
    previous = set_comm_ctas(0)  # every CTA dispatches, no lead
    try:
        expected = step(inputs, experts, F.MoKConfig())
        set_comm_ctas(None)
        # 2 (the lead covers every first-phase task), the default 16, most of the GPU.
        for comm in (2, 16, 100):
            config = dataclasses.replace(F.MoKConfig(), fwd_num_comm_sms=comm,
                                         bwd_num_comm_sms=comm)  # fmt: skip
            for _ in range(2):
                got = step(inputs, experts, config)
                for i, (a, b) in enumerate(zip(got, expected, strict=True)):
                    assert (a is None and b is None) or torch.equal(a, b), (comm, i)
    finally:
        set_comm_ctas(previous)
        set_backward_path(previous_path)


def test_comm_ctas_dispatch_and_the_others_start_at_once():
    e = 8
    inputs = make_inputs(4096, 512, 512, e, 2, seed=6, device=torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clock = torch.zeros(sms, CLOCK_SLOTS, dtype=torch.int64, device="cuda")
    previous_path = set_backward_path("megakernel")
    set_phase_clock(clock)
    try:
        step(inputs, e, F.MoKConfig(fwd_num_comm_sms=16, bwd_num_comm_sms=16))
    finally:
        set_phase_clock(None)
        set_backward_path(previous_path)
    stamps = clock.cpu()  # the backward megakernel's
    assert (stamps[:, :7] > 0).all(), "a CTA missed a stamp"
    start, dispatched = stamps[:, 0], stamps[:, 1]
    copy = dispatched - start
    # A compute CTA stamps "dispatched" right after its start; a communication CTA after
    # copying its share of the rows (128 KiB or more each here).
    assert copy[16:].max() < copy[:16].min(), (copy[:16].tolist(), copy[16:].max().item())
