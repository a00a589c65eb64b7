"""Macrobatch ring reuse with replay (MoKConfig.macrobatch_size below the routed rows), on CPU.

- mok.reference's oracles of the two new kernels: each macrobatch's schedule sizes
  (`macrobatch_schedules`) against a walk over the rows, and the window weight gradients
  (`weight_gradient_window`) continued macrobatch by macrobatch against one pass, bitwise.
- The layer through mok.functional on the CPU path (mok.reference's ring semantics: the
  context holds macrobatch 0, the backward replays the others): out and every gradient bitwise
  the same for every macrobatch size, with and without the shared expert, a clamp, fp32
  main_grads, a recomputed context (MoKExperts(recompute=True)), torch.compile and an EP group
  of two; the macrobatch sizes scale the original's tests (4096, 8192 and 16384 of 57344 routed
  rows) to 256, 512 and 1024 of 2048.
- The GPU launchers' composition (mok/launchers/macrobatch.py) with the kernels replaced by
  mok.reference's math on the same operands: bitwise the same for every macrobatch size, the
  launches it makes, their arguments against the shipped manifest.
- Clear errors: a macrobatch that is not a multiple of 128 or of the minibatch, a context of
  the wrong rows.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.distributed as dist
from bitwise import assert_bitwise, bits
from ep_worker import run_on_gloo_group
from fake_kernels import fake_kernels, fake_push_router_grads
from torch._subclasses.fake_tensor import FakeTensorMode

from mok import functional as F
from mok import ops, validation
from mok import reference as R
from mok.launchers import dispatch, epilogues, expert_gemm, expert_gemm_bwd
from mok.nn import MoKExperts
from mok.testing import WEIGHT_NAMES, make_inputs, rel_error
from mok.types import PassConfig

macrobatch = importlib.import_module("mok.launchers.macrobatch")

# 2048 routed rows (2560 rows of capacity with padding) over few experts, so that every
# expert's segment has several row tiles and crosses macrobatch edges: a weight-gradient sum
# taken in another order would show (two-term fp32 sums do not: they commute).
T, H, I, E, K = 1024, 256, 256, 4, 2
SIZES = (256, 512, 1024)  # the original's 4096 / 8192 / 16384 of 57344 rows, scaled


def config_of(macrobatch_size: int | None) -> F.MoKConfig:
    if macrobatch_size is None:
        return F.MoKConfig()
    return F.MoKConfig(minibatch_size=256, macrobatch_size=macrobatch_size)


# ----------------------------------------------------------------------------------------------
# the kernels' oracles
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window_rows", [128, 256, 384, 1024, 4096])
def test_macrobatch_schedules_match_a_walk_over_the_rows(window_rows):
    gen = torch.Generator().manual_seed(window_rows)
    for experts, capacity in ((1, 128), (7, 2048), (64, 4096 + 512)):
        sizes = torch.randint(0, 6, (experts,), generator=gen) * 128
        sizes[0] = 0  # an empty first expert
        while int(sizes.sum()) > capacity:
            sizes[int(sizes.argmax())] -= 128
        rows = int(sizes.sum())
        tokens, per_expert = R.macrobatch_schedules(
            torch.tensor([rows], dtype=torch.int32), sizes.to(torch.int32),
            window_rows=window_rows, capacity=capacity,
        )  # fmt: skip
        windows = -(-capacity // window_rows)
        assert tokens.shape == (windows,) and per_expert.shape == (windows, experts)
        owner = torch.repeat_interleave(torch.arange(experts), sizes)  # expert of each row
        for m in range(windows):
            first, end = m * window_rows, min((m + 1) * window_rows, capacity)
            mine = owner[first:end]
            want = torch.bincount(mine, minlength=experts) if mine.numel() else 0 * sizes
            assert torch.equal(per_expert[m].long(), want), (m, window_rows)
            assert int(tokens[m]) == mine.numel() == int(per_expert[m].sum())
            assert (per_expert[m] % 128 == 0).all()


@pytest.mark.parametrize("output", ["bf16", "accumulate"])
def test_window_weight_gradients_continue_across_macrobatches_bitwise(output):
    gen = torch.Generator().manual_seed(7)
    sizes = torch.tensor([384, 0, 128, 1024, 0, 256], dtype=torch.int32)  # empty experts too
    rows, m_size, n_size = int(sizes.sum()) + 256, 128, 256  # 256 rows past the last segment
    a = torch.randn(rows, m_size, generator=gen).to(torch.bfloat16)
    b = torch.randn(rows, n_size, generator=gen).to(torch.bfloat16)
    initial = torch.randn(len(sizes), m_size, n_size, generator=gen)
    initial[1, 0, :4] = -0.0  # an empty expert's main_grad keeps the bits of old + 0

    def run(window_rows):
        out = initial.clone() if output == "accumulate" else torch.full(initial.shape, float("nan"))
        out = out if output == "accumulate" else out.to(torch.bfloat16)
        partials = torch.full((2, m_size, n_size), float("nan"))
        for m, first in enumerate(range(0, rows, window_rows)):
            window = slice(first, min(first + window_rows, rows))
            R.weight_gradient_window(a[window], b[window], sizes, first, out, partials[m % 2],
                                     partials[(m + 1) % 2], output=output)  # fmt: skip
        return out

    one_pass = run(rows)
    assert not torch.isnan(one_pass.float()).any()  # every expert written, the empty ones too
    segment = 0
    for e, n in enumerate(sizes.tolist()):
        grad = a[segment : segment + n].float().t() @ b[segment : segment + n].float()
        want = initial[e] + grad if output == "accumulate" else grad
        assert rel_error(one_pass[e].float(), want) < 2**-7
        segment += n
    for window_rows in (128, 256, 512, 768):
        assert torch.equal(bits(run(window_rows)), bits(one_pass)), window_rows


# ----------------------------------------------------------------------------------------------
# the layer through mok.functional (CPU path)
# ----------------------------------------------------------------------------------------------


def run_functional(inputs, config, *, limit=None, main=False, routing_experts=E):
    t, h = inputs["x"].shape
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=t, hidden_size=h, topk=K,
                         num_local_experts=routing_experts)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]
    schedule = F.build_schedule(ws, config, inputs["top_experts"],
                                num_local_experts=routing_experts)  # fmt: skip
    out, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights,
                         swiglu_limit=limit)  # fmt: skip
    main_grads = None
    if main:
        gen = torch.Generator().manual_seed(3)
        order = (3, 4, 5, 0, 1, 2)  # routed gate/up/down, then shared
        main_grads = tuple(
            None if weights[i] is None else torch.randn(weights[i].shape, generator=gen)
            for i in order
        )
    grads = F.backward(config, ws, schedule, ctx, inputs["grad_output"], inputs["x"],
                       inputs["router_weights"], *weights, swiglu_limit=limit,
                       main_grads=main_grads)  # fmt: skip
    return schedule, out, ctx, grads


@pytest.mark.parametrize(
    "shared,limit,main,routing",
    [
        (True, None, False, "random"),
        (False, 0.5, False, "random"),
        (True, None, True, "random"),
        (False, None, True, "one_expert"),  # one expert holds every token: it crosses each edge
        (True, None, False, "empty_experts"),
    ],
)
def test_layer_is_bitwise_the_same_for_every_macrobatch_size(shared, limit, main, routing):
    inputs = make_inputs(T, H, I, E, K, shared=shared, routing=routing, seed=11)
    schedule, *want = run_functional(inputs, config_of(None), limit=limit, main=main)
    capacity = schedule.capacity
    assert want[1].x_routed.shape[0] == capacity
    for size in SIZES:
        got_schedule, out, ctx, grads = run_functional(inputs, config_of(size), limit=limit,
                                                       main=main)  # fmt: skip
        assert torch.equal(got_schedule.peer_rank, schedule.peer_rank)
        assert_bitwise((out, *grads), (want[0], *want[2]), size)
        # The context holds macrobatch 0's rows only: the memory saved.
        routed = ctx.tensors()[:4]
        assert [t.shape[0] for t in routed] == [size] * 4
        assert_bitwise(routed, [t[:size] for t in want[1].tensors()[:4]], size)
        assert_bitwise(ctx.tensors()[4:], want[1].tensors()[4:], size)


def test_a_macrobatch_of_every_row_or_more_is_the_default_path():
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=12)
    _, out, ctx, grads = run_functional(inputs, config_of(None))
    for size in (T * K, 1 << 14):  # T * k = 2048: every row at once, not ring reuse
        _, out2, ctx2, grads2 = run_functional(inputs, config_of(size))
        assert ctx2.x_routed.shape == ctx.x_routed.shape
        assert_bitwise((out2, *grads2), (out, *grads), size)


@pytest.mark.parametrize("recompute", [False, True])
def test_module_with_ring_reuse_gives_the_default_bits(recompute):
    """MoKExperts: the saved context (macrobatch 0) or a recomputed one (every row, read
    macrobatch by macrobatch without replay), with fp32 main_grads."""
    inputs = make_inputs(T, H, I, E, K, seed=13)

    def step(config):
        torch.manual_seed(0)
        module = MoKExperts(E, H, I, K, shared_expert=True, config=config, recompute=recompute,
                            accumulate_main_grad=True)  # fmt: skip
        for p in module.parameters():
            p.main_grad = torch.zeros(p.shape)
        x = inputs["x"].clone().requires_grad_()
        w = inputs["router_weights"].clone().requires_grad_()
        out = module(x, w, inputs["top_experts"])
        out.float().pow(2).sum().backward()
        return [out, x.grad, w.grad] + [p.main_grad for p in module.parameters()]

    want = step(config_of(None))
    for size in SIZES:
        assert_bitwise(step(config_of(size)), want, size)


def test_compiled_step_with_ring_reuse_equals_eager():
    """torch.compile(fullgraph=True): the fake forward gives the context macrobatch 0's rows."""
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=14)
    config = config_of(512)
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    weights = [inputs[n] for n in WEIGHT_NAMES]

    def step(top_experts, x, router_weights, dy, *weights):
        schedule = F.build_schedule(ws, config, top_experts, num_local_experts=E)
        out, ctx = F.forward(config, ws, schedule, x, router_weights, *weights)
        grads = F.backward(config, ws, schedule, ctx, dy, x, router_weights, *weights)
        return out, ctx.x_routed, grads

    args = (inputs["top_experts"], inputs["x"], inputs["router_weights"], inputs["grad_output"])
    eager = step(*args, *weights)
    assert eager[1].shape == (512, H)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")(*args, *weights)
    assert_bitwise((compiled[0], compiled[1], *compiled[2]), (eager[0], eager[1], *eager[2]),
                   "compiled")  # fmt: skip


