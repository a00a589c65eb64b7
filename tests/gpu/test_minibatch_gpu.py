"""`MoKConfig.minibatch_size` on the GPU: the megakernels run their tasks minibatch by minibatch,
pipelined (mok/dsl_kernels/phases/minibatches.py), and any minibatch size gives the bits of one
minibatch, run after run, forward and backward. Minibatch edges cut expert segments (256 rows against 512-row experts), leave
experts empty, or hold one expert only."""

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


def layer_outputs(inputs, e, config):
    out, ctx, grads, schedule = run_layer(inputs, e, config)
    rows = int(schedule.num_tokens.item())
    routed = (ctx.x_routed, ctx.gate_routed, ctx.up_routed, ctx.hidden_routed)
    return (out, *(t[:rows] for t in routed), *(g for g in grads if g is not None))


@pytest.mark.parametrize(
    "experts,topk,routing",
    [(8, 2, "random"), (32, 8, "random"), (16, 4, "empty_experts"), (8, 2, "one_expert")],
)
def test_any_minibatch_gives_the_bits_of_one_minibatch(experts, topk, routing):
    inputs = make_inputs(2048, 512, 512, experts, topk, routing=routing, seed=11,
                         device=torch.device("cuda"))  # fmt: skip
    expected = layer_outputs(inputs, experts, F.MoKConfig())  # one minibatch
    # 256 (the smallest), one that does not divide the rows, 4096, > the rows.
    for size in (256, 1280, 4096, 1 << 20):
        config = dataclasses.replace(
            F.MoKConfig(), minibatch_size=size, macrobatch_size=size * max(1, (1 << 17) // size)
        )
        for _ in range(2):
            got = layer_outputs(inputs, experts, config)
            for i, (a, b) in enumerate(zip(got, expected, strict=True)):
                assert torch.equal(a, b), (size, i)
