"""Every bad input of SEMANTICS §7 raises ValueError/TypeError naming argument, expected, actual."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok import functional as F
from mok.config import MoKConfig
from mok.testing import make_inputs

T, H, I, E, K = 64, 128, 128, 4, 2


@pytest.fixture()
def setup():
    inputs = make_inputs(T, H, I, E, K, shared=True, seed=0)
    config = MoKConfig()
    ws = F.get_workspace(config, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K,
                         num_local_experts=E)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=E)
    args = dict(
        x=inputs["x"], router_weights=inputs["router_weights"],
        shared_gate_weights=inputs["shared_gate"], shared_up_weights=inputs["shared_up"],
        shared_down_weights=inputs["shared_down"], routed_gate_weights=inputs["routed_gate"],
        routed_up_weights=inputs["routed_up"], routed_down_weights=inputs["routed_down"],
    )  # fmt: skip
    _, ctx = F.forward(config, ws, schedule, **args)
    return dict(config=config, ws=ws, schedule=schedule, args=args, ctx=ctx, inputs=inputs)


# --- MoKConfig.validate ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,exc,match",
    [
        ("fwd_num_comm_sms", 3, ValueError, r"fwd_num_comm_sms must be an even int >= 0, got 3"),
        ("bwd_num_comm_sms", -2, ValueError, r"bwd_num_comm_sms must be an even int >= 0, got -2"),
        ("fwd_num_comm_sms", 2.0, TypeError, r"fwd_num_comm_sms must be an int, got float"),
        ("minibatch_size", 300, ValueError, r"minibatch_size must be a positive multiple of 256, got 300"),
        ("macrobatch_size", 4096 + 256, ValueError, r"macrobatch_size must be a positive multiple of minibatch_size \(131072\), got 4352"),
        ("schedule_capacity_multiplier", 0.0, ValueError, r"schedule_capacity_multiplier must be a finite number > 0, got 0.0"),
        ("schedule_capacity_multiplier", float("nan"), ValueError, r"schedule_capacity_multiplier must be a finite number > 0, got nan"),
        ("schedule_capacity_multiplier", "1", TypeError, r"schedule_capacity_multiplier must be a float, got str"),
        ("all_gather_top_experts_chunk_bytes", 100, ValueError, r"all_gather_top_experts_chunk_bytes must be a positive multiple of 16, got 100"),
        ("minibatch_size", True, TypeError, r"minibatch_size must be an int, got bool"),
    ],
)  # fmt: skip
def test_config_validate(field, value, exc, match):
    with pytest.raises(exc, match=match):
        dataclasses.replace(MoKConfig(), **{field: value}).validate()


def test_config_comm_sms_bounded_by_device():
    with pytest.raises(ValueError, match=r"fwd_num_comm_sms must be < the device's SM count 16"):
        MoKConfig(fwd_num_comm_sms=16).validate(num_sms=16)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        MoKConfig().minibatch_size = 256


# --- get_workspace --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(hidden_size=100), ValueError, r"hidden_size must be >= 128, got 100"),
        (dict(hidden_size=192), ValueError, r"hidden_size must be a multiple of 128, got 192"),
        (dict(num_local_tokens=0), ValueError, r"num_local_tokens must be >= 1, got 0"),
        (dict(num_local_tokens=8.0), TypeError, r"num_local_tokens must be an int, got float"),
        (dict(topk=0), ValueError, r"topk must be >= 1, got 0"),
        (dict(topk=33), ValueError, r"topk must be <= 32, got 33"),
        (dict(device="meta"), ValueError, r"device must be a cpu or cuda device, got meta"),
        (dict(device=3), TypeError, r"device must be a device, got int"),
        (dict(num_local_experts=0), ValueError, r"num_local_experts must be >= 1, got 0"),
    ],
)
def test_get_workspace_errors(kwargs, exc, match):
    args = dict(device="cpu", num_local_tokens=T, hidden_size=H, topk=K) | kwargs
    with pytest.raises(exc, match=match):
        F.get_workspace(MoKConfig(), None, **args)


def test_get_workspace_bad_group_and_config():
    with pytest.raises(TypeError, match=r"group must be a ProcessGroup, got str"):
        F.get_workspace(
            MoKConfig(), "world", device="cpu", num_local_tokens=T, hidden_size=H, topk=K
        )
    with pytest.raises(TypeError, match=r"config must be a MoKConfig, got dict"):
        F.get_workspace({}, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"device must be an available device, got cuda:0 but"):
        F.get_workspace(
            MoKConfig(), None, device="cuda:0", num_local_tokens=T, hidden_size=H, topk=K
        )


def test_destroyed_workspace(setup):
    ws = F.get_workspace(
        MoKConfig(), None, device="cpu", num_local_tokens=32, hidden_size=H, topk=1
    )
    ws.destroy()
    ids = torch.zeros(32, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"workspace has been destroyed"):
        F.build_schedule(ws, MoKConfig(), ids, num_local_experts=1)


# --- build_schedule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda t: t.to(torch.int32), TypeError, r"top_experts must have dtype torch.int64, got torch.int32"),
        (lambda t: t[:, :1].contiguous(), ValueError, r"top_experts must have shape \[64, 2\], got \[64, 1\]"),
        (lambda t: t.t().contiguous().t(), ValueError, r"top_experts must be contiguous"),
        (lambda t: t.clone().fill_(4), ValueError, r"top_experts must hold expert ids in \[0, 4\) .* got 4 at index \[0, 0\]"),
        (lambda t: t.clone().fill_(-1), ValueError, r"top_experts must hold expert ids in \[0, 4\) .* got -1"),
        (lambda t: t.tolist(), TypeError, r"top_experts must be a torch.Tensor, got list"),
    ],
)  # fmt: skip
def test_build_schedule_errors(setup, mutate, exc, match):
    with pytest.raises(exc, match=match):
        F.build_schedule(setup["ws"], setup["config"], mutate(setup["inputs"]["top_experts"]),
                         num_local_experts=E)  # fmt: skip


def test_build_schedule_bad_expert_count_and_overflow(setup):
    ids = setup["inputs"]["top_experts"]
    with pytest.raises(ValueError, match=r"num_local_experts must be >= 1, got 0"):
        F.build_schedule(setup["ws"], setup["config"], ids, num_local_experts=0)
    tight = F.get_workspace(MoKConfig(), None, device="cpu", num_local_tokens=T, hidden_size=H,
                            topk=K)  # capacity 2*T*K = 256 < 4 experts * 128 padded rows  # fmt: skip
    with pytest.raises(
        ValueError, match=r"schedule capacity overflow on EP rank 0: 512 routed rows"
    ):
        F.build_schedule(tight, MoKConfig(), ids, num_local_experts=E)


# --- forward --------------------------------------------------------------------------------


def _bad(name, value):
    return (name, value)


@pytest.mark.parametrize(
    "name,make,exc,match",
    [
        ("x", lambda a: a.float(), TypeError, r"x must have dtype torch.bfloat16, got torch.float32"),
        ("x", lambda a: a[:32], ValueError, r"x must have shape \[64, 128\], got \[32, 128\]"),
        ("x", lambda a: a.t().contiguous().t(), ValueError, r"x must be contiguous"),
        ("x", lambda a: a.to("meta"), ValueError, r"x must be on device cpu, got meta"),
        ("router_weights", lambda a: a.double(), TypeError, r"router_weights must have dtype torch.float32, got torch.float64"),
        ("router_weights", lambda a: a.clone().fill_(0.0), ValueError, r"router_weights must be finite and > 0, got 0.0 at index \[0, 0\]"),
        ("router_weights", lambda a: a.clone().fill_(-0.5), ValueError, r"router_weights must be finite and > 0, got -0.5"),
        ("router_weights", lambda a: a.clone().fill_(float("inf")), ValueError, r"router_weights must be finite and > 0, got inf"),
        ("router_weights", lambda a: a.clone().fill_(float("nan")), ValueError, r"router_weights must be finite and > 0, got nan"),
        ("routed_gate_weights", lambda a: a[:, :, :64].contiguous(), ValueError, r"routed_gate_weights must have shape \[4, 128, 128\], got \[4, 128, 64\]"),
        ("routed_gate_weights", lambda a: a[0], ValueError, r"routed_gate_weights must have shape \[E, I, H\], got \[128, 128\]"),
        ("routed_gate_weights", lambda a: a[:3], ValueError, r"routed_gate_weights must have shape \[4, 128, 128\], got \[3, 128, 128\]"),
        ("routed_up_weights", lambda a: a.float(), TypeError, r"routed_up_weights must have dtype torch.bfloat16"),
        ("routed_down_weights", lambda a: a.transpose(1, 2), ValueError, r"routed_down_weights must be contiguous"),
        ("routed_gate_weights", lambda a: (a, a), TypeError, r"routed weights must be all MXFP8 tuples or all bf16 tensors; \['routed_gate_weights'\] are tuples"),
        ("shared_gate_weights", lambda a: None, ValueError, r"shared expert weights must be all given or all None"),
        ("shared_down_weights", lambda a: a[:, :64].contiguous(), ValueError, r"shared_down_weights must have shape \[128, 128\], got \[128, 64\]"),
    ],
)  # fmt: skip
def test_forward_errors(setup, name, make, exc, match):
    args = dict(setup["args"])
    args[name] = make(args[name])
    with pytest.raises(exc, match=match):
        F.forward(setup["config"], setup["ws"], setup["schedule"], **args)


def test_intermediate_alignment(setup):
    args = dict(setup["args"])
    for n in ("routed_gate_weights", "routed_up_weights"):
        args[n] = args[n][:, :64].contiguous()
    with pytest.raises(
        ValueError, match=r"intermediate size .* must be a positive multiple of 128, got 64"
    ):
        F.forward(setup["config"], setup["ws"], setup["schedule"], **args)


@pytest.mark.parametrize(
    "limit,exc,match",
    [(0.0, ValueError, r"swiglu_limit must be a finite number > 0 or None, got 0.0"),
     (float("inf"), ValueError, r"swiglu_limit must be a finite number > 0 or None, got inf"),
     ("7", TypeError, r"swiglu_limit must be a float or None, got str")],
)  # fmt: skip
def test_swiglu_limit_errors(setup, limit, exc, match):
    with pytest.raises(exc, match=match):
        F.forward(setup["config"], setup["ws"], setup["schedule"], **setup["args"],
                  swiglu_limit=limit)  # fmt: skip


def test_schedule_and_workspace_mismatch(setup):
    other = F.get_workspace(MoKConfig(), None, device="cpu", num_local_tokens=T, hidden_size=H,
                            topk=K, num_local_experts=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"schedule was built by build_schedule for another "
                       r"workspace \(handle \d+, \d+ tokens\), not for this one"):  # fmt: skip
        F.forward(setup["config"], other, setup["schedule"], **setup["args"])
    # A schedule made by hand carries no origin: its shapes still say it does not fit.
    by_hand = dataclasses.replace(setup["schedule"])
    with pytest.raises(
        ValueError, match=r"schedule.peer_rank must have shape \[\d+\], got \[\d+\]"
    ):
        F.forward(setup["config"], other, by_hand, **setup["args"])
    with pytest.raises(TypeError, match=r"schedule must be a MoKSchedule, got tuple"):
        F.forward(setup["config"], setup["ws"], tuple(), **setup["args"])


# --- backward -------------------------------------------------------------------------------


def _backward(setup, **overrides):
    kw = dict(forward_context=setup["ctx"], grad_output=setup["inputs"]["grad_output"],
              **setup["args"]) | overrides  # fmt: skip
    return F.backward(setup["config"], setup["ws"], setup["schedule"], **kw)


def test_backward_errors(setup):
    dy = setup["inputs"]["grad_output"]
    with pytest.raises(
        TypeError, match=r"grad_output must have dtype torch.bfloat16, got torch.float32"
    ):
        _backward(setup, grad_output=dy.float())
    with pytest.raises(
        TypeError, match=r"forward_context must be a MoKForwardContext, got NoneType"
    ):
        _backward(setup, forward_context=None)
    no_shared = dataclasses.replace(setup["ctx"], gate_shared=None)
    with pytest.raises(ValueError, match=r"forward_context.gate_shared is None but shared expert"):
        _backward(setup, forward_context=no_shared)
    bad_ctx = dataclasses.replace(setup["ctx"], hidden_routed=setup["ctx"].hidden_routed[:, :64])
    with pytest.raises(ValueError, match=r"forward_context.hidden_routed must have shape"):
        _backward(setup, forward_context=bad_ctx)


def test_main_grads_errors(setup):
    g = setup["args"]["routed_gate_weights"]
    with pytest.raises(ValueError, match=r"main_grads must have 6 entries \(or be None\), got 2"):
        _backward(setup, main_grads=(None, None))
    with pytest.raises(
        TypeError,
        match=r"main_grads\[routed_gate_weights\] must have dtype torch.float32, got torch.bfloat16",
    ):
        _backward(setup, main_grads=(torch.zeros_like(g),) + (None,) * 5)
    with pytest.raises(TypeError, match=r"main_grads must be a tuple, got list"):
        _backward(setup, main_grads=[None] * 6)
