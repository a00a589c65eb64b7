"""The original's raw op set (mok/original/ops.py) on the CPU path: the original's schemas
and mutated arguments, fake implementations, torch.compile(fullgraph=True) over a composition,
the composition as the original's functional API writes it bitwise equal to mok.functional
(BF16 and MXFP8, one rank and an EP group of two on gloo), and a clear error for each bad
argument of every op."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ep_worker import run_on_gloo_group
from original_composition import (
    assert_all_equal,
    context_in_mok_order,
    launch,
    raw_backward,
    raw_forward,
    raw_recompute,
    raw_schedule,
)
from torch._subclasses.fake_tensor import FakeTensorMode

from mok import functional as F
from mok import ops
from mok.errors import MoKInputError
from mok.mxfp8_context import flat
from mok.testing import make_inputs

# T multiple of 128: mok's MXFP8 recompute quantises x [T, H] along H in 128-row tiles.
# I != H so that a transposed weight has a shape of its own.
T, H, I, E, K = 128, 128, 256, 4, 2
CONFIG = F.MoKConfig()
WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")

# The original's argument names, in order, its output count and its mutated arguments.
SCHEDULE = ["schedule_peer_rank", "schedule_peer_token_idx", "num_tokens", "tokens_per_expert"]
LAUNCH = ["topk", "swiglu_limit", "num_comm_sms", "macrobatch_size", "minibatch_size"]
BWD_BUFFERS = ["d_y_buffer", "d_y_buffer_ptrs", "d_x_routed_buffer", "d_x_routed_buffer_ptrs",
               "router_weight_buffer", "router_weight_buffer_ptrs", "d_router_weight_buffer",
               "d_router_weight_buffer_ptrs"]  # fmt: skip
MXFP8_CONTEXT = ["x_fp8_t_routed", "x_sc_t_routed", "gate_shared", "gate_fp8_routed",
                 "gate_sc_routed", "up_shared", "up_fp8_routed", "up_sc_routed", "hidden_shared",
                 "hidden_fp8_t_routed", "hidden_sc_t_routed"]  # fmt: skip
ORIGINAL = {
    "all_gather_top_experts": (
        ["top_experts", "all_gather_top_experts_buffer",
         "all_gather_top_experts_buffer_multicast_ptr", "rank", "chunk_bytes"],
        0, ["all_gather_top_experts_buffer"],
    ),
    "barrier_all": (
        ["barrier_buffer", "barrier_buffer_ptrs", "barrier_buffer_multicast_ptr", "target"],
        0, ["barrier_buffer", "target"],
    ),
    "schedule": (["topk_all", "num_local_experts", "schedule_capacity", "rank"], 4, []),
    "dispatch_mlp_swiglu_combine_fwd_bf16": (
        ["x", "x_ptrs", "combine_buffer", "combine_buffer_ptrs", "w_shared_gate",
         "w_routed_gate", "w_shared_up", "w_routed_up", "w_shared_down", "w_routed_down",
         *SCHEDULE, *LAUNCH],
        9, ["combine_buffer"],
    ),
    "dispatch_mlp_swiglu_combine_bwd_bf16": (
        [*BWD_BUFFERS, "w_shared_gate", "w_routed_gate", "w_shared_up", "w_routed_up",
         "w_shared_down", "w_routed_down", "x_routed", "gate_shared", "gate_routed", "up_shared",
         "up_routed", "hidden_shared", "hidden_routed", "x", "x_ptrs", *SCHEDULE, *LAUNCH],
        15, ["d_x_routed_buffer", "d_router_weight_buffer", "x_routed", "gate_routed",
             "up_routed", "hidden_routed"],
    ),
    "dispatch_mlp_swiglu_combine_fwd_mxfp8": (
        ["x", "x_ptrs", "combine_buffer", "combine_buffer_ptrs", "w_shared_gate",
         "w_routed_gate", "w_routed_gate_sc", "w_shared_up", "w_routed_up", "w_routed_up_sc",
         "w_shared_down", "w_routed_down", "w_routed_down_sc", *SCHEDULE, *LAUNCH],
        13, ["combine_buffer"],
    ),
    "dispatch_mlp_swiglu_combine_bwd_mxfp8": (
        [*BWD_BUFFERS, "w_shared_gate", "w_routed_gate_T", "w_routed_gate_T_sc", "w_shared_up",
         "w_routed_up_T", "w_routed_up_T_sc", "w_shared_down", "w_routed_down_T",
         "w_routed_down_T_sc", *MXFP8_CONTEXT, "x", "x_ptrs", "w_routed_gate",
         "w_routed_gate_sc", "w_routed_up", "w_routed_up_sc", *SCHEDULE, *LAUNCH],
        18, ["d_x_routed_buffer", "d_router_weight_buffer", "x_fp8_t_routed", "x_sc_t_routed",
             "gate_fp8_routed", "gate_sc_routed", "up_fp8_routed", "up_sc_routed",
             "hidden_fp8_t_routed", "hidden_sc_t_routed"],
    ),
    "recompute_forward_context_bf16": (
        ["x", "x_ptrs", "w_shared_gate", "w_routed_gate", "w_shared_up", "w_routed_up",
         *SCHEDULE, *LAUNCH],
        7, [],
    ),
    "recompute_forward_context_mxfp8": (
        ["x", "x_ptrs", "w_shared_gate", "w_routed_gate", "w_routed_gate_sc", "w_shared_up",
         "w_routed_up", "w_routed_up_sc", *SCHEDULE, *LAUNCH],
        11, [],
    ),
}  # fmt: skip


def _op(name: str):
    """mok.ops' op of that name (for recompute_forward_context_mxfp8 the overload packet)."""
    return getattr(ops, name)


