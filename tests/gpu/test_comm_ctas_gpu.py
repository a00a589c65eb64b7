"""The megakernels' communication CTAs and dynamic ticket (tickets.py) on the GPU: whatever the
number of communication CTAs, every output is bit-equal to every CTA dispatching first, run
after run (which CTA takes which task changes, the bits do not)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok import functional as F
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
    # Every CTA dispatches first (0 communication CTAs), against 2, 16 and most of the GPU.
    zero = dataclasses.replace(F.MoKConfig(), fwd_num_comm_sms=0, bwd_num_comm_sms=0)
    expected = step(inputs, experts, zero)
    for comm in (2, 16, 100):
        config = dataclasses.replace(F.MoKConfig(), fwd_num_comm_sms=comm, bwd_num_comm_sms=comm)
        for _ in range(2):
            got = step(inputs, experts, config)
            for i, (a, b) in enumerate(zip(got, expected, strict=True)):
                assert (a is None and b is None) or torch.equal(a, b), (comm, i)
