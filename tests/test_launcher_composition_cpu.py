"""The GPU forward and backward ops' compositions (mok/launchers/forward_op.py, backward_op.py),
checked on CPU.

The SM90 kernels are replaced by the reference's math on the same operands (each kernel is
tested against that math on the H200 in tests/gpu/), so these tests check the glue against
mok.reference: gathers, dY_e scaling, slot scatter, router-weight partials, the shared expert's
padding and main_grad accumulation.
"""

from __future__ import annotations

import ctypes
import importlib
import math

import pytest
import torch
from fake_kernels import fake_push_router_grads

from mok import functional as F
from mok import reference as R
from mok.launchers import dispatch, expert_gemm, expert_gemm_bwd, mxfp8
from mok.launchers.plans import Carve, schedule_addresses
from mok.mxfp8_context import dequantised_context, quantised_context
from mok.testing import make_inputs, rel_error
from mok.types import PassConfig

# The modules, not the `forward` and `backward` functions mok.launchers re-exports by name.
fwd = importlib.import_module("mok.launchers.forward_op")
bwd = importlib.import_module("mok.launchers.backward_op")

T, H, I, E, K = 200, 256, 256, 6, 2
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")


def _segments(tokens):
    return R.expert_segments(R.MoKSchedule(None, None, None, tokens))


def fake_down(hidden, down_w, tokens):
    y = torch.zeros(hidden.shape[0], down_w.shape[1], dtype=torch.bfloat16)
    for e, (s, t) in enumerate(_segments(tokens)):
        y[s:t] = R._mm(hidden[s:t], down_w[e]).to(torch.bfloat16)
    return y


def _to_slots(y, slots):
    """The megakernels' slot epilogue: row r of y at row peer_token_idx[r], padding dropped."""
    peer_rank, peer_token_idx, num_slots = slots
    out = torch.full((num_slots, y.shape[1]), float("nan"), dtype=torch.bfloat16)
    real = peer_rank >= 0
    out[peer_token_idx[real].long()] = y[real]
    return out


def fake_d_hidden(dy, down_w, gate, up, tokens, *, swiglu_limit=None, router_partials=None):
    d_gate, d_up = torch.zeros_like(gate), torch.zeros_like(up)
    for e, (s, t) in enumerate(_segments(tokens)):
        d_hidden = dy[s:t].float() @ down_w[e].float()
        d_gate[s:t], d_up[s:t] = R.swiglu_backward(d_hidden, gate[s:t], up[s:t], swiglu_limit)
        if router_partials is not None:  # per 128-column block: sum of hidden * d_hidden
            hidden = R.swiglu(gate[s:t], up[s:t], swiglu_limit).float()
            blocks = (hidden * d_hidden).view(t - s, -1, 128).sum(dim=2)
            router_partials[s:t] = blocks
    return d_gate, d_up


def fake_d_x(d_gate, d_up, gate_w, up_w, tokens):
    out = torch.zeros(d_gate.shape[0], gate_w.shape[2], dtype=torch.bfloat16)
    for e, (s, t) in enumerate(_segments(tokens)):
        out[s:t] = (d_gate[s:t].float() @ gate_w[e].float()
                    + d_up[s:t].float() @ up_w[e].float()).to(torch.bfloat16)  # fmt: skip
    return out


def fake_weight_gradient(a, b, tokens, *, output="fp32", out=None):
    grad = torch.zeros(tokens.shape[0], a.shape[1], b.shape[1])
    for e, (s, t) in enumerate(_segments(tokens)):
        grad[e] = a[s:t].float().t() @ b[s:t].float()
    if output == "accumulate":
        return out.add_(grad)
    if out is not None:  # into `out` (a fused gradient's half)
        return out.copy_(grad.to(out.dtype))
    return grad.to(torch.bfloat16) if output == "bf16" else grad


def fake_gate_up_swiglu(x, gate_w, up_w, tokens, *, swiglu_limit=None):
    shape = (x.shape[0], gate_w.shape[1])
    gate, up, hidden = (torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3))
    for e, (s, t) in enumerate(_segments(tokens)):
        gate[s:t] = R._mm(x[s:t], gate_w[e]).to(torch.bfloat16)
        up[s:t] = R._mm(x[s:t], up_w[e]).to(torch.bfloat16)
        hidden[s:t] = R.swiglu(gate[s:t], up[s:t], swiglu_limit)
    return gate, up, hidden