def _setup(shared=True, seed=0, group=None, num_local_experts=E, inputs=None):
    inputs = make_inputs(T, H, I, E, K, shared=shared, seed=seed) if inputs is None else inputs
    ws = F.get_workspace(CONFIG, group, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=num_local_experts)  # fmt: skip
    schedule = F.build_schedule(ws, CONFIG, inputs["top_experts"],
                                num_local_experts=num_local_experts)  # fmt: skip
    return inputs, ws, schedule


def _tensors(schedule):
    return (schedule.peer_rank, schedule.peer_token_idx, schedule.num_tokens,
            schedule.tokens_per_expert)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# schemas and fake tensors
# ----------------------------------------------------------------------------------------------


def test_schemas_are_the_originals():
    for name, (arguments, num_outputs, mutated) in ORIGINAL.items():
        packet = getattr(torch.ops.mok, name)
        overload = "original" if name == "recompute_forward_context_mxfp8" else ""
        schema = packet._schemas[overload]
        assert [a.name for a in schema.arguments] == arguments, name
        assert len(schema.returns) == num_outputs, name
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert written == mutated, name
        for a in schema.arguments:
            if a.name.endswith("_ptrs"):
                assert str(a.type) in ("List[int]", "List[SymInt]"), (name, a.name)
    # mok.ops holds the same ops; the MXFP8 recompute name keeps mok's layer op as its default
    # overload (mok.functional calls it with a workspace handle first).
    for name in ORIGINAL:
        if name != "recompute_forward_context_mxfp8":
            assert getattr(ops, name)._opoverload is getattr(torch.ops.mok, name).default
    assert ops.recompute_forward_context_mxfp8 is torch.ops.mok.recompute_forward_context_mxfp8
    default = torch.ops.mok.recompute_forward_context_mxfp8.default._schema
    assert default.arguments[0].name == "workspace_handle"


def _quantised(inputs):
    """mxfp8_quantize of each routed weight: (fp8, scale, fp8_t, scale_t)."""
    return {n: ops.mxfp8_quantize(inputs[n], True, True) for n in WEIGHTS[3:]}