@pytest.mark.parametrize("shared,limit", [(True, None), (False, 0.5)])
def test_layer_replaying_x_only_gives_the_default_bits(shared, limit):
    """MoKConfig.macrobatch_replay "gather": the context holds macrobatch 0's x rows and gate,
    up and hidden of every row; every output and gradient bitwise the default path's."""
    inputs = make_inputs(T, H, I, E, K, shared=shared, seed=11)
    schedule, *want = run_functional(inputs, config_of(None), limit=limit)
    for size in SIZES:
        config = dataclasses.replace(config_of(size), macrobatch_replay="gather")
        _, out, ctx, grads = run_functional(inputs, config, limit=limit)
        assert_bitwise((out, *grads), (want[0], *want[2]), size)
        routed = ctx.tensors()[:4]
        assert [t.shape[0] for t in routed] == [size] + [schedule.capacity] * 3
        assert_bitwise(routed, [want[1].x_routed[:size], *want[1].tensors()[1:4]], size)
    # Every row at once: the knob changes nothing.
    config = dataclasses.replace(config_of(None), macrobatch_replay="gather")
    _, out, ctx, grads = run_functional(inputs, config, limit=limit)
    assert_bitwise((out, *grads), (want[0], *want[2]), "every row")
    assert ctx.x_routed.shape[0] == schedule.capacity


