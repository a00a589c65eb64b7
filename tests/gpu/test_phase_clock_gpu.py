"""The megakernels' phase clock (dsl_kernels/common/phase_clock.py) on the GPU: every CTA
stamps every boundary of its roles, in order, and the stamps change no output bit."""

from __future__ import annotations

import pytest
import torch

from mok.launchers import set_backward_path
from mok.launchers.moe_forward import CLOCK_SLOTS, set_phase_clock
from mok.testing import make_inputs, run_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def step(inputs, e):
    out, _, grads, _ = run_layer(inputs, e)
    return (out, *grads)


def test_phase_clock_stamps_in_order_and_changes_no_bit():
    t, h, i, e, k = 2048, 512, 512, 8, 2
    inputs = make_inputs(t, h, i, e, k, seed=3, device=torch.device("cuda"))
    previous = set_backward_path("megakernel")
    try:
        expected = step(inputs, e)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        clock = torch.zeros(sms, CLOCK_SLOTS, dtype=torch.int64, device="cuda")
        set_phase_clock(clock)
        try:
            got = step(inputs, e)
        finally:
            set_phase_clock(None)
    finally:
        set_backward_path(previous)
    for a, b in zip(got, expected, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    stamps = clock.cpu()  # the backward megakernel's, which overwrote the forward's
    assert (stamps[:, :7] > 0).all(), "a CTA missed a stamp"
    start, dispatched, p1, p2, p3, crew, producer = (stamps[:, j] for j in range(7))
    assert (start <= dispatched).all() and (dispatched <= p1).all()
    assert (p1 <= p2).all() and (p2 <= p3).all()
    assert (crew >= dispatched).all() and (producer >= dispatched).all()