@pytest.fixture(scope="module")
def env():
    """One workspace, schedule and a valid argument set for every op (by keyword)."""
    inputs, ws, schedule = _setup(shared=True, seed=11)
    weights = [inputs[n] for n in WEIGHTS]
    sg, su, sd, rg, ru, rd = weights
    sched = dict(zip(SCHEDULE, _tensors(schedule), strict=True))
    settings = dict(zip(LAUNCH, launch(CONFIG, ws, None, 0), strict=True))
    _, fwd = raw_forward(
        CONFIG, ws, _tensors(schedule), inputs["x"], inputs["router_weights"], weights
    )
    ws.d_y_buffer.copy_(inputs["grad_output"])
    q = _quantised(inputs)
    (g, gsc, gt, gtsc), (u, usc, ut, utsc), (d, dsc, dt, dtsc) = (q[n] for n in WEIGHTS[3:])
    fwd_buffers = dict(x=ws.x_buffer, x_ptrs=ws.x_buffer_ptrs, combine_buffer=ws.combine_buffer,
                       combine_buffer_ptrs=ws.combine_buffer_ptrs)  # fmt: skip
    bwd_buffers = {n: getattr(ws, n) for n in BWD_BUFFERS}
    bwd_buffers.update(x=ws.x_buffer, x_ptrs=ws.x_buffer_ptrs)
    mx_fwd = dict(**fwd_buffers, w_shared_gate=sg, w_routed_gate=g, w_routed_gate_sc=gsc,
                  w_shared_up=su, w_routed_up=u, w_routed_up_sc=usc, w_shared_down=sd,
                  w_routed_down=d, w_routed_down_sc=dsc, **sched, **settings)  # fmt: skip
    mx_ctx = ops.dispatch_mlp_swiglu_combine_fwd_mxfp8(**mx_fwd)[:11]
    bf16_ctx = ["x_routed", "gate_shared", "gate_routed", "up_shared", "up_routed",
                "hidden_shared", "hidden_routed"]  # fmt: skip
    kwargs = {
        "all_gather_top_experts": dict(
            top_experts=inputs["top_experts"].to(torch.int32),
            all_gather_top_experts_buffer=ws.all_gather_top_experts_buffer,
            all_gather_top_experts_buffer_multicast_ptr=0, rank=0, chunk_bytes=2048,
        ),
        "barrier_all": dict(barrier_buffer=ws.barrier_buffer,
                            barrier_buffer_ptrs=ws.barrier_buffer_ptrs,
                            barrier_buffer_multicast_ptr=0, target=ws.barrier_target),
        "schedule": dict(topk_all=ws.all_gather_top_experts_buffer, num_local_experts=E,
                         schedule_capacity=ws.schedule_capacity, rank=0),
        "dispatch_mlp_swiglu_combine_fwd_bf16": dict(
            **fwd_buffers, w_shared_gate=sg, w_routed_gate=rg, w_shared_up=su, w_routed_up=ru,
            w_shared_down=sd, w_routed_down=rd, **sched, **settings,
        ),
        "dispatch_mlp_swiglu_combine_bwd_bf16": dict(
            **bwd_buffers, w_shared_gate=sg, w_routed_gate=rg, w_shared_up=su, w_routed_up=ru,
            w_shared_down=sd, w_routed_down=rd, **dict(zip(bf16_ctx, fwd[:7], strict=True)),
            **sched, **settings,
        ),
        "dispatch_mlp_swiglu_combine_fwd_mxfp8": mx_fwd,
        "dispatch_mlp_swiglu_combine_bwd_mxfp8": dict(
            **bwd_buffers, w_shared_gate=sg, w_routed_gate_T=gt, w_routed_gate_T_sc=gtsc,
            w_shared_up=su, w_routed_up_T=ut, w_routed_up_T_sc=utsc, w_shared_down=sd,
            w_routed_down_T=dt, w_routed_down_T_sc=dtsc,
            **dict(zip(MXFP8_CONTEXT, mx_ctx, strict=True)), w_routed_gate=g,
            w_routed_gate_sc=gsc, w_routed_up=u, w_routed_up_sc=usc, **sched, **settings,
        ),
        "recompute_forward_context_bf16": dict(
            x=ws.x_buffer, x_ptrs=ws.x_buffer_ptrs, w_shared_gate=sg, w_routed_gate=rg,
            w_shared_up=su, w_routed_up=ru, **sched, **settings,
        ),
        "recompute_forward_context_mxfp8": dict(
            x=ws.x_buffer, x_ptrs=ws.x_buffer_ptrs, w_shared_gate=sg, w_routed_gate=g,
            w_routed_gate_sc=gsc, w_shared_up=su, w_routed_up=u, w_routed_up_sc=usc, **sched,
            **settings,
        ),
    }  # fmt: skip
    return dict(ws=ws, inputs=inputs, kwargs=kwargs)


def test_fake_implementations_give_the_real_outputs_metadata(env):
    for name, kwargs in env["kwargs"].items():
        real = _op(name)(**kwargs)
        mode = FakeTensorMode()
        fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                       for k, v in kwargs.items()}  # fmt: skip
        with mode:
            fake = _op(name)(**fake_kwargs)
        if real is None:
            assert fake is None, name
            continue
        assert len(fake) == len(real), name
        for index, (a, b) in enumerate(zip(fake, real, strict=True)):
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), (name, index)