def test_fake_forward_sizes_the_context_by_the_macrobatch():
    inputs = make_inputs(T, H, I, E, K, seed=15)
    ws = F.get_workspace(F.MoKConfig(), None, device="cpu", num_local_tokens=T, hidden_size=H,
                         topk=K, num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, F.MoKConfig(), inputs["top_experts"], num_local_experts=E)
    weights = [inputs[n] for n in WEIGHT_NAMES]
    for size, rows in ((256, 256), (1024, 1024), (T * K, schedule.capacity)):
        args = [ws.handle, *(schedule.peer_rank, schedule.peer_token_idx, schedule.num_tokens,
                             schedule.tokens_per_expert), inputs["x"], inputs["router_weights"],
                *weights, None, 0, 256, size]  # fmt: skip
        real = torch.ops.mok.forward(*args)
        mode = FakeTensorMode()
        with mode:
            fake = torch.ops.mok.forward(
                *[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            )
        assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real], size
        assert real[1].shape == (rows, H)
        # macrobatch_replay "gather": gate, up and hidden keep every row.
        real = torch.ops.mok.forward(*args, "gather")
        with mode:
            fake = torch.ops.mok.forward(
                *[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args],
                "gather",
            )
        assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real], size
        assert [t.shape[0] for t in real[1:5]] == [rows] + [schedule.capacity] * 3


def ep_worker(rank, world_size, macrobatch_size, replay="gate_up"):
    inputs = make_inputs(world_size * EP_TOKENS, H, I, E, K, shared=True, seed=16)
    local = E // world_size
    rows = slice(rank * EP_TOKENS, (rank + 1) * EP_TOKENS)
    mine = {n: (v[rows] if n in ("x", "router_weights", "top_experts", "grad_output") else v)
            for n, v in inputs.items()}  # fmt: skip
    for name in ("routed_gate", "routed_up", "routed_down"):
        mine[name] = inputs[name][rank * local : (rank + 1) * local]
    config = dataclasses.replace(config_of(macrobatch_size), macrobatch_replay=replay)
    ws = F.get_workspace(config, dist.group.WORLD, device="cpu", num_local_tokens=EP_TOKENS,
                         hidden_size=H, topk=K, num_local_experts=local)  # fmt: skip
    weights = [mine[n] for n in WEIGHT_NAMES]
    schedule = F.build_schedule(ws, config, mine["top_experts"], num_local_experts=local)
    out, ctx = F.forward(config, ws, schedule, mine["x"], mine["router_weights"], *weights)
    grads = F.backward(config, ws, schedule, ctx, mine["grad_output"], mine["x"],
                       mine["router_weights"], *weights)  # fmt: skip
    return {"out": out, "grads": grads, "rows": [t.shape[0] for t in ctx.tensors()[:4]],
            "capacity": schedule.capacity}  # fmt: skip


EP_TOKENS = 512  # per rank: T * k = 1024 routed rows


@pytest.mark.parametrize("replay", ["gate_up", "gather"])
def test_ep_group_of_two_with_ring_reuse_gives_the_default_bits(replay):
    """Each rank replays its macrobatches pulling x rows from both ranks; with "gather" the
    context keeps every row's gate, up and hidden and the replay is that pull alone."""
    want = run_on_gloo_group(ep_worker, 2, None)
    got = run_on_gloo_group(ep_worker, 2, 256, replay)
    for rank in range(2):
        kept = got[rank]["capacity"] if replay == "gather" else 256
        assert got[rank]["rows"] == [256, kept, kept, kept]
        assert_bitwise((got[rank]["out"], *got[rank]["grads"]),
                       (want[rank]["out"], *want[rank]["grads"]), rank)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# clear errors
