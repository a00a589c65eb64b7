"""MXFP8 layers with macrobatches below the routed rows (ring reuse with replay), on CPU.

Through mok.functional on the CPU path (mok.reference.mxfp8_forward / mxfp8_backward with
`macrobatch_size`): out, the context's macrobatch-0 rows and every gradient bitwise the same
for every macrobatch size, with and without the shared expert and a clamp; the backward from a
recomputed (every-row) context too; the fake forward sizes the MXFP8 context by the macrobatch.
The GPU launchers' ring (mok/launchers/macrobatch.py) is held to the same bits on the GPU
(tests/gpu/test_mxfp8_backward_gpu.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from bitwise import assert_bitwise
from torch._subclasses.fake_tensor import FakeTensorMode

from mok import functional as F
from mok import ops
from mok import reference as R
from mok.testing import context_values, make_inputs

T, H, I, E, K = 512, 256, 256, 4, 2  # 1024 routed rows over few experts: segments cross edges
SIZES = (256, 512)
SHARED = ("shared_gate", "shared_up", "shared_down")
ROUTED = ("routed_gate", "routed_up", "routed_down")


def quantised(inputs):
    """(forward tuples, backward tuples) of the routed weights, by mok.reference."""

    def pair(w, transpose):
        return tuple(t.contiguous() for t in R.mxfp8_quantize(w, transpose=transpose))

    fwd = [pair(inputs[n], False) for n in ROUTED]
    bwd = [fwd[0] + pair(inputs["routed_gate"], True), fwd[1] + pair(inputs["routed_up"], True),
           pair(inputs["routed_down"], True)]  # fmt: skip
    return fwd, bwd


def config_of(macrobatch_size):
    if macrobatch_size is None:
        return F.MoKConfig()
    return F.MoKConfig(minibatch_size=256, macrobatch_size=macrobatch_size)


def step(inputs, config, limit=None, recompute=False):
    """(schedule, out, context, gradients) of one MXFP8 step through mok.functional."""
    fwd, bwd = quantised(inputs)
    shared = [inputs[n] for n in SHARED]
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=E)
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *shared,
                         *fwd, swiglu_limit=limit)  # fmt: skip
    used = ctx
    if recompute:
        used = F.recompute_forward_context(config, ws, schedule, inputs["x"], *shared[:2],
                                           *fwd[:2], swiglu_limit=limit)  # fmt: skip
    grads = F.backward(config, ws, schedule, used, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], *shared, *bwd, swiglu_limit=limit)  # fmt: skip
    return schedule, out, ctx, grads


@pytest.mark.parametrize("shared,limit", [(True, None), (False, 0.75)])
def test_mxfp8_layer_is_bitwise_the_same_for_every_macrobatch_size(shared, limit):
    inputs = make_inputs(T, H, I, E, K, shared=shared, seed=21)
    schedule, out, ctx, grads = step(inputs, config_of(None), limit)
    full = context_values(ctx)
    assert full[0].shape[0] == schedule.capacity
    for size in SIZES:
        _, out_m, ctx_m, grads_m = step(inputs, config_of(size), limit)
        assert_bitwise((out_m, *grads_m), (out, *grads), size)
        # The context holds macrobatch 0's rows only (the original's MXFP8 pairs).
        values = context_values(ctx_m)
        assert [t.shape[0] for t in values[:4]] == [size] * 4
        assert_bitwise(values[:4], [t[:size] for t in full[:4]], size)


def test_mxfp8_backward_from_a_recomputed_context_needs_no_replay():
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=22)
    _, out, _, grads = step(inputs, config_of(None))
    for size in SIZES:
        _, out_m, _, grads_m = step(inputs, config_of(size), recompute=True)
        assert_bitwise((out_m, *grads_m), (out, *grads), size)


def test_mxfp8_reference_replays_what_the_forward_kept():
    """The reference's replay of a later macrobatch is the forward's rows of it, bitwise."""
    inputs = make_inputs(T, H, I, E, K, seed=23)
    fwd, _ = quantised(inputs)
    schedule = R.make_schedule(inputs["top_experts"], num_local_experts=E, capacity=1280)
    shared = [inputs[n] for n in SHARED]
    _, full = R.mxfp8_forward(schedule, inputs["x"], inputs["router_weights"], *shared, *fwd)
    for first, window in R.macrobatch_windows(schedule, 256):
        replayed = R.mxfp8_recompute_forward_context(
            window, inputs["x"], None, None, fwd[0], fwd[1], topk=K
        )
        rows = slice(first, first + window.capacity)
        assert_bitwise(replayed.tensors()[:4], [t[rows] for t in full.tensors()[:4]], first)


def test_fake_mxfp8_forward_sizes_the_context_by_the_macrobatch():
    inputs = make_inputs(T, H, I, E, K, seed=24)
    fwd, _ = quantised(inputs)
    config = config_of(256)
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=E)
    args = (ws.handle, *(getattr(schedule, n) for n in ("peer_rank", "peer_token_idx",
            "num_tokens", "tokens_per_expert")))  # fmt: skip
    real = ops.forward_mxfp8(*args, inputs["x"], inputs["router_weights"], None, None, None,
                             *(t for w in fwd for t in w), None, 0, 256, 256)  # fmt: skip
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_in = [mode.from_tensor(t) for t in (*args[1:], inputs["x"], inputs["router_weights"])]
        fake_w = [mode.from_tensor(t) for w in fwd for t in w]
        fake = ops.forward_mxfp8(args[0], *fake_in, None, None, None, *fake_w, None, 0, 256, 256)
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real]
    assert real[1].shape[0] == 256
    assert torch.isfinite(real[0].float()).all()


def test_mxfp8_refuses_the_gather_replay_with_ring_reuse():
    """macrobatch_replay "gather" is BF16 only: with MXFP8 routed weights and ring reuse the
    forward says so; with every row at once the knob changes nothing."""
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=31)
    with pytest.raises(ValueError, match=r"macrobatch_replay 'gather' is BF16 only: with MXFP8 "
                                         r"routed weights and macrobatch_size 256 below"):  # fmt: skip
        step(inputs, dataclasses.replace(config_of(256), macrobatch_replay="gather"))
    _, out, _, grads = step(inputs, config_of(None))
    _, out_g, _, grads_g = step(inputs, dataclasses.replace(config_of(None),
                                                            macrobatch_replay="gather"))  # fmt: skip
    assert_bitwise((out_g, *grads_g), (out, *grads), "every row")