# ----------------------------------------------------------------------------------------------
# the composition equals mok.functional, bitwise
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared,limit", [(True, None), (False, None), (True, 2.0)])
def test_raw_composition_equals_functional_bitwise(shared, limit):
    inputs, ws, schedule = _setup(shared=shared, seed=3)
    weights = [inputs[n] for n in WEIGHTS]
    x, w = inputs["x"], inputs["router_weights"]
    out, ctx = F.forward(CONFIG, ws, schedule, x, w, *weights, swiglu_limit=limit)
    grads = F.backward(CONFIG, ws, schedule, ctx, inputs["grad_output"], x, w, *weights,
                       swiglu_limit=limit)  # fmt: skip
    sched = raw_schedule(CONFIG, ws, inputs["top_experts"], E)
    assert_all_equal(sched, _tensors(schedule))
    raw_out, fwd = raw_forward(CONFIG, ws, sched, x, w, weights, limit)
    assert torch.equal(raw_out, out)
    assert_all_equal(context_in_mok_order(fwd), ctx.tensors())
    assert fwd[8].numel() == 0 and (fwd[7].numel() > 0) == shared  # y_routed, y_shared
    dy = inputs["grad_output"]
    assert_all_equal(raw_backward(CONFIG, ws, sched, fwd, dy, x, w, weights, limit), grads)
    assert_all_equal(raw_recompute(CONFIG, ws, sched, weights, limit), fwd[:7])