# ----------------------------------------------------------------------------------------------


def test_macrobatch_errors_are_clear_on_both_paths():
    with pytest.raises(ValueError, match=r"macrobatch_size must be a positive multiple of 128 "
                                         r"routed rows \(forward: .*got 200"):  # fmt: skip
        validation.check_macrobatch(200, T, K, "forward")
    with pytest.raises(ValueError, match=r"macrobatch_size must be a multiple of minibatch_size "
                                         r"\(512\) \(backward\), got 768"):  # fmt: skip
        validation.check_macrobatch(768, T, K, "backward", 512)
    with pytest.raises(TypeError, match="macrobatch_size must be an int"):
        validation.check_macrobatch(256.0, T, K, "forward")
    assert validation.check_macrobatch(256, T, K, "forward", 256) is True  # ring reuse
    assert validation.check_macrobatch(T * K, T, K, "forward", 256) is False  # every row at once
    assert validation.context_rows(256, 4096, T, K) == 256
    assert validation.context_rows(T * K, 4096, T, K) == 4096
    # The CPU path of the op (the ints of the config, unvalidated) applies the same rule.
    inputs = make_inputs(T, H, I, E, K, seed=17)
    ws = F.get_workspace(F.MoKConfig(), None, device="cpu", num_local_tokens=T, hidden_size=H,
                         topk=K, num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, F.MoKConfig(), inputs["top_experts"], num_local_experts=E)
    weights = [inputs[n] for n in WEIGHT_NAMES]
    sched = (schedule.peer_rank, schedule.peer_token_idx, schedule.num_tokens,
             schedule.tokens_per_expert)  # fmt: skip
    for size, minibatch, message in ((200, 256, "multiple of 128"),
                                     (768, 512, "multiple of minibatch_size")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ops.forward(ws.handle, *sched, inputs["x"], inputs["router_weights"], *weights, None,
                        0, minibatch, size)  # fmt: skip
    # MoKConfig refuses them where it is used (made with any values, as the original's).
    with pytest.raises(ValueError, match="multiple of minibatch_size"):
        F.MoKConfig(minibatch_size=256, macrobatch_size=384).validate()
    # macrobatch_replay: MoKConfig's values only, on the config and on the raw op.
    with pytest.raises(ValueError, match=r"macrobatch_replay must be one of \('gate_up', "
                                         r"'gather'\), got 'gemm'"):  # fmt: skip
        F.MoKConfig(macrobatch_replay="gemm").validate()
    with pytest.raises(TypeError, match="macrobatch_replay must be a str, got bool"):
        F.MoKConfig(macrobatch_replay=True).validate()
    with pytest.raises(ValueError, match="macrobatch_replay must be one of"):
        ops.forward(ws.handle, *sched, inputs["x"], inputs["router_weights"], *weights, None, 0,
                    256, 512, "all")  # fmt: skip


def test_backward_refuses_a_context_of_other_rows():
    inputs = make_inputs(T, H, I, E, K, seed=18)
    config = config_of(512)
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=E)
    weights = [inputs[n] for n in WEIGHT_NAMES]
    _, ctx = F.forward(config, ws, schedule, inputs["x"], inputs["router_weights"], *weights)
    bad = dataclasses.replace(ctx, x_routed=ctx.x_routed[:256])
    with pytest.raises(ValueError, match=r"forward_context.x_routed must have shape \[512, 256\]"):
        F.backward(config, ws, schedule, bad, inputs["grad_output"], inputs["x"],
                   inputs["router_weights"], *weights)  # fmt: skip
    # The reference names the rows it takes.
    with pytest.raises(ValueError, match=r"capacity \(2560\) or macrobatch 0's \(512\) rows"):
        R.backward(schedule, bad, inputs["grad_output"], inputs["x"], inputs["router_weights"],
                   *weights, macrobatch_size=512)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# the GPU launchers' composition, kernels replaced by the reference's math
# ----------------------------------------------------------------------------------------------


def fake_routed_forward(x, schedule, topk, weights, pass_config, *, slots=None, context=None,
                        **_):  # fmt: skip
    """The forward megakernel over one (sub-)schedule: dispatch, gate/up + SwiGLU, down rows to
    their slots; row tile by row tile, as the reference (and the kernel) computes them. The
    context in new tensors, or written into `context` (as the launch writes it there)."""
    ctx, y = R._routed_forward(schedule, x, *weights, topk=topk, group=None,
                               swiglu_limit=pass_config.swiglu_limit)  # fmt: skip
    slots = R.push_rows(y, schedule.peer_rank, schedule.peer_token_idx, x.shape[0] * topk, None,
                        out=slots)  # fmt: skip
    if context is None:
        return ctx.tensors()[:4], slots
    for into, rows in zip(context, ctx.tensors()[:4], strict=True):
        into.copy_(rows)
    return context, slots