def fake_gather_rows(src, peer_rank, peer_token_idx, num_tokens, topk, *, weights=None, peers=None):
    """The gather kernels' math: rows from their tokens (scaled: bf16(w * float(row)))."""
    rows = torch.where(peer_rank >= 0, peer_token_idx.long() // topk, 0)
    out = src.index_select(0, rows)
    if weights is not None:
        w = torch.where(peer_rank >= 0, weights.reshape(-1)[peer_token_idx.long().clamp(0)], 0)
        out = (w[:, None] * out.float()).to(torch.bfloat16)
    out[peer_rank < 0] = 0
    out[int(num_tokens) :] = float("nan")  # not part of the contract
    return out


def fake_routed_forward(x, schedule, topk, gate_w, up_w, down_w, *, swiglu_limit=None, **_):
    """The forward megakernel's math: the three kernels' fakes in sequence."""
    peer, slot, tokens = schedule.peer_rank, schedule.peer_token_idx, schedule.tokens_per_expert
    x_routed = fake_gather_rows(x, peer, slot, schedule.num_tokens, topk)
    gate, up, hidden = fake_gate_up_swiglu(x_routed, gate_w, up_w, tokens,
                                           swiglu_limit=swiglu_limit)  # fmt: skip
    slots = _to_slots(fake_down(hidden, down_w, tokens), (peer, slot, x.shape[0] * topk))
    return (x_routed, gate, up, hidden), slots


def fake_routed_backward(grad_output, router_weights, schedule, x_routed, gate, up, hidden,
                         gate_w, up_w, down_w, *, swiglu_limit=None, weight_grads=True,
                         mxfp8=False, **_):  # fmt: skip
    """The backward megakernel's math: the kernels' fakes in sequence (`mxfp8`: the GEMMs' A
    operands are the round trips along their K, as the MXFP8 variant's dispatch and crew write)."""
    peer, slot, tokens = schedule.peer_rank, schedule.peer_token_idx, schedule.tokens_per_expert
    topk = router_weights.shape[1]
    dy_e = fake_gather_rows(grad_output, peer, slot, schedule.num_tokens, topk,
                            weights=router_weights)  # fmt: skip
    a_operand = R.mxfp8_round_trip if mxfp8 else (lambda t: t)
    partials = torch.empty(dy_e.shape[0], gate.shape[1] // 128)
    d_gate, d_up = fake_d_hidden(a_operand(dy_e), down_w, gate, up, tokens,
                                 swiglu_limit=swiglu_limit, router_partials=partials)  # fmt: skip
    slots = _to_slots(fake_d_x(a_operand(d_gate), a_operand(d_up), gate_w, up_w, tokens),
                      (peer, slot, grad_output.shape[0] * topk))  # fmt: skip
    d_weights = None
    if weight_grads:
        d_weights = [
            fake_weight_gradient(a, b, tokens, output="bf16")
            for a, b in ((d_gate, x_routed), (d_up, x_routed), (dy_e, hidden))
        ]
    return dy_e, d_gate, d_up, partials, slots, d_weights


class _FakeForwardPlan:
    """The forward megakernel's plan on the fakes; with `combine` (a group of one without a
    shared expert) it also writes the epilogue's sum into the caller's `out`."""

    bound = True  # a launch is bound: the op takes the combine path when asked

    def __init__(self, x, schedule, topk, weights, pass_config, peers, slots, combine=False,
                 schedule_ids=None):  # fmt: skip
        self.args, self.combine = (topk, *weights, pass_config.swiglu_limit), combine
        self.schedules = schedule_ids is not None  # the ops here pass None: the full path
        assert not self.schedules

    def __call__(self, x, schedule, slots, weights, combine=None):
        topk, gate_w, up_w, down_w, limit = self.args
        assert (combine is not None) == self.combine
        ctx, slots = fake_routed_forward(x, schedule, topk, gate_w, up_w, down_w,
                                         swiglu_limit=limit)  # fmt: skip
        if combine is not None:
            out, router_weights = combine
            out.copy_(R.fwd_epilogue(None, slots, router_weights))
        return ctx, slots


_BY_ADDRESS: dict[int, torch.Tensor] = {}  # partials the fake backward plan wrote, for the push


class _FakeBackwardPlan:
    """The backward plan's interface on the kernels' fakes: the launch gets the schedule by
    address (checked against the plan's), its context through the op's maker."""

    bound = True  # a launch is bound: the op takes the in-kernel finish when asked

    def __init__(self, dy, w, schedule, context, weights, pass_config, weight_grads, peers, slots,
                 mxfp8=False, finish=False, fused_grads=False):  # fmt: skip
        self.schedule, self.weights, self.mxfp8 = schedule, tuple(weights), mxfp8
        self.finish, self.fused_grads = finish, fused_grads
        self.limit, self.weight_grads = pass_config.swiglu_limit, weight_grads
        capacity, hidden_size = context[0].shape
        inter = context[1].shape[1]
        self.scratch = Carve([(torch.bfloat16, (capacity, hidden_size)),
                              (torch.bfloat16, (capacity, inter)),
                              (torch.bfloat16, (capacity, inter)),
                              (torch.float32, (capacity, inter // 128))], context[0].device)  # fmt: skip

    def launch(self, dy, w, schedule_at, context_at, context, slots, weights=None,
               finish_at=(0, 0)):  # fmt: skip
        assert schedule_at == schedule_addresses(self.schedule)
        assert (finish_at != (0, 0)) == self.finish
        assert (weights is not None) == self.mxfp8  # MXFP8: this call's dequantised weights
        tensors = [context(i) for i in range(4)]
        assert context_at == tuple(t.data_ptr() for t in tensors)
        routed = weights if self.mxfp8 else self.weights
        *scratch, slots, d_weights = fake_routed_backward(
            dy, w, self.schedule, *tensors, *routed, swiglu_limit=self.limit,
            weight_grads=self.weight_grads, mxfp8=self.mxfp8,
        )  # fmt: skip
        buffer = self.scratch.new()
        for view, got in zip(self.scratch.views(buffer), scratch, strict=True):
            view.copy_(got)
        partials = self.scratch.view(buffer, 3)
        _BY_ADDRESS[partials.data_ptr()] = partials
        if self.finish:  # the megakernel's last phase: backward_finish's math, by address
            d_x, d_router = (_cpu_tensor(at, dtype, shape) for at, dtype, shape in zip(
                finish_at, (torch.bfloat16, torch.float32), (dy.shape, w.shape), strict=True))  # fmt: skip
            fake_push_router_grads(partials, self.schedule, w, d_router)
            d_x.copy_(R.bwd_epilogue(None, slots, w.shape[1]))
        if self.fused_grads and d_weights is not None:  # the kernel's halves of one tensor
            d_weights[:2] = list(torch.cat(d_weights[:2], dim=1).split(d_weights[0].shape[1], 1))
        return buffer, slots, d_weights


def _cpu_tensor(address: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """The CPU tensor of `shape` at `address` (memory the op allocated; writes land in it)."""
    count = math.prod(shape)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return torch.frombuffer(raw, dtype=dtype, count=count).view(shape)


class _FakePush:
    def __init__(self, partials, schedule, router_weights, d_router, peers):
        self.schedule = schedule

    def launch(self, partials_at, schedule_at, router_weights, d_router):
        assert schedule_at == schedule_addresses(self.schedule)
        fake_push_router_grads(_BY_ADDRESS.pop(partials_at), self.schedule, router_weights,
                               d_router)  # fmt: skip


class _FakeFinish:
    """backward_finish's interface on the fakes: the push, then the unweighted epilogue."""

    def __init__(self, d_x_shared, slots, topk, partials, schedule, router_weights, d_router):
        self.topk, self.push = topk, _FakePush(partials, schedule, router_weights, d_router, None)

    def __call__(self, d_x_shared, slots, partials_at, schedule_at, router_weights, d_router):
        self.push.launch(partials_at, schedule_at, router_weights, d_router)
        return R.bwd_epilogue(d_x_shared, slots, self.topk)


def fake_dequantize(data, scales, *, transposed=False):
    """The dequantising kernels' math: mok.reference's, in the weight's own layout."""
    values = R.mxfp8_dequantize(data, scales, transpose=transposed)
    return values.to(torch.bfloat16).contiguous()


def fake_round_trip(x, *, along_rows, out=None):
    """The round-trip kernels' math (mok.reference's), in place when `out` is x."""
    got = R.mxfp8_round_trip(x, along_rows=along_rows)
    return got if out is None else out.copy_(got)


@pytest.fixture()
def fake_kernels(monkeypatch):
    """The ops' plans built from the kernels' fakes (the op plans call these factories)."""
    from mok.launchers import plans

    plans.clear_plans()
    monkeypatch.setattr(dispatch, "gather_rows", fake_gather_rows)
    monkeypatch.setattr(fwd, "forward_plan", _FakeForwardPlan)
    monkeypatch.setattr(bwd, "backward_plan", _FakeBackwardPlan)
    monkeypatch.setattr(bwd, "router_grad_push_plan", _FakePush)
    monkeypatch.setattr(bwd, "finish_plan", _FakeFinish)
    monkeypatch.setattr(expert_gemm, "gate_up_swiglu", fake_gate_up_swiglu)
    monkeypatch.setattr(fwd, "fwd_epilogue_plan",
                        lambda *_: lambda y, slots, w, checked=False: R.fwd_epilogue(y, slots, w))  # fmt: skip
    monkeypatch.setattr(expert_gemm, "down", fake_down)
    monkeypatch.setattr(expert_gemm_bwd, "d_hidden_swiglu", fake_d_hidden)
    monkeypatch.setattr(expert_gemm_bwd, "d_x", fake_d_x)
    monkeypatch.setattr(expert_gemm_bwd, "weight_gradient", fake_weight_gradient)
    monkeypatch.setattr(mxfp8, "mxfp8_round_trip", fake_round_trip)
    monkeypatch.setattr(mxfp8, "mxfp8_dequantize", fake_dequantize)
    monkeypatch.setattr(bwd, "bwd_epilogue_plan",
                        lambda shared, slots, topk: lambda d, s: R.bwd_epilogue(d, s, topk))  # fmt: skip
    yield
    plans.clear_plans()


class _Workspace:
    ep_rank, ep_size, hidden_size, topk, num_local_tokens = 0, 1, H, K, T
    megakernel_ctas, wait_timeout_ns, handle = None, 1, -1
    # A group of one's slots are the workspace's (launchers/forward_op.py, backward_op.py).
    buffers = {name: torch.full((T * K, H), float("nan"), dtype=torch.bfloat16)
               for name in ("combine_buffer", "d_x_routed_buffer")}  # fmt: skip

    def require_alive(self):
        return self


def _settings(swiglu_limit):
    """A pass's settings as mok.layer_ops makes them on `_Workspace` (16 comm CTAs, minibatches
    of 4096 rows, one macrobatch of every row)."""
    return PassConfig.of_workspace(_Workspace(), swiglu_limit=swiglu_limit, num_comm_ctas=16,
                                   minibatch_size=4096, macrobatch_size=131072)  # fmt: skip


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shared,limit,main", [(True, None, False), (False, 0.5, True)])
def test_composition_equals_reference_backward(fake_kernels, monkeypatch, shared, limit, main,
                                               fused):  # fmt: skip
    """`fused`: a group of one's push and epilogue in one launch (backward_finish), or, where
    the epilogue needs more than one launch (finish_plan gives None), the two kernels."""
    if not fused:
        monkeypatch.setattr(bwd, "finish_plan", lambda *_: None)
    inp = make_inputs(T, H, I, E, K, shared=shared, seed=3)
    schedule = R.make_schedule(inp["top_experts"], num_local_experts=E, capacity=T * K + E * 128)
    weights = [inp[n] for n in WEIGHTS]
    _, ctx = R.forward(schedule, inp["x"], inp["router_weights"], *weights, swiglu_limit=limit)
    want = R.backward(schedule, ctx, inp["grad_output"], inp["x"], inp["router_weights"],
                      *weights, swiglu_limit=limit)  # fmt: skip
    empty = inp["x"].new_empty(0)
    ctx_tensors = [t if t is not None else empty for t in ctx.tensors()]
    order = (3, 4, 5, 0, 1, 2)  # routed gate/up/down, then shared
    mains = tuple(torch.zeros(weights[i].shape) if main and weights[i] is not None else None
                  for i in order)  # fmt: skip
    got = bwd.backward(_Workspace(), schedule, ctx_tensors, inp["grad_output"], inp["x"],
                       inp["router_weights"], weights[:3], weights[3:], _settings(limit),
                       mains)  # fmt: skip
    assert torch.equal(got[0], want[0])  # d_x: same bf16 slots, same fixed-order epilogue
    # d_router uses the bf16-rounded expert output (the kernel's y): within bf16 rounding.
    assert rel_error(got[1], want[1]) < 2**-8
    for i, (g, w) in enumerate(zip(got[2:], want[2:], strict=True)):
        if w is None:
            assert g.numel() == 0
        elif main:
            assert g.numel() == 0 and torch.allclose(mains[i], w, rtol=1e-5, atol=1e-5)
        else:
            assert rel_error(g.float(), w) < 2**-8 and g.dtype == torch.bfloat16


@pytest.mark.parametrize("shared,limit,exact", [(True, None, False), (False, 0.5, False),
                                                (True, 0.5, True)])  # fmt: skip
def test_mxfp8_composition_equals_reference_backward(fake_kernels, shared, limit, exact):
    """`exact`: the context given as the dequantised quantised one (the original's, as
    mok.functional keeps it), whose identity round trips the op skips: the same results."""
    inp = make_inputs(T, H, I, E, K, shared=shared, seed=5)
    # A capacity of whole 128-row tiles, as the workspace's (the round trips' kernels need it).
    schedule = R.make_schedule(inp["top_experts"], num_local_experts=E, capacity=1280)
    shared_w = [inp[n] for n in WEIGHTS[:3]]
    forward_q = [R.mxfp8_quantize(inp[n]) for n in WEIGHTS[3:]]
    gate_t, up_t, down_t = (R.mxfp8_quantize(inp[n], transpose=True) for n in WEIGHTS[3:])
    routed = (forward_q[0] + gate_t, forward_q[1] + up_t, down_t)
    _, ctx = R.mxfp8_forward(schedule, inp["x"], inp["router_weights"], *shared_w, *forward_q,
                             swiglu_limit=limit)  # fmt: skip
    want = R.mxfp8_backward(schedule, ctx, inp["grad_output"], inp["x"], inp["router_weights"],
                            *shared_w, *routed, swiglu_limit=limit)  # fmt: skip
    if exact:
        ctx = dequantised_context(quantised_context(ctx, inp["x"]))
    empty = inp["x"].new_empty(0)
    ctx_tensors = [t if t is not None else empty for t in ctx.tensors()]
    got = bwd.backward(_Workspace(), schedule, ctx_tensors, inp["grad_output"], inp["x"],
                       inp["router_weights"], shared_w, routed, _settings(limit), (None,) * 6,
                       exact)  # fmt: skip
    assert torch.equal(got[0], want[0])  # d_x: same round trips, same fp32 products
    assert rel_error(got[1], want[1]) < 2**-8
    for g, w in zip(got[2:], want[2:], strict=True):
        if w is None:
            assert g.numel() == 0
        else:
            assert rel_error(g.float(), w) < 2**-8 and g.dtype == torch.bfloat16


@pytest.mark.parametrize("shared,limit", [(True, None), (False, 0.5)])
def test_forward_composition_equals_reference(fake_kernels, shared, limit):
    _check_forward_composition(shared, limit)


def test_no_path_switch_is_exported():
    import mok.launchers

    # One implementation per pass: no module-level switch between two.
    for name in ("set_forward_path", "set_backward_path", "set_comm_ctas", "set_phase_clock"):
        assert not hasattr(mok.launchers, name), name


def _check_forward_composition(shared, limit):
    inp = make_inputs(T, H, I, E, K, shared=shared, seed=4)
    schedule = R.make_schedule(inp["top_experts"], num_local_experts=E, capacity=T * K + E * 128)
    weights = [inp[n] for n in WEIGHTS]
    out, ctx = R.forward(schedule, inp["x"], inp["router_weights"], *weights, swiglu_limit=limit)
    got = fwd.forward(_Workspace(), schedule, inp["x"], inp["router_weights"], weights[:3],
                      weights[3:], _settings(limit))  # fmt: skip
    assert torch.equal(got[0], out)
    rows = int(schedule.num_tokens)
    for g, w in zip(got[1:5], ctx.tensors()[:4], strict=True):
        assert torch.equal(g[:rows], w[:rows])
    for g, w in zip(got[5:], ctx.tensors()[4:], strict=True):
        assert g.numel() == 0 if w is None else torch.equal(g, w)
    again = fwd.recompute_forward_context(_Workspace(), schedule, inp["x"], *weights[:2],
                                          *weights[3:5], limit)  # fmt: skip
    for i, (a, b) in enumerate(zip(again, got[1:], strict=True)):
        # Routed rows at or past num_tokens are not part of the contract.
        assert torch.equal(a[:rows], b[:rows]) if i < 4 else torch.equal(a, b)


def test_an_op_plan_is_not_reused_for_another_workspace_with_its_handle(fake_kernels):
    """An evicted workspace's handle is taken over by the one made anew: the op plan made for
    the old object (its buffers, tables) must not serve the new one."""
    inp = make_inputs(T, H, I, E, K, seed=6)
    schedule = R.make_schedule(inp["top_experts"], num_local_experts=E, capacity=T * K + E * 128)
    weights = [inp[n] for n in WEIGHTS]
    first, second = _Workspace(), _Workspace()  # the same handle, two objects
    outs = [fwd.forward(ws, schedule, inp["x"], inp["router_weights"], weights[:3], weights[3:],
                        _settings(None)) for ws in (first, second)]  # fmt: skip
    from mok.launchers import plans

    (op,) = [p for k, p in plans.plans_of_thread().items() if k[0] == "forward"]
    assert op.ws() is second
    assert torch.equal(outs[0][0], outs[1][0])


@pytest.mark.parametrize("main_down", [False, True])
def test_fused_gate_up_weights_give_one_fused_gradient(fake_kernels, main_down):
    """Routed gate/up as the halves of one [E, 2 I, H]: the op returns their gradient as that
    one fused bf16 tensor in gate's place (empty in up's), equal to the separate weights'; from
    the megakernel's launch, or (a main_grad for down) from the weight-gradient kernels."""
    inp = make_inputs(T, H, I, E, K, seed=7)
    schedule = R.make_schedule(inp["top_experts"], num_local_experts=E, capacity=T * K + E * 128)
    weights = [inp[n] for n in WEIGHTS]
    gate_up = torch.cat([inp["routed_gate"], inp["routed_up"]], dim=1)
    fused = weights[:3] + [gate_up[:, :I], gate_up[:, I:]] + weights[5:]
    _, ctx = R.forward(schedule, inp["x"], inp["router_weights"], *weights)
    empty = inp["x"].new_empty(0)
    ctx_tensors = [t if t is not None else empty for t in ctx.tensors()]
    results = []
    for ws in (weights, fused):
        mains = (None, None, torch.zeros(E, H, I) if main_down else None, None, None, None)
        results.append(bwd.backward(_Workspace(), schedule, ctx_tensors, inp["grad_output"],
                                    inp["x"], inp["router_weights"], ws[:3], ws[3:],
                                    _settings(None), mains))  # fmt: skip
    separate, got = results
    assert got[2].shape == (E, 2 * I, H) and got[3].numel() == 0
    assert torch.equal(got[2], torch.cat([separate[2], separate[3]], dim=1))
    assert torch.equal(got[0], separate[0]) and torch.equal(got[4], separate[4])
    split = F.backward_outputs(got, (None,) * 6, False)
    assert split[2]._base is got[2] and split[3]._base is got[2]
    assert split[3].data_ptr() == got[2].data_ptr() + I * H * 2