@pytest.mark.parametrize("shared", [True, False])
def test_mxfp8_raw_composition_equals_functional_bitwise(shared):
    inputs, ws, schedule = _setup(shared=shared, seed=5)
    q = _quantised(inputs)
    (g, gsc, gt, gtsc), (u, usc, ut, utsc), (d, dsc, dt, dtsc) = (q[n] for n in WEIGHTS[3:])
    sg, su, sd = (inputs[n] for n in WEIGHTS[:3])
    x, w, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    out, ctx = F.forward(CONFIG, ws, schedule, x, w, sg, su, sd, (g, gsc), (u, usc), (d, dsc))
    grads = F.backward(CONFIG, ws, schedule, ctx, dy, x, w, sg, su, sd, q["routed_gate"],
                       q["routed_up"], (dt, dtsc))  # fmt: skip
    # mok.functional's MXFP8 recompute still reaches mok's layer op (the default overload).
    again = F.recompute_forward_context(CONFIG, ws, schedule, x, sg, su, (g, gsc), (u, usc))
    assert_all_equal(flat(again, x), flat(ctx, x))

    sched, settings = _tensors(schedule), launch(CONFIG, ws, None, 0)
    ws.x_buffer.copy_(x)
    ws.router_weight_buffer.copy_(w)
    fwd = ops.dispatch_mlp_swiglu_combine_fwd_mxfp8(
        ws.x_buffer, ws.x_buffer_ptrs, ws.combine_buffer, ws.combine_buffer_ptrs, sg, g, gsc, su,
        u, usc, sd, d, dsc, *sched, *settings,
    )  # fmt: skip
    y_shared = fwd[11] if shared else None
    assert torch.equal(ops.fwd_epilogue(y_shared, ws.combine_buffer, ws.router_weight_buffer), out)
    # The raw op's quantised context is mok.functional's MXFP8 context (the original's layout).
    for a, b in zip(fwd[:11], flat(ctx, x), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    recomputed = ops.recompute_forward_context_mxfp8(
        ws.x_buffer, ws.x_buffer_ptrs, sg, g, gsc, su, u, usc, *sched, *settings
    )
    for a, b in zip(recomputed, fwd[:11], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    ws.d_y_buffer.copy_(dy)
    bwd = ops.dispatch_mlp_swiglu_combine_bwd_mxfp8(
        ws.d_y_buffer, ws.d_y_buffer_ptrs, ws.d_x_routed_buffer, ws.d_x_routed_buffer_ptrs,
        ws.router_weight_buffer, ws.router_weight_buffer_ptrs, ws.d_router_weight_buffer,
        ws.d_router_weight_buffer_ptrs, sg, gt, gtsc, su, ut, utsc, sd, dt, dtsc, *fwd[:11],
        ws.x_buffer, ws.x_buffer_ptrs, g, gsc, u, usc, *sched, *settings,
    )  # fmt: skip
    d_x = ops.bwd_epilogue(bwd[0] if shared else None, ws.d_x_routed_buffer, K)
    shared_grads = (bwd[12], bwd[14], bwd[16]) if shared else (None, None, None)
    got = (d_x, ws.d_router_weight_buffer.clone(), bwd[13], bwd[15], bwd[17], *shared_grads)
    assert_all_equal(got, grads)


def _ep_worker(rank, world_size):
    inputs = make_inputs(world_size * T, H, I, E, K, shared=True, seed=21)
    rows, experts = slice(rank * T, (rank + 1) * T), slice(rank * 2, rank * 2 + 2)
    local = {n: v[experts] if n.startswith("routed") else v for n, v in inputs.items()}
    local.update({n: inputs[n][rows] for n in ("x", "router_weights", "top_experts",
                                               "grad_output")})  # fmt: skip
    _, ws, schedule = _setup(group=dist.group.WORLD, num_local_experts=2, inputs=local)
    weights = [local[n] for n in WEIGHTS]
    x, w, dy = local["x"], local["router_weights"], local["grad_output"]
    out, ctx = F.forward(CONFIG, ws, schedule, x, w, *weights)
    grads = F.backward(CONFIG, ws, schedule, ctx, dy, x, w, *weights)
    sched = raw_schedule(CONFIG, ws, local["top_experts"], 2)
    raw_out, fwd = raw_forward(CONFIG, ws, sched, x, w, weights)
    raw_grads = raw_backward(CONFIG, ws, sched, fwd, dy, x, w, weights)
    return dict(schedule=(_tensors(schedule), sched), out=(out, raw_out), grads=(grads, raw_grads))


def test_raw_composition_on_an_ep_group_of_two_equals_functional():
    for result in run_on_gloo_group(_ep_worker, 2):
        want, got = result["schedule"]
        assert_all_equal(got, want)
        want, got = result["out"]
        assert torch.equal(got, want)
        want, got = result["grads"]
        assert_all_equal(got, want)


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph_of_the_raw_composition(backend):
    inputs, ws, schedule = _setup(shared=True, seed=7)
    weights = [inputs[n] for n in WEIGHTS]
    x, w, dy = inputs["x"], inputs["router_weights"], inputs["grad_output"]
    out, ctx = F.forward(CONFIG, ws, schedule, x, w, *weights)
    grads = F.backward(CONFIG, ws, schedule, ctx, dy, x, w, *weights)

    def step(x, w, ids, dy, *weights):
        sched = raw_schedule(CONFIG, ws, ids, E)
        out, fwd = raw_forward(CONFIG, ws, sched, x, w, weights)
        recomputed = raw_recompute(CONFIG, ws, sched, weights)
        return out, fwd[:7], recomputed, raw_backward(CONFIG, ws, sched, fwd, dy, x, w, weights)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got_out, got_ctx, got_recomputed, got_grads = compiled(x, w, inputs["top_experts"], dy,
                                                           *weights)  # fmt: skip
    assert torch.equal(got_out, out)
    assert_all_equal(got_recomputed, got_ctx)
    assert_all_equal(got_grads, grads)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph_of_the_mxfp8_ops(backend):
    """The MXFP8 ops, the overload packet of recompute_forward_context_mxfp8 among them (the
    original's call and mok.functional's)."""
    inputs, ws, schedule = _setup(shared=True, seed=9)
    q = _quantised(inputs)
    (g, gsc, gt, gtsc), (u, usc, ut, utsc), (d, dsc, dt, dtsc) = (q[n] for n in WEIGHTS[3:])
    sg, su, sd = (inputs[n] for n in WEIGHTS[:3])
    sched, settings = _tensors(schedule), launch(CONFIG, ws, None, 0)

    def step(x, w, dy):
        ws.x_buffer.copy_(x)
        ws.router_weight_buffer.copy_(w)
        ws.d_y_buffer.copy_(dy)
        fwd = ops.dispatch_mlp_swiglu_combine_fwd_mxfp8(
            ws.x_buffer, ws.x_buffer_ptrs, ws.combine_buffer, ws.combine_buffer_ptrs, sg, g, gsc,
            su, u, usc, sd, d, dsc, *sched, *settings,
        )  # fmt: skip
        out = ops.fwd_epilogue(fwd[11], ws.combine_buffer, ws.router_weight_buffer)
        recomputed = ops.recompute_forward_context_mxfp8(
            ws.x_buffer, ws.x_buffer_ptrs, sg, g, gsc, su, u, usc, *sched, *settings
        )
        layer_ctx = F.recompute_forward_context(CONFIG, ws, schedule, x, sg, su, (g, gsc),
                                                (u, usc))  # fmt: skip
        bwd = ops.dispatch_mlp_swiglu_combine_bwd_mxfp8(
            ws.d_y_buffer, ws.d_y_buffer_ptrs, ws.d_x_routed_buffer, ws.d_x_routed_buffer_ptrs,
            ws.router_weight_buffer, ws.router_weight_buffer_ptrs, ws.d_router_weight_buffer,
            ws.d_router_weight_buffer_ptrs, sg, gt, gtsc, su, ut, utsc, sd, dt, dtsc, *fwd[:11],
            ws.x_buffer, ws.x_buffer_ptrs, g, gsc, u, usc, *sched, *settings,
        )  # fmt: skip
        d_x = ops.bwd_epilogue(bwd[0], ws.d_x_routed_buffer)
        return (out, *recomputed, *flat(layer_ctx, x), d_x, *bwd[12:])

    args = (inputs["x"], inputs["router_weights"], inputs["grad_output"])
    eager = step(*args)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)(*args)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# bad arguments: each a clear error naming the argument
# ----------------------------------------------------------------------------------------------


ZERO_WEIGHTS = torch.zeros(T, K)
BAD_ARGUMENTS = [
    # (op, argument, its replacement from the valid value, error, message)
    ("all_gather_top_experts", "top_experts", lambda v: v.long(), MoKInputError, "torch.int32"),
    ("all_gather_top_experts", "all_gather_top_experts_buffer", lambda v: v.clone(), ValueError,
     "no workspace holds"),
    ("all_gather_top_experts", "all_gather_top_experts_buffer_multicast_ptr", lambda v: 8,
     ValueError, "never multicasts"),
    ("all_gather_top_experts", "rank", lambda v: 1, ValueError, "EP rank 0, got 1"),
    ("all_gather_top_experts", "chunk_bytes", lambda v: 24, ValueError, "multiple of 16"),
    ("barrier_all", "barrier_buffer_ptrs", lambda v: [8], ValueError, "no workspace"),
    ("barrier_all", "barrier_buffer_ptrs", lambda v: [0], MoKInputError, "list of positive"),
    ("barrier_all", "target", lambda v: v.new_zeros(2), ValueError, r"target must have shape \[1\]"),
    ("barrier_all", "barrier_buffer_multicast_ptr", lambda v: 8, ValueError, "never multicast"),
    ("schedule", "topk_all", lambda v: v.long(), MoKInputError, "topk_all must have dtype"),
    ("schedule", "topk_all", lambda v: v[0], ValueError, r"topk_all must have shape \[\*, \*"),
    ("schedule", "topk_all", lambda v: torch.full_like(v, E), ValueError, r"in \[0, 4\)"),
    ("schedule", "num_local_experts", lambda v: 0, ValueError, "num_local_experts must be >= 1"),
    ("schedule", "schedule_capacity", lambda v: 200, ValueError, "multiple of 128"),
    ("schedule", "schedule_capacity", lambda v: 128, ValueError,
     r"schedule_capacity must be >= num_local_tokens \* topk = 128 \* 2 = 256, got 128"),
    ("schedule", "rank", lambda v: 1, ValueError, r"rank must be in \[0, 1\)"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "x_ptrs", lambda v: [8], ValueError,
     "x_ptrs must be the x_buffer_ptrs of a live"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "combine_buffer_ptrs", lambda v: [8], ValueError,
     "combine_buffer_ptrs must be workspace.combine_buffer_ptrs"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "x", lambda v: v.float(), MoKInputError,
     "x must have dtype torch.bfloat16"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "combine_buffer", lambda v: v[:T], ValueError,
     "combine_buffer must have shape"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "w_routed_up", lambda v: v[:, :128], ValueError,
     "w_routed_up must have shape"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "w_routed_gate", lambda v: v[:, :100], ValueError,
     "intermediate_size"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "w_shared_up", lambda v: None, ValueError,
     "all given or all None"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "schedule_peer_rank", lambda v: v[:128], ValueError,
     "schedule_peer_rank must have shape"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "tokens_per_expert", lambda v: v[:2], ValueError,
     r"tokens_per_expert must have shape \[4\]"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "topk", lambda v: 3, ValueError,
     "topk must be the workspace's topk 2"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "swiglu_limit", lambda v: -1.0, ValueError,
     "swiglu_limit"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "num_comm_sms", lambda v: 3, ValueError,
     "num_comm_sms must be a multiple of 2"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "minibatch_size", lambda v: 100, ValueError,
     "minibatch_size must be >= 256"),
    ("dispatch_mlp_swiglu_combine_fwd_bf16", "macrobatch_size", lambda v: v + 256, ValueError,
     "macrobatch_size must be a multiple of"),
    ("dispatch_mlp_swiglu_combine_bwd_bf16", "d_y_buffer_ptrs", lambda v: [8], ValueError,
     "d_y_buffer_ptrs must be the d_y_buffer_ptrs of a live"),
    ("dispatch_mlp_swiglu_combine_bwd_bf16", "x_ptrs", lambda v: [8], ValueError,
     "x_ptrs must be workspace.x_buffer_ptrs"),
    ("dispatch_mlp_swiglu_combine_bwd_bf16", "router_weight_buffer", lambda v: v.bfloat16(),
     MoKInputError, "router_weight_buffer must have dtype torch.float32"),
    ("dispatch_mlp_swiglu_combine_bwd_bf16", "d_router_weight_buffer", lambda v: v[:, :1],
     ValueError, "d_router_weight_buffer must have shape"),
    ("dispatch_mlp_swiglu_combine_bwd_bf16", "gate_routed", lambda v: v[:128], ValueError,
     "gate_routed must have shape"),
    ("dispatch_mlp_swiglu_combine_bwd_bf16", "hidden_shared", lambda v: v[:0, 0], ValueError,
     "hidden_shared must have shape"),
    ("dispatch_mlp_swiglu_combine_bwd_bf16", "router_weight_buffer", lambda v: ZERO_WEIGHTS,
     ValueError, "router_weights must be finite and > 0"),
    ("dispatch_mlp_swiglu_combine_fwd_mxfp8", "w_routed_gate", lambda v: v.bfloat16(),
     MoKInputError, "w_routed_gate must have dtype torch.float8_e4m3fn"),
    ("dispatch_mlp_swiglu_combine_fwd_mxfp8", "w_routed_down_sc", lambda v: v[:1], ValueError,
     "w_routed_down_sc must have shape"),
    ("dispatch_mlp_swiglu_combine_fwd_mxfp8", "w_shared_gate", lambda v: v.float(),
     MoKInputError, "w_shared_gate must have dtype torch.bfloat16"),
    ("dispatch_mlp_swiglu_combine_bwd_mxfp8", "w_routed_gate_T", lambda v: v.transpose(1, 2),
     ValueError, "w_routed_gate_T must have shape"),
    ("dispatch_mlp_swiglu_combine_bwd_mxfp8", "w_routed_down_T_sc", lambda v: v[:1], ValueError,
     "w_routed_down_T_sc must have shape"),
    ("dispatch_mlp_swiglu_combine_bwd_mxfp8", "x_fp8_t_routed", lambda v: v.float(),
     MoKInputError, "x_fp8_t_routed must have dtype"),
    ("dispatch_mlp_swiglu_combine_bwd_mxfp8", "hidden_sc_t_routed", lambda v: v[:, :1],
     ValueError, "hidden_sc_t_routed must have shape"),
    ("recompute_forward_context_bf16", "w_routed_up", lambda v: v.float(), MoKInputError,
     "w_routed_up must have dtype"),
    ("recompute_forward_context_bf16", "x_ptrs", lambda v: [8], ValueError, "no workspace"),
    ("recompute_forward_context_mxfp8", "w_routed_up_sc", lambda v: v[:1], ValueError,
     "w_routed_up_sc must have shape"),
    ("recompute_forward_context_mxfp8", "x_ptrs", lambda v: [8], ValueError, "no workspace"),
]  # fmt: skip


@pytest.mark.parametrize("name,argument,replace,error,message", BAD_ARGUMENTS,
                         ids=[f"{c[0]}-{c[1]}" for c in BAD_ARGUMENTS])  # fmt: skip
def test_bad_argument_is_a_clear_error(env, name, argument, replace, error, message):
    kwargs = dict(env["kwargs"][name])
    kwargs[argument] = replace(kwargs[argument])
    with pytest.raises(error, match=message):
        _op(name)(**kwargs)


def test_every_op_has_bad_argument_cases():
    assert {case[0] for case in BAD_ARGUMENTS} == set(ORIGINAL)