def fake_routed_backward(grad_output, router_weights, schedule, context, weights, pass_config,
                         *, weight_grads=True, slots=None, window=None, **_):  # fmt: skip
    """The backward megakernel over one (sub-)schedule: with a WeightWindow its weight tasks
    (the window's part of each gradient, from and into its partials), else no weight phase."""
    assert not weight_grads  # the ring path sums the weight gradients macrobatch by macrobatch
    _, gate, up, _ = context
    gate_w, up_w, down_w = weights
    swiglu_limit = pass_config.swiglu_limit
    topk = router_weights.shape[1]
    peer, slot = schedule.peer_rank, schedule.peer_token_idx
    dy_routed = R.pull_rows(grad_output, peer, slot.long() // topk, None)
    w_routed = R.pull_rows(router_weights.reshape(-1, 1).float(), peer, slot, None)
    dy_e = (w_routed * dy_routed.float()).to(torch.bfloat16)
    d_gate, d_up = torch.zeros_like(gate), torch.zeros_like(up)
    partials = torch.zeros(gate.shape[0], gate.shape[1] // 128)
    d_x = torch.zeros(gate.shape[0], grad_output.shape[1], dtype=torch.bfloat16)
    for e, (start, end) in enumerate(R.expert_segments(schedule)):
        for r in R._row_tiles(start, end):
            d_hidden = dy_e[r].float() @ down_w[e].float()
            d_gate[r], d_up[r] = R.swiglu_backward(d_hidden, gate[r], up[r], swiglu_limit)
            d_x[r] = (d_gate[r].float() @ gate_w[e].float()
                      + d_up[r].float() @ up_w[e].float()).to(torch.bfloat16)  # fmt: skip
            y = R.swiglu(gate[r], up[r], swiglu_limit).float()
            partials[r] = (y * d_hidden).view(y.shape[0], -1, 128).sum(dim=2)
    slots = R.push_rows(d_x, peer, slot, grad_output.shape[0] * topk, None, out=slots)
    if window is None:
        return dy_e, d_gate, d_up, partials, slots, None
    # The kernel's GEMM order (dW_down, dW_gate, dW_up) and its partials' layout.
    x_rows, hidden = context[0], context[3]
    d_w_gate, d_w_up, d_w_down = window.d_weights
    hidden_size, inter = d_w_down.shape[1:]
    for g, (a, b, out) in enumerate(((dy_e, hidden, d_w_down), (d_gate, x_rows, d_w_gate),
                                     (d_up, x_rows, d_w_up))):  # fmt: skip
        shape = (hidden_size, inter) if g == 0 else (inter, hidden_size)
        R.weight_gradient_window(a, b, window.tokens_per_expert, window.first_row, out,
                                 window.partial_in[g].view(shape),
                                 window.partial_out[g].view(shape), output="bf16")  # fmt: skip
    return dy_e, d_gate, d_up, partials, slots, list(window.d_weights)


def fake_gather_rows(src, peer_rank, peer_token_idx, num_tokens, topk, *, out=None, peers=None):
    rows = R.pull_rows(src, peer_rank, peer_token_idx.long() // topk, None)
    if out is None:
        return rows
    out.copy_(rows)
    return out


def fake_gate_up_swiglu(x, gate_w, up_w, tokens, *, swiglu_limit=None, gate=None, up=None,
                        hidden=None):  # fmt: skip
    shape = (x.shape[0], gate_w.shape[1])
    outs = [t if t is not None else torch.zeros(shape, dtype=torch.bfloat16)
            for t in (gate, up, hidden)]  # fmt: skip
    gate, up, hidden = outs
    for e, (start, end) in enumerate(R.expert_segments(R.MoKSchedule(None, None, None, tokens))):
        for r in R._row_tiles(start, end):
            gate[r] = R._mm(x[r], gate_w[e]).to(torch.bfloat16)
            up[r] = R._mm(x[r], up_w[e]).to(torch.bfloat16)
            hidden[r] = R.swiglu(gate[r], up[r], swiglu_limit)
    return gate, up, hidden


def fake_down(hidden, down_w, tokens):
    y = torch.zeros(hidden.shape[0], down_w.shape[1], dtype=torch.bfloat16)
    for e, (start, end) in enumerate(R.expert_segments(R.MoKSchedule(None, None, None, tokens))):
        y[start:end] = R._mm(hidden[start:end], down_w[e]).to(torch.bfloat16)
    return y


def fake_d_hidden(dy, down_w, gate, up, tokens, *, swiglu_limit=None, router_partials=None):
    d_hidden = dy.float() @ down_w[0].float()
    return R.swiglu_backward(d_hidden, gate, up, swiglu_limit)


def fake_d_x(d_gate, d_up, gate_w, up_w, tokens):
    return (d_gate.float() @ gate_w[0].float() + d_up.float() @ up_w[0].float()).to(torch.bfloat16)


def fake_weight_gradient(a, b, tokens, *, output="fp32", out=None):
    grad = (a.float().t() @ b.float()).unsqueeze(0)
    if output == "accumulate":
        return out.add_(grad)
    return grad.to(torch.bfloat16) if output == "bf16" else grad


class _Workspace:
    ep_rank, ep_size, hidden_size, topk, num_local_tokens = 0, 1, H, K, T
    megakernel_ctas, wait_timeout_ns = None, 1
    # A group of one's slots are the workspace's (launchers/forward_op.py, backward_op.py).
    buffers = {name: torch.full((T * K, H), float("nan"), dtype=torch.bfloat16)
               for name in ("combine_buffer", "d_x_routed_buffer")}  # fmt: skip


@pytest.fixture()
def launches(monkeypatch):
    """The ring path's kernels replaced by the reference's math; returns the launch log."""
    log = []

    def logged(name, fn):
        def run(*args, **kwargs):
            log.append(name)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(macrobatch, "window_schedules",
                        logged("macrobatch_schedule", R.macrobatch_windows))  # fmt: skip
    monkeypatch.setattr(macrobatch, "launch_routed_forward",
                        logged("moe_forward", fake_routed_forward))  # fmt: skip
    monkeypatch.setattr(macrobatch, "launch_routed_backward",
                        logged("moe_backward", fake_routed_backward))  # fmt: skip
    monkeypatch.setattr(macrobatch, "push_router_grads",
                        logged("router_grad_push", fake_push_router_grads))  # fmt: skip
    monkeypatch.setattr(macrobatch, "weight_gradient_window",
                        logged("weights_window", R.weight_gradient_window))  # fmt: skip
    monkeypatch.setattr(dispatch, "gather_rows", logged("gather_rows", fake_gather_rows))
    monkeypatch.setattr(expert_gemm, "gate_up_swiglu", logged("gate_up", fake_gate_up_swiglu))
    monkeypatch.setattr(expert_gemm, "down", fake_down)
    monkeypatch.setattr(expert_gemm_bwd, "d_hidden_swiglu", fake_d_hidden)
    monkeypatch.setattr(expert_gemm_bwd, "d_x", fake_d_x)
    monkeypatch.setattr(expert_gemm_bwd, "weight_gradient", fake_weight_gradient)
    monkeypatch.setattr(epilogues, "fwd_epilogue", R.fwd_epilogue)
    monkeypatch.setattr(epilogues, "bwd_epilogue", R.bwd_epilogue)
    return log


def compose(inputs, schedule, size, main, limit, replay="gate_up"):
    """(out, context, 8 gradients, fp32 main_grads) through the ring launchers."""
    weights = [inputs[n] for n in WEIGHT_NAMES]
    shared, routed = weights[:3], weights[3:]
    pass_config = PassConfig(swiglu_limit=limit, minibatch_size=256, macrobatch_size=size,
                             macrobatch_replay=replay)  # fmt: skip
    got = macrobatch.forward(_Workspace(), schedule, inputs["x"], inputs["router_weights"], shared,
                             routed, pass_config)  # fmt: skip
    out, ctx = got[0], list(got[1:])
    order = (3, 4, 5, 0, 1, 2)
    gen = torch.Generator().manual_seed(5)
    mains = tuple(torch.randn(weights[i].shape, generator=gen) if main and weights[i] is not None
                  else None for i in order)  # fmt: skip
    grads = macrobatch.backward(_Workspace(), schedule, ctx, inputs["grad_output"], inputs["x"],
                                inputs["router_weights"], shared, routed, pass_config,
                                mains)  # fmt: skip
    return out, ctx, grads, [m for m in mains if m is not None]


@pytest.mark.parametrize("shared,limit,main", [(False, None, False), (True, 0.5, True)])
def test_ring_launchers_give_the_same_bits_for_every_macrobatch_size(launches, shared, limit,
                                                                    main):  # fmt: skip
    inputs = make_inputs(T, H, I, E, K, shared=shared, routing="one_expert", seed=19)
    schedule = R.make_schedule(inputs["top_experts"], num_local_experts=E, capacity=4096)
    windows = -(-schedule.capacity // SIZES[0])
    want = compose(inputs, schedule, 1 << 14, main, limit)  # one macrobatch of every row
    assert want[1][0].shape[0] == schedule.capacity
    # Routed-only, the ring launchers' math is the reference's, bitwise.
    weights = [inputs[n] for n in WEIGHT_NAMES]
    if not shared:
        out, _ = R.forward(schedule, inputs["x"], inputs["router_weights"], *weights,
                           swiglu_limit=limit)  # fmt: skip
        assert torch.equal(bits(want[0]), bits(out))
    for size in SIZES:
        launches.clear()
        got = compose(inputs, schedule, size, main, limit)
        assert [t.shape[0] for t in got[1][:4]] == [size] * 4
        assert_bitwise((got[0], *got[2], *got[3]), (want[0], *want[2], *want[3]), size)
        count = -(-schedule.capacity // size)
        # Forward: one schedule launch and a megakernel per macrobatch. Backward: the
        # schedule launch, a replay of every macrobatch but 0 (gather + gate/up), then per
        # macrobatch the megakernel (with its weight tasks for bf16 gradients) and the router
        # push, and for fp32 main_grads the three window weight-gradient GEMMs.
        assert launches.count("macrobatch_schedule") == 2
        assert launches.count("moe_forward") == launches.count("moe_backward") == count
        assert launches.count("gather_rows") == count - 1
        assert launches.count("gate_up") == count - 1 + (1 if shared else 0)
        assert launches.count("router_grad_push") == count
        assert launches.count("weights_window") == (3 * count if main else 0)
    assert windows == 16  # 4096 rows of capacity, about half of them routed


@pytest.mark.parametrize("shared,limit,main", [(False, None, False), (True, 0.5, True)])
def test_ring_launchers_replaying_x_only_give_the_same_bits(launches, shared, limit, main):
    """macrobatch_replay "gather": the forward writes gate, up and hidden of every macrobatch
    into tensors of every row, and the backward pulls each later macrobatch's x rows again and
    runs no gate/up GEMM."""
    inputs = make_inputs(T, H, I, E, K, shared=shared, routing="one_expert", seed=19)
    schedule = R.make_schedule(inputs["top_experts"], num_local_experts=E, capacity=4096)
    want = compose(inputs, schedule, 1 << 14, main, limit)
    for size in SIZES:
        launches.clear()
        got = compose(inputs, schedule, size, main, limit, replay="gather")
        assert [t.shape[0] for t in got[1][:4]] == [size] + [schedule.capacity] * 3
        assert_bitwise((got[0], *got[2], *got[3]), (want[0], *want[2], *want[3]), size)
        assert_bitwise(got[1][:4], [want[1][0][:size], *want[1][1:4]], size)
        count = -(-schedule.capacity // size)
        assert launches.count("moe_forward") == launches.count("moe_backward") == count
        assert launches.count("gather_rows") == count - 1
        assert launches.count("gate_up") == (1 if shared else 0)  # the shared expert's only
        assert launches.count("weights_window") == (3 * count if main else 0)


def test_ring_launchers_read_a_full_context_without_replay(launches):
    inputs = make_inputs(T, H, I, E, K, seed=20)
    schedule = R.make_schedule(inputs["top_experts"], num_local_experts=E, capacity=4096)
    weights = [inputs[n] for n in WEIGHT_NAMES]
    _, ctx = R.forward(schedule, inputs["x"], inputs["router_weights"], *weights)
    empty = torch.empty(0)
    ctx_tensors = [t if t is not None else empty for t in ctx.tensors()]
    shared, routed = weights[:3], weights[3:]
    want = macrobatch.backward(_Workspace(), schedule, ctx_tensors, inputs["grad_output"],
                               inputs["x"], inputs["router_weights"], shared, routed,
                               PassConfig(minibatch_size=256, macrobatch_size=1 << 14),
                               (None,) * 6)  # fmt: skip
    launches.clear()
    ring = PassConfig(minibatch_size=256, macrobatch_size=512)
    got = macrobatch.backward(_Workspace(), schedule, ctx_tensors, inputs["grad_output"],
                              inputs["x"], inputs["router_weights"], shared, routed, ring,
                              (None,) * 6)  # fmt: skip
    assert "gather_rows" not in launches and "gate_up" not in launches
    assert_bitwise(got, want, "full context")
    with pytest.raises(ValueError, match=r"hold macrobatch 0 \(512 rows\) or every routed row "
                                         r"\(4096\), got shape \[1024, 256\]"):  # fmt: skip
        macrobatch.backward(_Workspace(), schedule, [ctx_tensors[0][:1024], *ctx_tensors[1:]],
                            inputs["grad_output"], inputs["x"], inputs["router_weights"], shared,
                            routed, ring, (None,) * 6)  # fmt: skip


def test_gpu_ops_hand_a_small_macrobatch_to_the_ring_launchers(monkeypatch):
    fwd = importlib.import_module("mok.launchers.forward_op")
    bwd = importlib.import_module("mok.launchers.backward_op")
    calls = []
    monkeypatch.setattr(macrobatch, "forward",
                        lambda *a: calls.append(("forward", a[-1].macrobatch_size)))  # fmt: skip
    monkeypatch.setattr(macrobatch, "backward",
                        lambda *a: calls.append(("backward", a[-2].macrobatch_size)))  # fmt: skip
    x, w = torch.zeros(T, H, dtype=torch.bfloat16), torch.ones(T, K)
    none3, pass_config = (None,) * 3, PassConfig(minibatch_size=256, macrobatch_size=1024)
    fwd.forward(_Workspace(), None, x, w, none3, none3, pass_config)
    bwd.backward(_Workspace(), None, [None] * 7, x, x, w, none3, none3, pass_config, (None,) * 6)
    assert calls == [("forward", 1024), ("backward", 1024)]


# ----------------------------------------------------------------------------------------------
# the new kernels' launches against the shipped manifest
# ----------------------------------------------------------------------------------------------


def test_new_kernels_launch_packs(monkeypatch):
    from mok.launchers import device_args

    made = fake_kernels(monkeypatch)
    monkeypatch.setattr(macrobatch, "sm_count", lambda device: 132)
    monkeypatch.setattr(macrobatch, "check_cuda", lambda name, t, dtype, shape: None)
    monkeypatch.setattr(macrobatch, "check_counts", lambda name, t, size: None)
    monkeypatch.setattr(macrobatch, "check_expert_weights",
                        lambda name, t, dtype, shape: t.stride(0) // t.shape[2])  # fmt: skip
    device_args.clear_descriptor_cache()
    inputs = make_inputs(T, H, I, E, K, seed=21)
    schedule = R.make_schedule(inputs["top_experts"], num_local_experts=E, capacity=4096)
    windows = macrobatch.window_schedules(schedule, 1024)
    ((grid, args),) = made["macrobatch_schedule"].launches
    assert grid == (1, 1, 1) and args["num_windows"] == 4 and args["window_rows"] == 1024
    assert args["capacity"] == 4096 and args["num_experts"] == E
    assert [first for first, _ in windows] == [0, 1024, 2048, 3072]
    assert all(w.peer_rank.shape == (1024,) and w.tokens_per_expert.shape == (E,)
               for _, w in windows)  # fmt: skip
    assert windows[2][1].peer_rank.data_ptr() == schedule.peer_rank[2048:].data_ptr()
    a = torch.zeros(1024, I, dtype=torch.bfloat16)
    b = torch.zeros(1024, H, dtype=torch.bfloat16)
    partials = torch.zeros(2, I, H)
    for output, dtype in (("bf16", torch.bfloat16), ("accumulate", torch.float32)):
        out = torch.zeros(E, I, H, dtype=dtype)
        macrobatch.weight_gradient_window(a, b, schedule.tokens_per_expert, 1024, out,
                                          partials[0], partials[1], output=output)  # fmt: skip
        ((grid, args),) = made[macrobatch.WINDOW_KERNELS[output][0]].launches
        tiles = E * (I // 128) * (H // 256)  # fewer than the SMs here
        assert grid == (tiles, 1, 1) and args["first_row"] == 1024 and args["window_rows"] == 1024
        assert (args["m_size"], args["n_size"], args["num_experts"]) == (I, H, E)
        assert args["out_expert_rows"] == I
    # The plan's next call (the next macrobatch): no new kernel lookup, the new first_row and
    # addresses written over the bound launch; a misaligned address is still refused.
    kernel = made[macrobatch.WINDOW_KERNELS["accumulate"][0]]
    later = torch.zeros(1024, I, dtype=torch.bfloat16)
    macrobatch.weight_gradient_window(later, b, schedule.tokens_per_expert, 2048, out,
                                      partials[1], partials[0], output="accumulate")  # fmt: skip
    assert made[macrobatch.WINDOW_KERNELS["accumulate"][0]] is kernel
    (_, first), (_, second) = kernel.launches
    assert second["first_row"] == 2048 and second["out_ptr"] == out.data_ptr()
    assert (second["partial_in_ptr"], second["partial_out_ptr"]) == (
        first["partial_out_ptr"], first["partial_in_ptr"])  # fmt: skip
    assert second["window_rows"] == 1024 and second["num_experts"] == E
    shifted = torch.zeros(1024 * I + 4, dtype=torch.bfloat16)[4:].view(1024, I)
    with pytest.raises(ValueError, match="a_rows must be 16-byte aligned"):
        macrobatch.weight_gradient_window(shifted, b, schedule.tokens_per_expert, 0, out,
                                          partials[0], partials[1], output="accumulate")  # fmt: skip
    with pytest.raises(ValueError, match="partial_in and partial_out must be different"):
        macrobatch.weight_gradient_window(a, b, schedule.tokens_per_expert, 0, out, partials[0],
                                          partials[0], output="accumulate")  # fmt: skip
    with pytest.raises(ValueError, match="first_row must be a multiple of 128"):
        macrobatch.weight_gradient_window(a, b, schedule.tokens_per_expert, 64, out, partials[0],
                                          partials[1], output="accumulate")  # fmt: skip
    device_args.clear_descriptor_cache()


class _SeenAsCuda(torch.Tensor):
    """A CPU tensor that the launchers' checks take for a CUDA one (they read is_cuda and
    data_ptr only), to test alignment rules without a GPU."""

    @property
    def is_cuda(self):
        return True


@pytest.mark.parametrize("num_experts", [1, 2, 3, 5])
def test_a_macrobatch_row_of_tokens_per_expert_is_accepted_at_any_expert_count(num_experts):
    """window_schedules hands each macrobatch row m of an int32 [M, E] table to the expert GEMMs;
    with E = 1 (the original's one-expert backward case) row 1 lies 4 bytes in. The kernels read
    it element by element (Int32Pointer, 4-byte aligned), so every row is accepted; a 16-byte
    rule refused it."""
    from mok.launchers.checks import check_counts, check_cuda

    table = torch.arange(4 * num_experts, dtype=torch.int32).reshape(4, num_experts)
    table = table.as_subclass(_SeenAsCuda)
    for m in range(4):
        check_counts("tokens_per_expert", table[m], num_experts)
    if num_experts % 4:
        with pytest.raises(ValueError, match="16-byte aligned"):
            check_cuda("tokens_per_expert", table[1], torch.int32, (num_experts,))
    with pytest.raises(
        ValueError, match=r"tokens_per_expert must be a contiguous CUDA torch.int32"
    ):
        check_counts("tokens_per_expert", table[1].long(), num_experts)
    with pytest.raises(ValueError, match=r"shape \[7\]"):
        check_counts("tokens_per_expert", table[1], 7)
