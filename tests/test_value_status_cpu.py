"""CPU tests of the in-kernel value checks' host side and of the eager op path.

The kernels' checks themselves run on the GPU (tests/gpu/test_forward_gpu.py); here: the words'
layout agrees between the kernels and the launcher, the PTX carries the checks, each word gives
its message, and `mok.ops.call` runs the same computation with or without the dispatcher.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mok import functional as F
from mok import ops
from mok.launchers import status
from mok.testing import make_inputs

WEIGHTS = ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")


def test_messages_name_the_value_and_the_op():
    words = [0] * 16
    assert status.message(words, "cuda:0") is None
    overflow = list(words)
    overflow[0:4] = [1, 4096, 2, 1024]
    assert status.message(overflow, "cuda:0").startswith(
        "schedule capacity overflow on EP rank 2: 4096 routed rows"
    )
    ids = list(words)
    ids[4:6] = [1, 64]
    assert "top_experts must hold expert ids in [0, 64)" in status.message(ids, "cuda:1")
    fwd = list(words)
    fwd[6] = 1
    assert "router_weights must be finite and > 0" in status.message(fwd, "cuda:0")
    assert "mok.ops.forward on cuda:0" in status.message(fwd, "cuda:0")
    bwd = list(words)
    bwd[7] = 4
    assert "router weights of EP rank 3" in status.message(bwd, "cuda:0")


def test_kernel_word_indices_match_the_launcher():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from mok.dsl_kernels.common import value_checks

    assert value_checks.STATUS_SCHEDULE_OVERFLOW == status.SCHEDULE_OVERFLOW
    assert value_checks.STATUS_BAD_EXPERT_ID == status.BAD_EXPERT_ID
    assert value_checks.STATUS_BAD_WEIGHT_FORWARD == status.BAD_WEIGHT_FORWARD
    assert value_checks.STATUS_BAD_WEIGHT_BACKWARD == status.BAD_WEIGHT_BACKWARD


@pytest.mark.parametrize("name", ["moe_combine_forward", "router_grad_push"])
def test_weight_checks_are_in_the_ptx(name):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from mok.dsl_kernels import build
    from mok.dsl_kernels.registry import variants

    variant = {v.name: v for v in variants()}[name]
    _, _, ptx = build.compile_variant(variant, "sm_90a")
    assert "setp.le.and.f32" in ptx and "@!ok st.global.b32" in ptx


def _layer(seed=3):
    t, h, i, e, k = 64, 128, 128, 4, 2
    inputs = make_inputs(t, h, i, e, k, shared=True, seed=seed)
    config = F.MoKConfig()
    ws = F.get_workspace(config, None, device=torch.device("cpu"), num_local_tokens=t,
                         hidden_size=h, topk=k, num_local_experts=e)  # fmt: skip
    schedule = F.build_schedule(ws, config, inputs["top_experts"], num_local_experts=e)
    return config, ws, schedule, inputs


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_call_equals_the_dispatcher_and_modes_still_see_the_op():
    config, ws, schedule, inputs = _layer()
    weights = [inputs[n] for n in WEIGHTS]
    x = inputs["x"].clone().requires_grad_(True)
    direct, _ = F.forward(config, ws, schedule, x, inputs["router_weights"], *weights)
    assert direct.grad_fn is None  # the eager path runs under no_grad, as the op would
    seen = _Seen()
    with seen:
        dispatched, _ = F.forward(config, ws, schedule, x, inputs["router_weights"], *weights)
    assert any(op.startswith("mok.forward") for op in seen.ops)
    assert torch.equal(direct, dispatched)


def test_call_names_only_registered_ops():
    with pytest.raises(KeyError):
        ops.call("no_such_op")
